"""begin_step's one compiled entry: every layer's directory pass, and its page submission, in one call.

Per layer, the engine used to cross from Python into compiled code and back
twice: once for the directory pass (numba unboxing its 33 arguments), once to
hand the page list to the source (`DiskSource.submit`'s Python around one C
call). Here one call, `run_layers(ids, plan)`, runs the passes of all layers
in window order, and right after each pass hands that layer's pages to the
io_uring C engine of its disk source (`st_eng_submit`, called by address), so
layer 1's reads are in flight while layer 14 is resolved, with no Python in
between.

The plan (`StepPlan.arr`, int64) describes the step once: the header holds the
cache's slot arrays, the step hash table and what changes per step (cache
step, stamp, page pool); each layer's record holds the addresses and lengths
of its directory, owned slots, CLOCK state, geometry and scratch, and its C
engine handle. The compiled code rebuilds arrays from those addresses
(`numba.carray`), so the call unboxes two arrays instead of 33 per layer. Each
pass writes its counts (PassResult's fields), its C job and three clock
readings into its row of `StepPlan.out`, which Python reads with one
`tolist()` for all layers.

Cost (BENCHMARKS.md, issue 14, `bench_entry_ab.py`, with the pass that walks
a list of its in-table lookups): begin_step 0.75x the per-layer path's on
fresh steps, level (0.99x) on warm ones, where the Python around the call
(~41 us) costs more than the per-layer path's (~32 us).

Stops: `run_layers` starts at plan[H_START] and returns after the last layer
(H_STOP = layers), or early at layer i (H_STOP = i, its pass done) when
- WHY_BAD: an id outside the table (the pass stopped there);
- WHY_SUBMIT: the layer has pages and no C engine to take them (a DRAM or
  remote source, a thread-engine disk, a closed or busy one), or the C engine
  refused them. Python submits them the usual way (`LayerReads.submit`, which
  raises the error, if any) and calls again from layer i + 1.

Safety: the plan holds raw addresses. `StepPlan` keeps a reference to every
array it names, and the engine builds a new plan whenever anything it names
may have been replaced: the engine's tables, scratch or settings change
(`StepEngine._plan = None`), the cache re-partitions slots or adds or drops a
layer (`RowCache.generation`), or the step hash table grows. The C engine
handles are read per step under the source's lock (`store.disk.NativeLane`),
which is held until the jobs are booked as tickets, so a concurrent submit or
close cannot interleave.

Worked example: two layers on io_uring disks, a fresh step: one call resolves
layer 1, submits its 170 pages, resolves layer 14, submits its 160, returns
H_STOP = 2; Python books the two jobs as tickets. Layer 14 on DRAM instead:
the call returns H_STOP = 1, WHY_SUBMIT; Python submits layer 14's pages to
the DRAM source and is done (there is no layer after it).
"""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING

import numpy as np
from llvmlite import ir
from numba import carray, njit, types
from numba.extending import intrinsic

from slacktier.cache.directory import C_PAGES, N_COUNTS, resolve_layer

if TYPE_CHECKING:
    from slacktier.store.base import PageBufferPool

# header fields of the plan
H_LAYERS = 0      # layers in window order
H_START = 1       # in: the first layer this call resolves
H_STOP = 2        # out: the layer it stopped at (its pass done), or H_LAYERS when it ran them all
H_WHY = 3         # out: WHY_* for a stop before the end
H_BUF_BASE = 4    # out: the first page buffer the next layer's pages take (in, when H_START > 0; else 0)
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
H_POOL_ADDR = 19  # the page pool's first buffer and buffer count (StepPlan.pool)
H_POOL_CAP = 20
H_SUBMIT_FN = 21  # address of st_eng_submit (0: no helper, every layer submits from Python)
H_CLOCK_FN = 22   # address of clock_gettime
H_TS = 23         # two words: clock_gettime's timespec
H_OUT = 25        # the results [layers, OUT] int64 (StepPlan.out)
HEADER = 26

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
RECORD = 32

# a layer's row of results (StepPlan.out), read by Python with one tolist() for all layers
O_JOB = N_COUNTS       # after the pass's counts (PassResult's fields): the C job of its pages, 0 none
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
    """st_eng_submit (csrc/uring_read.c) through its address `fn`; the job handle, 0 when refused (see err)."""
    sig = types.int64(*([types.int64] * 9))

    def codegen(context, builder, signature, args):
        i32, i64 = ir.IntType(32), ir.IntType(64)
        fnty = ir.FunctionType(i64, [i64, i32, i64, i64, i64, i64, i64, i64])
        call = builder.inttoptr(args[0], fnty.as_pointer())
        rest = list(args[1:])
        rest[1] = builder.trunc(rest[1], i32)
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
    submit_fn = plan[H_SUBMIT_FN]
    clock_fn = plan[H_CLOCK_FN]
    base = plan.ctypes.data
    ts = base + 8 * H_TS
    out = carray(_p_i64(plan[H_OUT]), (n_layers, OUT))
    li = plan[H_START]
    buf_base = plan[H_BUF_BASE] if li > 0 else 0   # a resumed call goes on where the last stopped
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
            carray(_p_i32(plan[r + R_DIRECTORY]), plan[r + R_ROWS]),
            carray(_p_i32(plan[r + R_OWNED]), plan[r + R_OWNED_LEN]), carray(_p_i64(plan[r + R_LSTATE]), 4),
            slot_layer, slot_row, state, ref, fill_miss, step, htab, plan[H_STAMP] + li, hbits,
            carray(_p_i8(plan[r + R_DESC_KIND]), cap), carray(_p_i64(plan[r + R_DESC_IDX]), cap),
            carray(_p_i32(plan[r + R_MISS_BUF]), cap), carray(_p_i32(plan[r + R_MISS_INPAGE]), cap),
            carray(_p_i32(plan[r + R_MISS_SLOT]), cap), carray(_p_i64(plan[r + R_MISS_ROW]), cap),
            carray(_p_i32(plan[r + R_PAGE_REGION]), cap), carray(_p_i64(plan[r + R_PAGE_NO]), cap),
            carray(_p_i32(plan[r + R_PAGE_BUF]), cap), carray(_p_i32(plan[r + R_OWN_POS]), cap),
            carray(_p_i64(plan[r + R_OWN_ROW]), cap), buf_base, pad_id, counts)
        t1 = _clock_ns(clock_fn, ts)
        res[O_T1] = t1
        res[O_T2] = t1
        res[O_JOB] = 0
        pages = counts[C_PAGES]
        if status != 0:
            plan[H_STOP] = li
            plan[H_WHY] = WHY_BAD
            plan[H_BUF_BASE] = buf_base + pages
            return
        if pages > 0:
            engine = plan[r + R_ENGINE]
            job = 0
            if engine != 0 and submit_fn != 0:
                job = _submit_at(submit_fn, engine, pages, plan[r + R_PAGE_REGION], plan[r + R_PAGE_NO],
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


class StepPlan:
    """The plan array of one engine configuration, and every array it names (kept alive here)."""

    def __init__(self, layers: int, generation: int, htab: np.ndarray, pool: PageBufferPool, columns: int) -> None:
        self.arr = np.zeros(HEADER + layers * RECORD, dtype=np.int64)
        self.arr[H_LAYERS] = layers
        self.ids_shape = (layers, columns)   # ids[T, L, C] of the steps it serves, less T
        self.pool = pool   # the page pool it names; a new pool needs a new plan
        self.arr[H_POOL_ADDR] = pool.base
        self.arr[H_POOL_CAP] = pool.capacity
        self.out = np.zeros((layers, OUT), dtype=np.int64)   # per layer: the pass's counts, job, clock readings
        self.arr[H_OUT] = _address(self.out)
        self.generation = generation   # the cache's, when built
        self.htab = htab               # the step hash table it names
        self.keep: list[np.ndarray] = [htab]
        self.runs: list = []     # the engine's layer runs, in window order
        self.states: list = []   # their cache layers (CacheLayer), in the same order
        self.lanes: list = []    # their sources' NativeLane (store.disk), None where Python submits, same order
        # (NativeLane, [its layers' R_ENGINE fields]), one per source whose C engine takes pages from compiled code
        self.natives: list[tuple[object, list[int]]] = []

    def put(self, at: int, a: np.ndarray, length_at: int | None = None) -> None:
        """Name array `a` (C-contiguous) at field `at`, its length at `length_at`."""
        if not a.flags.c_contiguous:
            raise ValueError("the plan names C-contiguous arrays only")
        self.keep.append(a)
        self.arr[at] = _address(a)
        if length_at is not None:
            self.arr[length_at] = a.shape[0]

    @staticmethod
    def record(i: int) -> int:
        """Offset of layer i's record."""
        return HEADER + i * RECORD
