"""The cache's compiled pass: every layer's directory pass of a step, and its page submission, in one call.

This is the only way a step's lookups are resolved: the step engine's
`begin_step` runs it over all its layers, and `RowCache.resolve` over one.
`RowCache.compiled_pass(layers, ...)` builds a `CompiledPass` for a list of
layers in window order; one call, `run_layers(ids, arr)`, then runs their
passes (`cache.directory.resolve_layer`) and, right after each pass, hands
that layer's pages to the C engine client of its device queue
(`st_eng_submit`, called by address, see `store.uring_queue`; an emulated
device's lane has a submit of the same signature, `store.emulated`, named per
layer), so layer 1's reads are in flight while layer 14 is resolved, with no
Python in between.

The pass's array (`CompiledPass.arr`, int64) describes the step once: the
header holds the cache's slot arrays, the step hash table and what changes per
step (cache step, stamp, page pool); each layer's record holds the addresses
and lengths of its directory, owned slots, CLOCK state, geometry and scratch,
and its C engine handle. The compiled code rebuilds arrays from those
addresses (`numba.carray`), so the call unboxes two arrays instead of 33 per
layer. Each pass writes its counts (PassResult's fields), its C job and three
clock readings into its row of `CompiledPass.out`, which `results` reads with
one `tolist()` for all layers.

Stops: `run` starts at layer `start` and returns after the last layer
(stop = layers), or early at layer i (stop = i, its pass done) with
- WHY_BAD: an id outside the rows this process serves, neither the pad id, nor outside the whole layer
  (a zero row where the geometry knows the layer's end), nor another rank's row under owned_only
  (the pass stopped there);
- WHY_SUBMIT: the layer has pages and no C engine to take them (a DRAM or
  remote source, a thread-engine disk, a closed or busy one), or the C engine
  refused them. The caller submits them through the source and runs again
  from layer i + 1.

Safety: the array holds raw addresses. `CompiledPass` keeps a reference to
every array it names and checks, once, every length the compiled code trusts;
`run` checks the ids. It is stale (`stale()`) once the cache re-partitions
slots, rebuilds a directory, or adds or drops a layer (`RowCache.generation`);
its owner builds a new one then, and whenever its own layers, scratch, pool or
settings change. A larger step than any before grows the step hash table, and
`start` names the new one. The C engine handles are set per
step under the client's lock (`store.disk.NativeLane`), held around the call,
so a concurrent submit or close cannot interleave with it. The jobs the call
queued are in the C engine's own list from then on; the step engine books
them as tickets of their sources later (at the step's first gather, each
under its client's lock again), off the step's critical path.

Worked example: two layers on io_uring disks, a fresh step: one call resolves
layer 1, submits its 170 pages, resolves layer 14, submits its 160, returns
stop = 2; at the first gather the engine books the two jobs as tickets.
Layer 14 on DRAM instead: the call returns stop = 1, WHY_SUBMIT; the engine
submits layer 14's pages to the DRAM source and is done (there is no layer
after it).
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
from llvmlite import ir
from numba import carray, njit, types
from numba.extending import intrinsic

from slacktier.cache.directory import (N_COUNTS, Count, NO_SEEN, LayerGeometry, PassResult, PassScratch,
                                       resolve_layer)
from slacktier.errors import ErrorKind, SlackTierError
from slacktier.native import submit_llvm_type

_INT64 = np.dtype(np.int64)

# header fields of the plan
H_LAYERS = 0      # layers in window order
H_START = 1       # in: the first layer this call resolves
H_STOP = 2        # out: the layer it stopped at (its pass done), or H_LAYERS when it ran them all
H_WHY = 3         # out: WHY_* for a stop before the end
H_BUF_BASE = 4    # in/out: the first page buffer the next layer's pages take
H_SLOTS = 5       # the cache's slot arrays: length, then addresses
H_SLOT_LAYER = 6
H_SLOT_ROW = 7
H_STATE = 8
H_REF = 9
H_FILL_MISS = 10
H_STEP = 11       # per step: the cache's step
H_HTAB = 12       # the step hash table [H_HROWS, 3] int64
H_HROWS = 13
H_STAMP = 14      # per step: layer i's pass uses stamp + i
H_HBITS = 15      # per step
H_OWNED_ONLY = 16
H_LOSSY = 17
H_PAD_ID = 18
H_POOL_ADDR = 19  # the page pool's first buffer and buffer count (the engine's PageBufferPool)
H_POOL_CAP = 20
H_CLOCK_FN = 21   # address of clock_gettime
H_TS = 22         # two words: clock_gettime's timespec
H_OUT = 24        # the results [layers, OUT] int64 (CompiledPass.out)
HEADER = 25

# a layer's record, at HEADER + i * RECORD
R_AXIS = 0         # its index in the ids' layer axis
R_ROW_START = 1
R_ROWS = 2
R_RANK_STARTS = 3  # address; R_RANKS + 1 entries
R_RANKS = 4
R_RANK_REGION = 5
R_SEEN = 6         # address and bytes of the seen bitmap (a 1-byte dummy when not lossy)
R_SEEN_LEN = 7
R_KEY = 8
R_DIRECTORY = 9
R_OWNED = 10
R_OWNED_LEN = 11
R_LSTATE = 12
R_CAPACITY = 13    # the scratch arrays' length
R_DESC_KIND = 14
R_DESC_IDX = 15
R_MISS_BUF = 16
R_MISS_INPAGE = 17
R_MISS_SLOT = 18
R_MISS_ROW = 19
R_PAGE_REGION = 20
R_PAGE_NO = 21
R_PAGE_BUF = 22
R_ENGINE = 23      # per step: the C engine handle its pages go to, 0 = Python submits them
R_ERR = 24         # st_eng_submit's error word
R_OWN_POS = 25     # the pass's list of in-table lookups (PassScratch.own_pos, own_row)
R_OWN_ROW = 26
R_DIR_LEN = 27     # the directory's entries (cache.rowdir)
R_SUBMIT_FN = 28   # address of the submit its pages go to, st_eng_submit's signature (0: Python submits)
R_TABLE_END = 29   # the whole layer's ids are [0, table_end), 0: not known (LayerGeometry.table_end)
RECORD = 32

# a layer's row of results (CompiledPass.out), read by Python with one tolist() for all layers
O_JOB = N_COUNTS       # after the pass's counts (directory.Count, PassResult's fields): its pages' C job, 0 none
O_T0 = N_COUNTS + 1    # CLOCK_MONOTONIC ns (perf_counter_ns's clock) before the pass, after it, after submitting
O_T1 = N_COUNTS + 2
O_T2 = N_COUNTS + 3
OUT = N_COUNTS + 4

WHY_DONE = 0
WHY_BAD = 1
WHY_SUBMIT = 2

_CLOCK_MONOTONIC = 1


def _pointer_from(nbtype):
    @intrinsic
    def as_pointer(typingctx, addr):
        """A typed pointer from an int64 address (what `numba.carray` takes)."""
        sig = types.CPointer(nbtype)(types.int64)

        def codegen(context, builder, signature, args):
            return builder.inttoptr(args[0], context.get_value_type(signature.return_type))

        return sig, codegen

    return as_pointer


_p_i8 = _pointer_from(types.int8)
_p_u8 = _pointer_from(types.uint8)
_p_i32 = _pointer_from(types.int32)
_p_i64 = _pointer_from(types.int64)


@intrinsic
def _clock_ns(typingctx, fn, ts):
    """clock_gettime(CLOCK_MONOTONIC) through its address `fn`, into the two words at `ts`; returns ns."""
    sig = types.int64(types.int64, types.int64)

    def codegen(context, builder, signature, args):
        i32, i64 = ir.IntType(32), ir.IntType(64)
        fnty = ir.FunctionType(i32, [i32, i64.as_pointer()])
        call = builder.inttoptr(args[0], fnty.as_pointer())
        words = builder.inttoptr(args[1], i64.as_pointer())
        builder.call(call, [ir.Constant(i32, _CLOCK_MONOTONIC), words])
        sec = builder.load(words)
        nsec = builder.load(builder.gep(words, [ir.Constant(i64, 1)]))
        return builder.add(builder.mul(sec, ir.Constant(i64, 1_000_000_000)), nsec)

    return sig, codegen


@intrinsic
def _submit_at(typingctx, fn, engine, n, region, page, buffer, pool_addr, pool_buffers, err):
    """The submit at address `fn` (`slacktier.native.SUBMIT`'s signature); the job handle, 0 when refused (see err)."""
    sig = types.int64(*([types.int64] * 9))

    def codegen(context, builder, signature, args):
        fnty = submit_llvm_type()
        call = builder.inttoptr(args[0], fnty.as_pointer())
        rest = [builder.trunc(a, t) if t.width < 64 else a for a, t in zip(args[1:], fnty.args)]
        return builder.call(call, rest)

    return sig, codegen


@njit(nogil=True, cache=True)
def run_layers(ids, plan):
    """Resolve layers plan[H_START].. of the step `ids` [T, L, C] int64 and submit their pages (module doc)."""
    n_layers = plan[H_LAYERS]
    n_slots = plan[H_SLOTS]
    slot_layer = carray(_p_i32(plan[H_SLOT_LAYER]), n_slots)
    slot_row = carray(_p_i64(plan[H_SLOT_ROW]), n_slots)
    state = carray(_p_i64(plan[H_STATE]), n_slots)
    ref = carray(_p_u8(plan[H_REF]), n_slots)
    fill_miss = carray(_p_i32(plan[H_FILL_MISS]), n_slots)
    htab = carray(_p_i64(plan[H_HTAB]), (plan[H_HROWS], 3))
    step = plan[H_STEP]
    hbits = plan[H_HBITS]
    owned_only = plan[H_OWNED_ONLY] != 0
    lossy = plan[H_LOSSY] != 0
    pad_id = plan[H_PAD_ID]
    clock_fn = plan[H_CLOCK_FN]
    base = plan.ctypes.data
    ts = base + 8 * H_TS
    out = carray(_p_i64(plan[H_OUT]), (n_layers, OUT))
    li = plan[H_START]
    buf_base = plan[H_BUF_BASE]   # the step's first page buffer, or where the last call stopped
    while li < n_layers:
        r = HEADER + li * RECORD
        res = out[li]
        res[O_T0] = _clock_ns(clock_fn, ts)
        cap = plan[r + R_CAPACITY]
        ranks = plan[r + R_RANKS]
        counts = res[:N_COUNTS]
        status = resolve_layer(
            ids[:, plan[r + R_AXIS], :], plan[r + R_ROW_START], plan[r + R_ROWS], owned_only,
            carray(_p_i64(plan[r + R_RANK_STARTS]), ranks + 1), carray(_p_i32(plan[r + R_RANK_REGION]), ranks),
            lossy, carray(_p_u8(plan[r + R_SEEN]), plan[r + R_SEEN_LEN]), plan[r + R_KEY],
            carray(_p_i64(plan[r + R_DIRECTORY]), plan[r + R_DIR_LEN]),
            carray(_p_i32(plan[r + R_OWNED]), plan[r + R_OWNED_LEN]), carray(_p_i64(plan[r + R_LSTATE]), 4),
            slot_layer, slot_row, state, ref, fill_miss, step, htab, plan[H_STAMP] + li, hbits,
            carray(_p_i8(plan[r + R_DESC_KIND]), cap), carray(_p_i64(plan[r + R_DESC_IDX]), cap),
            carray(_p_i32(plan[r + R_MISS_BUF]), cap), carray(_p_i32(plan[r + R_MISS_INPAGE]), cap),
            carray(_p_i32(plan[r + R_MISS_SLOT]), cap), carray(_p_i64(plan[r + R_MISS_ROW]), cap),
            carray(_p_i32(plan[r + R_PAGE_REGION]), cap), carray(_p_i64(plan[r + R_PAGE_NO]), cap),
            carray(_p_i32(plan[r + R_PAGE_BUF]), cap), carray(_p_i32(plan[r + R_OWN_POS]), cap),
            carray(_p_i64(plan[r + R_OWN_ROW]), cap), buf_base, pad_id, plan[r + R_TABLE_END], counts)
        t1 = _clock_ns(clock_fn, ts)
        res[O_T1] = t1
        res[O_T2] = t1
        res[O_JOB] = 0
        pages = counts[Count.PAGES]
        if status != 0:
            plan[H_STOP] = li
            plan[H_WHY] = WHY_BAD
            plan[H_BUF_BASE] = buf_base + pages
            return
        if pages > 0:
            engine = plan[r + R_ENGINE]
            fn = plan[r + R_SUBMIT_FN]
            job = 0
            if engine != 0 and fn != 0:
                job = _submit_at(fn, engine, pages, plan[r + R_PAGE_REGION], plan[r + R_PAGE_NO],
                                 plan[r + R_PAGE_BUF], plan[H_POOL_ADDR], plan[H_POOL_CAP], base + 8 * (r + R_ERR))
            if job == 0:
                plan[H_STOP] = li
                plan[H_WHY] = WHY_SUBMIT
                plan[H_BUF_BASE] = buf_base + pages
                return
            res[O_JOB] = job
            res[O_T2] = _clock_ns(clock_fn, ts)
        buf_base += pages
        li += 1
    plan[H_STOP] = n_layers
    plan[H_WHY] = WHY_DONE
    plan[H_BUF_BASE] = buf_base


def _address(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


def clock_gettime_address() -> int:
    """Address of libc's clock_gettime (the clock Python's perf_counter_ns reads on Linux)."""
    return ctypes.cast(ctypes.CDLL(None).clock_gettime, ctypes.c_void_p).value


_CLOCK_FN = clock_gettime_address()


class _Cache(Protocol):
    """What a compiled pass reads of its `cache.rowcache.RowCache` (which builds it: no import back)."""

    generation: int
    step: int
    slot_layer: np.ndarray
    slot_row: np.ndarray
    state: np.ndarray
    ref: np.ndarray
    fill_miss: np.ndarray

    def layer(self, layer: int): ...

    def step_table(self): ...

    def settle(self, state) -> None: ...


@dataclass(frozen=True)
class PassLayer:
    """One layer of a compiled pass: where its lookups sit in the step's ids, its rows, and its outputs."""

    layer: int
    axis: int                  # its index in the ids' layer axis
    geometry: LayerGeometry
    scratch: PassScratch


class CompiledPass:
    """begin_step's passes over a fixed list of layers (window order), as one compiled call: built by
    `RowCache.compiled_pass`, valid while `stale()` is False (module doc).

    A step: `start(tokens)`, then `run(ids)` and, for each stop, `results(...)`; `set_engine(i, handle)`
    names the C engine client that takes layer i's pages (0: the caller submits them), per step, under
    that client's lock.
    """

    def __init__(self, cache: _Cache, layers: Sequence[PassLayer], *, columns: int, owned_only: bool,
                 lossy: bool, pad_id: int, pool_base: int, pool_buffers: int) -> None:
        n = len(layers)
        self._cache = cache
        self.layers = tuple(layers)
        self.columns = int(columns)
        self.ids_shape = (n, self.columns)   # ids[T, L, C] of the steps it serves, less T
        self.capacity = min((pl.scratch.capacity for pl in layers), default=0)   # lookups per layer, at most
        self.generation = cache.generation
        self._steps = cache.step_table()
        self.htab = self._steps.table
        self.arr = a = np.zeros(HEADER + n * RECORD, dtype=np.int64)
        # Per-step fields go in and out through a memoryview, not numpy's scalar indexing: with the CPU caches
        # cold (as after the model's forward) a memoryview's reads and writes cost less.
        self._words = memoryview(a)
        self.out = np.zeros((n, OUT), dtype=np.int64)   # per layer: the pass's counts, job, clock readings
        self._keep: list[np.ndarray] = [self.htab, self.out]
        self.states = [cache.layer(pl.layer) for pl in layers]
        a[H_LAYERS] = n
        a[H_OUT] = _address(self.out)
        a[H_POOL_ADDR] = pool_base
        a[H_POOL_CAP] = pool_buffers
        a[H_CLOCK_FN] = _CLOCK_FN
        a[H_OWNED_ONLY] = bool(owned_only)
        a[H_LOSSY] = bool(lossy)
        a[H_PAD_ID] = int(pad_id)
        self._put(H_SLOT_LAYER, cache.slot_layer, H_SLOTS)
        for at, arr in ((H_SLOT_ROW, cache.slot_row), (H_STATE, cache.state), (H_REF, cache.ref),
                        (H_FILL_MISS, cache.fill_miss)):
            _same_length(arr, cache.slot_layer, "the cache's slot arrays")
            self._put(at, arr)
        self._put(H_HTAB, self.htab, H_HROWS)
        # The compiled code has no bounds checks: everything it indexes is checked here, once, or per run.
        for i, (pl, state) in enumerate(zip(layers, self.states)):
            geo, sc = pl.geometry, pl.scratch
            if geo.rows != state.rows:
                raise SlackTierError(ErrorKind.BAD_INPUT, f"geometry of {geo.rows} rows, directory of {state.rows}",
                                     layer=pl.layer, fix="re-add the layer with the table's row count")
            if lossy and geo.seen is None:
                raise SlackTierError(ErrorKind.BAD_INPUT, "lossy pass without a seen-set", layer=pl.layer,
                                     fix="give the layer's geometry a seen bitmap, or turn lossy off")
            if not 0 <= pl.axis < n:
                raise SlackTierError(ErrorKind.BAD_INPUT, f"layer axis {pl.axis} outside 0..{n - 1}", layer=pl.layer,
                                     fix="give each layer its index in the ids' layer axis")
            r = HEADER + i * RECORD
            a[r + R_AXIS] = pl.axis
            a[r + R_ROW_START] = geo.row_start
            a[r + R_ROWS] = geo.rows
            a[r + R_TABLE_END] = geo.table_end
            self._put(r + R_RANK_STARTS, geo.rank_starts)
            self._put(r + R_RANK_REGION, geo.rank_region, r + R_RANKS)
            self._put(r + R_SEEN, geo.seen if geo.seen is not None else NO_SEEN, r + R_SEEN_LEN)
            a[r + R_KEY] = state.key
            self._put(r + R_DIRECTORY, state.directory, r + R_DIR_LEN)
            self._put(r + R_OWNED, state.owned, r + R_OWNED_LEN)
            self._put(r + R_LSTATE, state.lstate)
            self._put(r + R_DESC_KIND, sc.desc_kind, r + R_CAPACITY)
            for at, arr in ((R_DESC_IDX, sc.desc_idx), (R_MISS_BUF, sc.miss_buf), (R_MISS_INPAGE, sc.miss_inpage),
                            (R_MISS_SLOT, sc.miss_slot), (R_MISS_ROW, sc.miss_row), (R_PAGE_REGION, sc.page_region),
                            (R_PAGE_NO, sc.page_no), (R_PAGE_BUF, sc.page_buf), (R_OWN_POS, sc.own_pos),
                            (R_OWN_ROW, sc.own_row)):
                _same_length(arr, sc.desc_kind, "a pass scratch's arrays")
                self._put(r + at, arr)

    def _put(self, at: int, a: np.ndarray, length_at: int | None = None) -> None:
        """Name array `a` (C-contiguous) at field `at`, its length at `length_at`; kept alive here."""
        if not a.flags.c_contiguous:
            raise ValueError("the compiled pass names C-contiguous arrays only")
        self._keep.append(a)
        self.arr[at] = _address(a)
        if length_at is not None:
            self.arr[length_at] = a.shape[0]

    def stale(self) -> bool:
        """True once the cache replaced an array this pass names (a new one must be built)."""
        return self.generation != self._cache.generation

    def start(self, tokens: int, buf_base: int = 0) -> None:
        """Begin a step of `tokens` tokens: stamps for its passes, the cache's step, pins left pending."""
        cache = self._cache
        n = len(self.layers)
        passes = max(1, n)   # one stamp per layer's pass
        bits = self._steps.prepare(tokens * self.columns, passes)
        if self._steps.table is not self.htab:   # grown for a larger step than any before
            self.htab = self._steps.table
            self._put(H_HTAB, self.htab, H_HROWS)
        w = self._words
        w[H_STEP] = cache.step
        w[H_STAMP] = self._steps.stamp - passes + 1
        w[H_HBITS] = bits
        w[H_BUF_BASE] = buf_base
        for state in self.states:   # pins an earlier pass left pending (none between steps)
            if state.pending is not None:
                cache.settle(state)

    def set_engine(self, i: int, handle: int) -> None:
        """The C engine client taking layer i's pages this step (0: the caller submits them)."""
        self._words[HEADER + i * RECORD + R_ENGINE] = handle

    def set_submit_fn(self, i: int, address: int) -> None:
        """The submit (st_eng_submit's signature) that takes layer i's pages: its NativeLane's `submit_address`
        (st_eng_submit, or an emulated device's lane, store.emulated); 0, the default, leaves them to Python."""
        self.arr[HEADER + i * RECORD + R_SUBMIT_FN] = address

    def run(self, ids: np.ndarray, start: int = 0) -> tuple[int, int]:
        """Resolve layers start.. of the step `ids` [T, L, C] int64 (C-contiguous); (stop, WHY_*) (module doc)."""
        if (type(ids) is not np.ndarray or ids.dtype is not _INT64 or ids.shape[1:] != self.ids_shape
                or ids.shape[0] * self.columns > self.capacity or not ids.flags.c_contiguous):
            raise SlackTierError(ErrorKind.BAD_INPUT, f"ids {getattr(ids, 'dtype', type(ids))} "
                                 f"{getattr(ids, 'shape', '')} for a pass of [T <= "
                                 f"{self.capacity // max(self.columns, 1)}, {self.ids_shape[0]}, {self.columns}] "
                                 "C-contiguous int64", fix="pass the step's ids as the pass was built for")
        w = self._words
        w[H_START] = start
        run_layers(ids, self.arr)
        return w[H_STOP], w[H_WHY]

    def results(self, start: int, stop: int) -> list[tuple[PassResult, int, list[int]]]:
        """(PassResult, C job or 0, [t0, t1, t2] ns) of layers start .. stop (stop included when < layers);
        records the hits whose pins a pass left pending with their cache layer."""
        rows = self.out.tolist()   # one call for all layers
        got = []
        for i in range(start, min(stop + 1, len(self.layers))):
            row = rows[i]
            res = tuple.__new__(PassResult, row[:N_COUNTS])   # counts are PassResult's fields, in order
            if res.pending:
                sc = self.layers[i].scratch
                self.states[i].pending = (sc.desc_kind, sc.desc_idx, res.pending)
            got.append((res, row[O_JOB], row[O_T0:]))
        return got


def _same_length(a: np.ndarray, like: np.ndarray, what: str) -> None:
    if a.shape[0] != like.shape[0]:
        raise SlackTierError(ErrorKind.BAD_INPUT, f"{what} differ in length ({a.shape[0]} vs {like.shape[0]})",
                             fix="rebuild the cache and its scratch together")
