"""The step engine: `begin_step(ids)` issues every lookup of a step, `gather(layer)` returns its rows.

One step, as data (DESIGN.md section 3):

    engine.begin_step(ids)            # ids: [T, L, 24] int64 table row ids
    for each layer l the model reaches:
        rows = engine.gather(l)       # [T, 24, 256] bf16 on the engine's device
    engine.end_step()                 # pins released, counters published

`begin_step` runs the cache's compiled pass (`cache.compiled`): each layer's
directory pass in window order (the order of `tables`, short window first),
and right after each pass that layer's page list goes to its device queue, so
the first layer's reads are in flight while the second is resolved. It is one
compiled call: the passes and the io_uring submissions run with no Python
between layers; a layer whose pages go to another kind of source (DRAM,
Redis, the thread engine) returns to Python, which submits them through the
step's `LayerReads` and resumes the call at the next layer. `gather(l)` waits for layer l's reads only
(`LayerReads.wait`), then one pass fills the missed rows' new cache slots and
dequantizes every lookup's row. The ids' layer axis is in ascending
layer-id order (what `EngramHasher` returns) unless `ids_layers` says otherwise.

Devices: on "cpu" the cache arrays are host tensors and the gather pass is one
compiled loop (`gather.gather_cpu`); on "cuda" the cache arrays live on the GPU,
missed rows go through a pinned staging buffer with non_blocking copies and the
pass runs as torch ops on the device (`gather.gather_torch`); end_step
synchronizes the stream before the staging buffer is reused. The CUDA path is
exercised only where a GPU is present (tests skip it otherwise).

Errors: any source error reaches the caller of `gather` (or `end_step`, for a
layer never gathered) as a SlackTierError naming layer, rank and page; the
slots that layer's reads would have filled are forgotten, so no garbage row is
ever served, then or later. A read that times out (`wait_timeout_s`; the
control file's `wait_timeout_ms`) may still land later, so at the end of that
step the page buffer pool is retired and a fresh one is allocated: a late
completion writes only into buffers nobody reads. A closed engine raises
CLOSED.

Configuration: `StepEngine.from_config(cfg)` builds an engine that serves a
`slacktier.config.ControlFile` (regions from each table's manifest, a source
per table opened by tier name, engine.build); `apply(what)` is the one way to
change what it serves between steps, all or nothing: another control file, a
path to one, or a `Change` of tables, cache or cache budget (engine.configure).
The checker and the metrics labels are engine.hooks; this module is the step.

Per-rank mode (`owned_only=True`): a tensor-parallel rank's process serves only
its own shard of each table (TableSpec row_start/rows = the rank's shard, one
rank region). Row ids outside
the shard are foreign: not resolved, not read, not cached, counted in
zero_rows, and their output rows are -0.0 (bf16 0x8000), the way SGLang's
per-rank host lookup zero-fills rows it does not own before its all-reduce.
-0.0 rather than +0.0 because -0.0 is the additive identity of IEEE addition
(x + -0.0 == x for every x, -0.0 included; -0.0 + +0.0 is +0.0), so the
all-reduce sum over ranks reproduces the single-process rows bit for bit, the
owner's -0.0 values included. Without owned_only an id outside the rows the
process serves is an error, unless it is outside the whole layer (below).

Ids outside the whole layer (`TableSpec.table_rows`, which a control file's
manifest always gives): a zero row (+0.0), nothing read or cached, counted in
`out_of_table` (and zero_rows), in every mode, rank and partition. That is what
SGLang's and vLLM's own lookups give such an id (their masked loads and fills),
so a plug-in serves it as the stock path does; the hashers never emit one, so
the first of each layer is logged as a warning. Under a rank partition the id
is mapped outside the stored rows too (RowMap.to_stored), never onto another
row's place.

Conventions (`convention`, codec.DEQUANT_CONVENTIONS): a plug-in's rows must
equal its serving engine's own lookup. "torch" (the default: SGLang's host
path and the reference DESIGN.md names) reads an E8M0 byte 0x00 as 2**-127 and
writes -0.0 in rows another rank serves (an all-reduce sums them); "vllm" reads
the byte as vLLM's Triton lookup does (0x00 -> 0.0, 0xFF -> +inf) and writes
+0.0 there, as that kernel's masked loads do (vLLM all-gathers, never sums).
The compiled gather takes the convention's own exact table, so it stays one
table lookup per value.

Padding (`pad_id`, default -1, what vLLM pads a step's hash ids with): a
lookup of the pad id comes out as a zero row (+0.0), touches no cache slot,
reads nothing and is counted in `padded` (and in zero_rows). The directory
pass tests for it only on ids outside the table, so real lookups pay nothing.
Row 0, which SGLang's idle data-parallel ranks send, is a real row: it is
served as row 0 (read and cached like any other), not as padding.

Metrics (`metrics=EngineMetrics(...)`, or `[engine] metrics = true`): end_step
adds the step's counters to Prometheus series (slacktier.engine.metrics) and
errors the engine raises are counted by kind. Without metrics nothing of this
runs: begin_step and gather are unchanged, end_step tests one attribute.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from time import perf_counter_ns
from typing import TYPE_CHECKING

import numpy as np
import torch

from slacktier.cache import KIND_FOREIGN, NO_HEAT, PassLayer, RowCache, fill_foreign
from slacktier.cache.compiled import WHY_BAD, CompiledPass
from slacktier.cache.directory import SKETCHED
from slacktier.config import ControlFile
from slacktier.engine import build as B
from slacktier.engine import configure as C
from slacktier.engine import gather as G
from slacktier.engine.configure import Change
from slacktier.engine.counters import LayerCounters, StepCounters, fill_from_pass
from slacktier.engine.hooks import bind_metrics, check_gathered
from slacktier.engine.reads import LayerReads
from slacktier.engine.runs import LayerRun
from slacktier.engine.tables import TableSpec
from slacktier.errors import ErrorKind, SlackTierError
from slacktier.store.base import PageBufferPool, PageReads, PageSource
from slacktier.tables.codec import check_convention
from slacktier.tables.layout import ROW_BYTES, ROW_VALUES
from slacktier.tables.packing import check_packed_reads

if TYPE_CHECKING:
    from slacktier.engine.metrics import EngineMetrics
    from slacktier.store.base import Lane

log = logging.getLogger(__name__)

GATHER_IMPLS = ("auto", "numba", "torch")
_INT64 = np.dtype(np.int64)


class StepEngine:
    """Serves table layers from page sources through a row cache, step by step."""

    def __init__(self, tables: Sequence[TableSpec], cache: RowCache | None = None, device: str = "cpu", *,
                 ids_layers: Sequence[int] | None = None, max_tokens: int = 256, columns: int = 24,
                 lossy: bool = False, check: bool = False, check_raise: bool = True, gather_impl: str = "auto",
                 wait_timeout_s: float | None = 5.0, owned_sources: Sequence[PageSource] = (),
                 owned_only: bool = False, pad_id: int = -1, metrics: EngineMetrics | None = None,
                 evict_ahead: bool = True, control: B.Applied | None = None, convention: str = "torch",
                 admission: str = "off") -> None:
        self.device = torch.device(device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise SlackTierError(ErrorKind.UNAVAILABLE, "device cuda asked but torch sees no CUDA device",
                                 fix='use device="cpu" or run on a machine with a GPU')
        if gather_impl not in GATHER_IMPLS:
            raise SlackTierError(ErrorKind.BAD_INPUT, f"unknown gather_impl {gather_impl!r}",
                                 fix=f"choose one of {', '.join(GATHER_IMPLS)}")
        if gather_impl == "numba" and self.device.type != "cpu":
            raise SlackTierError(ErrorKind.BAD_INPUT, "the numba gather runs on CPU only",
                                 fix='use gather_impl="torch" or "auto" on an accelerator')
        self.gather_impl = ("numba" if self.device.type == "cpu" else "torch") if gather_impl == "auto" \
            else gather_impl
        self.cache = cache if cache is not None else RowCache(0, self.device)
        if self.cache.device != self.device:
            raise SlackTierError(ErrorKind.BAD_INPUT, f"cache on {self.cache.device}, engine on {self.device}",
                                 fix="build the cache on the engine's device")
        self.columns = int(columns)
        self.convention = check_convention(convention)
        self._lut_t = G.lut_by_scale(self.convention)
        self.lossy = bool(lossy)
        self.owned_only = bool(owned_only)
        self.pad_id = C.checked_pad_id(pad_id)
        self.metrics = metrics   # None: no metrics work at all
        self.check = bool(check)
        # With check on, a row that differs from the table's source is never served: gather raises CHECKSUM
        # naming layer, rank and page. check_raise=False only counts and logs them (a diagnostic run that
        # wants every mismatch of a step counted; those rows are served).
        self.check_raise = bool(check_raise)
        # end_step empties as many slots per layer as the step claimed, for the next step's misses
        # (RowCache.evict_ahead): their victims' directory reads leave begin_step for the step's slack.
        self.evict_ahead = bool(evict_ahead)
        # The cache's admission rule (cache.ADMISSIONS): "prefill-cold" lets rows a prefill token misses enter
        # with CLOCK's reference bit clear, "counters" keeps 2-bit counts that decode lookups raise, so a
        # prompt's rows that are never read again leave before the rows decode keeps reading (begin_step's
        # decode flags say which tokens are prefill; without them every token counts as decode);
        # "counters+sketch" adds a frequency sketch per layer that a prefill miss must pass to take a slot.
        self._plan: _Plan | None = None   # built on the first step after any change it depends on
        self.admission = admission
        self._wait_timeout_s = C.checked_timeout(wait_timeout_s)
        self._owned_sources: list[PageSource] = list(owned_sources)   # changed in place: the finalizer holds it
        # An engine garbage-collected without close() still releases what its sources hold (descriptors,
        # device-queue attachments, target locks, which would refuse a later restage), and says so.
        self._finalizer = weakref.finalize(self, _close_dropped, self._owned_sources)
        self._finalizer.atexit = False   # at exit the process releases them; a source's join could only delay it
        self._closed = False
        self._in_step = False
        self._step = 0
        self._tokens = 0
        self._token_capacity = 0
        self._pool: PageBufferPool | None = None
        self._staging: torch.Tensor | None = None
        self._reads = LayerReads(wait_timeout_s)
        self.retired_pools = 0   # pools given up after a read timed out (its buffers may still be written)
        self._applied = control   # the control file it serves (engine.build), when built from one
        # What it serves, set by engine.configure: runs per layer, window order, rank partitions' row maps
        self._layers: dict[int, LayerRun] = {}
        self._order: list[int] = []
        self._row_maps: list[tuple[int, object]] = []
        self._taken = self._unread = 0   # window positions: results taken below _taken, resolved below _unread
        self.last_step: StepCounters | None = None
        self.totals: dict[int, LayerCounters] = {}
        self._warned_outside: set[int] = set()   # layers whose out-of-table ids were logged once
        C.commit(self, C.prepare(self, list(tables), ids_layers, (), None, self.cache, self.lossy, self.check))
        C.grow(self, max(1, int(max_tokens)))
        if metrics is not None:
            bind_metrics(metrics, [self._layers[layer] for layer in self._order], control, self.cache,
                         self.owned_only)

    # ---- configuration (engine.configure, engine.build) ----------------------------------------
    @classmethod
    def from_config(cls, cfg: ControlFile, **overrides: object) -> StepEngine:
        """An engine serving control file `cfg`; it owns (and closes) the sources it opens (engine.build).

        `overrides` go to the constructor (ids_layers, columns, gather_impl, check_raise, ...).
        """
        return B.build_engine(cls, cfg, **overrides)

    @classmethod
    def from_control(cls, path: str | Path, **overrides: object) -> StepEngine:
        """An engine built from a control file on disk (schema: slacktier.config)."""
        return B.build_engine_from_file(cls, path, **overrides)

    def apply(self, what: ControlFile | str | Path | Change) -> None:
        """Change what the engine serves between steps, all or nothing: a control file, its path, or a `Change`
        of tables, cache or cache budget; only what changed is rebuilt (engine.configure)."""
        C.apply(self, what)

    @property
    def config(self) -> ControlFile | None:
        """The control file this engine serves, when it was built from one."""
        return self._applied.control if self._applied is not None else None

    @property
    def control_state(self) -> B.Applied | None:
        """engine.build's record of the control file served (its resolved tables and open sources), if any."""
        return self._applied

    @property
    def wait_timeout_s(self) -> float | None:
        """How long a gather (and end_step) waits for a layer's reads before it times out (None: no bound)."""
        return self._wait_timeout_s

    @wait_timeout_s.setter
    def wait_timeout_s(self, timeout_s: float | None) -> None:
        # the step in flight's waits too, not only the next step's: a caller that raises the bound after a
        # timeout must not have the step's remaining waits (end_step's) keep the old one
        self._wait_timeout_s = C.checked_timeout(timeout_s)
        self._reads.timeout_s = self._wait_timeout_s

    @property
    def layers(self) -> tuple[int, ...]:
        """Layer ids in window order (the order begin_step resolves and submits them)."""
        return tuple(self._order)

    @property
    def ids_layers(self) -> tuple[int, ...]:
        """Layer ids in the order of the ids' layer axis."""
        return tuple(sorted(self._layers, key=lambda l: self._layers[l].axis))

    def table(self, layer: int) -> TableSpec:
        """The spec the engine serves `layer` with."""
        return self._run(layer).spec

    # ---- the step -----------------------------------------------------------------------------
    @property
    def admission(self) -> str:
        """The cache's admission rule (`cache.ADMISSIONS`); set between steps."""
        return self._admission

    @admission.setter
    def admission(self, rule: str) -> None:
        self._admission = C.checked_admission(rule)
        self.cache.use_sketch(rule in SKETCHED)   # the layers' sketches, for the rules that read one
        if self._plan is not None:   # a plan built later takes the rule from _build_plan
            self._plan.cp.set_heat_lut(C.heat_lut(self._admission))

    def begin_step(self, ids: np.ndarray, decode: np.ndarray | None = None) -> None:
        """Issue every lookup of a step: ids [T, L, 24] int64 table row ids (L in `ids_layers` order).

        int32 ids are taken too (widened exactly); every other dtype is refused, unsigned ones included.
        decode: [T] bool, True for a decode token, False for a prefill token (None: all decode). Only the
        cache's admission rule reads it (`admission`: "prefill-cold", "counters"); rows served are the same either
        way."""
        ids = self._step_ids(ids)   # [T, L, 24] int64, C-contiguous; stored rows under a rank partition
        heat = NO_HEAT   # without flags every token decodes; the pass makes the rule's codes (C.step_flags)
        if decode is not None:   # flags checked whenever given
            heat = C.step_flags(self._admission, decode, ids.shape[0])
        self._in_step = True
        self._step += 1
        self._tokens = ids.shape[0]
        try:
            self._resolve_and_submit(ids, heat)
        except BaseException as exc:
            self._abort_step()
            if self.metrics is not None:
                self.metrics.error(exc)
            raise

    def gather(self, layer: int) -> torch.Tensor:
        """Rows of `layer` for this step: bf16 [T, 24, 256] on the engine's device (waits for its reads only)."""
        self._refuse_if_closed()
        if not self._in_step:
            raise SlackTierError(ErrorKind.BAD_INPUT, "gather outside a step", layer=layer,
                                 fix="call begin_step(ids) first")
        run = self._run(layer)
        self._wait(run)   # its pages are in the pool (or the error is raised)
        if run.res.packed:
            self._check_packed(run)
        sc = run.scratch
        n, n_miss, n_foreign = run.res.lookups, run.res.misses, run.res.foreign   # n = T * 24 lookups
        t0 = perf_counter_ns()
        if self.gather_impl == "numba":
            bits = np.empty((n, ROW_VALUES), dtype=np.uint16)   # [n, 256] bf16 bits
            G.gather_cpu(sc.desc_kind, sc.desc_idx, n, sc.miss_buf, sc.miss_inpage, sc.miss_slot, n_miss,
                         self._pool.pages, self.cache.weight.numpy(), self.cache.scale.numpy(), self._lut_t, bits)
            if n_foreign and self.convention == "torch":   # "vllm": +0.0, as gather_cpu leaves them
                fill_foreign(sc.desc_kind, n, bits)
            out = torch.from_numpy(bits).view(torch.bfloat16)
        else:
            staging = None
            if self._staging is not None:
                # Each layer stages its missed rows in its own slice of the pinned buffer, so a copy still
                # in flight for one layer is never overwritten by another; end_step synchronizes.
                span = self._token_capacity * self.columns * ROW_BYTES
                staging = self._staging[run.axis * span:(run.axis + 1) * span]
            out = G.gather_torch(sc.desc_kind[:n], sc.desc_idx[:n], sc.miss_buf[:n_miss],
                                 sc.miss_inpage[:n_miss], sc.miss_slot[:n_miss], self._pool.pages,
                                 self.cache.weight, self.cache.scale, staging, self.convention)
            if n_foreign and self.convention == "torch":
                foreign = np.flatnonzero(sc.desc_kind[:n] == KIND_FOREIGN)
                out.index_fill_(0, torch.from_numpy(foreign).to(out.device, non_blocking=True), -0.0)
        run.counters.gather_us += (perf_counter_ns() - t0) / 1e3
        run.gathered = True
        if self.check:
            wrong = check_gathered(run, out, self.convention, self.check_raise, self.cache)
            if wrong is not None:
                if self.metrics is not None:
                    self.metrics.error(wrong)
                raise wrong
        return out.view(self._tokens, self.columns, ROW_VALUES)   # [T, 24, 256] bf16

    def end_step(self) -> StepCounters:
        """Release the step's pins, publish and return its counters; raises a read error of a layer never gathered."""
        self._refuse_if_closed()
        if not self._in_step:
            raise SlackTierError(ErrorKind.BAD_INPUT, "end_step without begin_step", fix="call begin_step first")
        error: BaseException | None = None
        for layer in self._order:
            run = self._layers[layer]
            if self._reads.failed(layer):
                continue   # its error reached the caller at gather; its fills are already forgotten
            try:
                self._wait(run)
            except SlackTierError as exc:
                error = error or exc
            if not run.gathered:
                self._forget_fills(run)
        counters = StepCounters(step=self._step, tokens=self._tokens)
        for layer in self._order:
            run = self._layers[layer]
            c = _counted(run)
            counters.layers[layer] = c
            self.totals[layer].add(c)
            run.ids = None
            if c.out_of_table and layer not in self._warned_outside:
                self._warned_outside.add(layer)
                log.warning("layer %d: %d ids outside the layer were served as zero rows (as the serving engines' "
                            "own lookups serve them; counted in out_of_table): the hasher's layout may not be the "
                            "table's", layer, c.out_of_table)
        self._finish_step()
        if self.cache.sketched:   # the step's lookups, counted after its passes (kernels.count_lookups)
            heat = self._plan.cp.heat_codes(self._tokens)   # the codes the pass made from the step's flags
            for layer in self._order:
                self.cache.count_lookups(layer, self._layers[layer].scratch, heat, self.columns)
        if self.evict_ahead:
            for layer, c in counters.layers.items():   # counted as this step's evictions
                claimed = c.rows_read - c.bypass
                if claimed > 0:
                    evicted = self.cache.evict_ahead(layer, claimed)
                    c.evictions += evicted
                    self.totals[layer].evictions += evicted
        self.last_step = counters
        if self.metrics is not None:
            self.metrics.observe(counters)
        if error is not None:
            raise error
        return counters

    @property
    def in_step(self) -> bool:
        """True between begin_step and end_step."""
        return self._in_step

    def close(self) -> None:
        """Abandon an open step, close the sources this engine owns; later calls raise CLOSED."""
        if self._closed:
            return
        if self._in_step:
            self._abort_step()
        self._finalizer.detach()
        for source in self._owned_sources:
            source.close()
        C.unpin(self)
        self._closed = True

    @property
    def closed(self) -> bool:
        """True once close() ran."""
        return self._closed

    def __enter__(self) -> StepEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- inside the step ----------------------------------------------------------------------
    def _step_ids(self, ids: np.ndarray) -> np.ndarray:
        """The step's ids as the compiled pass takes them, or a refusal: the one place they are checked (the
        compiled pass keeps its own guard, as it trusts raw addresses). Argument errors are counted in the
        metrics, when on; a larger step than any before grows the scratch and page pool first."""
        plan = self._plan
        # The usual step (a plan built, the hasher's C-contiguous int64 ids of a known shape and size) passes
        # the one test below: the last step left the interpreter's memory out of cache, so each call and
        # attribute here costs misses (measured: the Python around the compiled call is faster this way).
        if (plan is None or self._in_step or self._closed or type(ids) is not np.ndarray or ids.dtype is not _INT64
                or ids.shape[1:] != plan.cp.ids_shape or ids.shape[0] > self._token_capacity
                or not ids.flags.c_contiguous):
            self._refuse_if_closed()
            try:
                if self._in_step:
                    raise SlackTierError(ErrorKind.BAD_INPUT, "begin_step while a step is open",
                                         fix="call end_step first")
                ids = np.asarray(ids)
                if ids.ndim != 3 or ids.shape[1] != len(self._layers) or ids.shape[2] != self.columns:
                    raise SlackTierError(ErrorKind.BAD_INPUT, f"ids are {ids.shape}, want [T, {len(self._layers)}, "
                                         f"{self.columns}]", fix="pass the hasher's [T, L, 24] output")
                if ids.dtype != _INT64:
                    ids = _widened_ids(ids)
            except SlackTierError as exc:
                if self.metrics is not None:
                    self.metrics.error(exc)
                raise
            ids = np.ascontiguousarray(ids)   # the one layout the compiled pass takes
            C.grow(self, ids.shape[0])
        if self._row_maps:   # a rank partition other than columns: the pass reads stored rows
            ids = self._stored_ids(ids)
        return ids

    def _stored_ids(self, ids: np.ndarray) -> np.ndarray:
        """The step's ids with each partitioned layer's global row ids as its stored rows (TableSpec.row_map);
        pad and out-of-table ids stay outside the stored rows, so the pass pads or zero-fills them."""
        out = ids.copy()
        for axis, row_map in self._row_maps:
            row_map.to_stored(ids[:, axis, :], out[:, axis, :])
        return out

    def _resolve_and_submit(self, ids: np.ndarray, heat: np.ndarray = NO_HEAT) -> None:
        """begin_step's passes and submissions, on the step's critical path (Eq. 1's s): the cache's compiled
        pass over every layer in window order (cache.compiled). It stops early at a layer whose pages go to a
        source without a C engine (Python submits them, and the pass resumes at the next layer) or at a bad
        id (refused). The passes' results and the booking of their lanes' jobs wait for the step's first gather
        (`_take_results`): the reads are in flight once the call returns, and what is left is bookkeeping."""
        plan = self._plan
        if plan is None or plan.cp.stale() or plan.pool is not self._pool:
            plan = self._plan = _build_plan(self)
        cp, runs, n_layers = plan.cp, plan.runs, len(plan.runs)
        cp.start(ids.shape[0])
        self._taken = self._unread = start = 0
        while True:
            with plan.lanes:   # the C engine clients' locks, around the call (_HeldLanes)
                stop, why = cp.run(ids, start, heat)   # layers start..stop resolved, C-engine pages submitted
            self._unread = min(stop + 1, n_layers)   # layers before this one have results to take
            # Taken now where layer `stop` stopped the call: an id outside its table, or pages for Python to submit.
            if stop < n_layers:
                self._take_results()
            if self.check:
                for run in runs[start:self._unread]:
                    run.ids = ids[:, run.axis, :].copy()   # [T, 24] int64, read by the checker at gather
            if stop == n_layers:
                return
            run = runs[stop]
            res = run.res
            if why == WHY_BAD:
                _refuse_row(run, ids[:, run.axis, :], res.bad_index, self.columns)
            sc = run.scratch
            self._reads.submit(run.spec.layer, run.spec.source, PageReads(
                region=sc.page_region[:res.pages], page=sc.page_no[:res.pages], buffer=sc.page_buf[:res.pages]),
                self._pool)
            run.clock = (run.clock[0], run.clock[1], perf_counter_ns())
            start = stop + 1

    def _take_results(self) -> None:
        """Take the compiled pass's results of the layers it resolved since the last take, and book the jobs
        it queued through lanes as tickets of their sources (each under its lane's lock): the one
        place results are read. Called where the pass stops, and before any wait for a layer's reads (gather,
        end_step, an abort), so no result is used and no read waited for before it is taken."""
        lo, hi = self._taken, self._unread
        if lo >= hi:
            return
        self._taken = hi
        plan = self._plan
        runs, lanes, pool, reads = plan.runs, plan.lanes.of_layer, plan.pool, self._reads
        for i, (res, job, clock) in enumerate(plan.cp.results(lo, hi - 1), lo):
            run = runs[i]
            run.res = res
            run.resolved = True   # whatever it claimed must be released on abort
            run.clock = clock
            if job:
                lane = lanes[i]
                with lane.lock:
                    ticket = lane.book(job, res.pages, pool)
                reads.track(run.spec.layer, lane.source, ticket, res.pages)

    def _wait(self, run: LayerRun) -> None:
        """Wait for `run`'s reads (results taken first); on failure forget the slots they would have filled."""
        self._take_results()
        try:
            waited = self._reads.wait(run.spec.layer)
        except BaseException as exc:
            if not run.gathered:
                self._forget_fills(run)
            if self.metrics is not None:
                self.metrics.error(exc)
            raise
        run.counters.wait_us += waited.wait_us
        run.counters.read_us += waited.read_us

    def _check_packed(self, run: LayerRun) -> None:
        """Refuse (CHECKSUM) the layer's rows when a packed page it read (context packing, tables.packing) does
        not name, in the slot a row was taken from, the row it was read for: a packed region or index that
        disagrees with the rows is a fault, never a wrong row. The slots its reads would fill are forgotten."""
        spec, sc, res = run.spec, run.scratch, run.res
        expected = sc.miss_row[:res.misses] + spec.row_start   # the rows the pass read (stored rows)
        if spec.row_map is not None:
            expected = spec.row_map.to_global(expected)
        bad = check_packed_reads(sc.miss_buf, sc.miss_inpage, expected, res.misses, sc.page_region, sc.page_buf,
                                 res.pages, min(spec.packing.region_index), self._pool.pages)
        if bad < 0:
            return
        self._forget_fills(run)
        p = int(sc.miss_buf[bad] - sc.page_buf[0])
        region = int(sc.page_region[p])
        rank = spec.packing.regions[spec.packing.region_index.index(region)].rank
        exc = SlackTierError(ErrorKind.CHECKSUM, f"packed page {int(sc.page_no[p])} of rank {rank}'s packed region "
                             f"does not hold row {int(expected[bad])} in slot {int(sc.miss_inpage[bad])}, where the "
                             "index sent the read: the packed region or its index disagrees with the table's rows; "
                             "none of this layer's rows is served", layer=spec.layer, rank=rank,
                             fix="stage the table again with its --pack-list (slacktier verify checks every page)")
        if self.metrics is not None:
            self.metrics.error(exc)
        raise exc

    def _forget_fills(self, run: LayerRun) -> None:
        if run.resolved and run.res.misses:
            self.cache.forget(run.spec.layer, run.scratch.miss_slot[:run.res.misses])

    def _abort_step(self) -> None:
        """Undo an open step after an error: wait out submitted reads, forget their fills, release pins."""
        self._take_results()
        for exc in self._reads.drain():   # the step is being abandoned; the first error is already raised
            log.warning("layer %s: read error while aborting the step: %s", exc.layer, exc)
        for run in self._layers.values():
            if not run.gathered:
                self._forget_fills(run)
        self._finish_step()

    def _finish_step(self) -> None:
        if self.device.type == "cuda":  # pragma: no cover - needs a GPU
            # The step's host->device copies read pinned staging that the next step rewrites.
            torch.cuda.current_stream(self.device).synchronize()
        if self._reads.tainted:
            # A read timed out and may still land: its buffers are never handed out again. The old pool
            # stays alive for as long as the source holds it; the next step reads into a fresh one.
            log.warning("a read timed out: retiring the page buffer pool (%d buffers)", self._pool.capacity)
            C.set_pool(self, PageBufferPool(self._pool.capacity))
            self.retired_pools += 1
        self._reads = LayerReads(self.wait_timeout_s)
        self.cache.release_pins()
        for run in self._layers.values():   # the next step's, made here rather than on its critical path
            run.counters = LayerCounters()
            run.resolved = run.gathered = False
        self._in_step = False

    def _refuse_if_closed(self) -> None:
        if self._closed:
            raise SlackTierError(ErrorKind.CLOSED, "the step engine is closed",
                                 fix="build a new engine; a closed one takes no more work")

    def _run(self, layer: int) -> LayerRun:
        try:
            return self._layers[layer]
        except KeyError:
            raise SlackTierError(ErrorKind.MISSING, f"the engine serves no layer {layer} (it serves "
                                 f"{self._order})", layer=layer, fix="pass a layer of the control file") from None


class _HeldLanes:
    """The locks of a plan's lanes (store.base.Lane), held around the compiled call so a concurrent submit or
    close cannot interleave with it; under them each lane is armed, and its word names its layers' client for
    this call (0: Python submits them). A lane that `defers` (the DRAM tier's host-memory copies) is deferred
    around the call too, so its copies start once the pass is done rather than on the caller's core during
    it. One reusable object per plan, entered with `with`: a `with` per lock does not fit a set of locks that
    varies per plan, and ExitStack costs microseconds here."""

    __slots__ = ("_cp", "_natives", "_deferred", "of_layer")

    def __init__(self, cp: CompiledPass, of_layer: list[Lane | None]) -> None:
        self._cp = cp
        self.of_layer = of_layer   # per layer in window order: its source's Lane, None: Python submits
        by_lane: dict[int, tuple[Lane, list[int]]] = {}
        for i, lane in enumerate(of_layer):
            if lane is not None:
                by_lane.setdefault(id(lane), (lane, []))[1].append(i)
        self._natives = list(by_lane.values())   # (Lane, the indices of its layers), one per lane
        # lanes whose medium's work would start on the CPU during the call (a DRAM copy): deferred around it
        self._deferred = [lane for lane, _ in self._natives if lane.defers]

    def __enter__(self) -> None:
        for lane in self._deferred:
            lane.defer(True)
        held = 0
        try:
            for lane, layers in self._natives:
                lane.lock.acquire()
                held += 1
                word = lane.arm()
                for i in layers:
                    self._cp.set_engine(i, word)
        except BaseException:
            for lane, _ in self._natives[:held]:
                lane.lock.release()
            for lane in self._deferred:
                lane.defer(False)
            raise

    def __exit__(self, *exc: object) -> None:
        for lane, _ in self._natives:
            lane.lock.release()
        for lane in self._deferred:
            lane.defer(False)


@dataclass
class _Plan:
    """The step's compiled pass and the device queue clients its layers' pages go to (`_build_plan`)."""

    cp: CompiledPass
    pool: PageBufferPool            # the page pool it names; a new pool needs a new plan
    runs: list[LayerRun]            # the engine's layer runs, in window order
    lanes: _HeldLanes               # their sources' lanes (store.base.Lane) and their locks


def _build_plan(engine: StepEngine) -> _Plan:
    """The cache's compiled pass over the engine's layers, cache and scratch as they are now, with the
    device queue client each layer's pages go to."""
    runs = [engine._layers[layer] for layer in engine._order]
    lane_of: dict[int, Lane | None] = {}   # per source: its lane, None: Python submits its pages
    lanes: list[Lane | None] = []
    for run in runs:
        source = run.spec.source
        if id(source) not in lane_of:
            lane_of[id(source)] = source.lane()
        lanes.append(lane_of[id(source)])
    pool = engine._pool
    cp = engine.cache.compiled_pass(
        [PassLayer(run.spec.layer, run.axis, run.spec.geometry, run.scratch) for run in runs],
        columns=engine.columns, owned_only=engine.owned_only, lossy=engine.lossy, pad_id=engine.pad_id,
        pool_base=pool.base, pool_buffers=pool.capacity)
    for i, lane in enumerate(lanes):   # each lane's own submit: st_eng_submit, or another of its signature
        if lane is not None:
            cp.set_submit_fn(i, lane.address)
    cp.set_heat_lut(C.heat_lut(engine.admission))   # the pass makes the rule's heat codes from the decode flags
    return _Plan(cp, pool, runs, _HeldLanes(cp, lanes))


def _refuse_row(run: LayerRun, lookups: np.ndarray, bad: int, columns: int) -> None:
    """Refuse (BAD_INPUT) the step whose lookup `bad` (of [T, 24] `lookups`) is outside the rows served."""
    spec = run.spec
    token, column = divmod(bad, columns)
    raise SlackTierError(ErrorKind.BAD_INPUT, f"row id {int(lookups[token, column])} (token {token}, column "
                         f"{column}) outside the table's rows [{spec.row_start}, "
                         f"{spec.row_start + spec.rows})", layer=spec.layer,
                         fix="hash with the layout the table was staged for (a process serving one rank's "
                         "shard: StepEngine(..., owned_only=True))")


def _counted(run: LayerRun) -> LayerCounters:
    """The step's counters of `run`: its pass's result and clock readings, and what gather added."""
    c = run.counters
    t0, t1, t2 = run.clock
    fill_from_pass(c, run.res)
    c.resolve_us = (t1 - t0) / 1e3
    c.submit_us = (t2 - t1) / 1e3
    return c


def _close_dropped(sources: list[PageSource]) -> None:
    """The finalizer of an engine collected without close(): close the sources it owned, and log it once."""
    failed = []
    for source in sources:
        try:
            source.close()
        except Exception as exc:   # a finalizer cannot raise: every failure is logged below, none is dropped
            failed.append(f"{type(source).__name__}: {exc}")
    log.warning("a StepEngine was garbage-collected without close(): closed its %d page sources (their files, "
                "device-queue attachments and target locks)%s; call engine.close() or use `with StepEngine...`",
                len(sources), f"; closing failed for {'; '.join(failed)}" if failed else "")


def _widened_ids(ids: np.ndarray) -> np.ndarray:
    """int32 ids widened to int64 (exact); any other dtype is refused naming it (BAD_INPUT).

    Only signed int64 (the hashers' output) and signed int32 (a serving engine's int32 index tensors) are
    ids. Unsigned ids are never cast: uint64 2**64-1 would wrap to -1, the pad id, and be served as a
    zero row; floats (12.7 -> 12) and bools would be truncated into another row."""
    if ids.dtype == np.int32:
        return ids.astype(np.int64)
    raise SlackTierError(ErrorKind.BAD_INPUT, f"ids are {ids.dtype}, want int64 (or int32) row ids",
                         fix="pass the hasher's int64 row ids; an unsigned, float or bool array is never cast")
