"""The step engine: `begin_step(ids)` issues every lookup of a step, `gather(layer)` returns its rows.

One step, as data (DESIGN.md section 3):

    engine.begin_step(ids)            # ids: [T, L, 24] int64 table row ids
    for each layer l the model reaches:
        rows = engine.gather(l)       # [T, 24, 256] bf16 on the engine's device
    engine.end_step()                 # pins released, counters published

`begin_step` runs the compiled directory pass (`resolve.resolve_layer`) once per
layer in window order (the order of `tables`, short window first) and hands
that layer's page list to its source before resolving the next layer, so the
first layer's reads are in flight while the second is resolved. `gather(l)`
waits for layer l's reads only, then one pass fills the missed rows' new cache
slots and dequantizes every lookup's row. The ids' layer axis is in ascending
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
ever served, then or later. A closed engine raises CLOSED.

Per-rank mode (`owned_only=True`): a tensor-parallel rank's process serves only
its own shard of each table (TableSpec row_start/rows = the rank's shard, one
rank region), with a directory of 4 B per row of that shard. Row ids outside
the shard are foreign: not resolved, not read, not cached, counted in
zero_rows, and their output rows are -0.0 (bf16 0x8000), the way SGLang's
per-rank host lookup zero-fills rows it does not own before its all-reduce.
-0.0 rather than +0.0 because -0.0 is the additive identity of IEEE addition
(x + -0.0 == x for every x, -0.0 included; -0.0 + +0.0 is +0.0), so the
all-reduce sum over ranks reproduces the single-process rows bit for bit, the
owner's -0.0 values included. Without owned_only an id outside the table is an
error.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from slacktier.cache.kernels import EVICTIONS
from slacktier.cache.rowcache import RowCache
from slacktier.engine import gather as G
from slacktier.engine import resolve as R
from slacktier.engine.checker import FileRowReader, mismatching_rows, reference_gather
from slacktier.engine.counters import LayerCounters, StepCounters
from slacktier.engine.tables import TableSpec
from slacktier.errors import ErrorKind, SlackTierError
from slacktier.store.base import PageBufferPool, PageReads, PageSource
from slacktier.tables.layout import ROW_BYTES, ROW_VALUES

log = logging.getLogger(__name__)

GATHER_IMPLS = ("auto", "numba", "torch")


@dataclass
class _Scratch:
    """Preallocated outputs of one layer's directory pass, for up to `capacity` lookups."""

    capacity: int
    desc_kind: np.ndarray = field(init=False)    # [cap] int8
    desc_idx: np.ndarray = field(init=False)     # [cap] int64
    miss_buf: np.ndarray = field(init=False)     # [cap] int32
    miss_inpage: np.ndarray = field(init=False)  # [cap] int32
    miss_slot: np.ndarray = field(init=False)    # [cap] int32
    miss_row: np.ndarray = field(init=False)     # [cap] int64
    page_region: np.ndarray = field(init=False)  # [cap] int32
    page_no: np.ndarray = field(init=False)      # [cap] int64
    page_buf: np.ndarray = field(init=False)     # [cap] int32
    counts: np.ndarray = field(init=False)       # [N_COUNTS] int64

    def __post_init__(self) -> None:
        n = self.capacity
        self.desc_kind = np.zeros(n, dtype=np.int8)
        self.desc_idx = np.zeros(n, dtype=np.int64)
        self.miss_buf = np.zeros(n, dtype=np.int32)
        self.miss_inpage = np.zeros(n, dtype=np.int32)
        self.miss_slot = np.zeros(n, dtype=np.int32)
        self.miss_row = np.zeros(n, dtype=np.int64)
        self.page_region = np.zeros(n, dtype=np.int32)
        self.page_no = np.zeros(n, dtype=np.int64)
        self.page_buf = np.zeros(n, dtype=np.int32)
        self.counts = np.zeros(R.N_COUNTS, dtype=np.int64)


@dataclass
class _LayerRun:
    """A layer's state within the engine and within the current step."""

    spec: TableSpec
    axis: int                      # index in ids' layer axis
    scratch: _Scratch
    ids: np.ndarray | None = None  # [N] int64 this step's row ids
    n: int = 0
    n_miss: int = 0
    n_pages: int = 0
    n_foreign: int = 0
    ticket: int | None = None
    resolved: bool = False
    waited: bool = False
    gathered: bool = False
    failed: bool = False
    evictions_before: int = 0
    counters: LayerCounters = field(default_factory=LayerCounters)
    reader: object | None = None


class StepEngine:
    """Serves table layers from page sources through a row cache, step by step."""

    def __init__(self, tables: Sequence[TableSpec], cache: RowCache | None = None, device: str = "cpu", *,
                 ids_layers: Sequence[int] | None = None, max_tokens: int = 256, columns: int = 24,
                 lossy: bool = False, check: bool = False, check_raise: bool = False, gather_impl: str = "auto",
                 wait_timeout_s: float | None = None, owned_sources: Sequence[PageSource] = (),
                 owned_only: bool = False) -> None:
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
        self.lossy = bool(lossy)
        self.owned_only = bool(owned_only)
        self.check = bool(check)
        self.check_raise = bool(check_raise)
        self.wait_timeout_s = wait_timeout_s
        self._owned_sources: list[PageSource] = list(owned_sources)
        self._closed = False
        self._in_step = False
        self._step = 0
        self._stamp = 0
        self._tokens = 0
        self._token_capacity = 0
        self._pool: PageBufferPool | None = None
        self._staging: torch.Tensor | None = None
        self._htab = np.zeros((0, 3), dtype=np.int64)
        self._layers: dict[int, _LayerRun] = {}
        self._order: list[int] = []
        self.last_step: StepCounters | None = None
        self.totals: dict[int, LayerCounters] = {}
        self._configure(list(tables), ids_layers)
        self._ensure_capacity(max(1, int(max_tokens)))

    # ---- configuration ------------------------------------------------------------------------
    def _configure(self, tables: list[TableSpec], ids_layers: Sequence[int] | None,
                   invalidate: Sequence[int] = (), cache_rows: int | None = None) -> None:
        layer_ids = [t.layer for t in tables]
        if len(set(layer_ids)) != len(layer_ids):
            raise SlackTierError(ErrorKind.BAD_INPUT, f"layers {layer_ids} listed twice",
                                 fix="give each table layer once")
        if self.lossy and any(t.seen is None for t in tables):
            missing = [t.layer for t in tables if t.seen is None]
            raise SlackTierError(ErrorKind.BAD_INPUT, f"lossy mode needs a seen-set for layers {missing}",
                                 layer=missing[0], fix="give each table a seen bitmap, or turn lossy off")
        axis = list(ids_layers) if ids_layers is not None else sorted(layer_ids)
        if sorted(axis) != sorted(layer_ids):
            raise SlackTierError(ErrorKind.BAD_INPUT, f"ids_layers {axis} do not match the tables {layer_ids}",
                                 fix="list every table layer once, in the order of the ids' layer axis")
        # Cache: drop gone layers, re-create ones whose row count changed, forget ones whose data changed.
        for layer in list(self.cache.layers):
            if layer not in layer_ids:
                self.cache.remove_layer(layer)
        for t in tables:
            if t.layer in self.cache.layers and self.cache.layer(t.layer).rows != t.rows:
                self.cache.remove_layer(t.layer)
            elif t.layer in self.cache.layers and t.layer in invalidate:
                self.cache.invalidate_layer(t.layer)
        for t in tables:
            if t.layer not in self.cache.layers:
                self.cache.add_layer(t.layer, t.rows, 0.0)
        self.cache.resize(slots=cache_rows, shares={t.layer: t.cache_share for t in tables})
        old = self._layers
        self._layers = {}
        for t in tables:
            run = _LayerRun(spec=t, axis=axis.index(t.layer), scratch=_Scratch(1))
            if t.layer in old and t.layer not in invalidate and old[t.layer].spec.regions == t.regions:
                run.reader = old[t.layer].reader if t.reference is None else None
            self._layers[t.layer] = run
            self.totals.setdefault(t.layer, LayerCounters())
        self._order = layer_ids
        tokens, self._token_capacity = self._token_capacity, 0
        if tokens:
            self._ensure_capacity(tokens)   # scratch for new layers, a pool for the new layer count
        if self.check:
            for run in self._layers.values():
                self._reader(run)

    def reconfigure(self, tables: Sequence[TableSpec], *, cache_rows: int | None = None,
                    ids_layers: Sequence[int] | None = None, invalidate: Sequence[int] = (),
                    owned_sources: Sequence[PageSource] | None = None, lossy: bool | None = None,
                    check: bool | None = None, owned_only: bool | None = None) -> None:
        """Switch tables, sources, cache size and shares between steps; unchanged layers keep their rows.

        `invalidate`: layers whose bytes changed (their cached rows are dropped).
        `owned_sources`: the sources the engine closes on `close` from now on.
        `owned_only`: switch per-rank mode (ids outside a table's rows are foreign, not errors).
        """
        self._refuse_if_closed()
        if self._in_step:
            raise SlackTierError(ErrorKind.BAD_INPUT, "reconfigure during a step",
                                 fix="call end_step first; configuration changes between steps")
        before = (self.lossy, self.check, self.owned_only)
        if lossy is not None:
            self.lossy = bool(lossy)
        if owned_only is not None:
            self.owned_only = bool(owned_only)
        if check is not None:
            self.check = bool(check)
        try:
            self._configure(list(tables), ids_layers, invalidate, cache_rows)
        except BaseException:
            self.lossy, self.check, self.owned_only = before
            raise
        if owned_sources is not None:
            self._owned_sources = list(owned_sources)

    def replace_cache(self, cache: RowCache) -> None:
        """Serve from a new (empty) cache from the next step on, possibly on another device."""
        self._refuse_if_closed()
        if self._in_step:
            raise SlackTierError(ErrorKind.BAD_INPUT, "replace_cache during a step", fix="call end_step first")
        if cache.device.type == "cuda" and not torch.cuda.is_available():
            raise SlackTierError(ErrorKind.UNAVAILABLE, "device cuda asked but torch sees no CUDA device",
                                 fix='use device="cpu" or run on a machine with a GPU')
        moved = cache.device != self.device
        for layer in list(self.cache.layers):
            self.cache.remove_layer(layer)
        self.cache = cache
        for t in (run.spec for run in self._layers.values()):
            cache.add_layer(t.layer, t.rows, 0.0)
        cache.resize(shares={run.spec.layer: run.spec.cache_share for run in self._layers.values()})
        if moved:
            self._unpin_pool()
            self.device = cache.device
            self.gather_impl = "numba" if self.device.type == "cpu" else "torch"
            if self.device.type == "cuda":
                self._pin_pool()

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

    def _run(self, layer: int) -> _LayerRun:
        try:
            return self._layers[layer]
        except KeyError:
            raise SlackTierError(ErrorKind.MISSING, f"the engine serves no layer {layer} (it serves "
                                 f"{self._order})", layer=layer, fix="pass a layer of the control file") from None

    def _reader(self, run: _LayerRun) -> object:
        if run.spec.reference is not None:
            return run.spec.reference
        if run.reader is None:
            spec = run.spec
            if len(spec.regions) != len(spec.ranks):
                raise SlackTierError(ErrorKind.BAD_INPUT, "the checker needs the table's regions or a reference",
                                     layer=spec.layer, fix="give TableSpec.regions or TableSpec.reference")
            by_rank = {r.rank: r for r in spec.regions}
            regions = [by_rank[r.rank] for r in spec.ranks]
            run.reader = FileRowReader(spec.layer, [r.row_start - spec.row_start for r in spec.ranks],
                                       [r.rows for r in spec.ranks], regions)
        return run.reader

    def _ensure_capacity(self, tokens: int) -> None:
        """Scratch, page pool and hash table for steps of up to `tokens` tokens."""
        if tokens <= self._token_capacity:
            return
        n = tokens * self.columns
        for run in self._layers.values():
            run.scratch = _Scratch(n)
        pages = n * max(1, len(self._layers))
        self._unpin_pool()
        self._pool = PageBufferPool(pages)
        if self.device.type == "cuda":
            self._pin_pool()
        self._htab = np.zeros((1 << _hash_bits(n), 3), dtype=np.int64)   # [H, 3] (stamp, key, value)
        self._token_capacity = tokens

    def _pin_pool(self) -> None:  # pragma: no cover - needs a GPU
        """CUDA: a pinned staging buffer the missed rows are packed into before their host->device copy.

        The page pool itself stays pageable: gather picks the missed rows out of it on the host (264 of
        every 4,096 bytes), so only those bytes cross to the device, from pinned memory, non_blocking.
        """
        assert self._pool is not None
        self._staging = torch.empty(self._pool.capacity * ROW_BYTES, dtype=torch.uint8, pin_memory=True)

    def _unpin_pool(self) -> None:
        if self._staging is not None:  # pragma: no cover - needs a GPU
            torch.cuda.synchronize(self.device)
            self._staging = None

    # ---- the step -----------------------------------------------------------------------------
    def _refuse_if_closed(self) -> None:
        if self._closed:
            raise SlackTierError(ErrorKind.CLOSED, "the step engine is closed",
                                 fix="build a new engine; a closed one takes no more work")

    def begin_step(self, ids: np.ndarray) -> None:
        """Issue every lookup of a step: ids [T, L, 24] int64 table row ids (L in `ids_layers` order)."""
        self._refuse_if_closed()
        if self._in_step:
            raise SlackTierError(ErrorKind.BAD_INPUT, "begin_step while a step is open", fix="call end_step first")
        ids = np.asarray(ids)
        if ids.ndim != 3 or ids.shape[1] != len(self._layers) or ids.shape[2] != self.columns:
            raise SlackTierError(ErrorKind.BAD_INPUT, f"ids are {ids.shape}, want [T, {len(self._layers)}, "
                                 f"{self.columns}]", fix="pass the hasher's [T, L, 24] output")
        if ids.dtype != np.int64:
            ids = ids.astype(np.int64)
        tokens = ids.shape[0]
        self._ensure_capacity(tokens)
        self._in_step = True
        self._step += 1
        self._tokens = tokens
        cache = self.cache
        buf_base = 0
        # One copy puts each layer's lookups contiguous: by_layer[axis] is layer axis's [T * 24] ids.
        by_layer = np.ascontiguousarray(ids.transpose(1, 0, 2)).reshape(ids.shape[1], -1)   # [L, T * 24]
        hbits = _hash_bits(by_layer.shape[1])
        seen_none = _NO_SEEN
        try:
            for layer in self._order:
                run = self._layers[layer]
                run.counters = LayerCounters()
                run.ticket = None
                run.resolved = run.waited = run.gathered = run.failed = False
                flat = by_layer[run.axis]   # [N] int64, contiguous
                run.ids = flat
                spec = run.spec
                cl = cache.layer(layer)
                sc = run.scratch
                run.evictions_before = int(cl.lstate[EVICTIONS])
                self._stamp += 1
                t0 = time.perf_counter_ns()
                status = R.resolve_layer(
                    flat, spec.row_start, spec.rows, self.owned_only, spec.rank_starts, spec.rank_region, self.lossy,
                    spec.seen if spec.seen is not None else seen_none,
                    cl.key, cl.directory, cl.owned, cl.lstate, cache.slot_layer, cache.slot_row, cache.state,
                    cache.fill_miss, cache.step,
                    self._htab, self._stamp, hbits,
                    sc.desc_kind, sc.desc_idx, sc.miss_buf, sc.miss_inpage, sc.miss_slot, sc.miss_row,
                    sc.page_region, sc.page_no, sc.page_buf, buf_base, sc.counts)
                t1 = time.perf_counter_ns()
                counts = sc.counts.tolist()   # Python ints: one call, not one numpy scalar per field
                run.n = flat.shape[0]
                run.n_miss = counts[R.C_MISSES]
                run.n_pages = counts[R.C_PAGES]
                run.resolved = True   # whatever it claimed must be released on abort
                if status != 0:
                    bad = counts[R.C_BAD]
                    raise SlackTierError(ErrorKind.BAD_INPUT, f"row id {int(flat[bad])} (token {bad // self.columns}"
                                         f", column {bad % self.columns}) outside the table's rows "
                                         f"[{spec.row_start}, {spec.row_start + spec.rows})", layer=layer,
                                         fix="hash with the layout the table was staged for (a process serving "
                                         "one rank's shard: StepEngine(..., owned_only=True))")
                if run.n_pages:
                    reads = PageReads(region=sc.page_region[:run.n_pages], page=sc.page_no[:run.n_pages],
                                      buffer=sc.page_buf[:run.n_pages])
                    run.ticket = self._call_source(run, lambda: spec.source.submit(reads, self._pool))
                t2 = time.perf_counter_ns()
                buf_base += run.n_pages
                c = run.counters
                c.lookups = run.n
                c.hits = counts[R.C_HITS]
                c.reused = counts[R.C_REUSE]
                c.rows_read = run.n_miss
                c.pages_read = run.n_pages
                run.n_foreign = counts[R.C_FOREIGN]
                c.zero_rows = counts[R.C_ZERO] + run.n_foreign
                c.bypass = counts[R.C_BYPASS]
                c.resolve_us = (t1 - t0) / 1e3
                c.submit_us = (t2 - t1) / 1e3
        except BaseException:
            self._abort_step()
            raise

    def _call_source(self, run: _LayerRun, fn):
        """Run a source call; name the layer (and rank/page where known) on any error it raises."""
        try:
            return fn()
        except SlackTierError as exc:
            if exc.layer is not None:
                raise
            raise SlackTierError(exc.kind, exc.message, fix=exc.fix, layer=run.spec.layer, rank=exc.rank,
                                 page=exc.page) from exc
        except OSError as exc:
            raise SlackTierError(ErrorKind.IO, f"page source failed: {exc}", layer=run.spec.layer,
                                 fix="check the table's device or server") from exc

    def _wait(self, run: _LayerRun) -> None:
        if run.waited:
            return
        if run.ticket is not None:
            t0 = time.perf_counter_ns()
            try:
                stats = self._call_source(run, lambda: run.spec.source.wait(run.ticket, self.wait_timeout_s))
            except BaseException:
                run.waited = True
                run.failed = True
                self._forget_fills(run)
                raise
            run.counters.wait_us += (time.perf_counter_ns() - t0) / 1e3
            run.counters.read_us += stats.read_us
        run.waited = True

    def _forget_fills(self, run: _LayerRun) -> None:
        if run.resolved and run.n_miss:
            self.cache.forget(run.spec.layer, run.scratch.miss_slot[:run.n_miss])

    def gather(self, layer: int) -> torch.Tensor:
        """Rows of `layer` for this step: bf16 [T, 24, 256] on the engine's device (waits for its reads only)."""
        self._refuse_if_closed()
        if not self._in_step:
            raise SlackTierError(ErrorKind.BAD_INPUT, "gather outside a step", layer=layer,
                                 fix="call begin_step(ids) first")
        run = self._run(layer)
        if run.failed:
            raise SlackTierError(ErrorKind.IO, "this layer's reads failed earlier in the step", layer=layer,
                                 fix="end the step and retry it")
        self._wait(run)
        sc = run.scratch
        t0 = time.perf_counter_ns()
        if self.gather_impl == "numba":
            bits = np.empty((run.n, ROW_VALUES), dtype=np.uint16)
            G.gather_cpu(sc.desc_kind, sc.desc_idx, run.n, sc.miss_buf, sc.miss_inpage, sc.miss_slot, run.n_miss,
                         self._pool.pages, self.cache.weight.numpy(), self.cache.scale.numpy(), G.lut(), bits)
            if run.n_foreign:
                R.fill_foreign(sc.desc_kind, run.n, bits)
            out = torch.from_numpy(bits).view(torch.bfloat16)
        else:
            staging = None
            if self._staging is not None:
                # Each layer stages its missed rows in its own slice of the pinned buffer, so a copy still
                # in flight for one layer is never overwritten by another; end_step synchronizes.
                span = self._token_capacity * self.columns * ROW_BYTES
                staging = self._staging[run.axis * span:(run.axis + 1) * span]
            out = G.gather_torch(sc.desc_kind[:run.n], sc.desc_idx[:run.n], sc.miss_buf[:run.n_miss],
                                 sc.miss_inpage[:run.n_miss], sc.miss_slot[:run.n_miss], self._pool.pages,
                                 self.cache.weight, self.cache.scale, staging)
            if run.n_foreign:
                foreign = np.flatnonzero(sc.desc_kind[:run.n] == R.KIND_FOREIGN)
                out.index_fill_(0, torch.from_numpy(foreign).to(out.device, non_blocking=True), -0.0)
        run.counters.gather_us += (time.perf_counter_ns() - t0) / 1e3
        run.gathered = True
        if self.check:
            self._check(run, out)
        return out.view(self._tokens, self.columns, ROW_VALUES)

    def _check(self, run: _LayerRun, out: torch.Tensor) -> None:
        kinds = run.scratch.desc_kind[:run.n]
        if run.counters.zero_rows:
            keep = np.flatnonzero(kinds <= R.KIND_MISS)   # zero and foreign rows are not the table's
            ours = out[torch.from_numpy(keep)]
            local = run.ids[keep] - run.spec.row_start
        else:
            keep = np.arange(run.n)
            ours = out
            local = run.ids - run.spec.row_start
        ref = reference_gather(self._reader(run).read(local))
        bad = int(mismatching_rows(ours, ref).sum())
        run.counters.checked_rows += int(keep.size)
        run.counters.mismatches += bad
        if bad:
            log.error("checker: %d of %d rows of layer %d differ from the reference gather", bad, keep.size,
                      run.spec.layer)
            if self.check_raise:
                raise SlackTierError(ErrorKind.CHECKSUM, f"{bad} of {keep.size} gathered rows differ from the "
                                     "reference gather", layer=run.spec.layer,
                                     fix="a bug in the cache or gather path: report it with the control file")

    def end_step(self) -> StepCounters:
        """Release the step's pins, publish and return its counters; raises a read error of a layer never gathered."""
        self._refuse_if_closed()
        if not self._in_step:
            raise SlackTierError(ErrorKind.BAD_INPUT, "end_step without begin_step", fix="call begin_step first")
        error: BaseException | None = None
        for layer in self._order:
            run = self._layers[layer]
            try:
                self._wait(run)
            except SlackTierError as exc:
                error = error or exc
            if not run.gathered and not run.failed:
                self._forget_fills(run)
        counters = StepCounters(step=self._step, tokens=self._tokens)
        for layer in self._order:
            run = self._layers[layer]
            run.counters.evictions = int(self.cache.layer(layer).lstate[EVICTIONS]) - run.evictions_before
            counters.layers[layer] = run.counters
            self.totals[layer].add(run.counters)
            run.ids = None
        if self.device.type == "cuda":  # pragma: no cover - needs a GPU
            # The step's host->device copies read pinned staging that the next step rewrites.
            torch.cuda.current_stream(self.device).synchronize()
        self.cache.release_pins()
        self._in_step = False
        self.last_step = counters
        if error is not None:
            raise error
        return counters

    def _abort_step(self) -> None:
        """Undo an open step after an error: wait out submitted reads, forget their fills, release pins."""
        for run in self._layers.values():
            if run.ticket is not None and not run.waited:
                try:
                    run.spec.source.wait(run.ticket, self.wait_timeout_s)
                except BaseException as exc:  # the step is being abandoned; the first error is already raised
                    log.warning("layer %d: read error while aborting the step: %s", run.spec.layer, exc)
                run.waited = True
            if not run.gathered:
                self._forget_fills(run)
            run.resolved = False
            run.ticket = None
        self.cache.release_pins()
        self._in_step = False

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
        for source in self._owned_sources:
            source.close()
        self._unpin_pool()
        self._closed = True

    @property
    def closed(self) -> bool:
        """True once close() ran."""
        return self._closed

    def __enter__(self) -> StepEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- control file -------------------------------------------------------------------------
    @classmethod
    def from_control(cls, path: str, **overrides: object) -> StepEngine:
        """An engine built from a control file (see slacktier.engine.control for the schema)."""
        from slacktier.engine.control import build_engine, load_control
        return build_engine(load_control(path), **overrides)

    def reload(self, path: str) -> None:
        """Switch to the configuration in control file `path` between steps, without a new process."""
        self._refuse_if_closed()
        from slacktier.engine.control import apply_control, load_control
        apply_control(self, load_control(path))


_NO_SEEN = np.zeros(1, dtype=np.uint8)


def _hash_bits(lookups: int) -> int:
    """log2 of the hash table entries one layer's pass uses: at least 4x its lookups (load <= 1/2),
    sized per step so a small step probes a small, cache-resident table. 3,072 lookups -> 14 (16,384)."""
    return max(4, (4 * max(lookups, 1) - 1).bit_length())   # ceil(log2(4 n)), without numpy's scalar calls
