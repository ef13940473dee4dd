"""The cache's compiled pass, lookup for lookup, against a plain-Python reference (tests/cache_reference.py).

Random steps over two layers mix hits, repeats within a step, pad ids, ids
outside the table (foreign with owned_only, else the pass stops there and the
step is abandoned), ids outside the whole layer where its end is known (zero
rows), lossy rows outside the seen-set, layers whose slots are all pinned (rows
read without a slot) and evictions; the cache is resized between steps, and
some steps end by emptying slots ahead (RowCache.evict_ahead). After every pass
every output must equal the reference's: the descriptors, each miss's row, slot,
page buffer and row in page, the pages and their buffers, and every count of
PassResult; after every resize the rows the cache still holds must be rows the
reference held in the same slots (no row is ever found in a stale slot), and the
cache's invariants hold.
"""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cache_reference import RefCache, RefLayer
from slacktier.cache import LayerGeometry, PassScratch, RowCache, token_heat
from slacktier.cache.kernels import HAND

# layer -> (row_start, rows, rank_starts, rank_region)
LAYERS = {1: (0, 300, [0, 150, 300], [0, 1]), 14: (50, 200, [0, 200], [2])}
PAD = -1
TABLE_END = 330   # the whole layer's ids, where the test gives the geometry its end: past both layers' rows


def _sync(ref: RefCache, cache: RowCache) -> None:
    """Take the cache's slot partition after a resize, once its rows are checked against the reference's."""
    for layer in LAYERS:
        rows, slots = cache.cached(layer)
        lay = ref.layers.get(layer)
        if lay is not None:
            for r, s in zip(rows.tolist(), slots.tolist(), strict=True):
                assert lay.directory.get(r) == s, f"layer {layer}: row {r} in slot {s}, the reference has it in " \
                                                   f"{lay.directory.get(r)}"
        state = cache.layer(layer)
        new = RefLayer(owned=state.owned.tolist(), hand=int(state.lstate[HAND]),   # reset where slots moved
                       directory=dict(zip(rows.tolist(), slots.tolist(), strict=True)))
        for s in set(lay.owned if lay else []) - set(new.owned):
            ref.slot_row.pop(s, None)
            ref.ref[s] = 0
        for s in new.owned:
            if s not in new.directory.values():
                ref.slot_row.pop(s, None)
            ref.ref[s] = int(cache.ref[s])
        ref.layers[layer] = new


step_st = st.tuples(
    st.sampled_from([None, 0, 3, 17, 60, 120]),          # resize before the step (None: keep)
    st.floats(0.0, 1.0),                                  # layer 1's share after it
    st.lists(st.tuples(st.integers(0, 40), st.integers(0, 5)), min_size=1, max_size=60),   # (hot row, kind)
    st.sampled_from([0, 0, 1, 4, 30]),                    # slots per layer emptied ahead after the step
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(max_slots=st.integers(0, 120), owned_only=st.booleans(), lossy=st.booleans(),
       steps=st.lists(step_st, min_size=1, max_size=12), end_known=st.booleans(), buf_base=st.integers(0, 1000),
       admission=st.sampled_from(["off", "prefill-cold", "counters"]))
def test_the_compiled_pass_matches_the_reference(max_slots, owned_only, lossy, steps, end_known, buf_base,
                                                 admission) -> None:
    cache = RowCache(max_slots, slots=max_slots)
    seen_rows = set(range(0, 200, 3)) if lossy else None
    geos = {}
    for layer, (start, rows, starts, regions) in LAYERS.items():
        seen = None
        if lossy:
            bits = np.zeros(rows, dtype=np.uint8)
            bits[sorted(seen_rows)] = 1
            seen = np.packbits(bits, bitorder="little")
        geos[layer] = LayerGeometry(start, rows, np.array(starts), np.array(regions), seen,
                                    TABLE_END if end_known else 0)
        cache.add_layer(layer, rows, 0.5)
    ref = RefCache()
    _sync(ref, cache)
    scratch = PassScratch(64)
    for resize, share, lookups, ahead in steps:
        if resize is not None:
            cache.resize(slots=min(resize, max_slots), shares={1: share, 14: 1.0 - share})
            _sync(ref, cache)
        for layer, (start, rows, starts, regions) in LAYERS.items():
            ids = []
            for hot, kind in lookups:
                if kind == 0:
                    ids.append(PAD)
                elif kind == 1 and owned_only:
                    ids.append(start + rows + hot)              # another rank's row, or past the layer's end
                elif kind == 2 and hot >= 38:
                    ids.append(PAD - 1 - hot)                   # negative: outside the layer, or as an id above
                elif kind == 1 and hot == 40:
                    ids.append(start + rows + 5)                # outside the table: the pass stops
                else:
                    ids.append(start + (hot * 7 + kind) % rows)  # a small hot set: hits and repeats
            # admission: one lookup per token ([N, 1] ids), a third of them prefill tokens
            heat = token_heat(admission, np.array([hot % 3 == 0 for hot, _ in lookups], dtype=bool)) \
                if admission != "off" else None
            got = cache.resolve(layer, np.array(ids, dtype=np.int64).reshape(-1, 1) if heat is not None else
                                np.array(ids, dtype=np.int64), geos[layer], scratch, owned_only=owned_only,
                                lossy=lossy, pad_id=PAD, buf_base=buf_base,
                                heat=heat)
            want = ref.resolve(layer, ids, row_start=start, rows=rows, rank_starts=starts, rank_region=regions,
                               owned_only=owned_only, seen=seen_rows if lossy else None, pad_id=PAD,
                               table_end=TABLE_END if end_known else 0, buf_base=buf_base,
                               heat=None if heat is None else heat.tolist())
            n = len(ids)
            assert got._asdict() == want.counts
            assert scratch.desc_kind[:n].tolist() == want.kinds
            assert scratch.desc_idx[:n].tolist() == want.idx
            assert scratch.miss_row[:got.misses].tolist() == want.miss_rows
            assert scratch.miss_slot[:got.misses].tolist() == want.miss_slots
            assert scratch.miss_buf[:got.misses].tolist() == want.miss_bufs
            assert scratch.miss_inpage[:got.misses].tolist() == want.miss_inpage
            assert list(zip(scratch.page_region[:got.pages].tolist(), scratch.page_no[:got.pages].tolist(),
                            strict=True)) == want.pages
            assert scratch.page_buf[:got.pages].tolist() == list(range(buf_base, buf_base + got.pages))
            if got.bad_index >= 0:   # the engine abandons the step: this layer's fills are forgotten
                slots = scratch.miss_slot[:got.misses].copy()
                cache.forget(layer, slots)
                lay = ref.layers[layer]
                for s in slots.tolist():
                    if s >= 0:
                        del lay.directory[ref.slot_row.pop(s)]
                        ref.ref[s] = 0
                break
        cache.release_pins()
        ref.end_step()
        for layer in LAYERS:
            assert cache.evict_ahead(layer, ahead) == ref.evict_ahead(layer, ahead)
            rows, slots = cache.cached(layer)
            assert dict(zip(rows.tolist(), slots.tolist(), strict=True)) == ref.layers[layer].directory
            assert [int(cache.ref[s]) for s in slots.tolist()] == [ref.ref[s] for s in slots.tolist()]
        assert cache.verify() == []
