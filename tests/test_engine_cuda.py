"""The accelerator path beside the CPU engine, bit for bit, on real-token steps of one rank's shard.

The engine on "cuda" keeps its cache arrays on the GPU, stages missed rows in
pinned memory and gathers with torch ops (`gather.gather_torch`). It runs here
against the CPU engine (numba gather) on the same steps: hits, misses, rows
evicted and read again (a cache smaller than a step's rows), foreign rows
(owned_only: -0.0) and pad ids (zeros). Without a GPU the same comparison runs
with the torch gather on the CPU, which is the code the GPU runs minus the
device, so the test is never empty; `benchmarks/gpu_checks.py` runs it on a
lent GPU machine.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from slacktier.cache import RowCache
from slacktier.engine.checker import ArrayRowReader
from slacktier.engine.step import StepEngine
from slacktier.engine.tables import TableSpec
from slacktier.testing.engine import ArraySource, pack_pages, real_token_ids
from slacktier.tables.codec import synthetic_rows
from slacktier.tables.engram_hash import EngramLayout
from slacktier.tables.layout import pages_for_rows, shard_bounds
from slacktier.tables.regions import Region

LAYOUT = EngramLayout.scaled(500)
RANKS = 4
RANK = 1
PAD = -1

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _engine(device: str, gather_impl: str, cache_rows: int) -> StepEngine:
    regions, pages, specs = [], [], []
    for i, layer in enumerate(LAYOUT.layer_ids):
        raw = synthetic_rows(11 + layer, 0, LAYOUT.rows(i))
        lo, hi = shard_bounds(LAYOUT.rows(i), LAYOUT.column_bounds(i), RANK, RANKS)
        regions.append(Region(layer=layer, rank=RANK, path=f"mem:{layer}:{RANK}", offset_bytes=0,
                              pages=pages_for_rows(hi - lo), row_start=lo, rows=hi - lo))
        pages.append(pack_pages(raw[lo:hi]))
        specs.append((layer, lo, hi, raw))
    source = ArraySource(regions, pages)
    tables = [TableSpec(layer=layer, row_start=lo, rows=hi - lo, source=source, cache_share=0.5,
                        regions=(regions[k],), region_index=(k,), reference=ArrayRowReader(raw[lo:hi]))
              for k, (layer, lo, hi, raw) in enumerate(specs)]
    return StepEngine(tables, RowCache(cache_rows, device), device=device, max_tokens=32, owned_only=True,
                      pad_id=PAD, check=True, check_raise=True, gather_impl=gather_impl)


@pytest.mark.parametrize("device,gather_impl", [("cpu", "torch"), pytest.param("cuda", "torch", marks=needs_cuda)])
@pytest.mark.parametrize("cache_rows", [4000, 40])
def test_engine_matches_the_cpu_engine_bit_for_bit(device: str, gather_impl: str, cache_rows: int) -> None:
    ids = real_token_ids(32 * 12, LAYOUT).reshape(12, 32, len(LAYOUT.layer_ids), 24)
    ids[:, -3:] = PAD                       # the last 3 tokens of every step are padding
    ids[6:] = ids[:6]                       # the second half repeats the first: hits, or rows evicted and read again
    ref = _engine("cpu", "numba", cache_rows)
    dev = _engine(device, gather_impl, cache_rows)
    for step in ids:
        ref.begin_step(step)
        dev.begin_step(step)
        for layer in LAYOUT.layer_ids:
            want = ref.gather(layer)
            got = dev.gather(layer)
            assert got.device.type == torch.device(device).type
            assert torch.equal(got.cpu().view(torch.int16), want.view(torch.int16)), layer
        a, b = ref.end_step(), dev.end_step()
        for layer in LAYOUT.layer_ids:   # the same pass on both: the same counts
            ca, cb = a.layers[layer], b.layers[layer]
            assert (ca.hits, ca.rows_read, ca.pages_read, ca.zero_rows, ca.padded) == \
                   (cb.hits, cb.rows_read, cb.pages_read, cb.zero_rows, cb.padded)
            assert cb.mismatches == 0
    totals = {layer: dev.totals[layer] for layer in LAYOUT.layer_ids}
    assert all(t.hits > 0 and t.rows_read > 0 and t.zero_rows > t.padded > 0 for t in totals.values())
    if cache_rows == 40:   # a cache smaller than a step's rows: evictions and slot-less reads both happen
        assert all(t.evictions > 0 and t.bypass > 0 for t in totals.values())
    assert ref.cache.verify() == [] and dev.cache.verify() == []
    ref.close()
    dev.close()
