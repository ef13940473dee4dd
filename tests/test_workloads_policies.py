"""Compiled cache policies against the plain-Python reference, Belady as an upper bound, and the CLOCK
simulator against the served cache (RowCache's directory pass) step by step."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from slacktier.cache import KIND_MISS, KIND_SLOT, LayerGeometry, PassScratch, RowCache, token_heat
from slacktier.cache import kernels as K
from slacktier.cache.simulate import HIT, READ, REUSE_BYPASS, REUSE_FILLED, replay_clock
from slacktier.errors import SlackTierError
from slacktier.tables.layout import ROWS_PER_PAGE
from slacktier.workloads import policies as P
from benchmarks.micro import policy_reference as R

traces = st.tuples(
    st.lists(st.integers(0, 30), min_size=0, max_size=250),
    st.integers(0, 24),
    st.randoms(use_true_random=False),
)


def _arrays(seq, rnd):
    ids = np.asarray(seq, dtype=np.int32)
    dec = np.asarray([rnd.random() < 0.5 for _ in seq], dtype=bool)
    return ids, dec, 31


@settings(max_examples=300, deadline=None)
@given(traces)
def test_lru_clock_s3fifo_match_reference(trace):
    seq, cap, rnd = trace
    ids, _, n = _arrays(seq, rnd)
    assert P.lru(ids, n, cap).tolist() == R.ref_lru(seq, cap)
    assert P.clock(ids, n, cap, evict_ahead=False).tolist() == R.ref_clock(seq, cap)   # classic CLOCK
    assert P.s3fifo(ids, n, cap).tolist() == R.ref_s3fifo(seq, cap, P.s3fifo_small_capacity(cap))


@settings(max_examples=300, deadline=None)
@given(traces)
def test_belady_matches_reference_and_is_never_beaten(trace):
    seq, cap, rnd = trace
    ids, dec, n = _arrays(seq, rnd)
    best = P.belady(ids, dec, n, cap)
    assert best.tolist() == R.ref_belady(seq, dec.tolist(), cap)
    assert not (best.astype(bool) & ~dec).any()  # only decode lookups count
    bound = int(best.sum())
    for hit in (P.lru(ids, n, cap), P.clock(ids, n, cap), P.s3fifo(ids, n, cap)):
        assert int(hit[dec].sum()) <= bound
    # static sets start full: their ceiling is Belady after free prefill lookups of the top-ranked rows
    rank_of_item = np.asarray([(x * 7919) % 31 for x in range(n)], dtype=np.int64)  # a fixed ranking
    ranks = rank_of_item[ids]
    warm_bound = int(P.belady_warm(ids, dec, ranks, n, cap).sum())
    assert warm_bound >= bound
    for hit in (P.static(ranks, cap), P.static_lru(ids, ranks, n, cap, cap // 2)):
        assert int(hit[dec].sum()) <= warm_bound
    warm = np.argsort(rank_of_item, kind="stable")[:cap].astype(np.int32)
    warm = warm[np.isin(warm, ids)]
    ids_w = np.concatenate([warm, ids])
    dec_w = np.concatenate([np.zeros(len(warm), dtype=bool), dec])
    assert warm_bound == sum(R.ref_belady(ids_w.tolist(), dec_w.tolist(), cap)[len(warm):])


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=1, max_size=8), st.integers(0, 2), st.randoms(use_true_random=False))
def test_belady_equals_exhaustive_optimum_on_tiny_traces(seq, cap, rnd):
    ids, dec, n = _arrays(seq, rnd)
    assert int(P.belady(ids, dec, n, cap).sum()) == R.brute_force_best_decode_hits(seq, dec.tolist(), cap)


def test_static_and_static_head_follow_their_definition():
    rng = np.random.default_rng(3)
    seq = (rng.zipf(1.3, 3000) % 200).astype(np.int64)
    ranking = P.rank_rows(seq[:1500])
    ranks = P.ranks_of(seq[1500:], ranking)
    ids, n = P.densify(seq[1500:])
    # the most frequent fit row has rank 0; unseen rows never hit
    uniq, counts = np.unique(seq[:1500], return_counts=True)
    assert P.ranks_of(np.array([uniq[np.argmax(counts)]]), ranking)[0] == 0
    assert P.ranks_of(np.array([10_000]), ranking)[0] == np.iinfo(np.int64).max
    for cap in (0, 5, 40):
        pinned = set(ranking[0][np.argsort(ranking[1])][:cap].tolist())
        assert P.static(ranks, cap).tolist() == [int(x in pinned) for x in seq[1500:].tolist()]
        head = cap // 2
        head_set = set(ranking[0][np.argsort(ranking[1])][:head].tolist())
        rest = [x for x in seq[1500:].tolist() if x not in head_set]
        lru_hits = iter(R.ref_lru(rest, cap - head))
        expected = [1 if x in head_set else next(lru_hits) for x in seq[1500:].tolist()]
        assert P.static_lru(ids, ranks, n, cap, head).tolist() == expected


def test_densify_and_errors():
    ids, n = P.densify(np.array([7, 9, 7, 400_000_000]))
    assert ids.tolist() == [0, 1, 0, 2] and n == 3
    with pytest.raises(SlackTierError):
        P.lru(ids, n, -1)
    with pytest.raises(SlackTierError):
        P.lru(np.array([5], dtype=np.int32), 3, 1)
    with pytest.raises(SlackTierError):
        P.static_lru(ids, np.zeros(4, dtype=np.int64), n, 2, 3)


def test_lru_beats_nothing_it_should_not_on_a_loop():
    # a cyclic scan one larger than the cache: LRU and CLOCK never hit, Belady does
    seq = np.tile(np.arange(5, dtype=np.int32), 20)
    dec = np.ones(seq.shape[0], dtype=bool)
    assert P.lru(seq, 5, 4).sum() == 0 and P.clock(seq, 5, 4).sum() == 0
    assert P.belady(seq, dec, 5, 4).sum() > 0


def test_clock_pins_a_step_rows_as_the_served_cache_does():
    # capacity 2, one step [1, 2, 3, 1, 2]: 1 and 2 take the slots and stay pinned, 3 is read without a
    # slot, then 1 and 2 find theirs. Pin-free CLOCK (one lookup per step) would evict 1 for 3, then 2 for 1.
    seq = np.array([1, 2, 3, 1, 2], dtype=np.int32)
    assert P.clock(seq, 4, 2, np.array([0, 5])).tolist() == [0, 0, 0, 1, 1]
    assert P.clock(seq, 4, 2).tolist() == R.ref_clock(seq.tolist(), 2) == [0, 0, 0, 0, 0]
    # the simulator's worked example: capacity 1, rows [5, 7, 5] in one step
    assert replay_clock(np.array([0, 1, 0]), np.array([0, 3]), 2, 1).tolist() == [READ, READ, REUSE_FILLED]


def test_the_sketch_keeps_a_decode_row_that_a_once_seen_prefill_row_would_evict():
    """One slot: a decode row looked up three times, a prefill row's miss, the decode row again. Under
    "counters" the prefill row takes the slot once CLOCK's hand has counted the decode row down, and the decode
    row misses; under "counters+sketch" the prefill row, counted once against the decode row's six (decode
    lookups count twice), is read without a slot, and the decode row hits."""
    ids = np.array([0, 0, 0, 1, 0])
    prefill = np.array([False, False, False, True, False])
    out = {rule: replay_clock(ids, None, 2, 1, heat=token_heat(rule, prefill), sketch=rule == "counters+sketch")
           for rule in ("counters", "counters+sketch")}
    assert out["counters"].tolist() == [READ, HIT, HIT, READ, READ]
    assert out["counters+sketch"].tolist() == [READ, HIT, HIT, READ, HIT]


def test_use_sketch_sizes_each_layers_sketch_to_its_slots():
    cache = RowCache(3000)
    cache.add_layer(1, 10_000, 0.5)
    cache.add_layer(14, 10_000, 0.5)
    assert cache.sketch_bytes() == 0
    cache.use_sketch(True)
    assert cache.sketch_bytes() == 2 * 4 * 2048            # 1,500 slots each: 2^11 counters per sketch row
    cache.resize(shares={1: 0.9, 14: 0.1})                  # 2,700 and 300 slots
    assert cache.layer(1).sketch.shape[0] == 4 * 4096 and cache.layer(14).sketch.shape[0] == 4 * 512
    assert cache.layer(14).lstate[K.RESET] == 10 * 300     # counts halve after ten lookups per slot
    cache.use_sketch(False)
    assert cache.sketch_bytes() == 0 and cache.layer(1).lstate[K.RESET] == 0


@pytest.mark.parametrize("admission", ["off", "prefill-cold", "counters", "counters+sketch"])
@pytest.mark.parametrize("ahead", [True, False])
@pytest.mark.parametrize("capacity", [0, 37, 400, 2500, 20_000])
def test_clock_simulator_is_the_served_cache_step_by_step(capacity, ahead, admission):
    """A Zipf trace in steps of T x 24 lookups (T varying, as prefill chunks and decode batches do), replayed
    through the characterization simulator and through a RowCache's directory pass (and, with `ahead`, its
    evict_ahead between steps, as the engine's end_step does): the same outcome for every lookup, so the same
    hits, reuses, reads and pages in every step. With an admission rule a random share of the tokens are
    prefill tokens (the pass takes their heat codes per token, the simulator per lookup). The sketch of
    "counters+sketch" counts row ids, so that rule replays the rows themselves, not dense ids."""
    rng = np.random.default_rng(capacity)
    table_rows = 2_000_000
    tokens = rng.integers(1, 65, 40)                                  # tokens per step
    starts = np.concatenate([[0], np.cumsum(tokens) * 24]).astype(np.int64)
    rows = (rng.zipf(1.15, int(starts[-1])) * 7919) % table_rows      # sparse rows of a big table
    prefill = rng.random(int(tokens.sum())) < 0.6                     # per token
    heat = None if admission == "off" else np.repeat(token_heat(admission, prefill), 24)
    sketch = admission == "counters+sketch"
    ids, n = (rows.astype(np.int64), table_rows) if sketch else P.densify(rows)
    outcome = replay_clock(ids, starts, n, capacity, evict_ahead=ahead, heat=heat, sketch=sketch)
    hit = P.clock(ids, n, capacity, starts, evict_ahead=ahead, heat=heat, sketch=sketch)
    assert hit.tolist() == (outcome <= REUSE_FILLED).astype(np.uint8).tolist()

    cache = RowCache(capacity)
    cache.add_layer(14, table_rows, 1.0)
    cache.use_sketch(sketch)
    geo = LayerGeometry.one_rank(table_rows)
    scratch = PassScratch(int(tokens.max()) * 24)
    for a, b in zip(starts[:-1].tolist(), starts[1:].tolist()):
        step_ids = rows[a:b].astype(np.int64)
        res = cache.resolve(14, step_ids.reshape(-1, 24), geo, scratch,
                            heat=None if heat is None else token_heat(admission, prefill[a // 24:b // 24]))
        o = outcome[a:b]
        assert res.hits == int((o == HIT).sum())
        assert res.reused == int(((o == REUSE_FILLED) | (o == REUSE_BYPASS)).sum())
        assert res.misses == int((o == READ).sum())
        assert res.pages == np.unique(step_ids[o == READ] // ROWS_PER_PAGE).shape[0]
        # per lookup: served from a slot (cached, or filled earlier in the step) exactly where the simulator says
        kind, idx = scratch.desc_kind[:b - a], scratch.desc_idx[:b - a]
        first = np.zeros(b - a, dtype=bool)
        miss = np.flatnonzero(kind == KIND_MISS)
        _, at = np.unique(idx[miss], return_index=True)
        first[miss[at]] = True
        has_slot = scratch.miss_slot[np.where(kind == KIND_MISS, idx, 0)] >= 0
        served = (kind == KIND_SLOT) | ((kind == KIND_MISS) & ~first & has_slot)
        assert served.astype(np.uint8).tolist() == hit[a:b].tolist()
        cache.release_pins()
        if ahead:
            cache.evict_ahead(14, res.misses - res.bypass)
    assert cache.verify() == []
    if admission != "off" and capacity == 2500:   # where the cache is under pressure: the rule changes hits
        assert hit.tolist() != P.clock(ids, n, capacity, starts, evict_ahead=ahead).tolist()
