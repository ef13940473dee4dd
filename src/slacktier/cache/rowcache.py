"""The device row cache: slots in two device arrays, a per-layer directory, CLOCK, pins, shares.

`resolve` runs a layer's directory pass (`cache.directory`) over one step's
lookups; `lookup` is the same policy for a batch of local rows without pages
(both on the one CLOCK of `cache.kernels`).

Memory: `max_slots` x (256 + 8) B on the device, reserved once; per slot 8 + 4
+ 4 + 1 + 8 + 8 + 4 B of host bookkeeping; per layer a directory (row -> slot,
`cache.rowdir`) of 16-32 B per slot the layer owns (8 B entries at a load of at
most 1/2, a power of two of them), whatever the table's row count: 16 MiB for
a layer owning 1M slots.

The slot budget `slots <= max_slots` is partitioned over layers by shares f_l
(each layer gets round(f_l * slots) slots by largest remainder); each layer
runs CLOCK over the slots it owns only, so one layer's misses never evict
another layer's rows. `resize` moves slot ownership without moving bytes, so
every row that stays cached stays correct; a shrinking layer gives up free
slots first, then unpinned rows (evicted), never a pinned row.

Worked example: 1,000 slots, shares {1: 0.75, 14: 0.25} -> layer 1 owns 750
slots, layer 14 owns 250; resize(slots=400) -> 300 and 100, layer 1 keeps its
300 most useful slots (free first released, then unreferenced rows).

Huge pages: a directory's random reads are begin_step's floor, and their cost
grows with the directory's size through address translation: a random read from a GB-sized array
costs more than one from a cache-sized array, and more again in 4 KiB pages than in huge pages
(`benchmarks/micro/bench_directory_floor.py` measures it). The
directory follows the slots, so it is that large only for a layer owning some
4M slots or more. numpy asks the kernel for transparent huge pages for large
arrays; where the kernel gives a directory of 64 MiB or more less than half of
them (THP off, or memory too fragmented), the resize that built it logs a
warning with the fix and counts it in `small_page_directories`.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from slacktier.cache import kernels as K
from slacktier.cache import rowdir as D
from slacktier.cache.compiled import CompiledPass, PassLayer
from slacktier.cache.directory import LayerGeometry, PassResult, PassScratch, StepTable, checked_heat, settle_layer
from slacktier.errors import ErrorKind, SlackTierError
from slacktier.tables.layout import ROW_BYTES, ROW_SCALES, ROW_VALUES

log = logging.getLogger(__name__)

_INT64 = np.dtype(np.int64)              # dtype identity test: a third of the cost of dtype != np.int64
HUGE_PAGE_CHECK_BYTES = 64 * 2**20       # directories from this size on are checked for huge pages


@dataclass
class CacheLayer:
    """One layer's share of the cache: its directory and the slots it owns."""

    layer: int
    key: int                 # small integer stored in slot_layer
    rows: int                # rows this process serves (local rows 0 .. rows - 1)
    share: float
    directory: np.ndarray    # cache.rowdir's hash table of (row, slot), sized to the owned slots
    owned: np.ndarray        # [n] int32 slot ids
    lstate: np.ndarray = field(default_factory=K.empty_lstate)  # kernels' per-layer words (HAND, PINNED, ...)
    # the frequency sketch of "counters+sketch" (RowCache.use_sketch); NO_SKETCH without one
    sketch: np.ndarray = field(default_factory=lambda: K.NO_SKETCH)
    # the last pass's hits whose pins wait (directory.settle_pins): (desc_kind, desc_idx, n), or None
    pending: tuple[np.ndarray, np.ndarray, int] | None = None


def split_slots(slots: int, shares: dict[int, float]) -> dict[int, int]:
    """Slots per layer by largest remainder: 10 slots, {1: .5, 14: .25} -> {1: 5, 14: 3} (round(7.5) = 8 in all)."""
    if not shares:
        return {}
    total_share = sum(shares.values())
    if any(f < 0 for f in shares.values()) or total_share > 1.0 + 1e-9:
        raise SlackTierError(ErrorKind.BAD_INPUT, f"cache shares {shares} must be >= 0 and sum to at most 1",
                             fix="give each layer a fraction of the cache, fractions summing to 1")
    want = {layer: f * slots for layer, f in shares.items()}
    total = min(slots, int(round(total_share * slots)))
    counts = {layer: int(np.floor(w)) for layer, w in want.items()}
    left = total - sum(counts.values())
    for layer in sorted(want, key=lambda k: (counts[k] - want[k], k))[:max(left, 0)]:
        counts[layer] += 1
    return counts


@dataclass(frozen=True)
class Available:
    """Memory a device can still give (bytes), and where the figure came from."""

    device: torch.device
    nbytes: int
    source: str

    def refuse(self, need: int, what: str) -> None:
        """Raise CAPACITY before allocating `need` bytes for `what` when the device cannot hold them."""
        if need > self.nbytes:
            raise SlackTierError(ErrorKind.CAPACITY, f"{what}: {need / 2**30:.2f} GiB needed on {self.device}, "
                                 f"{self.nbytes / 2**30:.2f} GiB available ({self.source})",
                                 fix="ask for fewer cache rows, or serve fewer rows per process (a TP rank's "
                                     "shard: owned_only with rank)")


def available_bytes(device: torch.device) -> Available:
    """What `device` can still allocate: MemAvailable of /proc/meminfo on the host, cudaMemGetInfo on a GPU."""
    if device.type == "cuda":   # pragma: no cover - needs a GPU
        free, _ = torch.cuda.mem_get_info(device)
        return Available(device, int(free), "cudaMemGetInfo")
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return Available(device, int(line.split()[1]) * 1024, "MemAvailable in /proc/meminfo")
    except OSError:
        pass
    pages = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return Available(device, int(pages), "free physical pages")


def huge_page_share(a: np.ndarray) -> float | None:
    """Share of `a`'s bytes in transparent huge pages, from /proc/self/smaps; None where there is no such file.

    numpy's huge-page advice splits a large array over several mappings (its unaligned ends and the aligned
    middle), so every mapping overlapping the array counts.
    """
    lo_a = a.__array_interface__["data"][0]
    hi_a = lo_a + a.nbytes
    huge = 0
    try:
        with open("/proc/self/smaps") as f:
            inside = False
            for line in f:
                if not line[:1].isupper():   # a mapping's first line, "7f4364600000-7f43a4600000 rw-p ..."
                    lo, hi = (int(x, 16) for x in line.split(" ", 1)[0].split("-"))
                    inside = lo < hi_a and hi > lo_a
                elif inside and line.startswith("AnonHugePages:"):
                    huge += int(line.split()[1]) * 1024
    except (OSError, ValueError):
        return None
    return huge / a.nbytes if a.nbytes else 1.0


class RowCache:
    """Row slots on `device` with per-layer directories, CLOCK replacement, step pins and shares."""

    def __init__(self, max_slots: int, device: str | torch.device = "cpu", slots: int | None = None) -> None:
        if max_slots < 0:
            raise SlackTierError(ErrorKind.BAD_INPUT, f"max_slots must be >= 0, got {max_slots}",
                                 fix="reserve a non-negative number of cache rows")
        self.device = torch.device(device)
        self.max_slots = int(max_slots)
        self.slots = self.max_slots if slots is None else int(slots)
        self._check_budget(self.slots)
        # Per slot: 264 B on the device, 8 + 8 + 4 + 4 + 4 + 1 B of host bookkeeping.
        available_bytes(self.device).refuse(self.max_slots * (ROW_VALUES + ROW_SCALES), "the cache's slots")
        available_bytes(torch.device("cpu")).refuse(self.max_slots * 29, "the cache's slot table")
        # Two device arrays, as in the paper: 256 B of fp8 weights and 8 B of e8m0 scales per slot.
        self.weight = torch.zeros((self.max_slots, ROW_VALUES), dtype=torch.uint8, device=self.device)
        self.scale = torch.zeros((self.max_slots, ROW_SCALES), dtype=torch.uint8, device=self.device)
        self.slot_layer = np.full(self.max_slots, -1, dtype=np.int32)   # layer key holding the slot, -1 free
        self.slot_row = np.full(self.max_slots, -1, dtype=np.int64)     # local row held
        # step << 1 | fill (see cache.kernels); NEVER: no step pinned it
        self.state = np.full(self.max_slots, K.NEVER, dtype=np.int64)
        self.ref = np.zeros(self.max_slots, dtype=np.uint8)              # CLOCK's reference bit, a byte
        self.fill_miss = np.full(self.max_slots, -1, dtype=np.int32)    # which read fills it (engine's index)
        self.owner = np.full(self.max_slots, -1, dtype=np.int32)        # layer key owning the slot, -1 unowned
        self.step = 0
        self._layers: dict[int, CacheLayer] = {}
        self._next_key = 0
        self._table = StepTable()
        # bumped whenever a layer's arrays may be replaced (layers added or dropped, slots re-partitioned):
        # the compiled pass names them by address (cache.compiled)
        self.generation = 0
        self.small_page_directories = 0   # directories add_layer warned about (see the module doc)
        self.sketched = False             # each layer keeps a frequency sketch (use_sketch)

    # ---- layers and sizes -------------------------------------------------------------------------
    def _check_budget(self, slots: int) -> None:
        if not 0 <= slots <= self.max_slots:
            raise SlackTierError(ErrorKind.CAPACITY, f"cache budget {slots} rows outside 0..{self.max_slots}",
                                 fix="reserve a larger max_cache_rows or ask for fewer rows")

    @property
    def layers(self) -> tuple[int, ...]:
        """Layer ids with a directory, in the order they were added."""
        return tuple(self._layers)

    def layer(self, layer: int) -> CacheLayer:
        """The state of one layer (directory, owned slots)."""
        try:
            return self._layers[layer]
        except KeyError:
            raise SlackTierError(ErrorKind.MISSING, f"layer {layer} has no cache directory",
                                 fix="add the layer to the cache first", layer=layer) from None

    def add_layer(self, layer: int, rows: int, share: float) -> CacheLayer:
        """Give `layer` a directory of `rows` rows and a share of the slots (re-partitions all layers)."""
        if layer in self._layers:
            raise SlackTierError(ErrorKind.BAD_INPUT, f"layer {layer} already has a cache directory",
                                 fix="remove it first or use resize", layer=layer)
        if rows < 0 or rows >= D.ROW_LIMIT:
            raise SlackTierError(ErrorKind.BAD_INPUT, f"layer rows {rows} outside 0..2**31",
                                 fix="split the table over more processes", layer=layer)
        state = CacheLayer(layer=layer, key=self._next_key, rows=int(rows), share=float(share),
                           directory=D.empty(0), owned=np.zeros(0, dtype=np.int32))
        self._next_key += 1
        shares = {k: v.share for k, v in self._layers.items()} | {layer: float(share)}
        counts = split_slots(self.slots, shares)   # validate before mutating
        self._layers[layer] = state
        try:
            self._rebalance(counts)
        except SlackTierError:
            del self._layers[layer]
            raise
        return state

    def _check_huge_pages(self, state: CacheLayer) -> None:
        """Warn (and count) when a large directory did not get huge pages: its reads then cost more."""
        nbytes = state.directory.nbytes
        if nbytes < HUGE_PAGE_CHECK_BYTES:
            return
        share = huge_page_share(state.directory)
        if share is None or share >= 0.5:
            return
        self.small_page_directories += 1
        log.warning("layer %d's directory (%d MiB) is %.0f%% in huge pages: begin_step's random reads of it cost "
                    "more in small pages; fix: set "
                    "/sys/kernel/mm/transparent_hugepage/enabled to madvise or always, with memory free for "
                    "2 MiB pages, before the engine starts", state.layer, nbytes >> 20, 100 * share)

    def remove_layer(self, layer: int) -> None:
        """Drop a layer's directory and free its slots (their rows are forgotten)."""
        state = self.layer(layer)
        self._refuse_if_pinned(state, 0)
        K.forget_slots(state.owned, state.directory, self.slot_layer, self.slot_row, self.state, self.ref)
        self.owner[state.owned] = -1
        del self._layers[layer]
        self.generation += 1

    def invalidate_layer(self, layer: int) -> None:
        """Forget every cached row of `layer` (its table changed); keeps its slots."""
        state = self.layer(layer)
        self._refuse_if_pinned(state, 0)
        K.forget_slots(state.owned, state.directory, self.slot_layer, self.slot_row, self.state, self.ref)

    def resize(self, slots: int | None = None, shares: dict[int, float] | None = None) -> None:
        """Change the slot budget and/or the per-layer shares; cached rows that keep a slot stay valid."""
        new_slots = self.slots if slots is None else int(slots)
        self._check_budget(new_slots)
        new_shares = {k: v.share for k, v in self._layers.items()}
        for layer, f in (shares or {}).items():
            self.layer(layer)
            new_shares[layer] = float(f)
        counts = split_slots(new_slots, new_shares)
        self._rebalance(counts)
        self.slots = new_slots
        for layer, f in new_shares.items():
            self._layers[layer].share = f

    def use_sketch(self, on: bool) -> None:
        """Give every layer a frequency sketch sized to its slots (`kernels.new_sketch`; the admission rule
        "counters+sketch" reads it), or drop them. Between steps; a sketch starts empty."""
        on = bool(on)
        if on == self.sketched:
            return
        self.sketched = on
        self.generation += 1
        for state in self._layers.values():
            self._size_sketch(state, fresh=True)

    def _size_sketch(self, state: CacheLayer, fresh: bool = False) -> None:
        """Keep `state`'s sketch as `sketched` asks, sized to its owned slots (counts kept while the size holds)."""
        slots = int(state.owned.shape[0])
        if not self.sketched:
            state.sketch = K.NO_SKETCH
            state.lstate[K.RESET] = state.lstate[K.SAMPLES] = 0
            return
        if fresh or state.sketch.shape[0] != K.sketch_bytes(slots):
            available_bytes(torch.device("cpu")).refuse(K.sketch_bytes(slots),
                                                         f"layer {state.layer}'s frequency sketch")
            state.sketch, _ = K.new_sketch(slots)
            state.lstate[K.SAMPLES] = 0
        state.lstate[K.RESET] = K.sketch_reset(slots)

    def count_lookups(self, layer: int, scratch: PassScratch, heat: np.ndarray, columns: int) -> None:
        """Count `layer`'s last pass's lookups (listed in `scratch`) in its frequency sketch, once; nothing
        without one. heat: the step's codes per token (`directory.token_heat`; empty: weight 1); columns: the
        lookups per token of the pass's ids. The engine calls this at end_step, after the step's passes."""
        state = self.layer(layer)
        K.count_lookups(state.sketch, state.lstate, scratch.own_row, scratch.own_pos, heat, int(columns))

    def sketch_bytes(self) -> int:
        """Host bytes of every layer's frequency sketch (0 unless `use_sketch`)."""
        return sum(state.sketch.nbytes for state in self._layers.values() if state.sketch is not K.NO_SKETCH)

    def _refuse_if_pinned(self, state: CacheLayer, target: int) -> None:
        self.settle(state)
        pinned = int(np.count_nonzero(self._pinned_mask(state.owned)))
        if pinned > target:
            raise SlackTierError(ErrorKind.CAPACITY, f"layer {state.layer} has {pinned} slots pinned by the "
                                 f"current step, cannot go down to {target}",
                                 fix="resize between steps (after end_step)", layer=state.layer)

    def _rebalance(self, counts: dict[int, int]) -> None:
        self._settle_all()
        self.generation += 1
        for layer, target in counts.items():
            state = self._layers[layer]
            if target < state.owned.shape[0]:
                self._refuse_if_pinned(state, target)
        if sum(counts.values()) > self.max_slots:
            raise SlackTierError(ErrorKind.CAPACITY, f"{sum(counts.values())} slots asked, {self.max_slots} reserved",
                                 fix="reserve a larger max_cache_rows")
        # Shrink first: give up free slots, then unreferenced rows, then referenced ones; never pinned.
        for layer, target in counts.items():
            state = self._layers[layer]
            owned = state.owned
            drop = owned.shape[0] - target
            if drop <= 0:
                continue
            occupied = self.slot_layer[owned] >= 0
            pinned = self._pinned_mask(owned)
            referenced = self.ref[owned] != 0
            order = np.lexsort((referenced, occupied, pinned))   # last key sorts first
            release = owned[order[:drop]]
            K.forget_slots(release, state.directory, self.slot_layer, self.slot_row, self.state, self.ref)
            self.owner[release] = -1
            keep = np.sort(owned[order[drop:]]).astype(np.int32)
            state.owned = keep
            state.lstate[K.HAND] = 0
        free = np.flatnonzero(self.owner < 0).astype(np.int32)
        taken = 0
        for layer, target in counts.items():
            state = self._layers[layer]
            grow = target - state.owned.shape[0]
            if grow <= 0:
                continue
            new = free[taken:taken + grow]
            taken += grow
            self.owner[new] = state.key
            self.slot_layer[new] = -1
            self.slot_row[new] = -1
            self.state[new] &= ~np.int64(K.FILL)
            self.ref[new] = 0
            state.owned = np.concatenate([state.owned, new]).astype(np.int32)
            state.lstate[K.HAND] = 0
        for state in self._layers.values():
            state.lstate[K.PINNED] = int(np.count_nonzero(self._pinned_mask(state.owned)))
            entries = D.entries_for(state.owned.shape[0])
            if entries != state.directory.shape[0]:   # the slot count left the range its size serves
                available_bytes(torch.device("cpu")).refuse(8 * entries, f"layer {state.layer}'s directory")
                directory = np.full(entries, D.EMPTY, dtype=np.int64)
                D.rebuild(directory, state.owned, state.key, self.slot_layer, self.slot_row)
                state.directory = directory
                self._check_huge_pages(state)
            self._size_sketch(state)

    # ---- steps --------------------------------------------------------------------------------------
    def settle(self, state: CacheLayer) -> None:
        """Apply the pins `resolve` left pending on `state`'s slots (its last pass's hits before any victim search).

        Called before anything reads this layer's pins or searches its slots for a victim within the step;
        other layers' passes never touch these slots (each layer owns its own), so theirs can wait.
        """
        if state.pending is not None:
            kind, idx, n = state.pending
            state.pending = None
            settle_layer(kind, idx, n, self.state, self.step, state.lstate)

    def _settle_all(self) -> None:
        for state in self._layers.values():
            self.settle(state)

    def release_pins(self) -> None:
        """End the current step: every pin is released (one increment), pinned counts reset.

        Pins still pending are dropped, not applied: they would be released now, and the pass stored
        their hits' reference bits already."""
        self.step += 1
        for state in self._layers.values():
            state.pending = None
            state.lstate[K.PINNED] = 0

    def evict_ahead(self, layer: int, rows: int) -> int:
        """Between steps: empty the next `rows` slots `layer`'s CLOCK will take (at most an eighth of its slots,
        `kernels.AHEAD_SHARE`); returns the rows evicted (`kernels.evict_ahead`).

        The next step's misses then take those slots without reading a victim's directory entry, work
        that otherwise sits in `begin_step`. The policy differs from CLOCK in one way: a row freed here and
        looked up in the next step misses, where CLOCK would have kept it (and then evicted the next one)."""
        state = self.layer(layer)
        self.settle(state)
        return int(K.evict_ahead(int(rows), state.directory, state.owned, state.lstate, self.slot_layer, self.slot_row,
                                 self.state, self.ref, self.step))

    def lookup(self, layer: int, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Pin hits and claim slots for misses of local `rows` [n] -> (slots [n] int32, hit [n] bool).

        A claimed slot (hit False, slot >= 0) is in the directory already; its
        bytes are the caller's to write with `write` before the row is read.
        Slot -1: every slot of the layer is pinned by this step.
        """
        state = self.layer(layer)
        rows = np.ascontiguousarray(rows, dtype=np.int64)
        if rows.size and (rows.min() < 0 or rows.max() >= state.rows):
            raise SlackTierError(ErrorKind.BAD_INPUT, f"rows outside 0..{state.rows - 1}",
                                 fix="pass local rows of the layer's shard", layer=layer)
        out_slot = np.empty(rows.shape[0], dtype=np.int32)
        out_hit = np.empty(rows.shape[0], dtype=np.uint8)
        self.settle(state)
        K.admit_rows(state.key, rows, state.directory, state.owned, state.lstate, self.slot_layer, self.slot_row,
                     self.state, self.ref, self.step, out_slot, out_hit)
        return out_slot, out_hit.astype(bool)

    def step_table(self) -> StepTable:
        """The stamped hash table a step's passes share (its pages and slot-less rows)."""
        return self._table

    def compiled_pass(self, layers: Sequence[PassLayer], *, columns: int, owned_only: bool = False,
                      lossy: bool = False, pad_id: int = 0, pool_base: int = 0,
                      pool_buffers: int = 0) -> CompiledPass:
        """The compiled pass over `layers` (window order) of this cache, as it is now (`cache.compiled`); each
        layer's submit is named with `CompiledPass.set_submit_fn`."""
        return CompiledPass(self, layers, columns=columns, owned_only=owned_only, lossy=lossy, pad_id=pad_id,
                            pool_base=pool_base, pool_buffers=pool_buffers)

    def resolve(self, layer: int, ids: np.ndarray, geometry: LayerGeometry, scratch: PassScratch, *,
                buf_base: int = 0, lossy: bool = False, owned_only: bool = False, pad_id: int = 0,
                heat: np.ndarray | None = None) -> PassResult:
        """Run `layer`'s directory pass over this step's ids (global row ids), outputs in `scratch`.

        ids: [N] or [T, C] int64 (lookup i = ids[i // C, i % C]). The compiled pass of `begin_step`, over
        one layer, its pages left for the caller to read.

        pad_id (negative; 0 = none): ids equal to it are padding, zero rows that touch nothing.

        Hits are pinned, misses claim a slot to fill (CLOCK) and a page buffer numbered from `buf_base`;
        lossy: rows outside geometry.seen come out as KIND_ZERO; owned_only: ids outside the geometry's
        rows are KIND_FOREIGN instead of an error; heat: [T] uint8 heat codes per token (T = 1 for [N] ids;
        `directory.token_heat`), or None for plain CLOCK: the reference count a row a token misses enters its
        slot with, and what its hits add (admission). On an id
        outside the table (result.bad_index >= 0)
        the pass stops there; what it claimed so far stays claimed (forget it, or end the step).
        """
        ids = np.asarray(ids)
        if ids.dtype != _INT64 or ids.ndim not in (1, 2):
            raise SlackTierError(ErrorKind.BAD_INPUT, f"ids are {ids.dtype} {ids.shape}, want [N] or [T, C] int64",
                                 layer=layer, fix="pass one layer's lookups as an int64 array")
        if ids.size > scratch.capacity:
            raise SlackTierError(ErrorKind.CAPACITY, f"{ids.size} lookups, scratch holds {scratch.capacity}",
                                 layer=layer, fix="allocate PassScratch for the largest step")
        rows = ids.reshape(1, -1) if ids.ndim == 1 else ids
        step = np.ascontiguousarray(rows).reshape(rows.shape[0], 1, rows.shape[1])
        cp = self.compiled_pass([PassLayer(layer, 0, geometry, scratch)], columns=step.shape[2],
                                owned_only=owned_only, lossy=lossy, pad_id=pad_id)
        cp.start(step.shape[0], buf_base)
        codes = checked_heat(heat, step.shape[0])
        cp.run(step, 0, codes)
        ((result, _, _),) = cp.results(0, 0)
        self.count_lookups(layer, scratch, codes, step.shape[2])   # what the engine's end_step does
        return result

    def forget(self, layer: int, slots: np.ndarray) -> None:
        """Drop the rows held in `slots` of `layer` (a fill that never arrived); slots < 0 are skipped."""
        state = self.layer(layer)
        self.settle(state)
        K.forget_slots(np.ascontiguousarray(slots, dtype=np.int32), state.directory, self.slot_layer,
                       self.slot_row, self.state, self.ref)

    def write(self, slots: np.ndarray, raw: torch.Tensor) -> None:
        """Store raw rows [n, 264] uint8 into `slots` [n] (the row's two arrays)."""
        idx = torch.as_tensor(np.asarray(slots, dtype=np.int64), device=self.device)
        raw = raw.to(self.device)
        self.weight[idx] = raw[:, :ROW_VALUES]
        self.scale[idx] = raw[:, ROW_VALUES:ROW_BYTES]

    def read(self, slots: np.ndarray) -> torch.Tensor:
        """Raw rows [n, 264] uint8 held in `slots`."""
        idx = torch.as_tensor(np.asarray(slots, dtype=np.int64), device=self.device)
        return torch.cat([self.weight[idx], self.scale[idx]], dim=1)

    # ---- inspection ---------------------------------------------------------------------------------
    def cached(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """(local rows [n] int64, slots [n] int32) of every row `layer` holds now, in row order."""
        return D.pairs(self.layer(layer).directory)

    def slot_of(self, layer: int, rows: np.ndarray) -> np.ndarray:
        """The slot holding each of `layer`'s local `rows` [n] ([n] int64, -1 where not cached)."""
        rows = np.ascontiguousarray(rows, dtype=np.int64).reshape(-1)
        out = np.empty(rows.shape[0], dtype=np.int64)
        D.find_many(self.layer(layer).directory, rows, out)
        return out

    def directory_bytes(self) -> int:
        """Host bytes of every layer's directory."""
        return sum(state.directory.nbytes for state in self._layers.values())

    def owned_slots(self, layer: int) -> int:
        """Slots `layer` owns now."""
        return int(self.layer(layer).owned.shape[0])

    def pinned(self) -> np.ndarray:
        """Slots pinned by the current step [n] int64."""
        self._settle_all()
        return np.flatnonzero(self._pinned_mask(np.arange(self.max_slots)))

    def _pinned_mask(self, slots: np.ndarray) -> np.ndarray:
        return (self.state[slots] >> 1) == self.step

    def evictions(self, layer: int) -> int:
        """Rows of `layer` evicted so far."""
        return int(self.layer(layer).lstate[K.EVICTIONS])

    def verify(self) -> list[str]:
        """Check every invariant; return the violations found (empty when consistent)."""
        problems: list[str] = []
        self._settle_all()
        keys = {s.key: s for s in self._layers.values()}
        seen_owner = np.full(self.max_slots, -1, dtype=np.int64)
        for state in self._layers.values():
            if np.unique(state.owned).shape[0] != state.owned.shape[0]:
                problems.append(f"layer {state.layer} owns a slot twice")
            if np.any(seen_owner[state.owned] >= 0):
                problems.append(f"layer {state.layer} owns a slot another layer owns")
            seen_owner[state.owned] = state.key
            if np.any(self.owner[state.owned] != state.key):
                problems.append(f"owner array disagrees with layer {state.layer}'s slot list")
            rows, slots = D.pairs(state.directory)
            if np.unique(rows).shape[0] != rows.shape[0]:
                problems.append(f"layer {state.layer}: a row is in the directory twice")
            if np.any(self.slot_of(state.layer, rows) != slots):
                problems.append(f"layer {state.layer}: a row its directory holds is not found by a lookup")
            if rows.shape[0] > D.LOAD * state.directory.shape[0]:
                problems.append(f"layer {state.layer}: directory of {state.directory.shape[0]} entries holds "
                                f"{rows.shape[0]} rows")
            if np.unique(slots).shape[0] != slots.shape[0]:
                problems.append(f"layer {state.layer}: two rows map to one slot")
            if np.any(self.slot_layer[slots] != state.key) or np.any(self.slot_row[slots] != rows):
                problems.append(f"layer {state.layer}: directory and slot back-pointers disagree")
            if np.any(self.owner[slots] != state.key):
                problems.append(f"layer {state.layer}: a row sits in a slot the layer does not own")
            pinned = int(np.count_nonzero(self._pinned_mask(state.owned)))
            if pinned != int(state.lstate[K.PINNED]):
                problems.append(f"layer {state.layer}: pinned count {state.lstate[K.PINNED]} != {pinned}")
        if np.count_nonzero(self.owner >= 0) > self.slots:
            problems.append(f"{np.count_nonzero(self.owner >= 0)} slots owned, budget {self.slots}")
        used = np.flatnonzero(self.slot_layer >= 0)
        orphan = ~np.isin(self.slot_layer[used], np.array(list(keys), dtype=np.int32))
        if np.any(orphan):
            problems.append(f"slots {used[orphan][:5]} hold rows of a removed layer")
        for key, state in keys.items():
            mine = used[self.slot_layer[used] == key]
            bad = self.slot_of(state.layer, self.slot_row[mine]) != mine
            if np.any(bad):
                problems.append(f"layer {state.layer}: slots {mine[bad][:5]} claim rows whose directory "
                                f"entry points elsewhere")
        return problems
