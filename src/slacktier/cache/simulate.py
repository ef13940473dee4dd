"""The served CLOCK replayed over a lookup trace, without bytes: what characterization measures.

`replay_clock` builds one layer's cache bookkeeping (the arrays a `RowCache`
holds for a layer owning `capacity` slots, no device arrays) and runs the
directory pass itself (`directory.resolve_layer`, on `kernels`' CLOCK) once per
replay step, releasing the step's pins after it and, with `evict_ahead` (the
engine's default), emptying as many slots as the step claimed, exactly as the
engine does with `begin_step` / `end_step`. So the miss-page curves the planner
reads come from the policy that is served, pins and in-step read reuse included.
With heat codes (the engine's admission rule: `directory.token_heat` of the
lookups' phases) the pass admits and ages rows by that rule, as the served cache does.

Worked example: capacity 1, one step of rows [5, 7, 5] -> 5 claims the slot
(READ), 7 finds the slot pinned and is read without one (READ), 5 reuses its
own fill (REUSE_FILLED): outcomes [3, 3, 1], one hit-or-reuse-with-slot.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from slacktier.cache import rowdir as D
from slacktier.cache.directory import KIND_SLOT, N_COUNTS, NO_INDEX_KEYS, NO_INDEX_ORDINALS, NO_PACKED, \
    Count, checked_heat, resolve_layer
from slacktier.cache.kernels import LSTATE_WORDS, NO_SKETCH, RESET, count_lookups, new_sketch
from slacktier.cache.kernels import evict_ahead as evict_ahead_kernel
from slacktier.cache.views import CacheView, GeoView, OutView, StepView
from slacktier.errors import ErrorKind, SlackTierError

HIT = 0            # the row was cached when the step began (served from its slot)
REUSE_FILLED = 1   # the row was read earlier this step into a slot (no new read; cached)
REUSE_BYPASS = 2   # the row was read earlier this step without a slot (no new read; not cached)
READ = 3           # a new row read


@njit(nogil=True, cache=True)
def _hash_bits(n):
    bits = 4
    while (np.int64(1) << bits) < 4 * n:
        bits += 1
    return bits


@njit(nogil=True, cache=True)
def _replay(ids, step_starts, n_items, capacity, dir_entries, ahead, heat, sketch, reset, out):
    # ids: [M] int64 rows 0..n_items-1; step_starts: [S + 1] int64; heat: [M] uint8 or empty;
    # sketch: the layer's frequency sketch (kernels.new_sketch) and its halving period, or NO_SKETCH and 0;
    # out: [M] int8 outcome per lookup
    directory = np.full(dir_entries, -1, dtype=np.int64)   # rowdir's table for `capacity` slots (rowdir.empty)
    owned = np.arange(capacity).astype(np.int32)          # RowCache gives a lone layer slots 0..c-1 in order
    lstate = np.zeros(LSTATE_WORDS, dtype=np.int64)
    lstate[RESET] = reset
    slot_layer = np.full(capacity, -1, dtype=np.int32)
    slot_row = np.full(capacity, -1, dtype=np.int64)
    state = np.full(capacity, -2, dtype=np.int64)         # as RowCache: never pinned (kernels.NEVER)
    ref = np.zeros(capacity, dtype=np.uint8)
    fill_miss = np.full(capacity, -1, dtype=np.int32)
    rank_starts = np.array([0, n_items], dtype=np.int64)
    rank_region = np.zeros(1, dtype=np.int32)
    seen = np.zeros(1, dtype=np.uint8)
    longest = 1
    for s in range(step_starts.shape[0] - 1):
        longest = max(longest, step_starts[s + 1] - step_starts[s])
    htab = np.zeros((np.int64(1) << _hash_bits(longest), 3), dtype=np.int64)
    desc_kind = np.empty(longest, dtype=np.int8)
    desc_idx = np.empty(longest, dtype=np.int64)
    miss_buf = np.empty(longest, dtype=np.int32)
    miss_inpage = np.empty(longest, dtype=np.int32)
    miss_slot = np.empty(longest, dtype=np.int32)
    miss_row = np.empty(longest, dtype=np.int64)
    page_region = np.empty(longest, dtype=np.int32)
    page_no = np.empty(longest, dtype=np.int64)
    page_buf = np.empty(longest, dtype=np.int32)
    own_pos = np.empty(longest, dtype=np.int32)
    own_row = np.empty(longest, dtype=np.int64)
    counts = np.zeros(N_COUNTS, dtype=np.int64)
    geo = GeoView(np.int64(0), np.int64(n_items), rank_starts, rank_region, seen, np.int64(0), NO_INDEX_KEYS,
                  NO_INDEX_ORDINALS, np.int64(0), np.full(rank_region.shape[0], -1, np.int32), NO_PACKED,
                  np.int64(1))
    cache = CacheView(np.int64(0), directory, owned, lstate, slot_layer, slot_row, state, ref, fill_miss, sketch)
    scratch = OutView(desc_kind, desc_idx, miss_buf, miss_inpage, miss_slot, miss_row, page_region, page_no, page_buf,
                  own_pos, own_row, counts)
    for s in range(step_starts.shape[0] - 1):
        a = step_starts[s]
        b = step_starts[s + 1]
        if a == b:
            continue
        # one step: stamp s + 1 invalidates the hash table, pins of step s end when step s + 1 begins
        # one lookup per "token" row, so the per-token heat codes are per lookup (same lookup order)
        resolve_layer(ids[a:b].reshape(b - a, 1), geo, cache,
                      StepView(np.int64(s), htab, np.int64(s + 1), _hash_bits(b - a), np.int64(0), False, False,
                               np.int64(0)), scratch, heat[a:b] if heat.shape[0] else heat)
        count_lookups(sketch, lstate, own_row, own_pos, heat[a:b] if heat.shape[0] else heat, 1)   # end_step's
        lstate[1] = 0   # RowCache.release_pins: pending pins dropped, the pinned count resets, the step moves on
        if ahead:       # StepEngine.end_step with evict_ahead: RowCache.evict_ahead for the next step (s + 1)
            evict_ahead_kernel(counts[Count.MISSES] - counts[Count.BYPASS], directory, owned, lstate, slot_layer,
                               slot_row, state, ref, s + 1)
        last = -1       # miss indices are handed out in order: a new read is the first with its index
        for i in range(b - a):
            if desc_kind[i] == KIND_SLOT:
                out[a + i] = HIT
            else:
                m = desc_idx[i]
                if m > last:
                    out[a + i] = READ
                    last = m
                elif miss_slot[m] >= 0:
                    out[a + i] = REUSE_FILLED
                else:
                    out[a + i] = REUSE_BYPASS


def replay_clock(ids: np.ndarray, step_starts: np.ndarray | None, n_items: int, capacity: int,
                 evict_ahead: bool = True, heat: np.ndarray | None = None, sketch: bool = False) -> np.ndarray:
    """Outcome per lookup [M] int8 (HIT, REUSE_FILLED, REUSE_BYPASS, READ) of the served cache of `capacity` rows.

    ids: [M] rows 0..n_items-1 in lookup order (dense ids from densify(); with `sketch`, the rows themselves:
    the sketch hashes row ids, so it counts as the engine's only on the engine's ids); step_starts: [S + 1]
    lookup index where each step begins, 0 .. M (None: every lookup is its own step, so no pin ever blocks an
    eviction). evict_ahead: as the
    engine's option of that name (its default); False replays CLOCK alone. heat: [M] uint8 heat codes per
    lookup, or None (plain CLOCK): the engine's admission rule, `directory.token_heat(admission, ~is_decode)`.
    sketch: the layer keeps a frequency sketch, as the engine's cache does under a rule of `directory.SKETCHED`.
    """
    ids = np.ascontiguousarray(ids, dtype=np.int64)
    m = ids.shape[0]
    if capacity < 0 or n_items < 0:
        raise SlackTierError(ErrorKind.BAD_INPUT, f"capacity {capacity}, items {n_items}",
                             fix="pass a capacity >= 0 rows and the item count from densify()")
    if m and (ids.min() < 0 or ids.max() >= n_items):
        raise SlackTierError(ErrorKind.BAD_INPUT, "dense ids outside 0..n_items-1", fix="build ids with densify()")
    starts = np.arange(m + 1, dtype=np.int64) if step_starts is None \
        else np.ascontiguousarray(step_starts, dtype=np.int64)
    if starts.ndim != 1 or starts.shape[0] < 1 or starts[0] != 0 or starts[-1] != m or np.any(np.diff(starts) < 0):
        raise SlackTierError(ErrorKind.BAD_INPUT, f"step starts must rise from 0 to {m} lookups",
                             fix="pass the lookup index where each step begins, then the lookup count")
    codes = checked_heat(heat, m)
    out = np.empty(m, dtype=np.int8)
    counts, reset = new_sketch(int(capacity)) if sketch else (NO_SKETCH, 0)
    _replay(ids, starts, int(n_items), int(capacity), D.entries_for(int(capacity)), bool(evict_ahead), codes,
            counts, reset, out)
    return out
