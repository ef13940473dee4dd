"""The compiled pass with context packing, lookup for lookup, against the plain-Python reference.

Random steps of tokens, each a context (its C ids) drawn from a small pool of which some are packed (in the
layer's index) and some not, with pad ids and repeats: a packed token's rows that miss must come from its
packed page (page ordinal * pages_per_context + slot // 15 of its rank's packed region, row slot % 15), once
per step however many rows and tokens need it, while hits and rows requested earlier in the step are served as
without packing; the reference recomputes every context key in plain Python. Geometries: one rank owning
every column (4 columns: one page per context; 20: two), two ranks each owning half the columns, and one rank
of two served alone (owned_only: the other rank's rows are foreign).
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cache_reference import RefCache, RefLayer, RefPacked, ref_context_key
from slacktier.cache import LayerGeometry, PassScratch, RowCache
from slacktier.cache.directory import PackedGeometry
from slacktier.tables.packing import PackIndex, context_keys

PAD = -1
COL_ROWS = 40   # rows per hash column


def _setup(case: str):
    """(columns, geometry kwargs, owned_only, rank regions of the reference, packed region per rank, slots)."""
    if case == "one-rank-4":
        c = 4
        return c, dict(row_start=0, rows=c * COL_ROWS, starts=[0, c * COL_ROWS], regions=[0]), False, [5], \
            list(range(c))
    if case == "one-rank-20":
        c = 20
        return c, dict(row_start=0, rows=c * COL_ROWS, starts=[0, c * COL_ROWS], regions=[0]), False, [5], \
            list(range(c))
    if case == "two-ranks":
        c = 4
        return c, dict(row_start=0, rows=c * COL_ROWS, starts=[0, 2 * COL_ROWS, 4 * COL_ROWS], regions=[0, 1]), \
            False, [2, 3], [0, 1, 0, 1]
    c = 4   # rank 1 of 2 alone: columns 2 and 3
    return c, dict(row_start=2 * COL_ROWS, rows=2 * COL_ROWS, starts=[0, 2 * COL_ROWS], regions=[0]), True, [1], \
        [0, 1, 0, 1]


def test_the_reference_key_is_the_compiled_key() -> None:
    rng = np.random.default_rng(3)
    ids = rng.integers(0, 2**62, size=(50, 24), dtype=np.int64)
    ids[0] = 0
    assert context_keys(ids).tolist() == [ref_context_key(row) for row in ids.tolist()]


step_st = st.lists(st.tuples(st.integers(0, 11), st.integers(0, 9)), min_size=1, max_size=24)


@pytest.mark.parametrize("case", ["one-rank-4", "one-rank-20", "two-ranks", "rank-alone"])
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(max_slots=st.integers(0, 60), seed=st.integers(0, 2**31), steps=st.lists(step_st, min_size=1, max_size=8),
       buf_base=st.integers(0, 100), n_packed=st.integers(1, 8))
def test_the_packed_pass_matches_the_reference(case, max_slots, seed, steps, buf_base, n_packed) -> None:
    c, g, owned_only, pk_region, slots = _setup(case)
    rng = np.random.default_rng(seed)
    pool = np.arange(c) * COL_ROWS + rng.integers(0, COL_ROWS, size=(12, c))   # 12 contexts, ids in their columns
    ppc = max(slots) // 15 + 1   # pages per context: 20 owned columns -> 2
    # the layer's pass reads global ids: the index is over them, whatever rows this process serves
    index = PackIndex.build(context_keys(pool[:n_packed]), 1)
    packed = PackedGeometry(index.keys, index.ordinals, np.array(pk_region), np.array(slots), ppc)
    geo = LayerGeometry(g["row_start"], g["rows"], np.array(g["starts"]), np.array(g["regions"]), packed=packed)
    ref_packed = RefPacked({ref_context_key(row): i for i, row in enumerate(pool[:n_packed].tolist())}, pk_region,
                           slots, ppc)
    cache = RowCache(max_slots, slots=max_slots)
    cache.add_layer(1, g["rows"], 1.0)
    state = cache.layer(1)
    ref = RefCache()
    ref.layers[1] = RefLayer(owned=state.owned.tolist())
    scratch = PassScratch(24 * c)
    for tokens in steps:
        rows = []
        for ctx, kind in tokens:
            row = pool[ctx].copy()
            if kind == 0:
                row[1] = PAD                                      # a pad id: never a packed context
            elif kind == 1:
                row[0] = rng.integers(0, COL_ROWS)                # another context sharing rows with a packed one
            rows.append(row)
        ids = np.array(rows, dtype=np.int64)                      # [T, C]
        got = cache.resolve(1, ids, geo, scratch, owned_only=owned_only, pad_id=PAD, buf_base=buf_base)
        want = ref.resolve(1, ids.reshape(-1).tolist(), row_start=g["row_start"], rows=g["rows"],
                           rank_starts=g["starts"], rank_region=g["regions"], owned_only=owned_only, pad_id=PAD,
                           buf_base=buf_base, columns=c, packed=ref_packed)
        n = ids.size
        assert got._asdict() == want.counts
        assert scratch.desc_kind[:n].tolist() == want.kinds
        assert scratch.desc_idx[:n].tolist() == want.idx
        assert scratch.miss_row[:got.misses].tolist() == want.miss_rows
        assert scratch.miss_slot[:got.misses].tolist() == want.miss_slots
        assert scratch.miss_buf[:got.misses].tolist() == want.miss_bufs
        assert scratch.miss_inpage[:got.misses].tolist() == want.miss_inpage
        assert list(zip(scratch.page_region[:got.pages].tolist(), scratch.page_no[:got.pages].tolist(),
                        strict=True)) == want.pages
        cache.release_pins()
        ref.end_step()
    assert cache.verify() == []


def test_a_packed_token_reads_one_page_for_its_missing_rows() -> None:
    """Worked example: one rank, 4 columns, an empty cache: a packed context's 4 rows come from 1 page; the
    same token unpacked reads 4 row pages (its ids are 40 rows apart, each in its own page)."""
    ctx = np.array([[3, 43, 83, 123]], dtype=np.int64)
    index = PackIndex.build(context_keys(ctx), 1)
    packed = PackedGeometry(index.keys, index.ordinals, np.array([1]), np.arange(4), 1)
    for geo_packed, pages, packed_pages in ((packed, 1, 1), (None, 4, 0)):
        cache = RowCache(16, slots=16)
        cache.add_layer(1, 160, 1.0)
        geo = LayerGeometry(0, 160, np.array([0, 160]), np.array([0]), packed=geo_packed)
        scratch = PassScratch(8)
        got = cache.resolve(1, ctx, geo, scratch)
        assert (got.misses, got.pages, got.packed) == (4, pages, packed_pages)
        if geo_packed is not None:
            assert scratch.page_region[0] == 1 and scratch.page_no[0] == 0
            assert scratch.miss_inpage[:4].tolist() == [0, 1, 2, 3]
