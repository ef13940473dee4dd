"""Compiled pieces of the row cache: pinning, CLOCK victim choice, slot claims, forgetting slots.

They operate on the plain numpy arrays a `RowCache` owns, so the step engine's
directory pass (`slacktier.engine.resolve`) calls them inline from its own
compiled loop and the cache's Python API calls them for batches.

Per-layer state `lstate` is an int64 [4] array: hand position in the layer's
owned-slot list, slots pinned in the current step, evictions so far, spare.

Per-slot state is one int64 word, `state[slot] = step << 2 | ref << 1 | fill`:
the step that last pinned the slot, the CLOCK reference bit, and whether the
slot is being filled by a read of that step. A slot is pinned when
`state >> 2 == step`, so releasing every pin at step end is one increment of
`step`, no sweep; and a hit touches one word (one cache line) of slot state.

Worked example: step 5 pins slot 9 on a hit -> state[9] = 5 << 2 | 2 = 22; a miss
claiming slot 9 in step 5 -> 23; CLOCK passing unpinned slot 9 in step 6 clears
the reference bit -> 20, and takes it on the next pass.
"""

from __future__ import annotations

import numpy as np
from numba import njit

HAND = 0
PINNED = 1
EVICTIONS = 2

REF = 2    # state bit: referenced since CLOCK last passed
FILL = 1   # state bit: filled by a read of the step in state >> 2


@njit(nogil=True, cache=True)
def pin_slot(slot, step, state, lstate):
    """Mark `slot` used in this step: pin it and set its reference bit."""
    v = state[slot]
    if (v >> 2) != step:
        state[slot] = (step << 2) | REF
        lstate[PINNED] += 1
    else:
        state[slot] = v | REF


@njit(nogil=True, cache=True)
def clock_victim(owned, lstate, state, step):
    """Next unpinned slot of the layer whose reference bit is clear (CLOCK), or -1 if all are pinned.

    Two laps suffice: the first clears every unpinned slot's reference bit.
    """
    n = owned.shape[0]
    if n == 0 or lstate[PINNED] >= n:
        return -1
    hand = lstate[HAND]
    if hand >= n:
        hand = 0
    for _ in range(2 * n + 1):
        s = owned[hand]
        hand += 1
        if hand == n:
            hand = 0
        v = state[s]
        if (v >> 2) == step:
            continue
        if v & REF:
            state[s] = v & ~np.int64(REF)
            continue
        lstate[HAND] = hand
        return s
    lstate[HAND] = hand
    return -1


@njit(nogil=True, cache=True)
def claim_slot(layer_key, row, directory, owned, lstate, slot_layer, slot_row, state, step):
    """Give `row` (absent from the directory) a slot of its layer, evicting an unpinned row; -1 if none."""
    s = clock_victim(owned, lstate, state, step)
    if s < 0:
        return -1
    if slot_layer[s] >= 0:
        # Owned slots only ever hold rows of their owner layer, so this is our directory.
        directory[slot_row[s]] = -1
        lstate[EVICTIONS] += 1
    slot_layer[s] = layer_key
    slot_row[s] = row
    directory[row] = s
    pin_slot(s, step, state, lstate)
    return s


@njit(nogil=True, cache=True)
def admit_rows(layer_key, rows, directory, owned, lstate, slot_layer, slot_row, state, step, out_slot, out_hit):
    """Batch lookup: hits pin their slot, misses claim one (-1 when every slot is pinned).

    rows: [n] int64 local rows; out_slot: [n] int32; out_hit: [n] uint8.
    """
    for i in range(rows.shape[0]):
        r = rows[i]
        s = directory[r]
        if s >= 0:
            pin_slot(s, step, state, lstate)
            out_slot[i] = s
            out_hit[i] = 1
        else:
            out_slot[i] = claim_slot(layer_key, r, directory, owned, lstate, slot_layer, slot_row, state, step)
            out_hit[i] = 0


@njit(nogil=True, cache=True)
def forget_slots(slots, directory, slot_layer, slot_row, state):
    """Drop the rows held in `slots` (slots < 0 are skipped): directory entries cleared, slots free.

    The pin stamp stays (a pinned slot stays pinned until the step ends); reference and fill bits clear.
    """
    for i in range(slots.shape[0]):
        s = slots[i]
        if s < 0 or slot_layer[s] < 0:
            continue
        r = slot_row[s]
        if directory[r] == s:
            directory[r] = -1
        slot_layer[s] = -1
        slot_row[s] = -1
        state[s] = (state[s] >> 2) << 2


def empty_lstate() -> np.ndarray:
    """A fresh per-layer state array [hand, pinned, evictions, spare]."""
    return np.zeros(4, dtype=np.int64)
