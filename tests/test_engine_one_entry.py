"""begin_step's one path: the cache's compiled pass (cache.compiled) inside the engine.

The pass itself is checked against a plain-Python reference at the cache level
(test_cache_pass_reference.py). Here the engine around it: exact rows and a
consistent cache step by step, with io_uring disk layers (submitted from
compiled code), a DRAM-like layer between them (submitted from Python, the pass
resumes after it), pad ids, steps larger than the engine was sized for and
cache resizes between steps (each makes the engine build a new pass); the
counters add up to the lookups.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from slacktier.cache import RowCache
from slacktier.config import DiskOptions
from slacktier.engine.checker import ArrayRowReader
from slacktier.engine.step import StepEngine
from slacktier.engine.tables import TableSpec
from slacktier.testing.engine import ArraySource, pack_pages
from slacktier.errors import ErrorKind, SlackTierError
from slacktier.store import _native
from slacktier.store.disk import DiskSource
from slacktier.tables.codec import dequantize_bits, synthetic_rows
from slacktier.tables.layout import pages_for_rows, shard_bounds
from slacktier.tables.regions import Region

ROWS = {1: 700, 3: 400, 14: 500}
URING_MISSING = _native.probe_io_uring()
COUNTED = ("lookups", "hits", "reused", "rows_read", "pages_read", "padded", "zero_rows", "bypass", "evictions")


@pytest.fixture(scope="module")
def files(o_direct_module_dir: Path) -> dict:
    """Each layer's rows, staged as one file per rank for 1..3 ranks: {(layer, ranks): [Region]}, and the raw rows."""
    raws = {layer: synthetic_rows(40 + layer, 0, n) for layer, n in ROWS.items()}
    out: dict = {"raws": raws}
    for ranks in (1, 2, 3):
        for layer, n in ROWS.items():
            regions = []
            for rank in range(ranks):
                lo, hi = shard_bounds(n, None, rank, ranks)
                path = o_direct_module_dir / f"l{layer}-r{rank}-of{ranks}.pages"
                pages = pack_pages(raws[layer][lo:hi])
                path.write_bytes(pages.tobytes())
                regions.append(Region(layer=layer, rank=rank, path=str(path), offset_bytes=0,
                                      pages=pages_for_rows(hi - lo), row_start=lo, rows=hi - lo))
            out[(layer, ranks)] = regions
    return out


def _tables(files: dict, ranks: int, kinds: dict[int, str], shares: dict[int, float]) -> tuple[list, list]:
    """TableSpecs and their sources: layer l read by a DiskSource ("disk", io_uring when the kernel has it,
    "threads") or an ArraySource ("array", submitted from Python)."""
    tables, sources = [], []
    for layer in ROWS:
        regions = tuple(files[(layer, ranks)])
        kind = kinds[layer]
        if kind == "array":
            raws = files["raws"][layer]
            source = ArraySource(regions, [pack_pages(raws[r.row_start:r.row_start + r.rows]) for r in regions])
        else:
            source = DiskSource(regions, DiskOptions(engine="auto" if kind == "disk" else "threads", queue_depth=32))
        sources.append(source)
        tables.append(TableSpec(layer=layer, row_start=0, rows=ROWS[layer], regions=regions, source=source,
                                cache_share=shares[layer], reference=ArrayRowReader(files["raws"][layer])))
    return tables, sources


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cache_rows=st.integers(0, 400), share=st.floats(0.05, 0.9), ranks=st.integers(1, 3),
       kinds=st.sampled_from([("disk", "disk", "disk"), ("disk", "array", "disk"), ("array", "disk", "threads"),
                              ("array", "array", "array")]),
       steps=st.lists(st.tuples(st.integers(1, 12), st.integers(0, 2**31), st.sampled_from([None, 0, 150, 400])),
                      min_size=1, max_size=7))
def test_the_compiled_pass_serves_exact_rows_across_sources_resizes_and_larger_steps(
        files, cache_rows, share, ranks, kinds, steps) -> None:
    """Exact rows, a consistent cache and counters that add up after every step; resizes and larger steps
    rebuild the pass."""
    kind = dict(zip(ROWS, kinds, strict=True))
    shares = {1: share, 3: (1.0 - share) / 2, 14: (1.0 - share) / 2}
    tables, sources = _tables(files, ranks, kind, shares)
    engine = StepEngine(tables, RowCache(400, slots=cache_rows), max_tokens=4, owned_sources=sources)
    raws = files["raws"]
    try:
        for tokens, seed, resize in steps:
            rng = np.random.default_rng(seed)
            # a small hot set, so rows and pages repeat within and across steps; some pad ids
            ids = np.stack([rng.integers(0, 50, (tokens, 24)) * (n // 50) for n in ROWS.values()], axis=1)
            ids[rng.random(ids.shape) < 0.05] = -1
            if resize is not None:
                engine.cache.resize(slots=resize)
            engine.begin_step(ids)
            outs = [engine.gather(layer) for layer in (14, 1, 3)]   # not in window order
            counters = engine.end_step()
            for out, layer in zip(outs, (14, 1, 3), strict=True):
                axis = list(ROWS).index(layer)
                flat = ids[:, axis].reshape(-1)
                want = dequantize_bits(raws[layer][np.maximum(flat, 0)])
                want[flat < 0] = 0
                assert np.array_equal(out.reshape(-1, 256).view(torch.int16).numpy(), want.view(np.int16))
                c = counters.layers[layer]
                assert c.lookups == flat.size and c.padded == int((flat < 0).sum())
                assert c.hits + c.reused + c.rows_read + c.padded == c.lookups
                assert c.bypass <= c.rows_read and c.pages_read <= c.rows_read
            assert engine.cache.verify() == []
    finally:
        engine.close()


@pytest.mark.skipif(URING_MISSING is not None, reason=f"io_uring unavailable: {URING_MISSING}")
def test_io_uring_layers_are_submitted_from_compiled_code(files, monkeypatch) -> None:
    """With every layer on an io_uring disk, no page list goes through Python's submit; the DRAM-like layer's
    does, once per step with misses, and the step's rows are exact."""
    calls = {"disk": 0, "array": 0}
    disk_submit, array_submit = DiskSource.submit, ArraySource.submit

    def counted(kind, real):
        def submit(self, reads, pool):
            calls[kind] += 1
            return real(self, reads, pool)
        return submit

    monkeypatch.setattr(DiskSource, "submit", counted("disk", disk_submit))
    monkeypatch.setattr(ArraySource, "submit", counted("array", array_submit))
    tables, sources = _tables(files, 2, {1: "disk", 3: "array", 14: "disk"}, {1: 0.4, 3: 0.3, 14: 0.3})
    with StepEngine(tables, RowCache(300), max_tokens=8, owned_sources=sources) as engine:
        rng = np.random.default_rng(3)
        for _ in range(4):
            ids = np.stack([rng.integers(0, n, (8, 24)) for n in ROWS.values()], axis=1)
            engine.begin_step(ids)
            for axis, layer in enumerate(ROWS):
                out = engine.gather(layer).reshape(-1, 256).view(torch.int16).numpy()
                want = dequantize_bits(files["raws"][layer][ids[:, axis].reshape(-1)])
                assert np.array_equal(out, want.view(np.int16))
            c = engine.end_step()
            assert c.layers[1].pages_read > 0 and c.layers[14].pages_read > 0
    assert calls == {"disk": 0, "array": 4}


@pytest.mark.skipif(URING_MISSING is not None, reason=f"io_uring unavailable: {URING_MISSING}")
def test_reads_queued_by_the_compiled_call_are_taken_by_end_step_and_close_without_a_gather(files) -> None:
    """begin_step leaves the jobs it queued for the step's first gather to book; a step ended, or an engine
    closed, before any gather still waits them out: the counters count their pages, nothing half-read is
    cached, and the sources close cleanly (their clients leave with no job left behind)."""
    tables, sources = _tables(files, 1, {1: "disk", 3: "disk", 14: "disk"}, {1: 0.4, 3: 0.3, 14: 0.3})
    engine = StepEngine(tables, RowCache(300), max_tokens=4, owned_sources=sources)
    rng = np.random.default_rng(11)
    ids = np.stack([rng.integers(0, n, (4, 24)) for n in ROWS.values()], axis=1)
    engine.begin_step(ids)
    c = engine.end_step()
    assert all(c.layers[layer].pages_read > 0 for layer in ROWS)
    assert engine.cache.verify() == [] and engine.cache.pinned().size == 0
    engine.begin_step(ids)   # the same rows again: none was cached by the step never gathered
    out = engine.gather(1).reshape(-1, 256).view(torch.int16).numpy()
    assert engine.end_step().layers[1].hits == 0
    assert np.array_equal(out, dequantize_bits(files["raws"][1][ids[:, 0].reshape(-1)]).view(np.int16))
    engine.begin_step(np.stack([rng.integers(0, n, (4, 24)) for n in ROWS.values()], axis=1))
    engine.close()   # with the step open and nothing gathered
    assert not engine.in_step
    for source in sources:
        with pytest.raises(SlackTierError) as exc:
            source.wait(1)
        assert exc.value.kind is ErrorKind.CLOSED


def test_a_closed_disk_source_is_a_clear_error_not_a_call_into_a_freed_engine(files) -> None:
    """A source closed under the engine: its C engine is gone, so the entry leaves the pages to Python's submit,
    which refuses them (CLOSED); the step is undone."""
    tables, sources = _tables(files, 1, {1: "disk", 3: "disk", 14: "disk"}, {1: 0.4, 3: 0.3, 14: 0.3})
    engine = StepEngine(tables, RowCache(300), max_tokens=2, owned_sources=sources)
    ids = np.stack([np.arange(48).reshape(2, 24) * 7 % n for n in ROWS.values()], axis=1).astype(np.int64)
    engine.begin_step(ids)
    engine.end_step()
    sources[1].close()   # layer 3's
    fresh = ids + 1
    with pytest.raises(SlackTierError) as exc:
        engine.begin_step(fresh)
    assert exc.value.kind is ErrorKind.CLOSED and exc.value.layer == 3
    assert not engine.in_step and engine.cache.pinned().size == 0 and engine.cache.verify() == []
    engine.close()


def test_an_id_outside_the_table_stops_the_entry_at_its_layer(files) -> None:
    """A bad id in the second layer: the first layer's reads were already submitted, the error names the
    second layer, and the step is undone (no pins, nothing cached from half-read rows)."""
    tables, sources = _tables(files, 1, {1: "disk", 3: "disk", 14: "disk"}, {1: 0.4, 3: 0.3, 14: 0.3})
    with StepEngine(tables, RowCache(300), max_tokens=2, owned_sources=sources) as engine:
        ids = np.zeros((2, 3, 24), dtype=np.int64)
        ids[:, 0] = np.arange(48).reshape(2, 24)
        ids[1, 1, 5] = ROWS[3]   # one past layer 3's last row
        with pytest.raises(SlackTierError) as exc:
            engine.begin_step(ids)
        assert exc.value.kind is ErrorKind.BAD_INPUT and exc.value.layer == 3 and "token 1, column 5" in str(exc.value)
        assert not engine.in_step and engine.cache.pinned().size == 0
        assert engine.cache.cached(1)[0].size == 0 and engine.cache.verify() == []
        ids[1, 1, 5] = 0
        engine.begin_step(ids)
        assert np.array_equal(engine.gather(1).reshape(-1, 256).view(torch.int16).numpy(),
                              dequantize_bits(files["raws"][1][np.arange(48)]).view(np.int16))
        engine.end_step()


def _exact(engine: StepEngine, files: dict, ids: np.ndarray) -> None:
    """Every layer's gathered rows of the open step equal the table's rows of `ids` bit for bit."""
    for axis, layer in enumerate(ROWS):
        out = engine.gather(layer).reshape(-1, 256).view(torch.int16).numpy()
        want = dequantize_bits(files["raws"][layer][np.asarray(ids)[:, axis].reshape(-1)])
        assert np.array_equal(out, want.view(np.int16))


def test_every_check_holds_once_the_plan_is_built(files) -> None:
    """After a first step the usual begin_step skips the general checks; anything unusual still takes them:
    a step still open, float ids, a wrong shape, ids of another layout or dtype, more tokens than sized for,
    a closed engine."""
    tables, sources = _tables(files, 1, {1: "disk", 3: "array", 14: "disk"}, {1: 0.4, 3: 0.3, 14: 0.3})
    engine = StepEngine(tables, RowCache(300), max_tokens=4, owned_sources=sources)
    rng = np.random.default_rng(11)

    def ids_of(tokens: int) -> np.ndarray:
        return np.stack([rng.integers(0, n, (tokens, 24)) for n in ROWS.values()], axis=1)

    ids = ids_of(4)
    engine.begin_step(ids)
    with pytest.raises(SlackTierError) as exc:
        engine.begin_step(ids)
    assert exc.value.kind is ErrorKind.BAD_INPUT and "step is open" in str(exc.value)
    _exact(engine, files, ids)
    engine.end_step()
    for bad in (ids.astype(np.float64), ids[:, :2], ids[..., :12], ids[None]):
        with pytest.raises(SlackTierError) as exc:
            engine.begin_step(bad)
        assert exc.value.kind is ErrorKind.BAD_INPUT and not engine.in_step
    for ids in (ids_of(4)[::-1], np.asfortranarray(ids_of(4)), ids_of(3).astype(np.int32), ids_of(9),
                ids_of(4).tolist()):
        engine.begin_step(ids)
        _exact(engine, files, ids)
        engine.end_step()
    engine.close()
    with pytest.raises(SlackTierError) as exc:
        engine.begin_step(ids_of(4))
    assert exc.value.kind is ErrorKind.CLOSED


@pytest.mark.skipif(URING_MISSING is not None, reason=f"io_uring unavailable: {URING_MISSING}")
def test_after_a_read_times_out_the_entry_reads_into_the_new_pool(files) -> None:
    """A read that times out retires the page pool; the compiled entry's later submissions must go to the new
    pool (the one gather reads), not the retired one its plan named."""
    tables, sources = _tables(files, 1, {1: "disk", 3: "disk", 14: "disk"}, {1: 0.1, 3: 0.1, 14: 0.1})
    engine = StepEngine(tables, RowCache(60), max_tokens=16, owned_sources=sources, wait_timeout_s=1e-7)
    rng = np.random.default_rng(5)

    def ids_of(tokens: int) -> np.ndarray:
        return np.stack([rng.integers(0, n, (tokens, 24)) for n in ROWS.values()], axis=1)

    for _ in range(50):   # ~45 pages a layer; a wait of 0.1 us nearly always finds them still in flight
        engine.begin_step(ids_of(16))
        try:
            engine.gather(1)
        except SlackTierError as exc:
            assert exc.kind is ErrorKind.TIMEOUT
            engine.wait_timeout_s = 30.0   # from the next step on
            try:
                engine.end_step()   # waits for the other layers with this step's 0.1 us: may time out too
            except SlackTierError as late:
                assert late.kind is ErrorKind.TIMEOUT
            break
        try:   # layer 1's pages go to the device first, so a later layer is often the one still in flight
            engine.end_step()
        except SlackTierError as late:
            assert late.kind is ErrorKind.TIMEOUT
            engine.wait_timeout_s = 30.0
            break
    assert engine.retired_pools == 1
    for _ in range(4):   # the first reaps the timed-out jobs through Python's submit; the rest go from compiled code
        ids = ids_of(16)
        engine.begin_step(ids)
        _exact(engine, files, ids)
        c = engine.end_step()
        assert c.layers[1].pages_read > 0
    engine.close()
