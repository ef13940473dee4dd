"""Admission rules in front of CLOCK, replayed over a lookup trace, compiled: which missed rows earn a slot.

Replacement order alone leaves a gap to Belady's ceiling; the paper finds that
admission, not eviction, is what moves the hit rate. This module replays CLOCK
with one or more admission rules in front of it, so the characterizer can weigh
each rule against the served CLOCK (`policies.clock`), S3-FIFO and Belady on the
same trace. It is an evaluation tool: of these rules the served cache runs only
"prefill cold" (the control file's `admission = "prefill-cold"`), which the
characterizer replays with the served pass itself (`cache.simulate`), not here.

The cache (`capacity` rows) is a CLOCK over `capacity - probation` main slots,
plus an optional probationary FIFO of `probation` slots. A lookup whose row is
in either is a hit (a probation hit marks the row). On a miss the rules decide,
in this order:

1. **n-gram order** (`prefill_max_order`, `decode_max_order`): a missed row of a
   higher order than the bound of its phase is read but not cached (bypassed).
2. **probation** (`probation_share` > 0): a prefill miss enters the probationary
   FIFO instead of CLOCK; when the FIFO is full its oldest row leaves: into CLOCK
   (reference bit set) if it was hit while on probation, else out of the cache.
   Prefill rows that are never read again so never displace a CLOCK row.
3. **cold insert** (`prefill_insert="cold"`): a prefill miss enters CLOCK with
   its reference bit clear, so the hand's next pass takes it unless it is hit first.
4. **frequency sketch** (`sketch` "prefill" or "all", TinyLFU-style): every
   lookup counts in a count-min sketch (4 rows of 4-bit counters, `sketch_width`
   counters per cache row and sketch row, rounded up to a power of two; every
   counter halves after `sketch_reset` lookups per cache row, so counts age).
   When CLOCK is full, its hand finds the victim as usual (clearing reference
   bits), and the missed row takes the victim's slot only if its estimated count
   is strictly above the victim's; otherwise the row is bypassed and the victim
   stays next in line.

With every rule off (`AdmissionRule()`) the kernel is textbook CLOCK, one lookup
at a time (`policies.clock(..., evict_ahead=False)` without step bounds).

Hits follow `policies`: a lookup is a hit when its row is cached at that moment,
so a bypassed row looked up again in the same step is a miss (the engine would
reuse the read: no new page, and `characterize.decode_step_pages` counts none).

Worked example, capacity 2, rule `decode_max_order=3`, lookups (row, order,
phase): (5, 2, decode) miss, cached; (8, 4, decode) miss, bypassed (order 4 > 3);
(5, 2, decode) hit; (8, 4, decode) miss again -> hits [0, 0, 1, 0].
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

import numba
import numpy as np

# the served cache's sketch shape and hashes (4-bit counters, rows of odd multipliers), so both count alike
from slacktier.cache.kernels import SKETCH_MAX, SKETCH_MULTIPLIERS, SKETCH_ROWS
from slacktier.errors import ErrorKind, SlackTierError

PREFILL_INSERTS = ("hot", "cold")
SKETCHES = ("off", "prefill", "all")
MIN_ORDER = 2       # Engram's lowest n-gram order (column // heads_per_order == 0)


@dataclass(frozen=True)
class AdmissionRule:
    """Which missed rows are cached, and where (see the module docstring for each rule)."""

    prefill_max_order: int = 4      # a prefill miss of a higher n-gram order is bypassed
    decode_max_order: int = 4       # a decode miss of a higher n-gram order is bypassed
    probation_share: float = 0.0    # share of the capacity given to the prefill probationary FIFO
    prefill_insert: str = "hot"     # "hot": reference bit set as CLOCK does; "cold": bit clear
    sketch: str = "off"             # TinyLFU filter on CLOCK insertions of "prefill" misses, "all" misses, or "off"
    sketch_width: float = 1.0       # sketch counters per cache row, per sketch row
    sketch_reset: float = 10.0      # lookups per cache row between two halvings of every counter

    def __post_init__(self) -> None:
        if not (MIN_ORDER - 1 <= self.prefill_max_order and MIN_ORDER - 1 <= self.decode_max_order):
            raise SlackTierError(ErrorKind.BAD_INPUT, f"max orders {self.prefill_max_order}, "
                                 f"{self.decode_max_order}", fix=f"use orders >= {MIN_ORDER - 1} (that bypasses all)")
        if not 0.0 <= self.probation_share < 1.0:
            raise SlackTierError(ErrorKind.BAD_INPUT, f"probation share {self.probation_share}",
                                 fix="pass a share in [0, 1)")
        if self.prefill_insert not in PREFILL_INSERTS:
            raise SlackTierError(ErrorKind.BAD_INPUT, f"prefill insert {self.prefill_insert!r}",
                                 fix=f"use one of {PREFILL_INSERTS}")
        if self.sketch not in SKETCHES:
            raise SlackTierError(ErrorKind.BAD_INPUT, f"sketch {self.sketch!r}", fix=f"use one of {SKETCHES}")
        if self.sketch_width <= 0 or self.sketch_reset <= 0:
            raise SlackTierError(ErrorKind.BAD_INPUT, f"sketch width {self.sketch_width}, reset {self.sketch_reset}",
                                 fix="pass a width and a reset period > 0")

    def label(self) -> str:
        """Short text naming the rules that are on ("CLOCK" when none is): for tables."""
        parts = []
        if self.prefill_max_order < 4 or self.decode_max_order < 4:
            parts.append(f"orders<=({self.prefill_max_order} prefill, {self.decode_max_order} decode)")
        if self.probation_share > 0:
            parts.append(f"probation {self.probation_share:g}")
        if self.prefill_insert == "cold":
            parts.append("prefill cold")
        if self.sketch != "off":
            parts.append(f"TinyLFU({self.sketch}, w{self.sketch_width:g}, r{self.sketch_reset:g})")
        return "CLOCK + " + " + ".join(parts) if parts else "CLOCK"

    def as_dict(self) -> dict:
        """The rule's fields, for JSON."""
        return asdict(self)


def probation_slots(rule: AdmissionRule, capacity: int) -> int:
    """Slots of the probationary FIFO: share x capacity, at least 1 when the share is > 0, and always leaving
    CLOCK one slot (0 for capacity <= 1). Worked example: share 0.05 of 1,000 rows -> 50."""
    if rule.probation_share <= 0 or capacity <= 1:
        return 0
    return min(max(1, int(capacity * rule.probation_share)), capacity - 1)


def sketch_bits(rule: AdmissionRule, capacity: int) -> int:
    """log2 of the counters per sketch row: the power of two >= width x capacity, at least 16 counters."""
    want = max(16, int(np.ceil(rule.sketch_width * max(capacity, 1))))
    return int(want - 1).bit_length()


def sketch_reset_lookups(rule: AdmissionRule, capacity: int) -> int:
    """Lookups between two halvings of the sketch (at least 1)."""
    return max(1, int(rule.sketch_reset * max(capacity, 1)))


@numba.njit(nogil=True, cache=True, inline="always")
def _sketch_index(x, j, shift, mult):
    return np.int64(((np.uint64(x) + np.uint64(1)) * mult[j]) >> shift)


@numba.njit(nogil=True, cache=True)
def _estimate(sketch, x, shift, mult):
    best = SKETCH_MAX
    for j in range(SKETCH_ROWS):
        c = sketch[j, _sketch_index(x, j, shift, mult)]
        if c < best:
            best = c
    return best


@numba.njit(nogil=True, cache=True)
def _admit_kernel(ids, decode, order, allow, n_items, capacity, pmax, dmax, prob_cap, cold, scope, bits, reset_every,
                  mult, hit):
    # ids: [M] int32 dense rows; decode, allow: [M] uint8; order: [M] int8 n-gram order; hit: [M] uint8 out
    main_cap = capacity - prob_cap
    where = np.zeros(n_items, dtype=np.uint8)         # 0 absent, 1 in CLOCK, 2 on probation
    slot_of = np.full(n_items, -1, dtype=np.int32)
    marked = np.zeros(n_items, dtype=np.uint8)        # hit while on probation
    slot_item = np.full(max(main_cap, 1), -1, dtype=np.int32)
    ref = np.zeros(max(main_cap, 1), dtype=np.uint8)
    fifo = np.empty(max(prob_cap, 1), dtype=np.int32)
    f_head = 0
    f_size = 0
    filled = 0
    hand = 0
    shift = np.uint64(64 - bits)
    sketch = np.zeros((SKETCH_ROWS, (np.int64(1) << bits) if scope > 0 else 1), dtype=np.uint8)
    samples = 0
    for i in range(ids.shape[0]):
        x = ids[i]
        dec = decode[i] != 0
        if scope > 0:
            for j in range(SKETCH_ROWS):
                k = _sketch_index(x, j, shift, mult)
                if sketch[j, k] < SKETCH_MAX:
                    sketch[j, k] += 1
            samples += 1
            if samples >= reset_every:
                for j in range(SKETCH_ROWS):
                    for k in range(sketch.shape[1]):
                        sketch[j, k] >>= 1
                samples = 0
        w = where[x]
        if w == 1:
            hit[i] = 1
            ref[slot_of[x]] = 1
            continue
        if w == 2:
            hit[i] = 1
            marked[x] = 1
            continue
        hit[i] = 0
        if capacity == 0:
            continue
        if allow[i] == 0 or order[i] > (dmax if dec else pmax):
            continue
        # the row to put into CLOCK, with its reference bit and whether the sketch filters it
        y = x
        y_ref = 1
        y_filter = scope == 2 or (scope == 1 and not dec)
        if not dec and prob_cap > 0:
            y = -1
            if f_size == prob_cap:
                t = fifo[f_head]
                f_head += 1
                if f_head == prob_cap:
                    f_head = 0
                f_size -= 1
                where[t] = 0
                if marked[t]:
                    y = t
                    y_filter = False
            fifo[(f_head + f_size) % prob_cap] = x
            f_size += 1
            where[x] = 2
            marked[x] = 0
            if y < 0:
                continue
        elif not dec and cold:
            y_ref = 0
        if filled < main_cap:
            s = filled
            filled += 1
        else:
            while ref[hand]:
                ref[hand] = 0
                hand += 1
                if hand == main_cap:
                    hand = 0
            v = slot_item[hand]
            if y_filter and _estimate(sketch, y, shift, mult) <= _estimate(sketch, v, shift, mult):
                continue        # bypassed; the victim stays under the hand
            where[v] = 0
            slot_of[v] = -1
            s = hand
            hand += 1
            if hand == main_cap:
                hand = 0
        slot_item[s] = y
        slot_of[y] = s
        ref[s] = y_ref
        where[y] = 1


def replay_admission(ids: np.ndarray, is_decode: np.ndarray, order: np.ndarray, n_items: int, capacity: int,
                     rule: AdmissionRule = AdmissionRule(), allow: np.ndarray | None = None) -> np.ndarray:
    """Hit mask [M] uint8 of CLOCK with `rule`'s admission at `capacity` rows.

    ids: [M] dense rows 0..n_items-1 (`policies.densify`); is_decode: [M] bool; order: [M] n-gram order of
    each lookup (2..4 for Engram: column // heads_per_order + 2). allow: [M] bool, a miss with False is
    bypassed before any rule runs (None: all True); `oracle_allow` gives the admission that knows the future.
    """
    if capacity < 0:
        raise SlackTierError(ErrorKind.BAD_INPUT, f"capacity {capacity} < 0", fix="pass a capacity >= 0 rows")
    ids = np.ascontiguousarray(ids, dtype=np.int32)
    m = ids.shape[0]
    dec = np.ascontiguousarray(is_decode, dtype=np.uint8)
    ords = np.ascontiguousarray(order, dtype=np.int8)
    allow_u8 = np.ones(m, dtype=np.uint8) if allow is None else np.ascontiguousarray(allow, dtype=np.uint8)
    if dec.shape != ids.shape or ords.shape != ids.shape or allow_u8.shape != ids.shape:
        raise SlackTierError(ErrorKind.BAD_INPUT, "is_decode and order need one entry per lookup",
                             fix="pass LookupTrace.lookup_decode() and lookup_orders()")
    if m and (ids.min() < 0 or ids.max() >= n_items):
        raise SlackTierError(ErrorKind.BAD_INPUT, "dense ids outside 0..n_items-1", fix="build ids with densify()")
    hit = np.empty(m, dtype=np.uint8)
    capacity = int(capacity)
    _admit_kernel(ids, dec, ords, allow_u8, int(n_items), capacity, int(rule.prefill_max_order), int(rule.decode_max_order),
                  probation_slots(rule, capacity), int(rule.prefill_insert == "cold"), SKETCHES.index(rule.sketch),
                  sketch_bits(rule, capacity), sketch_reset_lookups(rule, capacity), SKETCH_MULTIPLIERS, hit)
    return hit


def oracle_allow(ids: np.ndarray, is_decode: np.ndarray) -> np.ndarray:
    """[M] bool: the lookup's row is looked up again and that next lookup is a decode one.

    Admission that knows the future (not realizable): as `allow` it shows how much of CLOCK's gap to Belady
    admission alone can close, with CLOCK's eviction order kept. Worked example: rows [4, 6, 4, 6] with
    decode flags [0, 0, 1, 0] -> [True, False, False, False].
    """
    ids = np.asarray(ids)
    dec = np.asarray(is_decode, dtype=bool)
    _, inv = np.unique(ids, return_inverse=True)
    nxt = np.full(ids.shape[0], -1, dtype=np.int64)
    order = np.lexsort((np.arange(ids.shape[0]), inv.reshape(-1)))    # by row, then lookup index
    same = inv.reshape(-1)[order[1:]] == inv.reshape(-1)[order[:-1]]
    nxt[order[:-1][same]] = order[1:][same]
    return (nxt >= 0) & dec[np.maximum(nxt, 0)]


def lookup_orders(column: np.ndarray, heads_per_order: int, min_order: int = MIN_ORDER) -> np.ndarray:
    """n-gram order [M] int8 of each lookup from its column: Engram column 9 with 8 heads per order -> 3."""
    return (np.asarray(column) // heads_per_order + min_order).astype(np.int8)


def candidate_rules() -> dict[str, list[AdmissionRule]]:
    """Per family, the parameter grid searched on the fit split (Engram's n-gram orders 2..4)."""
    base = AdmissionRule()
    return {
        "order": [replace(base, prefill_max_order=p, decode_max_order=d)
                  for p in (1, 2, 3, 4) for d in (3, 4) if (p, d) != (4, 4)],
        "probation": [replace(base, probation_share=s) for s in (0.01, 0.05, 0.2)],
        "cold": [replace(base, prefill_insert="cold")],
        "sketch": [replace(base, sketch=sc, sketch_reset=r) for sc in ("prefill", "all")
                   for r in (2.0, 10.0, 40.0, 160.0)],
    }


def combinations(best: dict[str, AdmissionRule]) -> list[AdmissionRule]:
    """The fit's best rule of each family combined: sketch + cold, sketch + order, sketch + order + cold,
    probation + order and probation + sketch (probation and cold both decide where prefill rows go, so they are
    not combined)."""
    s, o, p = best["sketch"], best["order"], best["probation"]
    orders = dict(prefill_max_order=o.prefill_max_order, decode_max_order=o.decode_max_order)
    return [replace(s, prefill_insert="cold"), replace(s, **orders), replace(s, prefill_insert="cold", **orders),
            replace(p, **orders), replace(p, sketch=s.sketch, sketch_width=s.sketch_width,
                                          sketch_reset=s.sketch_reset)]
