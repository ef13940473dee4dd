"""A layer's directory (local row -> slot), sized to the slots the layer owns, not to the table's rows.

One open-addressing hash table per layer, `[2**b]` int64 entries, each entry
one (row, slot) pair packed as `row << 32 | slot`; EMPTY (-1) is a free entry.
Linear probing from a multiplicative hash of the row; deletion shifts the
entries after it back (no tombstones), so a lookup stops at the first empty
entry, however long the cache has run.

Size: the directory holds at most one entry per owned slot (a row is in it
only while a slot holds it), and `entries_for(slots)` gives it at least
1 / LOAD entries per slot, rounded up to a power of two; so its load stays at
or below LOAD (0.5) and a lookup reads one entry, sometimes two in the same
64 B line. A layer owning 1M slots takes 2**21 entries, 16 MiB, where an
array of 4 B per table row (the paper's directory) takes 1.5 GB for a V4.1
layer (366 MiB per TP4 rank). `RowCache` rebuilds a layer's directory when its slot count moves out
of the range its size serves (`resize`), from the slot arrays.

Limits: rows and slots below 2**31 (one process serves fewer than 2**31 rows
of one layer; `RowCache.add_layer` refuses more).

Worked example: a layer owning 6 slots -> 16 entries (6 / 0.5 = 12 -> 16);
row 531 in slot 4 -> the entry 531 << 32 | 4 at `hash(531)` or the first free
entry after it; removing row 531 moves the entries after it that hashed at or
before its place one step back.
"""

from __future__ import annotations

import numpy as np
from numba import njit

EMPTY = np.int64(-1)
LOAD = 0.5                      # entries in use / entries, at most: short probe runs, a lookup mostly one entry
MIN_ENTRIES = 16
ROW_LIMIT = 1 << 31             # rows and slots fit the 32-bit halves of an entry
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_LOW = np.int64(0xFFFFFFFF)


def entries_for(slots: int) -> int:
    """Entries of a directory for a layer owning `slots` slots: a power of two >= slots / LOAD."""
    need = max(MIN_ENTRIES, int(np.ceil(max(slots, 0) / LOAD)))
    return 1 << (need - 1).bit_length()


def empty(slots: int) -> np.ndarray:
    """A directory with no rows, sized for `slots` slots."""
    return np.full(entries_for(slots), EMPTY, dtype=np.int64)


@njit(nogil=True, cache=True, inline="always")
def home(row, mask):
    """The entry where `row`'s probe starts (bits 32.. of a multiplicative hash)."""
    return np.int64((np.uint64(row) * _GOLDEN) >> np.uint64(32)) & mask


@njit(nogil=True, cache=True, inline="always")
def find(dtab, row):
    """`row`'s slot, or -1 when the directory does not hold it."""
    mask = dtab.shape[0] - 1
    h = home(row, mask)
    while True:
        e = dtab[h]
        if e == EMPTY:
            return -1
        if (e >> 32) == row:
            return e & _LOW
        h = (h + 1) & mask


@njit(nogil=True, cache=True, inline="always")
def insert(dtab, row, slot):
    """Map `row` (absent) to `slot`."""
    mask = dtab.shape[0] - 1
    h = home(row, mask)
    while dtab[h] != EMPTY:
        h = (h + 1) & mask
    dtab[h] = (np.int64(row) << 32) | slot


@njit(nogil=True, cache=True, inline="always")
def remove(dtab, row, slot):
    """Drop `row` when it maps to `slot` (any other mapping, or none, is left alone); backward-shift deletion."""
    mask = dtab.shape[0] - 1
    i = home(row, mask)
    want = (np.int64(row) << 32) | slot
    while True:
        e = dtab[i]
        if e == EMPTY:
            return
        if e == want:
            break
        i = (i + 1) & mask
    j = i
    while True:
        j = (j + 1) & mask
        e = dtab[j]
        if e == EMPTY:
            break
        k = home(e >> 32, mask)
        # e may move back to i when its home is not in the cyclic range (i, j]
        if (i <= j and (k <= i or k > j)) or (i > j and k <= i and k > j):
            dtab[i] = e
            i = j
    dtab[i] = EMPTY


@njit(nogil=True, cache=True)
def rebuild(dtab, owned, layer_key, slot_layer, slot_row):
    """Fill the empty directory `dtab` with the rows the layer's `owned` slots hold."""
    for k in range(owned.shape[0]):
        s = owned[k]
        if slot_layer[s] == layer_key:
            insert(dtab, slot_row[s], s)


def pairs(dtab: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(rows [n] int64, slots [n] int32) held, in row order."""
    used = dtab[dtab != EMPTY]
    rows = used >> 32
    order = np.argsort(rows, kind="stable")
    return rows[order], (used[order] & _LOW).astype(np.int32)


@njit(nogil=True, cache=True)
def find_many(dtab, rows, out):
    """out[i] = the slot of rows[i], -1 absent."""
    for i in range(rows.shape[0]):
        out[i] = find(dtab, rows[i])
