"""Properties of the step engine over random steps: exact rows, consistent counters and cache, window order."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from slacktier.cache import RowCache
from slacktier.engine.step import StepEngine
from slacktier.engine.tables import seen_bitmap
from slacktier.testing.engine import ArraySource, array_tables
from slacktier.store.base import PageBufferPool, PageReads
from slacktier.tables.codec import dequantize_bits

ROWS = {1: 700, 14: 500}


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cache_rows=st.integers(0, 300), share=st.floats(0.0, 1.0), ranks=st.integers(1, 3),
       impl=st.sampled_from(["numba", "torch"]),
       steps=st.lists(st.tuples(st.integers(1, 12), st.integers(0, 2**31)), min_size=1, max_size=8))
def test_random_steps_are_exact(cache_rows: int, share: float, ranks: int, impl: str, steps: list) -> None:
    tables, _, raws = array_tables(ROWS, ranks=ranks, cache_shares={1: share, 14: 1.0 - share})
    engine = StepEngine(tables, RowCache(cache_rows), gather_impl=impl, max_tokens=4)
    for tokens, seed in steps:
        rng = np.random.default_rng(seed)
        # A small hot set so rows repeat within and across steps.
        ids = np.stack([rng.integers(0, 40, (tokens, 24)) * (n // 40) for n in ROWS.values()], axis=1)
        engine.begin_step(ids)
        for j, layer in enumerate(ROWS):
            out = engine.gather(layer)
            assert out.shape == (tokens, 24, 256) and out.dtype == torch.bfloat16
            want = dequantize_bits(raws[layer][ids[:, j].reshape(-1)])
            assert np.array_equal(out.reshape(-1, 256).view(torch.int16).numpy(), want.view(np.int16))
        counters = engine.end_step()
        for layer, c in counters.layers.items():
            assert c.lookups == tokens * 24 == c.hits + c.reused + c.rows_read + c.zero_rows
            assert c.pages_read <= c.rows_read
            assert c.bypass <= c.rows_read
            if cache_rows == 0:
                assert c.hits == 0
        assert engine.cache.verify() == []
        assert engine.cache.pinned().size == 0


def test_repeated_rows_and_pages_are_read_once() -> None:
    tables, source, raws = array_tables({1: 600}, ranks=1)
    engine = StepEngine(tables, RowCache(100), ids_layers=[1])
    ids = np.zeros((4, 1, 24), dtype=np.int64)
    ids[:, 0, :12] = 31          # one row, 48 times
    ids[:, 0, 12:] = 32          # same page (rows 30..44 are page 2)
    engine.begin_step(ids)
    engine.gather(1)
    c = engine.end_step().layers[1]
    assert (c.rows_read, c.pages_read, c.reused, c.hits) == (2, 1, 94, 0)
    engine.begin_step(ids)
    engine.gather(1)
    c = engine.end_step().layers[1]
    assert (c.rows_read, c.pages_read, c.hits) == (0, 0, 96)
    # With no cache, repeats are still read once (the step's own read is reused).
    engine = StepEngine(array_tables({1: 600}, ranks=1)[0], RowCache(0))
    engine.begin_step(ids)
    out = engine.gather(1)
    c = engine.end_step().layers[1]
    assert (c.rows_read, c.pages_read, c.bypass) == (2, 1, 2)
    want = dequantize_bits(raws[1][ids.reshape(-1)])
    assert np.array_equal(out.reshape(-1, 256).view(torch.int16).numpy(), want.view(np.int16))


class RecordingSource(ArraySource):
    """An ArraySource that notes, at each submit, how many slots each layer has pinned so far."""

    def __init__(self, base: ArraySource, cache: RowCache) -> None:
        super().__init__(base.regions, base.pages)
        self.cache = cache
        self.log: list[tuple[int, dict[int, int]]] = []

    def submit(self, reads: PageReads, pool: PageBufferPool) -> int:
        layer = self.regions[int(reads.region[0])].layer
        self.log.append((layer, {l: int(self.cache.layer(l).lstate[1]) for l in self.cache.layers}))
        return super().submit(reads, pool)


def test_first_window_layer_is_submitted_before_the_next_is_resolved() -> None:
    for order in ([1, 14], [14, 1]):
        tables, source, raws = array_tables(ROWS, ranks=2)
        cache = RowCache(400)
        rec = RecordingSource(source, cache)
        by_layer = {t.layer: t for t in tables}
        for t in tables:
            t.source = rec
        engine = StepEngine([by_layer[layer] for layer in order], cache)
        assert engine.layers == tuple(order) and engine.ids_layers == (1, 14)
        ids = np.stack([np.arange(48).reshape(2, 24) * 7 for _ in ROWS], axis=1)
        engine.begin_step(ids)
        first, second = order
        assert [layer for layer, _ in rec.log] == order
        pins_at_first_submit = rec.log[0][1]
        assert pins_at_first_submit[first] > 0 and pins_at_first_submit[second] == 0
        engine.gather(second)
        engine.gather(first)
        engine.end_step()


def test_lossy_mode_zeroes_unseen_rows_without_reading_them() -> None:
    tables, source, raws = array_tables(ROWS, ranks=2)
    seen_rows = {layer: np.arange(0, n, 2) for layer, n in ROWS.items()}   # even rows seen
    tables = [dataclasses.replace(t, seen=seen_bitmap(t.rows, seen_rows[t.layer])) for t in tables]
    engine = StepEngine(tables, RowCache(200), lossy=True, check=True, check_raise=True)
    rng = np.random.default_rng(4)
    ids = np.stack([rng.integers(0, n, (10, 24)) for n in ROWS.values()], axis=1)
    engine.begin_step(ids)
    for j, layer in enumerate(ROWS):
        out = engine.gather(layer).reshape(-1, 256)
        flat = ids[:, j].reshape(-1)
        even = flat % 2 == 0
        want = dequantize_bits(raws[layer][flat])
        assert np.array_equal(out[torch.from_numpy(even)].view(torch.int16).numpy(), want[even].view(np.int16))
        assert not out[torch.from_numpy(~even)].view(torch.int16).any()
    c = engine.end_step()
    for j, layer in enumerate(ROWS):
        flat = ids[:, j].reshape(-1)
        assert c.layers[layer].zero_rows == int(np.count_nonzero(flat % 2))
        assert c.layers[layer].rows_read == len(np.unique(flat[flat % 2 == 0]))
        assert c.layers[layer].mismatches == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_engine_matches_the_cpu_engine() -> None:
    tables, _, raws = array_tables(ROWS, ranks=2)
    gpu = StepEngine(tables, RowCache(300, "cuda"), device="cuda", check=True, check_raise=True)
    rng = np.random.default_rng(9)
    for _ in range(4):
        ids = np.stack([rng.integers(0, 60, (16, 24)) * (n // 60) for n in ROWS.values()], axis=1)
        gpu.begin_step(ids)
        for j, layer in enumerate(ROWS):
            out = gpu.gather(layer)
            assert out.device.type == "cuda"
            want = dequantize_bits(raws[layer][ids[:, j].reshape(-1)])
            assert np.array_equal(out.reshape(-1, 256).view(torch.int16).cpu().numpy(), want.view(np.int16))
        gpu.end_step()
    assert sum(c.hits for c in gpu.totals.values()) > 0
    gpu.close()
