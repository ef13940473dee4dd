"""The one CLOCK: pinning, victim choice, slot claims and forgetting, compiled, over a `RowCache`'s arrays.

Every user of the replacement policy calls these: the directory pass of
`begin_step` (`cache.directory.resolve_layer`), the cache's batch lookup
(`admit_rows`), and the characterization replay (`cache.simulate`) that draws
the miss-page curves the planner reads. The primitives `pin`, `victim` and
`claim` take the layer's hand and pinned count as values and return them
updated, and are inlined (`inline="always"`), so a caller's loop keeps those
counters in registers: writing them back to memory on every lookup made the
directory pass several times slower.

Per-layer state `lstate` is an int64 [LSTATE_WORDS] array: hand position in the
layer's owned-slot list, slots pinned in the current step, evictions so far,
spare, the frequency sketch's lookups since its last halving, the lookups
between two halvings (0: the layer has no sketch), and the lookups of the last
pass still to count in it.

Per-slot state is one int64 word, `state[slot] = step << 1 | fill`: the step
that last pinned the slot, and whether the slot is being filled by a read of
that step. A slot is pinned when `state >> 1 == step`, so releasing every pin at
step end is one increment of `step`, no sweep. CLOCK's reference count lives
apart, one byte per slot in `ref`: a hit raises it with a store, which is all a
hit whose pin may wait needs (see `cache.directory`: a pass's hits before its
first victim search leave their pins pending, and a step that never searched
needs none of them once it ends). Plain CLOCK keeps it at 0 or 1 (a bit); an
admission rule (a token's heat code, `heat_code`) may let a miss enter at 0 and
a hit raise it up to 3, and the hand takes one off each count it passes.

With the rule "counters+sketch" the layer also keeps a frequency sketch (a
count-min sketch of 4-bit counters, `SKETCH_ROWS` rows of a power of two
counters each, about one per slot; every counter halves after
`SKETCH_RESET` lookups per slot, so old counts fade): a miss of a token whose
code has `FILTER` takes CLOCK's victim only if its row's estimate is above the
victim's row's; otherwise it is read without a slot and the victim stays under
the hand (TinyLFU's admission test). The step's lookups are counted after its
passes (`count_lookups`, at end_step: each adds to its row's counters, twice for
a token whose heat code has `HEAVY`), so begin_step does not pay for the
sketch's random writes.

Worked example: step 5 pins slot 9 on a hit -> state[9] = 5 << 1 = 10, ref[9] = 1;
a miss claiming slot 9 in step 5 -> state[9] = 5 << 1 | 1 = 11, ref[9] = 1; CLOCK
passing unpinned slot 9 in step 6 clears ref[9], and takes the slot on its next pass.
With the rule "counters" a decode hit raises ref[9] to 3, and the hand passes
slot 9 three times (3 -> 2 -> 1 -> 0) before it takes it.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from slacktier.cache import rowdir as D
from slacktier.errors import ErrorKind, SlackTierError

HAND = 0
PINNED = 1
EVICTIONS = 2
SAMPLES = 4        # lstate: sketch lookups since its last halving
RESET = 5          # lstate: sketch lookups between two halvings, 0 when the layer has no sketch
OWN = 6            # lstate: lookups the layer's last pass listed (own_row) and the sketch has not counted yet
LSTATE_WORDS = 7

FILL = 1   # state bit: filled by a read of the step in state >> 1
NEVER = -2  # the state of a slot no step has pinned
MAX_REF = 3  # the highest reference count a heat code may raise a slot to


def heat_code(insert: int, add: int, most: int) -> int:
    """A token's heat code, one byte: how its lookups move their slots' reference counts.

    insert: the count a row it misses enters its slot with (bits 0-1); add: what a hit adds (bits 2-3);
    most: the highest a hit raises the count to (bits 4-5). Plain CLOCK is heat_code(1, 1, 1) (`HOT`): a
    miss enters referenced, a hit sets the bit. Worked example: heat_code(2, 2, 3) = 0x3A.
    """
    if not (0 <= insert <= MAX_REF and 0 <= add <= MAX_REF and 0 <= most <= MAX_REF):
        raise SlackTierError(ErrorKind.BAD_INPUT, f"heat code insert {insert}, add {add}, most {most}",
                             fix=f"give each in 0..{MAX_REF}")
    return insert | add << 2 | most << 4


HOT = heat_code(1, 1, 1)
FILTER = 0x40   # heat code bit: the token's misses pass the sketch's admission test
HEAVY = 0x80    # heat code bit: the token's lookups count twice in the sketch

SKETCH_ROWS = 4
SKETCH_MAX = 15          # 4-bit counters, one byte each
SKETCH_RESET = 10        # lookups per slot between two halvings of every counter
#: odd 64-bit multipliers, one per sketch row: row j of row id x -> ((x + 1) * M[j] mod 2^64) >> (64 - bits)
SKETCH_MULTIPLIERS = np.array([0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9, 0xD6E8FEB86659FD93],
                              dtype=np.uint64)
NO_SKETCH = np.zeros(1, dtype=np.uint8)   # the sketch of a layer without one (never read)


def sketch_bits(slots: int) -> int:
    """log2 of the counters per sketch row for a layer of `slots` slots: the power of two >= slots, at least 16."""
    return (max(16, int(slots)) - 1).bit_length()


def sketch_bytes(slots: int) -> int:
    """Host bytes of a layer's sketch for `slots` slots (one byte a counter). Worked example: 1,000,000 -> 4 MiB."""
    return SKETCH_ROWS << sketch_bits(slots)


def sketch_reset(slots: int) -> int:
    """Lookups between two halvings of a layer's sketch: SKETCH_RESET per slot."""
    return SKETCH_RESET * max(int(slots), 1)


def new_sketch(slots: int) -> tuple[np.ndarray, int]:
    """A zeroed sketch for a layer of `slots` slots, [SKETCH_ROWS << bits] uint8, and its halving period in
    lookups. Worked example: 1,000,000 slots -> 4 x 2^20 counters (4 MiB), halved every 10,000,000 lookups."""
    return np.zeros(sketch_bytes(slots), dtype=np.uint8), sketch_reset(slots)


@njit(nogil=True, cache=True, inline="always")
def sketch_log2(sketch):
    """log2 of the counters per row of a flat sketch of SKETCH_ROWS rows (0 for NO_SKETCH)."""
    bits = 0
    while (np.int64(SKETCH_ROWS) << bits) < sketch.shape[0]:
        bits += 1
    return bits


@njit(nogil=True, cache=True, inline="always")
def sketch_slot(x, j, bits):
    """Counter of row id x (>= 0) in sketch row j of 2^bits counters, as an index into the flat sketch."""
    h = ((np.uint64(x) + np.uint64(1)) * SKETCH_MULTIPLIERS[j]) >> np.uint64(64 - bits)
    return (np.int64(j) << np.int64(bits)) + np.int64(h)


@njit(nogil=True, cache=True, inline="always")
def sketch_add(sketch, x, w, bits):
    """Count row id x w times (each counter saturates at SKETCH_MAX)."""
    for j in range(SKETCH_ROWS):
        k = sketch_slot(x, j, bits)
        v = sketch[k] + w
        sketch[k] = SKETCH_MAX if v > SKETCH_MAX else v


@njit(nogil=True, cache=True, inline="always")
def sketch_estimate(sketch, x, bits):
    """Row id x's estimated count: the least of its counters."""
    best = SKETCH_MAX
    for j in range(SKETCH_ROWS):
        c = sketch[sketch_slot(x, j, bits)]
        if c < best:
            best = c
    return best


@njit(nogil=True, cache=True)
def count_lookups(sketch, lstate, own_row, own_pos, heat, n_c):
    """Count the layer's last pass's lookups in its sketch (none without one): own_row [N] the local rows the
    pass listed, own_pos [N] their positions in its [T, n_c] ids (token = position // n_c), heat [T] the
    tokens' codes (empty: weight 1). Halves every counter each `lstate[RESET]` lookups. Counts each pass once."""
    n = lstate[OWN]
    lstate[OWN] = 0
    reset = lstate[RESET]
    if reset <= 0 or n <= 0:
        return
    bits = sketch_log2(sketch)
    samples = lstate[SAMPLES]
    n_heat = heat.shape[0]
    ahead = 8   # lookups whose counters are fetched ahead of their writes
    for j in range(min(ahead, n)):
        for k in range(SKETCH_ROWS):
            prefetch(sketch, sketch_slot(own_row[j], k, bits))
    for j in range(n):
        if j + ahead < n:
            for k in range(SKETCH_ROWS):
                prefetch(sketch, sketch_slot(own_row[j + ahead], k, bits))
        w = 1
        if n_heat and heat[own_pos[j] // n_c] & HEAVY:
            w = 2
        sketch_add(sketch, own_row[j], w, bits)
        samples += 1
        if samples >= reset:
            sketch_halve(sketch)
            samples = 0
    lstate[SAMPLES] = samples


@njit(nogil=True, cache=True)
def sketch_halve(sketch):
    """Halve every counter (the sketch's ageing)."""
    for k in range(sketch.shape[0]):
        sketch[k] >>= 1


@intrinsic
def prefetch(typingctx, arr, idx):
    """Hint the CPU to load the cache line of arr[idx] (1-D array, int64 index); no fault, no effect on values."""
    sig = types.void(arr, types.int64)

    def codegen(context, builder, signature, args):
        aryty = signature.args[0]
        ary = context.make_array(aryty)(context, builder, args[0])
        ptr = cgutils.get_item_pointer(context, builder, aryty, ary, [args[1]], wraparound=False)
        if getattr(ptr.type, "is_opaque", False):      # LLVM >= 15: one opaque pointer type
            name = "llvm.prefetch.p0"
        else:                                           # older llvmlite: typed pointers, prefetch takes i8*
            ptr = builder.bitcast(ptr, ir.IntType(8).as_pointer())
            name = "llvm.prefetch.p0i8"
        i32 = ir.IntType(32)
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [ptr.type, i32, i32, i32]),
                                            name)
        # read (0), keep in all cache levels (3), data cache (1)
        builder.call(fn, [ptr, ir.Constant(i32, 0), ir.Constant(i32, 3), ir.Constant(i32, 1)])
        return context.get_dummy_value()

    return sig, codegen


@njit(nogil=True, cache=True, inline="always")
def pin(state, slot, step):
    """Pin `slot` for `step`; returns 1 when the slot was not pinned yet, else 0. The reference count is the
    caller's to raise (`heat_hit`, or a store of 1 for plain CLOCK)."""
    if (state[slot] >> 1) != step:
        state[slot] = step << 1
        return 1
    return 0


@njit(nogil=True, cache=True, inline="always")
def heat_hit(ref, slot, code):
    """A hit by a token of heat `code` (`heat_code`): the slot's reference count rises by the code's add, to at
    most its most."""
    most = (code >> 4) & 3
    v = ref[slot] + ((code >> 2) & 3)
    ref[slot] = most if v > most else v


@njit(nogil=True, cache=True, inline="always")
def filling(state, slot, step):
    """True when `slot` is being filled by a read of `step` (a later lookup of its row reuses that read)."""
    return state[slot] == (step << 1) | FILL


@njit(nogil=True, cache=True, inline="always")
def victim(owned, state, ref, hand, pinned, step):
    """CLOCK over the layer's `owned` [n] int32 slots: (slot, new hand); slot -1 when all n are pinned.

    A pinned slot is skipped with its reference count kept; an unpinned referenced
    slot's count drops by one; the first unpinned unreferenced slot is the victim.
    MAX_REF + 1 laps suffice: each lap takes one off every unpinned slot's count.
    """
    n = owned.shape[0]
    if n == 0 or pinned >= n:
        return -1, hand
    if hand >= n:
        hand = 0
    for _ in range((MAX_REF + 1) * n + 1):
        s = owned[hand]
        hand += 1
        if hand == n:
            hand = 0
        if (state[s] >> 1) == step:
            continue
        if ref[s]:
            ref[s] -= 1
            continue
        return s, hand
    return -1, hand


@njit(nogil=True, cache=True, inline="always")
def claim(layer_key, row, slot, directory, slot_layer, slot_row, state, ref, step):
    """Put `row` into `slot` (a victim: unpinned), pinned and marked filling; returns 1 if it evicted a row.

    directory: the layer's (`cache.rowdir`), which does not hold `row`. The slot enters referenced (count 1);
    an admission rule's pass then sets the count its heat code gives."""
    evicted = 0
    if slot_layer[slot] >= 0:
        # Owned slots only ever hold rows of their owner layer, so this is our directory.
        D.remove(directory, slot_row[slot], slot)
        evicted = 1
    slot_layer[slot] = layer_key
    slot_row[slot] = row
    D.insert(directory, row, slot)
    state[slot] = (step << 1) | FILL   # a victim is never pinned: this is a new pin
    ref[slot] = 1
    return evicted


AHEAD_SHARE = 8   # evict_ahead empties at most 1/AHEAD_SHARE of a layer's slots per step


@njit(nogil=True, cache=True)
def evict_ahead(n, directory, owned, lstate, slot_layer, slot_row, state, ref, step):
    """Free the next `n` slots CLOCK will take (at most 1/AHEAD_SHARE of the owned slots), between steps;
    returns the rows evicted.

    CLOCK's next victims are the unpinned, unreferenced owned slots from the hand on, in order (it lowers the
    counts of referenced ones as it passes them). This frees those slots' rows now (directory entry removed,
    slot empty) without moving the hand or changing any count, so the next pass's victim searches take the
    same slots in the same order and find them empty: a miss then claims its slot with no random read of
    a victim's directory entry. One lap at most; a slot already empty counts as one of the n. A row freed
    ahead and looked up in the next step is a miss that CLOCK would have kept: that is the policy's whole
    difference (RowCache.evict_ahead).
    """
    m = owned.shape[0]
    n = min(n, m // AHEAD_SHARE)
    if n <= 0:
        return 0
    hand = lstate[HAND]
    if hand >= m:
        hand = 0
    # The victims in order, their directory lines prefetched (all in flight together), then removed.
    victims = np.empty(n, dtype=np.int32)
    held = 0
    found = 0
    k = 0
    while found < n and k < m:
        s = owned[hand]
        hand += 1
        if hand == m:
            hand = 0
        k += 1
        if (state[s] >> 1) == step or ref[s]:
            continue
        found += 1
        if slot_layer[s] >= 0:
            h = D.home(slot_row[s], directory.shape[0] - 1)
            prefetch(directory, h)
            prefetch(directory, (h + 8) & (directory.shape[0] - 1))
            victims[held] = s
            held += 1
    for j in range(held):
        s = victims[j]
        D.remove(directory, slot_row[s], s)
        slot_layer[s] = -1   # slot_row keeps the row: the sketch's admission test compares a miss with it
    lstate[EVICTIONS] += held
    return held


@njit(nogil=True, cache=True)
def admit_rows(layer_key, rows, directory, owned, lstate, slot_layer, slot_row, state, ref, step, out_slot,
               out_hit):
    """Batch lookup: hits pin their slot, misses claim one (-1 when every slot is pinned).

    rows: [n] int64 local rows; out_slot: [n] int32; out_hit: [n] uint8 (1 also for a row claimed
    earlier in the same call or step: it has its slot).
    """
    hand = lstate[HAND]
    pinned = lstate[PINNED]
    evictions = lstate[EVICTIONS]
    for i in range(rows.shape[0]):
        r = rows[i]
        s = D.find(directory, r)
        if s >= 0:
            pinned += pin(state, s, step)
            ref[s] = 1
            out_slot[i] = s
            out_hit[i] = 1
            continue
        s, hand = victim(owned, state, ref, hand, pinned, step)
        if s >= 0:
            evictions += claim(layer_key, r, s, directory, slot_layer, slot_row, state, ref, step)
            pinned += 1
        out_slot[i] = s
        out_hit[i] = 0
    lstate[HAND] = hand
    lstate[PINNED] = pinned
    lstate[EVICTIONS] = evictions


@njit(nogil=True, cache=True)
def forget_slots(slots, directory, slot_layer, slot_row, state, ref):
    """Drop the rows held in `slots` (slots < 0 are skipped): directory entries cleared, slots free.

    The pin stamp stays (a pinned slot stays pinned until the step ends); reference and fill bits clear.
    """
    for i in range(slots.shape[0]):
        s = slots[i]
        if s < 0 or slot_layer[s] < 0:
            continue
        D.remove(directory, slot_row[s], s)
        slot_layer[s] = -1
        slot_row[s] = -1
        state[s] = (state[s] >> 1) << 1
        ref[s] = 0


def empty_lstate() -> np.ndarray:
    """A fresh per-layer state array [hand, pinned, evictions, spare, sketch samples, sketch reset]."""
    return np.zeros(LSTATE_WORDS, dtype=np.int64)
