"""The cache's compiled pass: every layer's directory pass of a step, and its page submission, in one call.

This is the only way a step's lookups are resolved: the step engine's
`begin_step` runs it over all its layers, and `RowCache.resolve` over one.
`RowCache.compiled_pass(layers, ...)` builds a `CompiledPass` for a list of
layers in window order; one call, `run_layers(ids, arr)`, then runs their
passes (`cache.directory.resolve_layer`) and, right after each pass, hands
that layer's pages to its source's lane (store.base.Lane: a submit of
`slacktier.tables.native.SUBMIT`'s signature, named per layer and called by
address, such as io_uring's `st_eng_submit`), so layer 1's reads are in
flight while layer 14 is resolved, with no Python in between.

The pass's array (`CompiledPass.arr`, int64) describes the step once, in the
layout `cache.views` declares: the header (`PASS_HEADER`) holds the cache's
slot arrays, the step hash table and what changes per step (cache step, stamp,
page pool); each layer's record (`PASS_LAYER`) holds the addresses and lengths
of its directory, owned slots, CLOCK state, geometry and scratch, and its
lane's client word. The compiled code rebuilds the pass's structs from those
addresses (`views.geo_view`, `cache_view`, `step_view`, `out_view`), so the
call unboxes two arrays instead of 33 per layer. Each pass writes its counts
(PassResult's fields), its C job and three clock readings into its row of
`CompiledPass.out` (`views.Row`), which `results` reads with one `tolist()`
for all layers.

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
`start` names the new one. The lanes' client words are set per
step under each lane's lock (store.base.Lane, `arm`), held around the call,
so a concurrent submit or close cannot interleave with it. The jobs the call
queued are the medium's from then on; the step engine books
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

from slacktier.cache.directory import NO_HEAT, N_COUNTS, Count, LayerGeometry, PassResult, PassScratch, resolve_layer
from slacktier.cache.views import (HEADER_WORD, LAYER_WORD, LAYER_WORDS, ROW_WORDS, PassPlan, Row, cache_view,
                                   geo_view, header, layer_records, out_view, p_i64, p_u8, same_length, slot_arrays,
                                   step_view)
from slacktier.errors import ErrorKind, SlackTierError
from slacktier.tables.native import submit_llvm_type

_INT64 = np.dtype(np.int64)

WHY_DONE = 0
WHY_BAD = 1
WHY_SUBMIT = 2

_CLOCK_MONOTONIC = 1


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
    """The submit at address `fn` (`slacktier.tables.native.SUBMIT`'s signature); the job, 0 when refused (see err)."""
    sig = types.int64(*([types.int64] * 9))

    def codegen(context, builder, signature, args):
        fnty = submit_llvm_type()
        call = builder.inttoptr(args[0], fnty.as_pointer())
        rest = [builder.trunc(a, t) if t.width < 64 else a for a, t in zip(args[1:], fnty.args)]
        return builder.call(call, rest)

    return sig, codegen


@njit(nogil=True, cache=True, inline="always")
def _heat_of_flags(h, tokens, flags):
    """The step's heat codes [tokens] uint8, in the header's buffer: each token's rule code by its decode flag
    (`flags` [tokens] 0/1 bytes), or the decode code for every token when `flags` is empty."""
    lut = carray(p_u8(h.heat_lut), 2)
    codes = carray(p_u8(h.heat_buf), tokens)
    if flags.shape[0] == 0:
        for t in range(tokens):
            codes[t] = lut[1]
    else:
        for t in range(tokens):
            codes[t] = lut[flags[t] & 1]
    return codes


@njit(nogil=True, cache=True)
def run_layers(ids, plan, heat):
    """Resolve layers start.. of the step `ids` [T, L, C] int64 and submit their pages; plan: the pass's
    header words (views.PassPlan.words; module doc); heat: [T] uint8 heat codes per token, or empty
    (`directory.resolve_layer`), or, with an admission rule in the header (`CompiledPass.set_heat_lut`),
    the tokens' decode flags, which become the codes here."""
    h = header(plan)
    if h.heat_lut != 0:
        heat = _heat_of_flags(h, ids.shape[0], heat)
    records = layer_records(h)
    n_layers = h.layers
    slots = slot_arrays(h)
    htab = carray(p_i64(h.htab), (h.hrows, 3))
    clock_fn = h.clock_fn
    ts = h.ts
    out = carray(p_i64(h.out), (n_layers, ROW_WORDS))
    li = h.start
    buf_base = h.buf_base   # the step's first page buffer, or where the last call stopped
    while li < n_layers:
        rec = records[li]
        res = out[li]
        res[Row.T0] = _clock_ns(clock_fn, ts)
        counts = res[:N_COUNTS]
        status = resolve_layer(ids[:, rec.axis, :], geo_view(rec), cache_view(rec, slots),
                               step_view(h, htab, li, buf_base), out_view(rec, counts), heat)
        t1 = _clock_ns(clock_fn, ts)
        res[Row.T1] = t1
        res[Row.T2] = t1
        res[Row.JOB] = 0
        pages = counts[Count.PAGES]
        if status != 0:
            h.stop = li
            h.why = WHY_BAD
            h.buf_base = buf_base + pages
            return
        if pages > 0:
            engine = rec.engine
            fn = rec.submit_fn
            job = 0
            if engine != 0 and fn != 0:
                job = _submit_at(fn, engine, pages, rec.page_region, rec.page_no, rec.page_buf, h.pool_addr,
                                 h.pool_buffers, h.errors + 8 * li)
            if job == 0:
                h.stop = li
                h.why = WHY_SUBMIT
                h.buf_base = buf_base + pages
                return
            res[Row.JOB] = job
            res[Row.T2] = _clock_ns(clock_fn, ts)
        buf_base += pages
        li += 1
    h.stop = n_layers
    h.why = WHY_DONE
    h.buf_base = buf_base


def clock_gettime_address() -> int:
    """Address of libc's clock_gettime (the clock Python's perf_counter_ns reads on Linux)."""
    return ctypes.cast(ctypes.CDLL(None).clock_gettime, ctypes.c_void_p).value


_CLOCK_FN = clock_gettime_address()

# words of the per-step fields (views.PASS_HEADER, PASS_LAYER), for the memoryview writes
_START, _STOP, _WHY, _BUF_BASE = (HEADER_WORD[f] for f in ("start", "stop", "why", "buf_base"))
_STEP, _STAMP, _HBITS = (HEADER_WORD[f] for f in ("step", "stamp", "hbits"))
_ENGINE = LAYER_WORD["engine"]


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

    A step: `start(tokens)`, then `run(ids)` and, for each stop, `results(...)`; `set_engine(i, word)`
    names the client word of the lane that takes layer i's pages (0: the caller submits them), per step,
    under that lane's lock.
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
        self.plan = plan = PassPlan(n)
        self.arr = plan.words   # what run_layers takes
        # Per-step fields go in and out through a memoryview, not numpy's scalar indexing: with the CPU caches
        # cold (as after the model's forward) a memoryview's reads and writes cost less.
        self._words = memoryview(plan.words)
        self._layer_words = memoryview(plan.layer_words)
        self.out = np.zeros((n, ROW_WORDS), dtype=np.int64)   # per layer: the pass's counts, job, clock readings
        self.errors = np.zeros(max(n, 1), dtype=np.int64)      # per layer: its submit's error word
        self._ts = np.zeros(2, dtype=np.int64)                 # clock_gettime's timespec
        self._heat_lut = np.zeros(2, dtype=np.uint8)           # set_heat_lut's codes
        self._heat_buf = np.zeros(self.capacity // max(self.columns, 1) + 1, dtype=np.uint8)   # a step's codes
        self.states = [cache.layer(pl.layer) for pl in layers]
        h = plan.header
        h["clock_fn"] = _CLOCK_FN
        h["pool_addr"] = pool_base
        h["pool_buffers"] = pool_buffers
        h["owned_only"] = bool(owned_only)
        h["lossy"] = bool(lossy)
        h["pad_id"] = int(pad_id)
        plan.put(h, "out", self.out)
        plan.put(h, "errors", self.errors)
        plan.put(h, "ts", self._ts)
        plan.put(h, "heat_buf", self._heat_buf)
        plan.put(h, "heat_lut", self._heat_lut)
        self._lut_word = int(h["heat_lut"])
        h["heat_lut"] = 0   # no rule: `run`'s heat holds the codes (set_heat_lut)
        plan.put(h, "slot_layer", cache.slot_layer, "slots")
        for name in ("slot_row", "state", "ref", "fill_miss"):
            arr = getattr(cache, name)
            same_length(arr, cache.slot_layer, "the cache's slot arrays")
            plan.put(h, name, arr)
        plan.put(h, "htab", self.htab, "hrows")
        # The compiled code has no bounds checks: everything it indexes is checked here, once, or per run.
        for i, (pl, state) in enumerate(zip(layers, self.states)):
            geo = pl.geometry
            if geo.rows != state.rows:
                raise SlackTierError(ErrorKind.BAD_INPUT, f"geometry of {geo.rows} rows, directory of {state.rows}",
                                     layer=pl.layer, fix="re-add the layer with the table's row count")
            if lossy and geo.seen is None:
                raise SlackTierError(ErrorKind.BAD_INPUT, "lossy pass without a seen-set", layer=pl.layer,
                                     fix="give the layer's geometry a seen bitmap, or turn lossy off")
            if geo.packed is not None and geo.packed.slots.shape[0] != self.columns:
                raise SlackTierError(ErrorKind.BAD_INPUT, f"context packing gives {geo.packed.slots.shape[0]} column "
                                     f"slots, the steps have {self.columns} columns", layer=pl.layer,
                                     fix="build the layer's PackedGeometry for the table's hash columns")
            if not 0 <= pl.axis < n:
                raise SlackTierError(ErrorKind.BAD_INPUT, f"layer axis {pl.axis} outside 0..{n - 1}", layer=pl.layer,
                                     fix="give each layer its index in the ids' layer axis")
            plan.put_layer(i, pl.axis, geo, state.key, state.directory, state.owned, state.lstate, pl.scratch,
                           state.sketch)

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
            self.plan.put(self.plan.header, "htab", self.htab, "hrows")
        w = self._words
        w[_STEP] = cache.step
        w[_STAMP] = self._steps.stamp - passes + 1
        w[_HBITS] = bits
        w[_BUF_BASE] = buf_base
        for state in self.states:   # pins an earlier pass left pending (none between steps)
            if state.pending is not None:
                cache.settle(state)

    def set_engine(self, i: int, word: int) -> None:
        """The client word (an armed lane's) that layer i's submit takes this step (0: the caller submits them)."""
        self._layer_words[i * LAYER_WORDS + _ENGINE] = word

    def set_submit_fn(self, i: int, address: int) -> None:
        """The submit (st_eng_submit's signature) that takes layer i's pages: its lane's `address` (st_eng_submit,
        or another lane's of that signature); 0, the default, leaves them to Python."""
        self.plan.records[i]["submit_fn"] = address

    def set_heat_lut(self, codes: np.ndarray | None) -> None:
        """An admission rule's two heat codes, [prefill code, decode code] (`directory.token_heat`): `run`'s heat
        is then each token's decode flag as a 0/1 byte (empty: every token decodes), and the compiled call
        makes the codes from them (`heat_codes`), so begin_step spends no numpy call on them. None: `run`'s
        heat holds the codes themselves, or is empty for plain CLOCK."""
        if codes is None:
            self.plan.header["heat_lut"] = 0
            return
        self._heat_lut[:] = codes
        self.plan.header["heat_lut"] = self._lut_word

    def heat_codes(self, tokens: int) -> np.ndarray:
        """The heat codes [tokens] uint8 the last `run` made from its decode flags (`set_heat_lut`), or NO_HEAT
        when no rule is set (the caller has the codes it passed)."""
        if self.plan.header["heat_lut"] == 0:
            return NO_HEAT
        return self._heat_buf[:tokens]

    def run(self, ids: np.ndarray, start: int = 0, heat: np.ndarray = NO_HEAT) -> tuple[int, int]:
        """Resolve layers start.. of the step `ids` [T, L, C] int64 (C-contiguous); (stop, WHY_*) (module doc).

        heat: [T] uint8, each token's heat code (`directory.token_heat`: the admission rule; the codes are
        trusted); empty, the default: plain CLOCK. With a rule set (`set_heat_lut`): each token's decode flag
        as 0 or 1 (a view of the bool flags), or empty when every token decodes."""
        if (type(ids) is not np.ndarray or ids.dtype is not _INT64 or ids.shape[1:] != self.ids_shape
                or ids.shape[0] * self.columns > self.capacity or not ids.flags.c_contiguous):
            raise SlackTierError(ErrorKind.BAD_INPUT, f"ids {getattr(ids, 'dtype', type(ids))} "
                                 f"{getattr(ids, 'shape', '')} for a pass of [T <= "
                                 f"{self.capacity // max(self.columns, 1)}, {self.ids_shape[0]}, {self.columns}] "
                                 "C-contiguous int64", fix="pass the step's ids as the pass was built for")
        if heat is not NO_HEAT and (type(heat) is not np.ndarray or heat.dtype != np.uint8
                                    or heat.shape != ids.shape[:1] or not heat.flags.c_contiguous):
            raise SlackTierError(ErrorKind.BAD_INPUT, f"heat codes {getattr(heat, 'dtype', type(heat))} "
                                 f"{getattr(heat, 'shape', '')} for {ids.shape[0]} tokens",
                                 fix="pass one uint8 code per token of the step (directory.token_heat), or none")
        w = self._words
        w[_START] = start
        run_layers(ids, self.arr, heat)
        return w[_STOP], w[_WHY]

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
            got.append((res, row[Row.JOB], row[Row.T0:]))
        return got

