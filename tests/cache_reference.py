"""A plain-Python reference of one layer's directory pass (cache.directory) and its CLOCK (cache.kernels).

It keeps its own directory (a dict), slot rows, pins, fill marks and reference
bits, and resolves a step's lookups one by one in order, the way the module doc
of `cache.directory` states the policy: hit (pin), reuse of a read this step,
pad, an id outside the whole layer, foreign, lossy zero, miss (page buffer,
CLOCK victim or none). The compiled
pass defers hits' pins and walks its lookups in waves; the outcome must be the
same lookup for lookup.

Context packing (`packed`, a `RefPacked`): a token whose context (its `columns` ids) is in the index reads
the rows it misses from its packed page instead of their row pages; the key is recomputed here in plain
Python (`ref_context_key`), so the compiled key and index are checked too.

Worked example: 2 slots, lookups [5, 7, 5, 9] on an empty layer -> 5 and 7 claim
slots 0 and 1, 5 reuses its own fill (miss 0), 9 finds both slots pinned and is
read without a slot (bypass).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from slacktier.cache import KIND_FOREIGN, KIND_MISS, KIND_SLOT, KIND_ZERO

ROWS_PER_PAGE = 15
_M64 = (1 << 64) - 1


def _mix(x: int) -> int:
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def ref_context_key(ids: list[int]) -> int:
    """tables.packing.context_key, in plain Python: per column a scrambled term, summed, then a splitmix64
    finalizer, as a signed 64-bit int, never 0."""
    acc = 0x243F6A8885A308D3
    for c, g in enumerate(ids):
        x = (((g & _M64) + (c + 1) * 0x9E3779B97F4A7C15) * 0xBF58476D1CE4E5B9) & _M64
        acc = (acc + (x ^ (x >> 29))) & _M64
    k = _mix(acc)
    k = k - (1 << 64) if k >= 1 << 63 else k
    return k if k != 0 else 1


@dataclass
class RefPacked:
    """A layer's packing as the reference reads it: context key -> ordinal, and where packed pages live."""

    index: dict[int, int]        # ref_context_key(ids) -> context ordinal
    region: list[int]            # per rank: its packed region (-1 none)
    slots: list[int]             # per column: its place among its owner's packed columns
    pages_per_context: int


@dataclass
class RefLayer:
    """One layer's slots as the reference sees them: `owned` in CLOCK order, and the rows they hold."""

    owned: list[int]
    hand: int = 0
    directory: dict[int, int] = field(default_factory=dict)   # row -> slot


@dataclass
class RefPass:
    kinds: list[int]
    idx: list[int]          # slot (hits) or miss index
    miss_rows: list[int]
    miss_slots: list[int]
    miss_bufs: list[int]    # page buffer of each miss: buf_base + its page's index in `pages`
    miss_inpage: list[int]  # its row within that page
    pages: list[tuple[int, int]]   # (region, page) in the order first read
    counts: dict[str, int]  # every field of cache.PassResult


class RefCache:
    """Slots shared by layers (each owns its own), pins by step, CLOCK reference counts and fill marks."""

    def __init__(self) -> None:
        self.step = 0
        self.pinned: dict[int, int] = {}     # slot -> step that pinned it
        self.filling: dict[int, int] = {}    # slot -> miss index of this step's read that fills it
        self.ref: dict[int, int] = {}
        self.slot_row: dict[int, int] = {}
        self.layers: dict[int, RefLayer] = {}

    def end_step(self) -> None:
        self.step += 1
        self.filling.clear()

    def evict_ahead(self, layer: int, n: int) -> int:
        """Between steps: empty the slots of the next n victims (at most an eighth of the layer's slots), leaving
        the hand and every reference count as they are; returns the rows evicted."""
        lay = self.layers[layer]
        m = len(lay.owned)
        n = min(n, m // 8)   # the cache's cap (kernels.AHEAD_SHARE), restated
        evicted = found = 0
        for k in range(m):
            if found >= n:
                break
            s = lay.owned[(lay.hand + k) % m] if lay.hand < m else lay.owned[k]
            if self.pinned.get(s) == self.step or self.ref.get(s, 0):
                continue
            found += 1
            old = self.slot_row.pop(s, None)
            if old is not None:
                del lay.directory[old]
                evicted += 1
        return evicted

    def _victim(self, lay: RefLayer) -> int:
        n = len(lay.owned)
        pinned = sum(1 for s in lay.owned if self.pinned.get(s) == self.step)
        if n == 0 or pinned >= n:
            return -1
        if lay.hand >= n:
            lay.hand = 0
        for _ in range(4 * n + 1):   # counts reach 3: the fourth lap finds an unreferenced slot
            s = lay.owned[lay.hand]
            lay.hand = (lay.hand + 1) % n
            if self.pinned.get(s) == self.step:
                continue
            if self.ref.get(s, 0):
                self.ref[s] -= 1
                continue
            return s
        return -1

    def resolve(self, layer: int, ids: list[int], *, row_start: int, rows: int, rank_starts: list[int],
                rank_region: list[int], owned_only: bool = False, seen: set[int] | None = None,
                pad_id: int = 0, table_end: int = 0, buf_base: int = 0, heat: list[int] | None = None,
                columns: int = 0, packed: RefPacked | None = None) -> RefPass:
        lay = self.layers[layer]
        out = RefPass([KIND_FOREIGN] * len(ids), [-1] * len(ids), [], [], [], [], [],
                      dict(lookups=len(ids), hits=0, misses=0, pages=0, zero=0, bypass=0, reused=0, foreign=0,
                           bad_index=-1, padded=0, pending=0, evicted=0, outside=0, packed=0))
        c = out.counts
        bypassed: dict[int, int] = {}        # row -> miss index, read this step without a slot
        page_buf: dict[tuple[int, int], int] = {}
        done = len(ids)
        for i, g in enumerate(ids):
            r = g - row_start
            if not 0 <= r < rows:
                if pad_id < 0 and g == pad_id:
                    out.kinds[i] = KIND_ZERO
                    c["padded"] += 1
                elif table_end > 0 and not 0 <= g < table_end:
                    out.kinds[i] = KIND_ZERO
                    c["outside"] += 1
                elif owned_only:
                    c["foreign"] += 1
                else:
                    c["bad_index"] = done = i
                    break
                continue
            s = lay.directory.get(r, -1)
            if s >= 0:
                if s in self.filling:
                    out.kinds[i], out.idx[i] = KIND_MISS, self.filling[s]
                    c["reused"] += 1
                else:
                    self.pinned[s] = self.step
                    if heat is None:
                        self.ref[s] = 1
                    else:   # a heat code: bits 2-3 what a hit adds, bits 4-5 the most it raises the count to
                        self.ref[s] = min(self.ref.get(s, 0) + (heat[i] >> 2 & 3), heat[i] >> 4)
                    out.kinds[i], out.idx[i] = KIND_SLOT, s
                    c["hits"] += 1
                continue
            if r in bypassed:
                out.kinds[i], out.idx[i] = KIND_MISS, bypassed[r]
                c["reused"] += 1
                continue
            if seen is not None and r not in seen:
                out.kinds[i] = KIND_ZERO
                c["zero"] += 1
                continue
            k = max(j for j in range(len(rank_region)) if rank_starts[j] <= r)
            key = (rank_region[k], (r - rank_starts[k]) // ROWS_PER_PAGE)
            inpage = (r - rank_starts[k]) % ROWS_PER_PAGE
            is_packed = False
            if packed is not None:
                t, col = divmod(i, columns)
                ordinal = packed.index.get(ref_context_key(ids[t * columns:(t + 1) * columns]), -1)
                if ordinal >= 0 and packed.region[k] >= 0:
                    slot = packed.slots[col]
                    key = (packed.region[k], ordinal * packed.pages_per_context + slot // ROWS_PER_PAGE)
                    inpage = slot % ROWS_PER_PAGE
                    is_packed = True
            if key not in page_buf:
                page_buf[key] = len(out.pages)
                out.pages.append(key)
                c["packed"] += is_packed
            m = len(out.miss_rows)
            out.miss_rows.append(r)
            out.miss_bufs.append(buf_base + page_buf[key])
            out.miss_inpage.append(inpage)
            s = self._victim(lay)
            out.miss_slots.append(s)
            if s >= 0:
                old = self.slot_row.get(s)
                if old is not None:
                    del lay.directory[old]
                    c["evicted"] += 1
                self.slot_row[s] = r
                lay.directory[r] = s
                self.pinned[s] = self.step
                self.ref[s] = 1 if heat is None else heat[i] & 3   # bits 0-1: the count a new row enters with
                self.filling[s] = m
            else:
                bypassed[r] = m
                c["bypass"] += 1
            out.kinds[i], out.idx[i] = KIND_MISS, m
        c["misses"], c["pages"] = len(out.miss_rows), len(out.pages)
        # The hits' pins stay pending (RowCache.settle applies them) when no lookup needed a victim: the
        # descriptors [0, done) hold them.
        c["pending"] = 0 if out.miss_rows else done
        return out
