"""Emulated devices (issue 31): the fluid server's completion times from the model (exact numbers), device models
refused by key, real bytes through the emulated queue in window order, and `slacktier whatif`'s refusals and report.
No test reads a wall-clock time: landing times are the model's output, orders are the queue's trace."""

from __future__ import annotations

import numpy as np
import pytest

from slacktier.cli import main
from slacktier.errors import SlackTierError
from slacktier.store import PageBufferPool, PageReads
from slacktier.store.emulated import (NVME_PAPER, RDMA_PAPER, EmulatedOptions, EmulatedSource, SimJob,
                                      completions_ms, emulated_device, forget_devices, load_device_model,
                                      model_from_dict)
from slacktier.store._native import probe_io_uring
from slacktier.store.devqueue import open_queues
from slacktier.testing.store import stage_synthetic


def test_four_ranks_on_one_nvme_paper_disk_land_at_the_papers_fit():
    jobs = [SimJob(2 * r + i, layer, 700, 0.0) for r in range(4) for i, layer in enumerate((1, 14))]
    done = completions_ms(jobs, NVME_PAPER)
    for r in range(4):
        assert done[2 * r] == pytest.approx(0.30 + 3.05e-3 * 700 + 0.37e-3 * 700)      # T1, paper section 4.1
        assert done[2 * r + 1] == pytest.approx(0.30 + 3.05e-3 * 1400 + 0.37e-3 * 700)  # behind all of layer 1


def test_one_rank_per_disk_reads_at_a_quarter_of_the_shared_page_cost():
    done = completions_ms([SimJob(0, 1, 700, 0.0), SimJob(1, 14, 700, 0.0)], NVME_PAPER)
    assert done[0] == pytest.approx(0.30 + 0.7625e-3 * 700 + 0.0925e-3 * 700)
    assert done[1] == pytest.approx(0.30 + 0.7625e-3 * 1400 + 0.0925e-3 * 700)


def test_a_later_layer_arriving_after_the_earlier_one_finished_steals_nothing():
    done = completions_ms([SimJob(0, 1, 100, 0.0), SimJob(1, 14, 100, 5.0)], NVME_PAPER)
    assert done[0] == pytest.approx(0.30 + 0.07625)
    assert done[1] == pytest.approx(5.0 + 0.30 + 0.07625)


def test_an_earlier_layer_arriving_later_is_served_first():
    done = completions_ms([SimJob(0, 14, 1000, 0.0), SimJob(1, 1, 100, 0.1)], NVME_PAPER)
    assert done[1] == pytest.approx(0.1 + 0.30 + 0.07625)            # preempts layer 14's backlog
    assert done[0] == pytest.approx(0.30 + 0.7625e-3 * 1100)         # its own pages plus layer 1's


def test_rdma_paper_reads_600_and_740_pages_in_the_papers_times():
    assert completions_ms([SimJob(0, 1, 600, 0.0)], RDMA_PAPER)[0] == pytest.approx(0.21)
    assert completions_ms([SimJob(0, 1, 740, 0.0)], RDMA_PAPER)[0] == pytest.approx(0.25)


GOOD = {"name": "mine", "intercept_ms": 0.1, "page_us": 1.0, "behind_page_us": 0.1, "queue_depth": 32}


@pytest.mark.parametrize("key", ["intercept_ms", "page_us", "behind_page_us", "queue_depth"])
def test_a_device_model_missing_a_term_is_refused_naming_it(key):
    doc = {k: v for k, v in GOOD.items() if k != key}
    with pytest.raises(SlackTierError, match=f"{key} is missing"):
        model_from_dict({"device": doc}, "mine.toml")


@pytest.mark.parametrize("key, value", [("intercept_ms", -0.1), ("page_us", -1.0), ("behind_page_us", float("nan")),
                                        ("queue_depth", 0), ("ranks_in_fit", 0)])
def test_a_negative_term_or_a_queue_depth_of_0_is_refused_naming_it(key, value):
    with pytest.raises(SlackTierError, match=key):
        model_from_dict({"device": {**GOOD, key: value}}, "mine.toml")


def test_a_toml_model_loads_and_an_unknown_name_is_refused(tmp_path):
    p = tmp_path / "mine.toml"
    p.write_text('[device]\nname = "mine"\nintercept_ms = 0.1\npage_us = 1.0\nbehind_page_us = 0.1\n'
                 'queue_depth = 32\nranks_in_fit = 2\n')
    m = load_device_model(str(p))
    assert (m.name, m.page_us, m.ranks_in_fit) == ("mine", 1.0, 2)
    with pytest.raises(SlackTierError, match="neither built in nor a file"):
        load_device_model("nvme-fast")


def test_a_model_written_as_toml_reads_back_equal(tmp_path):
    from slacktier.store.emulated import DeviceModel, device_model_toml

    m = DeviceModel("my \"nvme\"", 0.123456789, 2.5, 0.0, 64, 4, 'fit of "today", C:\\runs')
    path = tmp_path / "m.toml"
    path.write_text(device_model_toml(m))
    assert load_device_model(str(path)) == m


def test_one_device_serves_one_model():
    forget_devices()
    try:
        emulated_device("d", NVME_PAPER)
        with pytest.raises(SlackTierError, match="already runs model nvme-paper"):
            emulated_device("d", RDMA_PAPER)
    finally:
        forget_devices()


def _reads(n: int) -> PageReads:
    return PageReads(np.zeros(n, np.int32), np.arange(n, dtype=np.int64), np.arange(n, dtype=np.int32))


def test_an_emulated_disk_returns_the_staged_bytes_and_admits_layer_1_first(o_direct_dir):
    one = stage_synthetic(o_direct_dir / "l1", layers=(1,), ranks=1, rows=900)
    fourteen = stage_synthetic(o_direct_dir / "l14", layers=(14,), ranks=1, rows=900)
    forget_devices()
    opts = EmulatedOptions(model="nvme-paper", device="t", rank=0)
    s1, s14 = EmulatedSource(one.specs, opts), EmulatedSource(fourteen.specs, opts)
    try:
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
    finally:
        s1.close()
        s14.close()
        forget_devices()


def _whatif(tmp_path, *extra: str, runs: int = 1) -> int:
    return main(["whatif", "--out", str(tmp_path / "w"), "--vocab", "2000", "--steps", "2", "--batch", "8",
                 "--ranks", "2", "--runs", str(runs), "--no-plot", *extra])


def test_whatif_refuses_one_table_on_an_emulated_and_a_real_device(tmp_path, capsys):
    assert _whatif(tmp_path, "--table", "1=nvme-paper", "--real", "1") == 2
    err = capsys.readouterr().err
    assert "layer 1 placed on emulated and on disk" in err
    assert not (tmp_path / "w").exists()


def test_whatif_refuses_a_model_with_a_negative_term_naming_it(tmp_path, capsys):
    bad = tmp_path / "bad.toml"
    bad.write_text('[device]\nintercept_ms = 0.1\npage_us = -3\nbehind_page_us = 0\nqueue_depth = 8\n')
    assert _whatif(tmp_path, "--table", f"1={bad}", "--table", "14=nvme-paper") == 2
    assert "page_us = -3" in capsys.readouterr().err


def test_whatif_refuses_a_batch_the_traffic_cannot_fill(tmp_path, capsys):
    assert main(["whatif", "--out", str(tmp_path / "w"), "--batch", "128", "--max-session-tokens", "16",
                 "--table", "1=nvme-paper"]) == 2
    assert "B=128 needs 128 sessions" in capsys.readouterr().err
    assert not (tmp_path / "w").exists()


def test_whatif_runs_two_ranks_on_one_emulated_disk_with_exact_rows(tmp_path, capsys):
    assert _whatif(tmp_path, "--table", "1=nvme-paper", "--table", "14=rdma-paper", "--disks", "per-rank") == 0
    out = capsys.readouterr().out
    first = out.splitlines()[[i for i, l in enumerate(out.splitlines()) if l.startswith("device reads")][0]]
    assert first == "device reads from model nvme-paper, rdma-paper; device compute from profile v41_paper"
    assert ": 0 mismatching rows" in out and "checker: 2 TP steps" in out


def _report_lines(out: str) -> list[str]:
    lines = out.splitlines()
    return lines[[i for i, l in enumerate(lines) if l.startswith("device reads")][0]:]


def test_whatif_report_starts_with_a_verdict_computed_from_its_table(tmp_path, capsys):
    """Two placements, 3 runs each: the verdict names the cheaper one in words with the table's own figure; every
    line fits 120 characters and names no tracker issue."""
    import re

    from slacktier.cli import build_parser

    assert build_parser().parse_args(["whatif"]).runs == 3
    assert main(["whatif", "--out", str(tmp_path / "w"), "--vocab", "2000", "--steps", "2", "--batch", "8",
                 "--ranks", "2", "--table", "1=nvme-paper", "--table", "14=nvme-paper"]) == 0   # default runs: 3
    lines = _report_lines(capsys.readouterr().out)
    assert max(map(len, lines)) <= 120 and not any(re.search(r"issue \d", l) for l in lines)
    at = [i for i, l in enumerate(lines) if l.startswith("Verdict: ")]
    assert len(at) == 1
    verdict = " ".join(l.strip() for l in lines[at[0]:at[0] + 2])
    assert verdict.startswith("Verdict: put layer 1 on nvme-paper, layer 14 on nvme-paper (one disk for 2 ranks):")
    head = next(i for i, l in enumerate(lines) if l.startswith("placement "))
    row = lines[head + 1]
    assert at[0] < head   # the verdict above the table
    overhead = re.search(r"([+-]\d+\.\d)%", row[30:]).group(1)
    assert f": {overhead}% of the step in stalls (3 runs," in verdict
    assert (tmp_path / "w" / "whatif.png").stat().st_size > 5000


def test_a_one_rank_whatif_on_emulated_devices_copies_each_steps_pages_at_the_seal(tmp_path, capsys, monkeypatch):
    """One rank runs the TP step as four do: its host pass, then the device's seal (every page copied before the
    step's clock starts), then its timeline step; only a layer on this machine's disk runs begin_step inline."""
    from slacktier.store.emulated import EmulatedDevice

    seals = {"n": 0}
    real = EmulatedDevice.seal

    def seal(self):
        seals["n"] += 1
        return real(self)

    monkeypatch.setattr(EmulatedDevice, "seal", seal)
    assert main(["whatif", "--out", str(tmp_path / "w"), "--vocab", "2000", "--steps", "2", "--batch", "8",
                 "--ranks", "1", "--runs", "1", "--no-plot", "--table", "1=rdma-paper",
                 "--table", "14=nvme-paper"]) == 0
    out = capsys.readouterr().out
    assert ": 0 mismatching rows" in out
    assert seals["n"] >= 2 * 2   # two devices (one per model), at least the two timed steps


@pytest.mark.parametrize("value", ["nan", "-0.1", "1e400", "x"])
def test_whatif_refuses_a_stated_host_pass_that_is_not_a_finite_number_of_ms(tmp_path, capsys, value):
    assert _whatif(tmp_path, "--table", "1=nvme-paper", "--host-pass-ms", value) == 2
    assert "--host-pass-ms" in capsys.readouterr().err
    assert not (tmp_path / "w").exists()


def test_whatif_refuses_a_stated_host_pass_beside_this_machines_disk(tmp_path, capsys):
    assert main(["whatif", "--out", str(tmp_path / "w"), "--vocab", "2000", "--steps", "2", "--batch", "8",
                 "--ranks", "1", "--real", "1", "--host-pass-ms", "0.1"]) == 2
    assert "a stated host pass with layer 1 on this machine's disk" in capsys.readouterr().err


def test_a_stated_host_pass_is_named_in_the_first_line_beside_the_measured_one(tmp_path, capsys):
    """--host-pass-ms states the user's s: the report says so before anything else, and still prints this
    machine's own begin_step from the same runs; the rows stay exact."""
    assert _whatif(tmp_path, "--table", "1=nvme-paper", "--table", "14=nvme-paper", "--host-pass-ms", "0.05") == 0
    lines = capsys.readouterr().out.splitlines()
    first = [i for i, l in enumerate(lines) if l.startswith("device reads")][0]
    assert lines[first] == ("device reads from model nvme-paper; device compute from profile v41_paper; host pass "
                            "stated at 0.05 ms per rank, not measured")
    stated = [i for i, l in enumerate(lines) if l.startswith("  host pass s: stated, 0.05 ms per rank")]
    assert len(stated) == 1 and "slowest rank's mean" in " ".join(lines[stated[0]:stated[0] + 2])
    assert any(": 0 mismatching rows" in l for l in lines)


# ---- the native lane: begin_step's pages reach the emulated queue from compiled code --------------------------

LANE_ROWS = {1: 700, 14: 500}


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
def test_begin_step_queues_emulated_pages_from_compiled_code_with_exact_rows(o_direct_dir, monkeypatch, stepped):
    """Every batch of begin_step reaches the emulated queue through the native lane: none through Python's
    submit, the queue counts them as lane batches, and the gathered rows are the table's, whether the device
    runs free or steps as in the what-if (the booked batches then wait for the device's seal)."""
    forget_devices()
    calls = _counting_submit(monkeypatch)
    engine, raws = _lane_engine(o_direct_dir, "lane-used")
    try:
        [q] = [q for q in open_queues() if q.device.name == "emulated:lane-used/rank0"]
        device = emulated_device("lane-used", RDMA_PAPER) if stepped else None
        for _ in _lane_steps(engine, raws, 4, seed=5, device=device):
            pass
        assert calls["submit"] == 0
        assert q.batches["lane"] == 8 and q.batches["submit"] == 0   # two layers, four steps
    finally:
        engine.close()
        forget_devices()


def test_in_a_tp_step_the_lanes_batches_are_booked_when_the_device_seals(o_direct_dir):
    """The device times a TP step's batches at its seal, once every rank's host pass is done, so begin_step
    books the emulated lane's jobs before it returns (the disk tier books its own at the first gather): by the
    seal both layers' batches are the queue's, none is left for a gather to book, and their pages are copied."""
    import torch

    from slacktier.tables.codec import dequantize_bits

    forget_devices()
    engine, raws = _lane_engine(o_direct_dir, "lane-sealed")
    try:
        [q] = [q for q in open_queues() if q.device.name == "emulated:lane-sealed/rank0"]
        device = emulated_device("lane-sealed", RDMA_PAPER)
        rng = np.random.default_rng(9)
        ids = np.stack([rng.integers(0, n, (8, 24)) for n in LANE_ROWS.values()], axis=1)
        device.begin_step()
        device.rank_host_pass(0)
        engine.begin_step(ids)
        device.seal()
        assert q.batches["lane"] == 2   # booked and sealed before any gather
        # and copied: every page of the step is in its pool before the rank's step starts, so nothing of the
        # emulator's runs beside the rank's timeline
        assert len(q._jobs) == 2 and all(j.done for j in q._jobs.values())
        device.start_rank(0)
        for axis, layer in enumerate(LANE_ROWS):
            out = engine.gather(layer).reshape(-1, 256).view(torch.int16).numpy()
            assert np.array_equal(out, dequantize_bits(raws[layer][ids[:, axis].reshape(-1)]).view(np.int16))
        engine.end_step()
        device.end_step()
        assert q.batches["lane"] == 2
    finally:
        engine.close()
        forget_devices()


def test_a_batch_the_lane_refuses_goes_through_python_and_the_lane_then_takes_the_next(o_direct_dir, monkeypatch):
    """A lane table too small for a batch: the compiled call refuses it, the engine submits it from Python (counted
    in LANE_REFUSALS), rows stay exact, and once the table has grown the batches go through the lane again."""
    from slacktier.store import emulated

    monkeypatch.setattr(emulated, "LANE_PAGES", 4)   # a step reads far more pages than 4
    forget_devices()
    calls = _counting_submit(monkeypatch)
    refused = sum(emulated.LANE_REFUSALS.values())
    engine, raws = _lane_engine(o_direct_dir, "lane-refused")
    try:
        [q] = [q for q in open_queues() if q.device.name == "emulated:lane-refused/rank0"]
        per_step = []
        for _ in _lane_steps(engine, raws, 4, seed=9):
            per_step.append(calls["submit"] - sum(per_step))
        assert per_step[0] == 2                                   # both layers' first batches refused, then Python
        assert sum(emulated.LANE_REFUSALS.values()) - refused == 2   # counted once per table that grew
        assert per_step[-1] == 0 and q.batches["lane"] >= 2         # grown: the last step went through the lane
        assert q.batches["submit"] == sum(per_step)
    finally:
        engine.close()
        forget_devices()


@pytest.mark.skipif(probe_io_uring() is not None, reason=f"io_uring unavailable: {probe_io_uring()}")
def test_one_compiled_pass_feeds_an_io_uring_disk_layer_and_an_emulated_layer_each_through_its_own_lane(
        o_direct_dir, monkeypatch):
    """Layer 1 on an io_uring disk, layer 14 on an emulated device: the one compiled call hands each layer's
    pages to its own client's submit (st_eng_submit, the emulated lane's), none through Python, rows exact."""
    forget_devices()
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
        forget_devices()
