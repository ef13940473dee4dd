"""The directory sized to the cache (cache.rowdir): an open-addressing table that always agrees with a dict."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from slacktier.cache import RowCache
from slacktier.cache import rowdir as D


@settings(max_examples=60, deadline=None)
@given(slots=st.integers(0, 40), ops=st.lists(st.tuples(st.booleans(), st.integers(0, 2**31 - 1)), max_size=200),
       clustered=st.booleans())
def test_inserts_and_removals_agree_with_a_dict(slots, ops, clustered) -> None:
    """Random inserts and removals (clustered rows collide and wrap around the table's end); every row it holds
    is found, every row it dropped is not, and it never holds more than LOAD of its entries."""
    dtab = D.empty(slots)
    want: dict[int, int] = {}
    free = list(range(slots))
    for insert, row in ops:
        if clustered:
            row %= 64
        if insert and row not in want and free:
            s = free.pop()
            D.insert(dtab, row, s)
            want[row] = s
        elif want:
            r = row if row in want else next(iter(want))
            s = want.pop(r)
            D.remove(dtab, r, s + 1)   # another slot: left alone
            D.remove(dtab, r, s)
            free.append(s)
        rows, got = D.pairs(dtab)
        assert dict(zip(rows.tolist(), got.tolist(), strict=True)) == want
        probe = np.array(sorted(want) + [2**31 - 2, 7, 63], dtype=np.int64)
        out = np.empty(probe.shape[0], dtype=np.int64)
        D.find_many(dtab, probe, out)
        assert out.tolist() == [want.get(int(r), -1) for r in probe]
        assert len(want) <= D.LOAD * dtab.shape[0]


def test_sizes_follow_the_slots_not_the_rows() -> None:
    """A layer of 384M rows owning 500k slots: 2**20 entries, 8 MiB; resizing rebuilds it with every row kept."""
    assert D.entries_for(0) == D.MIN_ENTRIES and D.entries_for(6) == 16 and D.entries_for(500_000) == 2**20
    cache = RowCache(1000)
    cache.add_layer(1, 384_000_000, 1.0)
    assert cache.directory_bytes() == 8 * D.entries_for(1000)
    slots, _ = cache.lookup(1, np.arange(0, 384_000_000, 400_000))
    cache.release_pins()
    before = cache.cached(1)
    cache.resize(slots=100)   # fewer slots: a smaller directory, the 100 kept rows found in it
    rows, kept = cache.cached(1)
    assert cache.directory_bytes() == 8 * D.entries_for(100) and rows.size == 100
    assert np.all(np.isin(rows, before[0])) and cache.verify() == []
    assert np.array_equal(cache.slot_of(1, rows), kept)


def test_the_planner_counts_the_directory_the_cache_builds() -> None:
    from slacktier.plan.tiers import directory_bytes

    for slots in (0, 1, 7, 8, 9, 1000, 500_000, 1 << 20, (1 << 20) + 1):
        assert directory_bytes(slots) == D.empty(slots).nbytes == 8 * D.entries_for(slots)

