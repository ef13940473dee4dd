"""The directory pass of `begin_step`: one compiled loop per layer over its T x 24 lookups, on the one CLOCK.

The directory is the layer's `cache.rowdir` hash table (row -> slot), sized to
the slots the layer owns.

For each lookup (global row id g, local row r = g - row_start):
1. r in the directory, slot filled earlier this step -> reuse that read (miss m);
   r in the directory otherwise -> hit: record the slot, pin it;
2. r requested earlier this step without a slot (cache full of pins) -> reuse that read;
3. lossy mode and r not in the seen-set -> zero row, nothing read;
   (g equal to the pad id, a negative id the serving engine pads a step with ->
   zero row, nothing read, nothing cached, counted as padded; tested only where
   g is outside the table, so an in-range lookup pays nothing for it;
   (g outside the whole layer, [0, table_end), when the geometry knows its end ->
   a zero row (+0.0), nothing read or cached, counted as outside: what SGLang's and
   vLLM's own lookups return for such an id, in every rank and partition;
   (owned_only: r outside [0, rows), a row another rank's process serves -> foreign,
   nothing read, nothing cached; without owned_only such an id is an error);
4. miss: r's rank by shard bounds, its page; a page buffer for that page unless
   the page is already being read this step; a slot to fill (`kernels.victim`,
   CLOCK, never a pinned slot; -1 when all the layer's slots are pinned: the row
   is served from its page buffer and not cached). Admission: each token may
   carry a heat code (`heat`, one byte per token; `kernels.heat_code`) that sets
   the reference count a row it misses enters with and what its hits add. The
   engine derives the codes from the control file's `admission` and the token's
   phase (`token_heat`): with "prefill-cold" a prefill token's misses enter at
   0, so CLOCK's next pass takes them unless a later step hits them, and rows of
   a prompt that is never read again do not push out rows decode keeps reading;
   with "counters" a decode token's misses enter at 2 and its hits add 2 (at
   most 3), a prefill token's misses enter at 0 and its hits add nothing;
   "counters+sketch" is "counters" with the layer's frequency sketch
   (`kernels.new_sketch`): a prefill token's miss takes its CLOCK victim's slot
   only when its row is counted more often than the victim's row (for a slot
   evict_ahead emptied, the row it held); otherwise the row is read without a
   slot and the victim stays under the hand. The pass only reads the sketch:
   it leaves the count of lookups it listed in `lstate[OWN]`, and
   `kernels.count_lookups` adds them after the step's passes (every lookup, a
   decode token's twice).
   Context packing (tables.packing; a layer whose geometry has a `PackedGeometry`): the missed row's
   token's context is looked up once per token (its 24 ids' key in the layer's index); a packed context's
   missed rows are read from its packed page (page ordinal * pages_per_context + slot // 15 of its rank's
   packed region, row slot % 15) instead of their row pages. Hits and rows already requested this step are
   served as before, so only rows that would have been read come from the packed page, and the packed page
   takes a page buffer once per step however many rows and tokens need it. A layer without an index takes
   the path above unchanged.

Hits before the pass's first CLOCK victim search read no slot state but their
reference count: each raises its slot's count (`ref`, a byte; a plain store of 1
with no heat codes) and leaves its pin (the step stamp)
pending, the first `counts[Count.PENDING]` descriptors. The first victim search
applies the pins before it (`settle_pins`) and hits after it pin at once, so
CLOCK sees every pin it would have seen; `RowCache` applies pending pins before
anything else in the step reads this layer's pins, and drops them at step end,
when they would be released anyway. A warm step (all hits) so never writes a
pin. Before that first search no slot of this pass is being filled (only a
victim search claims one), so those hits need no `filling` test either.

Outputs go to a `PassScratch`: descriptors kind [N] int8 (KIND_SLOT, KIND_MISS,
KIND_ZERO, KIND_FOREIGN) and idx [N] int64 (slot, or miss index); misses: page
buffer, row-in-page, slot to fill (or -1), local row; pages: region, page,
buffer, exactly the PageReads to submit. Counts come back as a `PassResult`.
The scratch also holds the pass's own list of in-table lookups (own_pos,
own_row): only the first sweep reads all T x 24 ids; the counting sweep and the
resolving loops walk that list (one lookup in four on a TP4 rank).

Pages and slot-less rows of this step are found in one open-addressing hash
table whose entries are valid only when their stamp equals this call's stamp,
so nothing is cleared between calls.

Worked example: rows 31 and 32 of a one-rank table, cache empty -> one page
(page 2: 31 // 15), two misses in buffer 0 at rows-in-page 1 and 2, two slots claimed.
"""

from __future__ import annotations

from collections import namedtuple
from dataclasses import dataclass, field
from enum import IntEnum

import numpy as np
from numba import njit

from slacktier.cache import rowdir as D
from slacktier.cache.kernels import (EVICTIONS, FILTER, HAND, HEAVY, HOT, OWN, PINNED, RESET, claim, filling,
                                     heat_code, heat_hit, pin, prefetch, sketch_estimate, sketch_log2, victim)
from slacktier.errors import ErrorKind, SlackTierError
from slacktier.tables.layout import ROWS_PER_PAGE
from slacktier.tables.packing import context_key, probe_index

KIND_SLOT = 0      # a cache hit: idx is the slot
KIND_MISS = 1      # a row read this step: idx is the miss index
KIND_ZERO = 2      # lossy: a row outside the seen-set, a pad id, an id outside the layer: nothing read, +0.0 out
KIND_FOREIGN = 3   # owned_only: another rank's row; the gather writes -0.0 (see fill_foreign)

class Count(IntEnum):
    """The pass's counts: the one field list. resolve_layer writes counts[Count.X]; PassResult's fields, the
    compiled pass's output row (cache.compiled) and the engine's LayerCounters (engine.counters) follow it."""

    LOOKUPS = 0
    HITS = 1
    MISSES = 2       # unique rows read (M)
    PAGES = 3        # unique pages read (P)
    ZERO = 4         # lossy: rows outside the seen-set
    BYPASS = 5       # misses with no slot (every slot pinned): served from the page buffer, not cached
    REUSED = 6       # lookups served by a read already requested this step
    FOREIGN = 7      # owned_only: lookups of rows another rank's process serves
    BAD_INDEX = 8    # index of the first id outside the table, -1 if none (the pass stopped there)
    PADDED = 9       # lookups of the pad id: zero rows, nothing read or cached
    PENDING = 10     # descriptors [0, pending) hold hits whose pins wait for settle_pins
    EVICTED = 11     # rows this pass evicted from the layer's slots
    OUTSIDE = 12     # lookups of ids outside the whole layer [0, table_end): zero rows, nothing read or cached
    PACKED = 13      # unique packed pages read (context packing; included in PAGES)


N_COUNTS = len(Count)
SPARE = 3        # lstate's spare word: the prefetch loops' sum goes there, so they are not optimized away

NO_SEEN = np.zeros(1, dtype=np.uint8)   # the seen argument of a pass that is not lossy (never read)
NO_HEAT = np.zeros(0, dtype=np.uint8)   # the heat argument of a pass with no admission rule: plain CLOCK
NO_INDEX_KEYS = np.zeros(0, dtype=np.int64)   # a layer without context packing: an empty index
NO_INDEX_ORDINALS = np.zeros(0, dtype=np.int32)
NO_PACKED = np.zeros(1, dtype=np.int32)
#: The cache's admission rules (the control file's `admission`), each as (a decode token's heat code, a prefill
#: token's): "off", plain CLOCK; "prefill-cold", a prefill token's misses enter unreferenced; "counters", 2-bit
#: reference counts that decode lookups raise and prefill lookups do not (step 4 of the module doc);
#: "counters+sketch", the same with the layer's frequency sketch (kernels: decode lookups count twice, and a
#: prefill token's miss takes its victim's slot only when its row is counted more often than the victim's).
ADMISSION_HEAT = {
    "off": (HOT, HOT),
    "prefill-cold": (HOT, heat_code(0, 1, 1)),
    "counters": (heat_code(2, 2, 3), heat_code(0, 0, 3)),
    "counters+sketch": (heat_code(2, 2, 3) | HEAVY, heat_code(0, 0, 3) | FILTER),
}
ADMISSIONS = tuple(ADMISSION_HEAT)
#: the rules whose layers keep a frequency sketch (RowCache.use_sketch)
SKETCHED = ("counters+sketch",)


def checked_heat(heat: np.ndarray | None, tokens: int) -> np.ndarray:
    """`heat` as the pass takes it ([T] uint8 C-contiguous, NO_HEAT for None), refused unless it holds one
    heat code (`kernels.heat_code`) per token."""
    if heat is None:
        return NO_HEAT
    codes = np.ascontiguousarray(heat)
    if codes.dtype != np.uint8 or codes.shape != (tokens,):
        raise SlackTierError(ErrorKind.BAD_INPUT, f"heat codes {codes.dtype} {codes.shape} for {tokens} tokens",
                             fix="pass one uint8 heat code per token (directory.token_heat)")
    return codes


def token_heat(admission: str, prefill: np.ndarray) -> np.ndarray:
    """The pass's heat codes [T] uint8 for `admission` and the tokens' phases (prefill: [T] bool, True for a
    prefill token); NO_HEAT for "off" (plain CLOCK, the pass's fastest path).

    Worked example: "counters", prefill [True, False] -> [0x30, 0x3A]."""
    if admission not in ADMISSION_HEAT:
        raise SlackTierError(ErrorKind.BAD_INPUT, f"admission {admission!r}", fix=f"use one of {ADMISSIONS}")
    if admission == "off":
        return NO_HEAT
    dec, pre = ADMISSION_HEAT[admission]
    return np.where(np.asarray(prefill, dtype=bool), np.uint8(pre), np.uint8(dec)).astype(np.uint8)



@dataclass(frozen=True)
class PackedGeometry:
    """A layer's context packing as its pass reads it (tables.packing): the index and where packed pages live.

    Worked example: TP4 columns, rank 1 served alone (its row region is source region 0, its packed region
    source region 1), 24 columns -> region [1], slots [0..5] * 4 (each column's place among its owner's
    columns), pages_per_context 1; context ordinal 7, column 9 -> page 7 of region 1, row slot 3.
    """

    keys: np.ndarray            # [H] int64 the index's keys (0 = empty), H a power of two
    ordinals: np.ndarray        # [H] int32 each key's context ordinal
    region: np.ndarray          # [R] int32 per rank of the geometry: its packed region's source index, -1 none
    slots: np.ndarray           # [C] int32 per column: its place among its owner's packed columns
    pages_per_context: int

    def __post_init__(self) -> None:
        keys = np.ascontiguousarray(self.keys, dtype=np.int64)
        ordinals = np.ascontiguousarray(self.ordinals, dtype=np.int32)
        region = np.ascontiguousarray(self.region, dtype=np.int32)
        slots = np.ascontiguousarray(self.slots, dtype=np.int32)
        h = keys.shape[0]
        # The compiled pass trusts these (no bounds checks), so they are checked here, once.
        if (keys.ndim != 1 or h < 2 or h & (h - 1) or ordinals.shape != keys.shape or self.pages_per_context < 1
                or slots.ndim != 1 or slots.shape[0] < 1 or slots.min() < 0
                or slots.max() >= self.pages_per_context * ROWS_PER_PAGE):
            raise SlackTierError(ErrorKind.BAD_INPUT, f"a pack index of {keys.shape} keys, {ordinals.shape} "
                                 f"ordinals, column slots {slots.tolist()}, {self.pages_per_context} pages per "
                                 "context", fix="build it with tables.packing (PackIndex, column_slots)")
        object.__setattr__(self, "keys", keys)
        object.__setattr__(self, "ordinals", ordinals)
        object.__setattr__(self, "region", region)
        object.__setattr__(self, "slots", slots)

    @property
    def bits(self) -> int:
        """log2 of the index's entries."""
        return int(self.keys.shape[0]).bit_length() - 1

_PAGE_TAG = np.int64(1) << np.int64(62)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


@dataclass(frozen=True)
class LayerGeometry:
    """Where a layer's rows live: the row range this process serves and its split over rank regions.

    Worked example: 1,000 rows over 2 ranks, shards [0, 500) and [500, 1000), in source regions 3
    and 4 -> rank_starts [0, 500, 1000], rank_region [3, 4]; local row 531 -> rank 1, page 2, byte 264.
    """

    row_start: int               # first global row id of the layer (ids minus this = local rows)
    rows: int                    # local rows this process serves (ids minus row_start fall in 0 .. rows)
    rank_starts: np.ndarray      # [R + 1] int64 local-row bounds of each rank's shard, 0 .. rows
    rank_region: np.ndarray      # [R] int32 source region index of each rank's shard
    seen: np.ndarray | None = None   # lossy mode: packed bitmap [ceil(rows / 8)] uint8 over local rows
    table_end: int = 0           # the whole layer's ids are [0, table_end) (all ranks); 0: not known
    packed: PackedGeometry | None = None   # context packing (tables.packing); None: none

    def __post_init__(self) -> None:
        starts = np.ascontiguousarray(self.rank_starts, dtype=np.int64)
        region = np.ascontiguousarray(self.rank_region, dtype=np.int32)
        object.__setattr__(self, "rank_starts", starts)
        object.__setattr__(self, "rank_region", region)
        # The compiled pass trusts these bounds (no bounds checks), so they are checked here, once.
        if self.rows <= 0 or self.row_start < 0:
            raise SlackTierError(ErrorKind.BAD_INPUT, f"layer rows {self.rows} from {self.row_start}",
                                 fix="give the layer a non-empty row range")
        if (starts.ndim != 1 or starts.shape[0] != region.shape[0] + 1 or starts.shape[0] < 2
                or starts[0] != 0 or starts[-1] != self.rows or np.any(np.diff(starts) < 0)):
            raise SlackTierError(ErrorKind.BAD_INPUT, f"rank bounds {starts.tolist()} do not split 0..{self.rows} "
                                 f"over {region.shape[0]} ranks", fix="give R + 1 non-decreasing bounds from 0 "
                                 "to rows and one region per rank")
        if self.table_end and self.table_end < self.row_start + self.rows:
            raise SlackTierError(ErrorKind.BAD_INPUT, f"the layer ends at row {self.table_end}, before this "
                                 f"process's rows [{self.row_start}, {self.row_start + self.rows})",
                                 fix="give the whole layer's row count (all ranks), or 0 when it is not known")
        if self.seen is not None:
            seen = np.ascontiguousarray(self.seen, dtype=np.uint8)
            if seen.ndim != 1 or seen.shape[0] < (self.rows + 7) // 8:
                raise SlackTierError(ErrorKind.BAD_INPUT, f"seen bitmap of {seen.shape} bytes for {self.rows} rows",
                                     fix="pack one bit per local row (np.packbits(..., bitorder='little'))")
            object.__setattr__(self, "seen", seen)
        if self.packed is not None and self.packed.region.shape[0] != region.shape[0]:
            raise SlackTierError(ErrorKind.BAD_INPUT, f"packed regions for {self.packed.region.shape[0]} ranks, "
                                 f"the layer has {region.shape[0]}", fix="give one packed region (or -1) per rank")

    @classmethod
    def one_rank(cls, rows: int, row_start: int = 0, seen: np.ndarray | None = None) -> LayerGeometry:
        """A layer stored as one region (region 0)."""
        return cls(row_start, rows, np.array([0, rows], dtype=np.int64), np.zeros(1, dtype=np.int32), seen)


@dataclass
class PassScratch:
    """Preallocated outputs of one layer's directory pass, for up to `capacity` lookups (the gather reads them)."""

    capacity: int
    desc_kind: np.ndarray = field(init=False)    # [cap] int8, KIND_*
    desc_idx: np.ndarray = field(init=False)     # [cap] int64, slot (KIND_SLOT) or miss index (KIND_MISS)
    miss_buf: np.ndarray = field(init=False)     # [cap] int32, page buffer holding the missed row
    miss_inpage: np.ndarray = field(init=False)  # [cap] int32, row within that page
    miss_slot: np.ndarray = field(init=False)    # [cap] int32, slot to fill, -1 none
    miss_row: np.ndarray = field(init=False)     # [cap] int64, local row
    page_region: np.ndarray = field(init=False)  # [cap] int32
    page_no: np.ndarray = field(init=False)      # [cap] int64
    page_buf: np.ndarray = field(init=False)     # [cap] int32
    own_pos: np.ndarray = field(init=False)      # [cap] int32, the pass's list of in-table lookups: positions
    own_row: np.ndarray = field(init=False)      # [cap] int64, and local rows
    counts: np.ndarray = field(init=False)       # [N_COUNTS] int64, written by the pass

    def __post_init__(self) -> None:
        n = max(int(self.capacity), 1)
        self.desc_kind = np.zeros(n, dtype=np.int8)
        self.desc_idx = np.zeros(n, dtype=np.int64)
        self.miss_buf = np.zeros(n, dtype=np.int32)
        self.miss_inpage = np.zeros(n, dtype=np.int32)
        self.miss_slot = np.zeros(n, dtype=np.int32)
        self.miss_row = np.zeros(n, dtype=np.int64)
        self.page_region = np.zeros(n, dtype=np.int32)
        self.page_no = np.zeros(n, dtype=np.int64)
        self.page_buf = np.zeros(n, dtype=np.int32)
        self.own_pos = np.zeros(n, dtype=np.int32)
        self.own_row = np.zeros(n, dtype=np.int64)
        self.counts = np.zeros(N_COUNTS, dtype=np.int64)


#: What one layer's pass did, one field per Count member (lower case), in its order: counts[] read with one
#: tolist(). The first `misses` entries of the scratch's miss arrays and `pages` of its page arrays are filled,
#: and the first `lookups` descriptors. The last five default to 0.
PassResult = namedtuple("PassResult", [m.name.lower() for m in Count], defaults=(0, 0, 0, 0, 0))


class StepTable:
    """The stamped open-addressing hash table [H, 3] int64 (stamp, key, value) of one pass's pages and rows."""

    def __init__(self) -> None:
        self.table = np.zeros((0, 3), dtype=np.int64)
        self.stamp = 0
        self._lookups = -1   # the last call's lookups and bits: a step's layers ask for the same size
        self._bits = 0

    def prepare(self, lookups: int, passes: int = 1) -> int:
        """Advance the stamp (invalidating every entry) and return log2 of the entries to use for `lookups`.

        At least 4x the lookups (load <= 1/2), sized per call so a small step probes a small, cache-resident
        table: 3,072 lookups -> 14 (16,384 entries). `passes` passes of that size may follow, each with a
        stamp of its own: `stamp - passes + 1` .. `stamp` (the step engine's compiled entry runs all layers).
        """
        self.stamp += passes
        if lookups == self._lookups:
            return self._bits
        bits = max(4, (4 * lookups - 1).bit_length())   # ceil(log2(4 n)), without numpy's scalar calls
        if (1 << bits) > self.table.shape[0]:
            self.table = np.zeros((1 << bits, 3), dtype=np.int64)
            self.stamp = passes
        self._lookups = lookups
        self._bits = bits
        return bits


@njit(nogil=True, cache=True, inline="always")
def _probe(key, htab, stamp, shift, mask):
    """Index of `key`'s entry in the hash table, or of the empty entry where it would go.

    htab: [H, 3] int64 rows (stamp, key, value), one entry per 24 B so a probe touches one line.
    """
    h = np.int64((np.uint64(key) * _GOLDEN) >> np.uint64(shift))
    while htab[h, 0] == stamp and htab[h, 1] != key:
        h = (h + 1) & mask
    return h


@njit(nogil=True, cache=True)
def resolve_layer(ids, geo, cache, step, out, heat):
    """Resolve one layer's lookups `ids` [T, C] int64 (lookup i = ids[i // C, i % C]; any strides, so the
    engine passes its [T, L, 24] step's layer slice as is, with no copy); returns 0, or 1 on a row id
    outside the table.

    geo: the layer's rows (`cache.views.GeoView`); cache: the cache's slot arrays and the layer's directory,
    owned slots and CLOCK state (`CacheView`); step: the step's pin stamp, hash table, stamp and first page
    buffer, and the pass's settings (`StepView`); out: the scratch and counts it writes (`OutView`).

    step.owned_only: ids outside [row_start, row_start + rows) are foreign (kind 3), not an error.
    step.pad_id (negative; 0 = no padding): ids equal to it are zero rows (kind 2), counted in counts[Count.PADDED].
    geo.table_end (> 0: the whole layer's ids are [0, table_end); 0: not known): any other id outside it is a zero
    row (kind 2), counted in counts[Count.OUTSIDE], with or without owned_only.
    out.own_pos [N] int32, out.own_row [N] int64: scratch, where the in-table lookups are listed (position,
    local row).
    heat: [T] uint8 per token, or empty (plain CLOCK): each token's heat code (`kernels.heat_code`), the
    reference count a row it misses enters with and what its hits add (step 4 of the module doc).
    """
    row_start, rows, rank_starts, rank_region, seen, table_end, pk_keys, pk_ordinals, pk_bits, pk_region, \
        pk_slot, pk_ppc = geo
    layer_key, directory, owned, lstate, slot_layer, slot_row, state, ref, fill_miss, sketch = cache
    pin_step, htab, stamp, hbits, buf_base, owned_only, lossy, pad_id = step
    (desc_kind, desc_idx, miss_buf, miss_inpage, miss_slot, miss_row, page_region, page_no, page_buf,
     own_pos, own_row, counts) = out
    shift = 64 - hbits
    mask = (np.int64(1) << hbits) - 1
    dmask = directory.shape[0] - 1
    n_hits = 0
    n_miss = 0
    n_pages = 0
    n_zero = 0
    n_bypass = 0
    n_reuse = 0
    n_padded = 0
    n_outside = 0
    n_packed = 0
    has_pack = pk_keys.shape[0] > 0
    pk_token = -1   # the token whose context was looked up last, and its ordinal (-1: not packed)
    pk_ord = np.int64(-1)
    pk_shift = np.uint64(64 - pk_bits)
    hand = lstate[HAND]
    pinned = lstate[PINNED]
    evictions = lstate[EVICTIONS]
    evictions_before = evictions
    n_t, n_c = ids.shape
    n = n_t * n_c
    n_heat = heat.shape[0]
    track = n_heat > 0 or has_pack   # the loop below follows the token of each lookup
    reset_every = lstate[RESET]      # > 0: the layer keeps a frequency sketch (kernels.new_sketch)
    sk_bits = sketch_log2(sketch)
    tok = 0            # the token of the lookup at hand, and where its positions end
    tok_end = np.int64(n_c)
    counts[Count.LOOKUPS] = n
    counts[Count.BAD_INDEX] = -1
    status = 0
    done = n
    # First wave, the only sweep over every lookup. Every descriptor starts out foreign (two fills,
    # which the loops below overwrite for in-table lookups; cheaper than a store per foreign lookup
    # inside the sweep, measured on warm steps). A pad id gets its
    # zero row, a bad id stops the pass; an in-table lookup is listed in own_pos / own_row, which the
    # later loops walk instead of the T x 24 ids (with owned_only, one lookup in four on a TP4 rank),
    # and its directory entry is prefetched: a random access (`rowdir`: 16 MiB for a layer of 1M slots,
    # in DRAM unless the last step left it in the last-level cache). Prefetches retire at once, so this
    # sweep has all of them in flight together; a sweep of loads instead held its loads in the core's
    # window until they landed.
    n_own = 0
    i = 0
    desc_kind[:n] = KIND_FOREIGN
    desc_idx[:n] = -1
    for t in range(n_t):
        for c in range(n_c):
            g = ids[t, c]
            r = g - row_start
            if r >= 0 and r < rows:
                prefetch(directory, D.home(r, dmask))
                own_pos[n_own] = i
                own_row[n_own] = r
                n_own += 1
            elif pad_id < 0 and g == pad_id:
                desc_kind[i] = KIND_ZERO
                n_padded += 1
            elif table_end > 0 and (g < 0 or g >= table_end):
                desc_kind[i] = KIND_ZERO
                n_outside += 1
            elif not owned_only:
                counts[Count.BAD_INDEX] = i
                status = 1
                done = i
                break
            i += 1
        if status:
            break
    n_foreign = done - n_own - n_padded - n_outside   # the rest of the lookups before `done`
    # Count the misses with loads that mostly find their line arriving; the loops below find them in
    # cache. On the way, start the next random line each lookup will touch: a hit's reference bit
    # (and, after a miss, when its pin is taken at once, its state word), a miss's two hash-table
    # probes (row, then page); each of these prefetches was measured to shorten begin_step.
    touch = np.int64(0)
    n_absent = 0
    hflat = htab.reshape(-1)
    for j in range(n_own):
        r = own_row[j]
        s = D.find(directory, r)
        touch += s
        if s >= 0:
            prefetch(ref, s)
            if n_absent > 0:
                prefetch(state, s)
        else:
            prefetch(hflat, np.int64((np.uint64(r) * _GOLDEN) >> np.uint64(shift)) * 3)
            k = 0
            while r >= rank_starts[k + 1]:
                k += 1
            pkey = (_PAGE_TAG | (np.int64(rank_region[k]) << np.int64(40))
                    | ((r - rank_starts[k]) // ROWS_PER_PAGE))
            prefetch(hflat, np.int64((np.uint64(pkey) * _GOLDEN) >> np.uint64(shift)) * 3)
            n_absent += 1
            if has_pack:   # the token's index entry (a random line of the index), once per token with a miss
                while own_pos[j] >= tok_end:   # positions rise: the token advances without a division
                    tok += 1
                    tok_end += n_c
                t = tok
                if t != pk_token:
                    pk_token = t
                    ph = np.int64((np.uint64(context_key(ids, t)) * _GOLDEN) >> pk_shift)
                    prefetch(pk_keys, ph)
                    prefetch(pk_ordinals, ph)
    pk_token = -1
    tok = 0
    tok_end = np.int64(n_c)
    # Second wave: the rows the CLOCK hand will evict next have directory entries at random places;
    # prefetch those of the next slots (twice the misses, as the hand skips pinned and referenced slots).
    # Prefetches, not loads, of the entry's line and the next (the eviction's backward shift reads on until an
    # empty entry): on cold steps (caches flushed) the pass was faster than with loads of the entry's line
    # alone, and the next line's prefetch paid for itself too (the variants measured alternating step by step).
    n_owned = owned.shape[0]
    if n_absent > 0 and n_owned > 0:
        for k in range(min(2 * n_absent + 16, n_owned)):
            j = hand + k
            if j >= n_owned:
                j -= n_owned
            s = owned[j]
            if slot_layer[s] >= 0:
                h = D.home(slot_row[s], dmask)
                prefetch(directory, h)
                prefetch(directory, (h + 8) & dmask)   # the next line: removing shifts the entries after it
    lstate[SPARE] = touch
    settled = False
    for j in range(n_own):
        i = own_pos[j]
        r = own_row[j]
        if track:   # positions rise: the token advances without a division
            while i >= tok_end:
                tok += 1
                tok_end += n_c
        s = D.find(directory, r)
        if s >= 0:
            if not settled:   # no victim search yet: nothing is being filled, the pin can wait
                # CLOCK's reference count now: the pin itself only matters within the step
                if n_heat:
                    heat_hit(ref, s, heat[tok])
                else:
                    ref[s] = 1
                desc_kind[i] = KIND_SLOT
                desc_idx[i] = s
                n_hits += 1
            elif filling(state, s, pin_step):
                desc_kind[i] = KIND_MISS
                desc_idx[i] = fill_miss[s]
                n_reuse += 1
            else:
                pinned += pin(state, s, pin_step)
                if n_heat:
                    heat_hit(ref, s, heat[tok])
                else:
                    ref[s] = 1
                desc_kind[i] = KIND_SLOT
                desc_idx[i] = s
                n_hits += 1
            continue
        h = _probe(r, htab, stamp, shift, mask)
        if htab[h, 0] == stamp:
            desc_kind[i] = KIND_MISS
            desc_idx[i] = htab[h, 2]
            n_reuse += 1
            continue
        if lossy and (seen[r >> 3] >> (r & 7)) & 1 == 0:
            desc_kind[i] = KIND_ZERO
            desc_idx[i] = -1
            n_zero += 1
            continue
        k = 0
        while r >= rank_starts[k + 1]:
            k += 1
        shard_row = r - rank_starts[k]
        pg = shard_row // ROWS_PER_PAGE
        inpage = shard_row - pg * ROWS_PER_PAGE
        region = np.int64(rank_region[k])
        packed = False
        if has_pack:   # the token's context: looked up at its first row to read, packed page if it is packed
            t = tok
            if t != pk_token:
                pk_token = t
                pk_ord = probe_index(pk_keys, pk_ordinals, pk_bits, context_key(ids, t))
            if pk_ord >= 0 and pk_region[k] >= 0:
                j = np.int64(pk_slot[i - (tok_end - n_c)])
                region = np.int64(pk_region[k])
                pg = pk_ord * pk_ppc + j // ROWS_PER_PAGE
                inpage = j - (j // ROWS_PER_PAGE) * ROWS_PER_PAGE
                packed = True
        pkey = _PAGE_TAG | (region << np.int64(40)) | pg
        ph = _probe(pkey, htab, stamp, shift, mask)
        if htab[ph, 0] == stamp:
            b = htab[ph, 2]
        else:
            b = buf_base + n_pages
            htab[ph, 0] = stamp
            htab[ph, 1] = pkey
            htab[ph, 2] = b
            page_region[n_pages] = region
            page_no[n_pages] = pg
            page_buf[n_pages] = b
            n_pages += 1
            if packed:
                n_packed += 1
        m = n_miss
        n_miss += 1
        miss_buf[m] = b
        miss_inpage[m] = inpage
        miss_row[m] = r
        if not settled:   # CLOCK must see the pins of this pass's earlier hits
            pinned += settle_pins(desc_kind, desc_idx, i, state, pin_step)
            settled = True
        sl, hand = victim(owned, state, ref, hand, pinned, pin_step)
        if sl >= 0 and reset_every > 0 and n_heat and heat[tok] & FILTER:
            # TinyLFU's test: the row takes the slot only when counted more often than the victim's row (or the
            # row evict_ahead emptied from it: kernels.evict_ahead keeps slot_row); otherwise the victim stays
            # under the hand and the row is read without a slot. The counts are those of earlier steps
            # (kernels.count_lookups runs after the step's passes).
            v = slot_row[sl]
            if v >= 0 and v != r and sketch_estimate(sketch, r, sk_bits) <= sketch_estimate(sketch, v, sk_bits):
                hand = hand - 1 if hand > 0 else owned.shape[0] - 1
                sl = -1
        miss_slot[m] = sl
        if sl >= 0:
            evictions += claim(layer_key, r, sl, directory, slot_layer, slot_row, state, ref, pin_step)
            pinned += 1
            fill_miss[sl] = m
            if n_heat:   # the count the token's rule gives a new row (0: CLOCK's next pass takes it)
                ref[sl] = heat[tok] & 3
        else:
            # The page probe may have moved the row's empty entry: probe again.
            h = _probe(r, htab, stamp, shift, mask)
            htab[h, 0] = stamp
            htab[h, 1] = r
            htab[h, 2] = m
            n_bypass += 1
        desc_kind[i] = KIND_MISS
        desc_idx[i] = m
    lstate[HAND] = hand
    lstate[PINNED] = pinned
    lstate[EVICTIONS] = evictions
    lstate[OWN] = n_own if reset_every > 0 else 0   # for kernels.count_lookups, after the step's passes
    counts[Count.HITS] = n_hits
    counts[Count.MISSES] = n_miss
    counts[Count.PAGES] = n_pages
    counts[Count.ZERO] = n_zero
    counts[Count.BYPASS] = n_bypass
    counts[Count.REUSED] = n_reuse
    counts[Count.FOREIGN] = n_foreign
    counts[Count.PADDED] = n_padded
    counts[Count.OUTSIDE] = n_outside
    counts[Count.PACKED] = n_packed
    counts[Count.PENDING] = 0 if settled else done
    counts[Count.EVICTED] = evictions - evictions_before
    return status


@njit(nogil=True, cache=True, inline="always")
def settle_pins(desc_kind, desc_idx, n, state, step):
    """Apply the pins of the KIND_SLOT descriptors among [0, n) for `step`; returns how many were new pins."""
    added = 0
    for i in range(n):
        if desc_kind[i] == KIND_SLOT:
            added += pin(state, desc_idx[i], step)
    return added


@njit(nogil=True, cache=True)
def fill_foreign(desc_kind, n, out):
    """Write -0.0 (bf16 bits 0x8000) into the output rows of foreign lookups; out: [n, 256] uint16."""
    for i in range(n):
        if desc_kind[i] == KIND_FOREIGN:
            for j in range(out.shape[1]):
                out[i, j] = 0x8000


@njit(nogil=True, cache=True)
def settle_layer(desc_kind, desc_idx, n, state, step, lstate):
    """`settle_pins` for one layer's pending hits, counted into its lstate's pinned count."""
    lstate[PINNED] += settle_pins(desc_kind, desc_idx, n, state, step)
