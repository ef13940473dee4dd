"""The directory pass (cache.directory via RowCache.resolve): descriptors, pages, pins and in-step reuse.

Moved from test_engine_resolve.py: the pass keeps each lookup's directory entry from its first
(prefetch) load; the first two cases make that entry stale within a step and check what comes out.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from slacktier.cache import (KIND_FOREIGN, KIND_MISS, KIND_SLOT, KIND_ZERO, LayerGeometry, PassResult, PassScratch,
                             RowCache, fill_foreign)
from slacktier.errors import ErrorKind, SlackTierError
from slacktier.tables.layout import ROWS_PER_PAGE

TWO_RANKS = LayerGeometry(0, 600, np.array([0, 300, 600]), np.array([0, 1], dtype=np.int32))


def _cache(slots: int, geometry: LayerGeometry = TWO_RANKS) -> RowCache:
    cache = RowCache(slots)
    cache.add_layer(1, geometry.rows, 1.0)
    return cache


def _step(cache: RowCache, rows: list[int], geometry: LayerGeometry = TWO_RANKS, **kw) -> tuple[PassResult,
                                                                                                 PassScratch]:
    scratch = PassScratch(64)
    ids = np.array(rows, dtype=np.int64) + geometry.row_start
    result = cache.resolve(1, ids, geometry, scratch, **kw)
    _check_outputs(cache, ids, geometry, scratch, result)
    cache.release_pins()
    return result, scratch


def _check_outputs(cache: RowCache, ids: np.ndarray, geometry: LayerGeometry, scratch: PassScratch,
                   result: PassResult) -> None:
    """Every descriptor names the row it was asked for: its slot holds it, or its page and row-in-page do."""
    pages = {(int(scratch.page_region[k]), int(scratch.page_no[k])): int(scratch.page_buf[k])
             for k in range(result.pages)}
    assert len(pages) == result.pages and len(set(pages.values())) == result.pages
    by_buf = {b: key for key, b in pages.items()}
    assert len(set(scratch.miss_row[:result.misses].tolist())) == result.misses
    for i, g in enumerate(ids.tolist()):
        r = g - geometry.row_start
        kind, idx = int(scratch.desc_kind[i]), int(scratch.desc_idx[i])
        if kind == KIND_SLOT:
            assert cache.slot_row[idx] == r and cache.slot_of(1, [r])[0] == idx
        elif kind == KIND_MISS:
            assert scratch.miss_row[idx] == r
            slot = int(scratch.miss_slot[idx])
            assert slot == -1 or (cache.slot_row[slot] == r and cache.slot_of(1, [r])[0] == slot)
            rank = int(np.searchsorted(geometry.rank_starts, r, side="right")) - 1
            region, page = by_buf[int(scratch.miss_buf[idx])]
            assert region == geometry.rank_region[rank]
            assert page * ROWS_PER_PAGE + scratch.miss_inpage[idx] == r - geometry.rank_starts[rank]
    assert (result.hits + result.misses + result.reused + result.zero + result.foreign + result.padded
            == result.lookups)
    assert cache.verify() == []


def test_worked_example_two_rows_one_page() -> None:
    cache = _cache(4, LayerGeometry.one_rank(600))
    r, sc = _step(cache, [31, 32], LayerGeometry.one_rank(600))
    assert r == PassResult(lookups=2, hits=0, misses=2, pages=1, zero=0, bypass=0, reused=0, foreign=0,
                           bad_index=-1)
    assert sc.page_no[0] == 2 and sc.miss_buf[:2].tolist() == [0, 0] and sc.miss_inpage[:2].tolist() == [1, 2]
    assert (sc.miss_slot[:2] >= 0).all()


def test_row_evicted_earlier_in_the_same_step_is_read_again() -> None:
    cache = _cache(2)
    r, _ = _step(cache, [10, 400])                 # both cached
    assert r.misses == 2 and r.pages == 2          # two ranks: two regions
    # 20 and 500 miss first and take both slots (CLOCK clears the reference bits, then evicts 10 and
    # 400); 10 and 400 were cached when the step began, but their slots now hold 20 and 500.
    r, _ = _step(cache, [20, 500, 10, 400])
    assert r.hits == 0 and r.misses == 4 and r.bypass == 2 and cache.evictions(1) == 2 and r.evicted == 2
    r, _ = _step(cache, [20, 500])
    assert r.hits == 2


def test_row_filled_earlier_in_the_same_step_is_reused() -> None:
    cache = _cache(4)
    r, _ = _step(cache, [7, 7, 300, 7, 300])
    assert r.misses == 2 and r.reused == 3 and r.hits == 0
    r, _ = _step(cache, [7, 300, 7])
    assert r.hits == 3 and r.misses == 0


def test_hits_before_any_victim_search_pin_later_and_clock_still_sees_them() -> None:
    cache = _cache(4)
    _step(cache, [1, 2, 3, 4])                       # the layer's four slots hold rows 1-4
    slot = {r: int(cache.slot_of(1, [r])[0]) for r in (1, 2, 3, 4)}
    scratch = PassScratch(64)
    before = cache.state.copy()
    cache.ref[:] = 0
    res = cache.resolve(1, np.array([4, 1, 2, 3]), TWO_RANKS, scratch)
    assert res.hits == 4 and res.pending == 4        # a warm pass: no victim search, pins wait
    assert np.array_equal(cache.state, before)       # ... it wrote no pin
    assert all(cache.ref[s] == 1 for s in slot.values())   # ... only the reference bits CLOCK reads next
    assert sorted(cache.pinned().tolist()) == sorted(slot.values())   # asking settles them
    assert cache.layer(1).lstate[1] == 4 and cache.verify() == []
    cache.release_pins()
    # a warm step that nobody asks about: its pins are never written, its reference bits are
    cache.ref[:] = 0
    before = cache.state.copy()
    cache.resolve(1, np.array([1, 2, 3, 4]), TWO_RANKS, scratch)
    cache.release_pins()
    assert np.array_equal(cache.state, before) and all(cache.ref[s] == 1 for s in slot.values())
    assert cache.pinned().size == 0 and cache.verify() == []
    # Hits, then a miss: the miss's CLOCK search settles the hits before it, so it takes row 4's slot, the
    # only one not hit this step (every slot is referenced; unsettled, the hand's first slot would go)
    res = cache.resolve(1, np.array([1, 2, 3, 9]), TWO_RANKS, scratch)
    assert (res.hits, res.misses, res.pending) == (3, 1, 0)
    assert int(scratch.miss_slot[0]) == slot[4]
    assert [int(cache.slot_of(1, [r])[0]) for r in (1, 2, 3)] == [slot[1], slot[2], slot[3]]
    assert cache.slot_of(1, [4])[0] == -1 and cache.verify() == []
    cache.release_pins()


def test_slotless_read_is_reused_and_not_cached() -> None:
    cache = _cache(1)
    r, sc = _step(cache, [5, 7, 7, 5])   # 5 takes the only slot, 7 is read without one, then reused
    assert (r.misses, r.bypass, r.reused) == (2, 1, 2) and sc.miss_slot[1] == -1
    r, _ = _step(cache, [5, 7])
    assert r.hits == 1 and r.misses == 1


def test_ids_outside_the_table_are_foreign_or_an_error() -> None:
    geo = LayerGeometry.one_rank(100, row_start=1000)
    cache = _cache(4, geo)
    r, sc = _step(cache, [3, -1, 150, 3], geo, owned_only=True)
    assert r.foreign == 2 and r.misses == 1 and r.reused == 1
    assert sc.desc_kind[:4].tolist() == [KIND_MISS, KIND_FOREIGN, KIND_FOREIGN, KIND_MISS]
    out = np.zeros((4, 256), dtype=np.uint16)
    fill_foreign(sc.desc_kind, 4, out)
    assert (out[1:3] == 0x8000).all() and (out[[0, 3]] == 0).all()
    r = cache.resolve(1, np.array([1003, 1150, 1004], dtype=np.int64), geo, PassScratch(8))
    assert r.bad_index == 1 and r.misses == 0 and r.hits == 1
    cache.release_pins()
    assert cache.verify() == []


def test_lossy_rows_outside_the_seen_set_read_nothing() -> None:
    seen = np.zeros(600, dtype=bool)
    seen[[10, 400]] = True
    geo = LayerGeometry(0, 600, TWO_RANKS.rank_starts, TWO_RANKS.rank_region, np.packbits(seen, bitorder="little"))
    cache = _cache(4, geo)
    r, sc = _step(cache, [10, 11, 400, 401], geo, lossy=True)
    assert r.zero == 2 and r.misses == 2 and sc.desc_kind[:4].tolist() == [KIND_MISS, KIND_ZERO, KIND_MISS, KIND_ZERO]
    with pytest.raises(SlackTierError):
        cache.resolve(1, np.array([1], dtype=np.int64), TWO_RANKS, PassScratch(4), lossy=True)


def test_guards_refuse_what_the_compiled_pass_cannot_check() -> None:
    cache = _cache(4)
    with pytest.raises(SlackTierError) as exc:
        cache.resolve(1, np.arange(9, dtype=np.int64), TWO_RANKS, PassScratch(8))
    assert exc.value.kind == ErrorKind.CAPACITY
    for ids, geo in ((np.arange(3, dtype=np.int32), TWO_RANKS), (np.arange(3, dtype=np.int64),
                                                                 LayerGeometry.one_rank(601))):
        with pytest.raises(SlackTierError):
            cache.resolve(1, ids, geo, PassScratch(8))
    with pytest.raises(SlackTierError) as exc:
        cache.resolve(2, np.arange(3, dtype=np.int64), TWO_RANKS, PassScratch(8))
    assert exc.value.kind == ErrorKind.MISSING
    for starts, region in (([0, 300], [0, 1]), ([0, 300, 599], [0, 1]), ([0, 400, 300, 600], [0, 1, 2])):
        with pytest.raises(SlackTierError):
            LayerGeometry(0, 600, np.array(starts), np.array(region, dtype=np.int32))
    with pytest.raises(SlackTierError):
        LayerGeometry.one_rank(600, seen=np.zeros(74, dtype=np.uint8))


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(slots=st.integers(0, 12),
       steps=st.lists(st.lists(st.integers(0, 59), min_size=0, max_size=30), min_size=1, max_size=12))
def test_pass_outputs_name_the_rows_asked_for(slots: int, steps: list[list[int]]) -> None:
    """Any step sequence: descriptors, slots and pages stay consistent; pinned slots are never evicted."""
    geo = LayerGeometry(0, 60, np.array([0, 17, 17, 60]), np.array([2, 0, 1], dtype=np.int32))
    cache = _cache(slots, geo)
    for rows in steps:
        scratch = PassScratch(30)
        ids = np.array(rows, dtype=np.int64)
        result = cache.resolve(1, ids, geo, scratch)
        _check_outputs(cache, ids, geo, scratch, result)
        used = set(scratch.desc_idx[:len(rows)][scratch.desc_kind[:len(rows)] == KIND_SLOT].tolist())
        used |= set(s for s in scratch.miss_slot[:result.misses].tolist() if s >= 0)
        assert set(cache.pinned().tolist()) == used
        assert result.bypass == 0 or len(used) == slots
        cache.release_pins()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(slots=st.integers(0, 40), tokens=st.integers(1, 6), seed=st.integers(0, 2**31 - 1))
def test_strided_step_slice_resolves_like_its_flat_copy(slots: int, tokens: int, seed: int) -> None:
    """The engine hands the pass one layer's [T, 24] slice of a [T, L, 24] step as a strided view: the
    result, descriptors, misses and pages equal those of the same ids as a flat contiguous copy."""
    rng = np.random.default_rng(seed)
    step = rng.integers(0, 600, size=(tokens, 3, 24)).astype(np.int64)
    step[rng.random(step.shape) < 0.1] = 700   # outside the table: foreign with owned_only
    caches = [_cache(slots), _cache(slots)]
    for t in range(2):   # two steps, so the second meets the first's cached rows
        view = step[:, 1, :]
        assert tokens == 1 or not view.flags.c_contiguous
        outs = []
        for cache, ids in zip(caches, (view, np.ascontiguousarray(view).reshape(-1))):
            scratch = PassScratch(tokens * 24)
            result = cache.resolve(1, ids, TWO_RANKS, scratch, owned_only=True)
            outs.append((result, scratch))
            cache.release_pins()
        (ra, sa), (rb, sb) = outs
        assert ra == rb and ra.lookups == tokens * 24
        n, m, p = ra.lookups, ra.misses, ra.pages
        for name, k in (("desc_kind", n), ("desc_idx", n), ("miss_buf", m), ("miss_inpage", m), ("miss_slot", m),
                        ("miss_row", m), ("page_region", p), ("page_no", p), ("page_buf", p)):
            assert np.array_equal(getattr(sa, name)[:k], getattr(sb, name)[:k]), name
        step = np.roll(step, 1, axis=0)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(slots=st.integers(0, 12), owned_only=st.booleans(),
       steps=st.lists(st.lists(st.one_of(st.integers(0, 59), st.sampled_from([-3, -1, 60, 75, 10_000])),
                               min_size=0, max_size=30), min_size=1, max_size=8))
def test_every_lookup_gets_its_kind_in_a_reused_scratch(slots: int, owned_only: bool, steps: list[list[int]]) -> None:
    """In-table, pad (-3), other negative and out-of-table ids mixed, one scratch reused across steps (so a
    descriptor left from an earlier step would show): a pad id is a zero row, an id outside the table foreign
    (owned_only) or the pass's stop, and every lookup before the stop is resolved and counted."""
    geo = LayerGeometry(0, 60, np.array([0, 17, 60]), np.array([1, 0], dtype=np.int32))
    cache = _cache(slots, geo)
    scratch = PassScratch(30)
    for rows in steps:
        ids = np.array(rows, dtype=np.int64)
        result = cache.resolve(1, ids, geo, scratch, owned_only=owned_only, pad_id=-3)
        outside = [i for i, g in enumerate(rows) if (g < 0 or g >= 60) and g != -3]
        done = len(rows) if owned_only or not outside else outside[0]
        assert result.bad_index == (-1 if done == len(rows) else done)
        kinds = scratch.desc_kind[:done].tolist()
        for g, kind in zip(rows, kinds):
            if g == -3:
                assert kind == KIND_ZERO
            elif g < 0 or g >= 60:
                assert kind == KIND_FOREIGN
            else:
                assert kind in (KIND_SLOT, KIND_MISS)
        assert result.padded == rows[:done].count(-3)
        assert result.foreign == sum(1 for g in rows[:done] if (g < 0 or g >= 60) and g != -3)
        inside = np.array([g for g in rows[:done] if 0 <= g < 60], dtype=np.int64)
        assert result.hits + result.misses + result.reused == inside.size
        if done == len(rows):
            _check_outputs(cache, ids, geo, scratch, result)
        cache.release_pins()


def test_one_counter_shape() -> None:
    """The pass's counts (cache.directory.Count) are PassResult's fields in order, the compiled pass's output
    row starts with them, and every count the engine publishes is mapped to LayerCounters (engine.counters)."""
    from slacktier.cache import PassResult
    from slacktier.cache.views import Row
    from slacktier.cache.directory import N_COUNTS, Count
    from slacktier.engine.counters import FROM_PASS, LayerCounters

    assert PassResult._fields == tuple(m.name.lower() for m in Count) and Row.JOB == N_COUNTS == len(Count)
    mapped = {p for parts in FROM_PASS.values() for p in parts}
    assert mapped | {"bad_index", "pending"} == set(PassResult._fields)
    assert set(FROM_PASS) <= set(LayerCounters.__dataclass_fields__)
