"""The emulated tier: real bytes through the emulated queue in window order, landing when the device model says,
and begin_step's batches reaching it from compiled code through its lane. No test reads a wall-clock time:
landing times are the model's output, orders are the queue's trace."""

from __future__ import annotations

import numpy as np
import pytest

from slacktier.store import PageBufferPool, PageReads
from slacktier.store._native import probe_io_uring
from slacktier.store.devqueue import open_queues
from slacktier.testing.store import stage_synthetic
from slacktier.whatif import (NVME_PAPER, RDMA_PAPER, EmulatedOptions, EmulatedSource, SimJob, completions_ms,
                              device_session)


def _reads(n: int) -> PageReads:
    return PageReads(np.zeros(n, np.int32), np.arange(n, dtype=np.int64), np.arange(n, dtype=np.int32))


def test_an_emulated_disk_returns_the_staged_bytes_and_admits_layer_1_first(o_direct_dir):
    one = stage_synthetic(o_direct_dir / "l1", layers=(1,), ranks=1, rows=900)
    fourteen = stage_synthetic(o_direct_dir / "l14", layers=(14,), ranks=1, rows=900)
    opts = EmulatedOptions(model="nvme-paper", device="t", rank=0)
    with device_session():
        s1, s14 = EmulatedSource(one.specs, opts), EmulatedSource(fourteen.specs, opts)
        try:
            _window_order_and_exact_bytes(one, fourteen, s1, s14)
        finally:
            s1.close()
            s14.close()


def _window_order_and_exact_bytes(one, fourteen, s1, s14) -> None:
    """Layer 14 submitted first, yet admitted after layer 1; the bytes are the staged ones."""
    dev = s1.emulated
    assert s14.emulated is dev
    n = one.specs[0].pages
    p1, p14 = PageBufferPool(n), PageBufferPool(n)
    [q] = [q for q in open_queues() if q.engine_name == "emulated" and q.device.name.startswith("emulated:t/")]
    q.trace(2 * n)
    dev.begin_step()
    dev.rank_host_pass(0)
    s1.hold(True)                         # both batches queued before the queue admits any read
    t14 = s14.submit(_reads(n), p14)      # layer 14 is submitted first ...
    t1 = s1.submit(_reads(n), p1)
    s1.hold(False)
    dev.start_rank(0)
    dev.end_step()
    r14, r1 = s14.wait(t14), s1.wait(t1)
    client, _, _ = q.traced()             # ... yet the queue admits every layer-1 read before layer 14's
    assert client.shape[0] == 2 * n and (client[:n] == client[0]).all() and (client[n:] != client[0]).all()
    q.trace(1)
    s1.wait(s1.submit(_reads(1), p1))
    assert q.traced()[0][0] == client[0], "layer 14's reads were admitted ahead of layer 1's"
    assert r1.pages == r14.pages == n
    assert np.array_equal(p1.pages[:n], one.pages[0][:n])
    assert np.array_equal(p14.pages[:n], fourteen.pages[0][:n])
    # ... and still lands after layer 1, whose pages the device serves first (model times, not a clock)
    done = completions_ms([SimJob(0, 14, n, 0.0), SimJob(1, 1, n, 0.0)], NVME_PAPER)
    assert done[1] < done[0]


# ---- the native lane: begin_step's pages reach the emulated queue from compiled code --------------------------

LANE_ROWS = {1: 700, 14: 500}


@pytest.fixture
def session():
    """The test's own emulated devices, forgotten when it ends."""
    with device_session() as s:
        yield s


def _lane_engine(directory, device: str, disk_layer: int | None = None):
    """A StepEngine over layers 1 and 14, each on an EmulatedSource (rdma-paper) of one rank, and the raw rows;
    `disk_layer` on an io_uring DiskSource instead."""
    from slacktier.cache import RowCache
    from slacktier.engine.checker import ArrayRowReader
    from slacktier.engine.step import StepEngine
    from slacktier.engine.tables import TableSpec
    from slacktier.tables.codec import synthetic_rows
    from slacktier.tables.layout import pages_for_rows
    from slacktier.tables.regions import Region
    from slacktier.testing.engine import pack_pages

    raws, tables, sources = {}, [], []
    opts = EmulatedOptions(model="rdma-paper", device=device, rank=0)
    for layer, n in LANE_ROWS.items():
        raws[layer] = synthetic_rows(60 + layer, 0, n)
        path = directory / f"lane-l{layer}.pages"
        path.write_bytes(pack_pages(raws[layer]).tobytes())
        region = Region(layer=layer, rank=0, path=str(path), offset_bytes=0, pages=pages_for_rows(n), row_start=0,
                        rows=n)
        if layer == disk_layer:
            from slacktier.config import DiskOptions
            from slacktier.store.disk import DiskSource
            source = DiskSource([region], DiskOptions(engine="io_uring", queue_depth=32))
        else:
            source = EmulatedSource([region], opts)
        sources.append(source)
        tables.append(TableSpec(layer=layer, row_start=0, rows=n, regions=(region,), source=source, cache_share=0.5,
                                reference=ArrayRowReader(raws[layer])))
    return StepEngine(tables, RowCache(300), max_tokens=8, owned_sources=sources), raws


def _lane_steps(engine, raws, steps: int, seed: int, device=None):
    """Run `steps` steps of random ids; every gathered row equal to the table's, bit for bit; yields after each.
    With `device`, each step is a TP step on it as the what-if runs one: begin_step in its pre-phase, the
    device sealed, then the rank's step started."""
    import torch

    from slacktier.tables.codec import dequantize_bits

    rng = np.random.default_rng(seed)
    for _ in range(steps):
        ids = np.stack([rng.integers(0, n, (8, 24)) for n in LANE_ROWS.values()], axis=1)
        if device is None:
            engine.begin_step(ids)
        else:
            device.begin_step()
            device.rank_host_pass(0)
            engine.begin_step(ids)
            device.seal()
            device.start_rank(0)
        for axis, layer in enumerate(LANE_ROWS):
            out = engine.gather(layer).reshape(-1, 256).view(torch.int16).numpy()
            want = dequantize_bits(raws[layer][ids[:, axis].reshape(-1)])
            assert np.array_equal(out, want.view(np.int16))
        c = engine.end_step()
        if device is not None:
            device.end_step()
        assert c.layers[1].pages_read > 0 and c.layers[14].pages_read > 0
        yield


def _counting_submit(monkeypatch) -> dict:
    """Count the batches that go through the disk tier's (and so the emulated tier's) Python `submit`."""
    from slacktier.store.disk import DiskSource

    calls = {"submit": 0}
    real = DiskSource.submit

    def submit(self, reads, pool):
        calls["submit"] += 1
        return real(self, reads, pool)

    monkeypatch.setattr(DiskSource, "submit", submit)
    return calls


@pytest.mark.parametrize("stepped", [False, True], ids=["free-running", "tp-step"])
def test_begin_step_queues_emulated_pages_from_compiled_code_with_exact_rows(o_direct_dir, monkeypatch, stepped,
                                                                            session):
    """Every batch of begin_step reaches the emulated queue through the native lane: none through Python's
    submit, the queue counts them as lane batches, and the gathered rows are the table's, whether the device
    runs free or steps as in the what-if (the booked batches then wait for the device's seal)."""
    calls = _counting_submit(monkeypatch)
    engine, raws = _lane_engine(o_direct_dir, "lane-used")
    try:
        [q] = [q for q in open_queues() if q.device.name == "emulated:lane-used/rank0"]
        device = session.device("lane-used", RDMA_PAPER) if stepped else None
        for _ in _lane_steps(engine, raws, 4, seed=5, device=device):
            pass
        assert calls["submit"] == 0
        assert q.batches["lane"] == 8 and q.batches["submit"] == 0   # two layers, four steps
    finally:
        engine.close()


def test_in_a_tp_step_the_lanes_batches_are_queued_when_the_device_seals(o_direct_dir, session):
    """The device times a TP step's batches at its seal, once every rank's host pass is done: the queue takes
    what compiled code recorded in its lane table then, before the engine books anything (at its first gather,
    as on the disk tier), so by the seal both layers' batches are queued and every read of the step copied."""
    import torch

    from slacktier.tables.codec import dequantize_bits

    engine, raws = _lane_engine(o_direct_dir, "lane-sealed")
    try:
        [q] = [q for q in open_queues() if q.device.name == "emulated:lane-sealed/rank0"]
        device = session.device("lane-sealed", RDMA_PAPER)
        rng = np.random.default_rng(9)
        ids = np.stack([rng.integers(0, n, (8, 24)) for n in LANE_ROWS.values()], axis=1)
        q.trace(1 << 20)
        device.begin_step()
        device.rank_host_pass(0)
        engine.begin_step(ids)
        assert q.batches["lane"] == 0 and q.traced()[0].shape[0] == 0   # recorded, not yet queued
        device.seal()
        assert q.batches["lane"] == 2   # queued at the seal, before any gather
        # and copied: every read of the step was handed out by the seal, so nothing of the emulator's runs
        # beside the rank's timeline
        sealed = q.traced()[0].shape[0]
        assert sealed > 0
        device.start_rank(0)
        for axis, layer in enumerate(LANE_ROWS):
            out = engine.gather(layer).reshape(-1, 256).view(torch.int16).numpy()
            assert np.array_equal(out, dequantize_bits(raws[layer][ids[:, axis].reshape(-1)]).view(np.int16))
        c = engine.end_step()
        device.end_step()
        assert q.batches["lane"] == 2 and q.traced()[0].shape[0] == sealed
        assert sealed == c.layers[1].pages_read + c.layers[14].pages_read
    finally:
        engine.close()


def test_a_batch_the_lane_refuses_goes_through_python_and_the_lane_then_takes_the_next(o_direct_dir, monkeypatch,
                                                                                      session):
    """A lane table too small for a batch: the compiled call refuses it, the engine submits it from Python (counted
    in LANE_REFUSALS), rows stay exact, and once the table has grown the batches go through the lane again."""
    from slacktier.whatif import lane

    monkeypatch.setattr(lane, "LANE_PAGES", 4)   # a step reads far more pages than 4
    calls = _counting_submit(monkeypatch)
    refused = sum(lane.LANE_REFUSALS.values())
    engine, raws = _lane_engine(o_direct_dir, "lane-refused")
    try:
        [q] = [q for q in open_queues() if q.device.name == "emulated:lane-refused/rank0"]
        per_step = []
        for _ in _lane_steps(engine, raws, 4, seed=9):
            per_step.append(calls["submit"] - sum(per_step))
        assert per_step[0] == 2                                   # both layers' first batches refused, then Python
        assert sum(lane.LANE_REFUSALS.values()) - refused == 2   # counted once per table that grew
        assert per_step[-1] == 0 and q.batches["lane"] >= 2         # grown: the last step went through the lane
        assert q.batches["submit"] == sum(per_step)
    finally:
        engine.close()


@pytest.mark.skipif(probe_io_uring() is not None, reason=f"io_uring unavailable: {probe_io_uring()}")
def test_one_compiled_pass_feeds_an_io_uring_disk_layer_and_an_emulated_layer_each_through_its_own_lane(
        o_direct_dir, monkeypatch, session):
    """Layer 1 on an io_uring disk, layer 14 on an emulated device: the one compiled call hands each layer's
    pages to its own client's submit (st_eng_submit, the emulated lane's), none through Python, rows exact."""
    calls = _counting_submit(monkeypatch)
    engine, raws = _lane_engine(o_direct_dir, "lane-mixed", disk_layer=1)
    try:
        [q] = [q for q in open_queues() if q.device.name == "emulated:lane-mixed/rank0"]
        for _ in _lane_steps(engine, raws, 3, seed=13):
            pass
        assert calls["submit"] == 0
        assert q.batches["lane"] == 3 and q.batches["submit"] == 0   # layer 14's, one a step
    finally:
        engine.close()


# ---- the tier is the whatif room's: a control file naming it needs that room imported ----------------------

_NAMES_EMULATED = ('from slacktier.config import parse_control\n'
                   'import slacktier.store, slacktier.engine.step\n'
                   'text = \'[[table]]\\nlayer = 1\\nmanifest = "t.json"\\nsource = "emulated"\\n\'\n'
                   'import sys\n'
                   'if sys.argv[1] == "whatif":\n'
                   '    import slacktier.whatif\n'
                   'print(type(parse_control(text).table(1).options).__name__)\n')


def test_a_control_file_naming_the_emulated_tier_is_refused_until_whatif_is_imported_and_read_after():
    """The store and the engine register no emulated tier: without `import slacktier.whatif` the control file is
    refused in one line that says how to load the tier; with it, the table parses into the tier's options."""
    import subprocess
    import sys

    def run(mode: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", _NAMES_EMULATED, mode], capture_output=True, text=True,
                              timeout=300)

    refused = run("store")
    assert refused.returncode != 0
    said = refused.stderr.strip().splitlines()[-1]
    assert "tier 'emulated' is registered by slacktier.whatif, which is not imported" in said
    assert "import slacktier.whatif before loading the control file" in said
    loaded = run("whatif")
    assert loaded.returncode == 0, loaded.stderr
    assert loaded.stdout.strip() == "EmulatedOptions"
