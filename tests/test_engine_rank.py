"""Per-rank mode: a process serving one rank's shard (owned_only) against the single-process engine.

Tensor parallelism as SGLang runs the Engram host table: each rank's process
holds only its shard's rows, looks up every id of the step, fills the ids it
does not own with zeros, and an all-reduce sums the ranks' outputs. Here four
per-rank engines (each a directory and cache for its own shard only) and one
engine serving all four regions run the same real-token steps; the sum over
ranks of the per-rank gathers must equal the single-process gather bit for
bit. Foreign rows come out as -0.0 so the sum keeps the owner's -0.0 values
(the test shows the rows hold -0.0, and that +0.0 zero-fill would flip them).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from slacktier.cache import RowCache
from slacktier.engine import Change
from slacktier.engine.checker import ArrayRowReader
from slacktier.engine.step import StepEngine
from slacktier.engine.tables import TableSpec
from slacktier.testing.engine import ArraySource, pack_pages, real_token_ids
from slacktier.errors import ErrorKind, SlackTierError
from slacktier.tables.regions import Region
from slacktier.tables.codec import synthetic_rows
from slacktier.tables.engram_hash import EngramLayout
from slacktier.tables.layout import pages_for_rows, shard_bounds

LAYOUT = EngramLayout.scaled(500)   # small V4.1-shaped layout, 24 hash columns per layer
RANKS = 4
SEED = 3
NEG_ZERO = -32768                   # bf16 -0.0 bits as int16


def _raws() -> dict[int, np.ndarray]:
    return {layer: synthetic_rows(SEED + layer, 0, LAYOUT.rows(i)) for i, layer in enumerate(LAYOUT.layer_ids)}


def _bounds(i: int, rank: int) -> tuple[int, int]:
    return shard_bounds(LAYOUT.rows(i), LAYOUT.column_bounds(i), rank, RANKS)


def single_engine(raws: dict[int, np.ndarray], cache_rows: int, gather_impl: str) -> StepEngine:
    """One process serving every rank's region of both layers."""
    regions, pages, tables = [], [], []
    for i, layer in enumerate(LAYOUT.layer_ids):
        index = []
        for rank in range(RANKS):
            lo, hi = _bounds(i, rank)
            index.append(len(regions))
            regions.append(Region(layer=layer, rank=rank, path=f"mem:{layer}:{rank}", offset_bytes=0,
                                  pages=pages_for_rows(hi - lo), row_start=lo, rows=hi - lo))
            pages.append(pack_pages(raws[layer][lo:hi]))
        tables.append((layer, index))
    source = ArraySource(regions, pages)
    specs = [TableSpec(layer=layer, row_start=0, rows=raws[layer].shape[0], regions=tuple(regions[i] for i in index),
                       region_index=tuple(index), source=source, cache_share=0.5,
                       reference=ArrayRowReader(raws[layer])) for layer, index in tables]
    return StepEngine(specs, RowCache(cache_rows), max_tokens=64, check=True, check_raise=True,
                      gather_impl=gather_impl)


def rank_engine(raws: dict[int, np.ndarray], rank: int, cache_rows: int, gather_impl: str,
                owned_only: bool = True) -> StepEngine:
    """One rank's process: its shard of each layer only (directory of the shard's rows)."""
    regions, pages, specs = [], [], []
    for i, layer in enumerate(LAYOUT.layer_ids):
        lo, hi = _bounds(i, rank)
        regions.append(Region(layer=layer, rank=rank, path=f"mem:{layer}:{rank}", offset_bytes=0,
                              pages=pages_for_rows(hi - lo), row_start=lo, rows=hi - lo))
        pages.append(pack_pages(raws[layer][lo:hi]))
    source = ArraySource(regions, pages)
    for i, layer in enumerate(LAYOUT.layer_ids):
        lo, hi = _bounds(i, rank)
        specs.append(TableSpec(layer=layer, row_start=lo, rows=hi - lo, source=source, cache_share=0.5,
                               regions=(regions[i],), region_index=(i,),
                               reference=ArrayRowReader(raws[layer][lo:hi])))
    return StepEngine(specs, RowCache(cache_rows), max_tokens=64, check=True, check_raise=True,
                      gather_impl=gather_impl, owned_only=owned_only)


@pytest.fixture(scope="module")
def ids() -> np.ndarray:
    """[240, 2, 24] real-token row ids."""
    return real_token_ids(240, LAYOUT)


@pytest.mark.parametrize("gather_impl,cache_rows", [("numba", 4000), ("numba", 96), ("torch", 4000)])
def test_rank_sum_equals_single_process(ids: np.ndarray, gather_impl: str, cache_rows: int) -> None:
    raws = _raws()
    single = single_engine(raws, cache_rows * RANKS, gather_impl)
    ranks = [rank_engine(raws, r, cache_rows, gather_impl) for r in range(RANKS)]
    neg_zeros = 0
    plus_fill_flips = 0
    owned_lookups = 0
    for a in range(0, ids.shape[0], 16):
        step = ids[a:a + 16]
        single.begin_step(step)
        for e in ranks:
            e.begin_step(step)
        for i, layer in enumerate(LAYOUT.layer_ids):
            want = single.gather(layer)                                  # [T, 24, 256] bf16
            outs = [e.gather(layer) for e in ranks]
            total = outs[0]
            for o in outs[1:]:
                total = total + o                                        # the all-reduce, in bf16
            assert torch.equal(total.view(torch.int16), want.view(torch.int16))
            # Every lookup is owned by exactly one rank; the others' rows are all -0.0.
            flat = step[:, i, :]
            owner = np.searchsorted([_bounds(i, r)[1] for r in range(RANKS)], flat, side="right")
            for r, o in enumerate(outs):
                foreign = torch.from_numpy(owner != r)
                assert bool((o.view(torch.int16)[foreign] == NEG_ZERO).all())
            # SGLang-style +0.0 fill: the sum loses the owner's -0.0 values, and nothing else changes.
            plus = [torch.where(torch.from_numpy(owner != r)[..., None], torch.zeros((), dtype=o.dtype), o)
                    for r, o in enumerate(outs)]
            psum = plus[0] + plus[1] + plus[2] + plus[3]
            wbits = want.view(torch.int16)
            neg_zeros += int((wbits == NEG_ZERO).sum())
            differ = psum.view(torch.int16) != wbits
            plus_fill_flips += int(differ.sum())
            assert bool((wbits[differ] == NEG_ZERO).all())
        single.end_step()
        for e in ranks:
            c = e.end_step()
            owned_lookups += sum(x.lookups - x.zero_rows for x in c.layers.values())
    assert neg_zeros > 0 and plus_fill_flips == neg_zeros     # the rows do hold -0.0: the test has teeth
    assert owned_lookups == ids.size
    assert sum(c.mismatches for e in ranks for c in e.totals.values()) == 0
    assert sum(c.checked_rows for e in ranks for c in e.totals.values()) == ids.size
    if cache_rows < 1000:
        assert sum(c.evictions for e in ranks for c in e.totals.values()) > 0
    for e in [single, *ranks]:
        e.close()


def test_rank_without_owned_only_refuses_foreign_ids(ids: np.ndarray) -> None:
    e = rank_engine(_raws(), 1, 1000, "numba", owned_only=False)
    with pytest.raises(SlackTierError) as err:
        e.begin_step(ids[:4])
    assert err.value.kind == ErrorKind.BAD_INPUT and "owned_only" in (err.value.fix or "")
    assert not e.in_step
    e.apply(Change(owned_only=True))
    e.begin_step(ids[:4])
    for layer in e.layers:
        e.gather(layer)
    c = e.end_step()
    assert all(0 < x.zero_rows < x.lookups for x in c.layers.values())
    e.close()
