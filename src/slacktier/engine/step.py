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

Control files: `StepEngine.from_config(cfg)` builds an engine that serves a
`slacktier.config.ControlFile` (regions from each table's manifest, a source
per table opened by tier name); `apply(cfg)` switches it to another one
between steps, rebuilding only what changed. Both live in `engine.build`
(these methods forward to it); this module keeps the step, and
`reconfigure`, the one switch between steps that `apply` is built on.

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
from dataclasses import dataclass, field
from pathlib import Path
from time import perf_counter_ns
from typing import TYPE_CHECKING

import numpy as np
import torch

from slacktier.cache import KIND_FOREIGN, KIND_MISS, PassLayer, PassResult, PassScratch, RowCache, fill_foreign
from slacktier.cache.compiled import WHY_BAD, CompiledPass
from slacktier.cache.rowcache import available_bytes, split_slots
from slacktier.cache.rowdir import ROW_LIMIT
from slacktier.engine import gather as G
from slacktier.engine.checker import FileRowReader, mismatching_rows, reference_gather
from slacktier.config import ControlFile, tier_facts, tier_names
from slacktier.engine import build as B
from slacktier.engine.counters import LayerCounters, StepCounters, fill_from_pass
from slacktier.engine.reads import LayerReads
from slacktier.engine.tables import TableSpec
from slacktier.errors import ErrorKind, SlackTierError
from slacktier.store.base import PageBufferPool, PageReads, PageSource
from slacktier.tables.codec import check_convention
from slacktier.tables.layout import PAGE_BYTES, ROW_BYTES, ROW_VALUES, ROWS_PER_PAGE

if TYPE_CHECKING:
    from slacktier.engine.metrics import EngineMetrics

log = logging.getLogger(__name__)

GATHER_IMPLS = ("auto", "numba", "torch")
_KEEP = object()   # reconfigure: an option not given keeps the engine's value


_NO_PASS = PassResult(0, 0, 0, 0, 0, 0, 0, 0, -1)   # a layer's result before its first pass
_INT64 = np.dtype(np.int64)
# PassScratch's arrays per lookup: desc_kind 1, desc_idx 8, miss_buf/inpage/slot 4 each, miss_row 8,
# page_region 4, page_no 8, page_buf 4, own_pos 4, own_row 8
_SCRATCH_BYTES_PER_LOOKUP = 57


@dataclass
class _LayerRun:
    """A layer's state within the engine and within the current step."""

    spec: TableSpec
    axis: int                      # index in ids' layer axis
    scratch: PassScratch
    ids: np.ndarray | None = None  # [T, 24] int64 this step's row ids, copied only when checking
    res: PassResult = _NO_PASS     # this step's directory pass (valid once `resolved`)
    clock: tuple[int, int, int] = (0, 0, 0)   # perf_counter_ns before the pass, after it, after submitting
    resolved: bool = False
    gathered: bool = False
    counters: LayerCounters = field(default_factory=LayerCounters)   # this step's, filled at end_step
    reader: object | None = None


class StepEngine:
    """Serves table layers from page sources through a row cache, step by step."""

    def __init__(self, tables: Sequence[TableSpec], cache: RowCache | None = None, device: str = "cpu", *,
                 ids_layers: Sequence[int] | None = None, max_tokens: int = 256, columns: int = 24,
                 lossy: bool = False, check: bool = False, check_raise: bool = True, gather_impl: str = "auto",
                 wait_timeout_s: float | None = 5.0, owned_sources: Sequence[PageSource] = (),
                 owned_only: bool = False, pad_id: int = -1, metrics: EngineMetrics | None = None,
                 evict_ahead: bool = True, control: B.Applied | None = None, convention: str = "torch") -> None:
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
        self.pad_id = _checked_pad_id(pad_id)
        self.metrics = metrics   # None: no metrics work at all
        self.check = bool(check)
        # With check on, a row that differs from the table's source is never served: gather raises CHECKSUM
        # naming layer, rank and page. check_raise=False only counts and logs them (a diagnostic run that
        # wants every mismatch of a step counted; those rows are served).
        self.check_raise = bool(check_raise)
        # end_step empties as many slots per layer as the step claimed, for the next step's misses
        # (RowCache.evict_ahead): their victims' directory reads leave begin_step for the step's slack.
        self.evict_ahead = bool(evict_ahead)
        self._wait_timeout_s = _checked_timeout(wait_timeout_s)
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
        self._layers: dict[int, _LayerRun] = {}
        self._order: list[int] = []
        self._plan: _Plan | None = None   # built on the first step after any change it depends on
        self._taken = self._unread = 0   # window positions: results taken below _taken, resolved below _unread
        self.last_step: StepCounters | None = None
        self.totals: dict[int, LayerCounters] = {}
        self._warned_outside: set[int] = set()   # layers whose out-of-table ids were logged once
        self._configure(list(tables), ids_layers)
        self._ensure_capacity(max(1, int(max_tokens)))
        if metrics is not None:
            self._bind_metrics()

    # ---- configuration ------------------------------------------------------------------------
    # A change is built in full (`_prepare`: checks, cache geometry, scratch, page pool, checker readers) before
    # anything the engine serves changes (`_commit`), so a refused change leaves the engine exactly as it was.
    def _configure(self, tables: list[TableSpec], ids_layers: Sequence[int] | None,
                   invalidate: Sequence[int] = (), cache_rows: int | None = None) -> None:
        self._commit(self._prepare(tables, ids_layers, invalidate, cache_rows, self.cache, self.lossy, self.check))

    def _prepare(self, tables: list[TableSpec], ids_layers: Sequence[int] | None, invalidate: Sequence[int],
                 cache_rows: int | None, cache: RowCache, lossy: bool, check: bool) -> _Layout:
        """Everything `tables` need, checked and allocated, with nothing the engine serves changed yet."""
        layer_ids = [t.layer for t in tables]
        if len(set(layer_ids)) != len(layer_ids):
            raise SlackTierError(ErrorKind.BAD_INPUT, f"layers {layer_ids} listed twice",
                                 fix="give each table layer once")
        if lossy and any(t.seen is None for t in tables):
            missing = [t.layer for t in tables if t.seen is None]
            raise SlackTierError(ErrorKind.BAD_INPUT, f"lossy mode needs a seen-set for layers {missing}",
                                 layer=missing[0], fix="give each table a seen bitmap, or turn lossy off")
        axis = list(ids_layers) if ids_layers is not None else sorted(layer_ids)
        if sorted(axis) != sorted(layer_ids):
            raise SlackTierError(ErrorKind.BAD_INPUT, f"ids_layers {axis} do not match the tables {layer_ids}",
                                 fix="list every table layer once, in the order of the ids' layer axis")
        # Cache geometry, checked the way RowCache checks it, before the cache is touched.
        slots = cache.slots if cache_rows is None else int(cache_rows)
        if not 0 <= slots <= cache.max_slots:
            raise SlackTierError(ErrorKind.CAPACITY, f"cache budget {slots} rows outside 0..{cache.max_slots}",
                                 fix="reserve a larger max_cache_rows or ask for fewer rows")
        split_slots(slots, {t.layer: t.cache_share for t in tables})
        for t in tables:   # directories are sized to the cache's slots: only the row count is checked
            if not 0 <= t.rows < ROW_LIMIT:
                raise SlackTierError(ErrorKind.BAD_INPUT, f"layer rows {t.rows} outside 0..2**31",
                                     fix="split the table over more processes", layer=t.layer)
        runs: dict[int, _LayerRun] = {}
        for t in tables:
            run = _LayerRun(spec=t, axis=axis.index(t.layer), scratch=PassScratch(1))
            old = self._layers.get(t.layer)
            if old is not None and t.layer not in invalidate and old.spec.regions == t.regions:
                run.reader = old.reader if t.reference is None else None
            runs[t.layer] = run
        pool, tokens = self._allocate(list(runs.values()), self._token_capacity)
        if check:
            for run in runs.values():
                self._reader(run)
        return _Layout(tables, runs, layer_ids, cache, slots, tuple(invalidate), pool, tokens, lossy)

    def _commit(self, layout: _Layout) -> None:
        """Serve `layout` (built by `_prepare`): from here on nothing is refused."""
        moved = layout.cache.device != self.device
        if layout.cache is not self.cache:
            for layer in list(self.cache.layers):
                self.cache.remove_layer(layer)
            self.cache = layout.cache
        cache = self.cache
        rows = {t.layer: t.rows for t in layout.tables}
        # Cache: drop gone layers, re-create ones whose row count changed, forget ones whose data changed.
        for layer in list(cache.layers):
            if layer not in rows or cache.layer(layer).rows != rows[layer]:
                cache.remove_layer(layer)
            elif layer in layout.invalidate:
                cache.invalidate_layer(layer)
        for t in layout.tables:
            if t.layer not in cache.layers:
                cache.add_layer(t.layer, t.rows, 0.0)
        cache.resize(slots=layout.slots, shares={t.layer: t.cache_share for t in layout.tables})
        if layout.lossy:
            for t in layout.tables:
                _forget_unseen(cache, t)
        self._layers = layout.runs
        self._order = layout.order
        # (axis, map) of every layer served under a rank partition other than columns (tables.partition)
        self._row_maps = [(run.axis, run.spec.row_map) for run in self._layers.values()
                          if run.spec.row_map is not None]
        self._plan = None
        for t in layout.tables:
            self.totals.setdefault(t.layer, LayerCounters())
        if layout.pool is not self._pool or moved:
            self._unpin_pool()
            self._pool = layout.pool
            if moved:
                self.device = layout.cache.device
                self.gather_impl = "numba" if self.device.type == "cpu" else "torch"
            if self._pool is not None and self.device.type == "cuda":
                self._pin_pool()
        self._token_capacity = layout.tokens

    def _allocate(self, runs: list[_LayerRun], tokens: int) -> tuple[PageBufferPool | None, int]:
        """Scratch (into `runs`) and a page pool for steps of up to `tokens` tokens; the current pool when it
        is the right size. Refused (CAPACITY) before allocating when host memory cannot hold them."""
        if tokens <= 0:
            return self._pool, 0
        n = tokens * self.columns
        pages = n * max(1, len(runs))
        need = len(runs) * n * _SCRATCH_BYTES_PER_LOOKUP + pages * PAGE_BYTES
        available_bytes(torch.device("cpu")).refuse(need, f"scratch and page buffers for steps of {tokens} tokens "
                                                          f"({pages} pages)")
        try:
            scratch = [PassScratch(n) for _ in runs]
            pool = self._pool if self._pool is not None and self._pool.capacity == pages else PageBufferPool(pages)
        except (MemoryError, OSError) as exc:
            raise SlackTierError(ErrorKind.CAPACITY, f"scratch and page buffers for steps of {tokens} tokens "
                                 f"({need / 2**30:.2f} GiB) could not be allocated: {exc}",
                                 fix="send fewer tokens per step (split the batch), or lower max_tokens") from None
        for run, s in zip(runs, scratch, strict=True):
            run.scratch = s
        return pool, tokens

    @property
    def wait_timeout_s(self) -> float | None:
        """How long a gather (and end_step) waits for a layer's reads before it times out (None: no bound)."""
        return self._wait_timeout_s

    @wait_timeout_s.setter
    def wait_timeout_s(self, timeout_s: float | None) -> None:
        # the step in flight's waits too, not only the next step's: a caller that raises the bound after a
        # timeout must not have the step's remaining waits (end_step's) keep the old one
        self._wait_timeout_s = _checked_timeout(timeout_s)
        reads = self.__dict__.get("_reads")
        if reads is not None:
            reads.timeout_s = self._wait_timeout_s

    def reconfigure(self, tables: Sequence[TableSpec], *, cache_rows: int | None = None,
                    ids_layers: Sequence[int] | None = None, invalidate: Sequence[int] = (),
                    owned_sources: Sequence[PageSource] | None = None, lossy: bool | None = None,
                    check: bool | None = None, owned_only: bool | None = None, pad_id: int | None = None,
                    evict_ahead: bool | None = None, cache: RowCache | None = None, wait_timeout_s: float | None | object = _KEEP,
                    metrics: EngineMetrics | None | object = _KEEP, control: B.Applied | None | object = _KEEP
                    ) -> None:
        """Switch tables, sources, cache size and shares between steps; unchanged layers keep their rows.

        A refused switch changes nothing. `invalidate`: layers whose bytes changed (their cached rows are
        dropped). `owned_sources`: the sources the engine closes on `close` from now on. `owned_only`: switch
        per-rank mode (ids outside a table's rows are foreign, not errors). `pad_id`: the id padded lookups
        carry (negative). `evict_ahead`: whether end_step empties the next step's victim slots. `cache`: a
        new (empty) cache to serve from, possibly on another device. `wait_timeout_s`, `metrics` (None: off) and `control` (engine.build's record of the control file
        served, None: none) replace the engine's when given.
        """
        self._refuse_if_closed()
        if self._in_step:
            raise SlackTierError(ErrorKind.BAD_INPUT, "reconfigure during a step",
                                 fix="call end_step first; configuration changes between steps")
        if pad_id is not None:
            _checked_pad_id(pad_id)
        if wait_timeout_s is not _KEEP:
            wait_timeout_s = _checked_timeout(wait_timeout_s)
        if cache is not None and cache.device.type == "cuda" and not torch.cuda.is_available():
            raise SlackTierError(ErrorKind.UNAVAILABLE, "device cuda asked but torch sees no CUDA device",
                                 fix='use device="cpu" or run on a machine with a GPU')
        lossy = self.lossy if lossy is None else bool(lossy)
        check = self.check if check is None else bool(check)
        self._commit(self._prepare(list(tables), ids_layers, invalidate, cache_rows,
                                   self.cache if cache is None else cache, lossy, check))
        self.lossy, self.check = lossy, check
        if owned_only is not None:
            self.owned_only = bool(owned_only)
        if owned_sources is not None:
            self._owned_sources[:] = list(owned_sources)
        if pad_id is not None:
            self.pad_id = int(pad_id)
        if evict_ahead is not None:
            self.evict_ahead = bool(evict_ahead)
        if wait_timeout_s is not _KEEP:
            self.wait_timeout_s = wait_timeout_s
            self._reads = LayerReads(wait_timeout_s)
        if control is not _KEEP:
            self._applied = control
        if metrics is not _KEEP:
            self.metrics = metrics
        if self.metrics is not None:
            self._bind_metrics()

    def replace_cache(self, cache: RowCache) -> None:
        """Serve from a new (empty) cache from the next step on, possibly on another device."""
        self._refuse_if_closed()
        if self._in_step:
            raise SlackTierError(ErrorKind.BAD_INPUT, "replace_cache during a step", fix="call end_step first")
        if cache.device.type == "cuda" and not torch.cuda.is_available():
            raise SlackTierError(ErrorKind.UNAVAILABLE, "device cuda asked but torch sees no CUDA device",
                                 fix='use device="cpu" or run on a machine with a GPU')
        tables = [self._layers[layer].spec for layer in self._order]
        self._commit(self._prepare(tables, self.ids_layers, (), None, cache, self.lossy, self.check))

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
            regions = spec.regions
            run.reader = FileRowReader(spec.layer, [r.row_start - spec.row_start for r in regions],
                                       [r.rows for r in regions], regions)
        return run.reader

    def _ensure_capacity(self, tokens: int) -> None:
        """Scratch and page pool for steps of up to `tokens` tokens (refused, CAPACITY, before allocating
        what host memory cannot hold; the engine is unchanged then)."""
        if tokens <= self._token_capacity:
            return
        pool, _ = self._allocate(list(self._layers.values()), tokens)
        self._plan = None
        if pool is not self._pool:
            self._unpin_pool()
            self._pool = pool
            if self.device.type == "cuda":
                self._pin_pool()
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

    def _bind_metrics(self) -> None:
        """Label each layer's series with its tier and rank (from the control file when there is one)."""
        from slacktier.engine.metrics import LayerLabels
        applied = self._applied
        labels = []
        for layer in self._order:
            spec = self._layers[layer].spec
            if applied is not None and layer in applied.resolved:
                t = applied.resolved[layer].config
                tier, rank = t.source, t.rank
            else:
                tier = getattr(spec.source, "tier", None) or type(spec.source).__name__
                rank = spec.regions[0].rank if len(spec.regions) == 1 and self.owned_only else -1
            host = sum(r.nbytes for r in spec.regions) if tier in tier_names() and tier_facts(tier).holds_host_copy \
                else 0
            labels.append(LayerLabels(layer, tier, rank, self.cache.owned_slots(layer), host))
        self.metrics.bind(labels)

    # ---- the step -----------------------------------------------------------------------------
    def _refuse_if_closed(self) -> None:
        if self._closed:
            raise SlackTierError(ErrorKind.CLOSED, "the step engine is closed",
                                 fix="build a new engine; a closed one takes no more work")

    def _checked_ids(self, ids: np.ndarray) -> np.ndarray:
        """`ids` as C-contiguous [T, L, 24] int64, or a BAD_INPUT error (counted in the metrics, when on)."""
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
        return np.ascontiguousarray(ids)   # the one layout the compiled pass takes

    def begin_step(self, ids: np.ndarray) -> None:
        """Issue every lookup of a step: ids [T, L, 24] int64 table row ids (L in `ids_layers` order).

        int32 ids are taken too (widened exactly); every other dtype is refused, unsigned ones included."""
        # The usual step (a plan built, the hasher's C-contiguous int64 ids of a known shape and size) takes
        # the checks below inline rather than through _refuse_if_closed, _checked_ids and _ensure_capacity:
        # the last step left the interpreter's memory out of cache, so each call and attribute here costs
        # misses (measured: the Python around the compiled call is faster this way, on warm and fresh steps alike).
        plan = self._plan
        if (plan is None or self._in_step or self._closed or type(ids) is not np.ndarray or ids.dtype is not _INT64
                or ids.shape[1:] != plan.cp.ids_shape or ids.shape[0] > self._token_capacity
                or not ids.flags.c_contiguous):
            self._refuse_if_closed()
            ids = self._checked_ids(ids)
            self._ensure_capacity(ids.shape[0])
        if self._row_maps:   # a rank partition other than columns: the pass reads stored rows
            ids = self._stored_ids(ids)
        tokens = ids.shape[0]
        self._in_step = True
        self._step += 1
        self._tokens = tokens
        # This pass is on the step's critical path (Eq. 1's s): per layer it resolves, submits and keeps
        # the PassResult and three clock readings; end_step turns them into the layer's counters.
        try:
            self._resolve(ids)
        except BaseException as exc:
            self._abort_step()
            if self.metrics is not None:
                self.metrics.error(exc)
            raise

    def _stored_ids(self, ids: np.ndarray) -> np.ndarray:
        """The step's ids with each partitioned layer's global row ids as its stored rows (TableSpec.row_map);
        pad and out-of-table ids stay outside the stored rows, so the pass pads or zero-fills them."""
        out = ids.copy()
        for axis, row_map in self._row_maps:
            row_map.to_stored(ids[:, axis, :], out[:, axis, :])
        return out

    def _resolve(self, ids: np.ndarray) -> None:
        """begin_step's passes and submissions: the cache's compiled pass over every layer (cache.compiled);
        Python runs between layers only where a layer's pages go to a source without a C engine, or an id is
        bad. The passes' results and the booking of their C jobs wait for the step's first gather
        (`_take_results`): the reads are in flight once the call returns, and what is left is bookkeeping."""
        plan = self._plan
        if plan is None or plan.cp.stale() or plan.pool is not self._pool:
            plan = self._plan = self._build_plan()
        cp = plan.cp
        cp.start(ids.shape[0])
        runs, n_layers = plan.runs, len(plan.runs)
        self._taken = self._unread = start = 0
        while True:
            # The clients' locks are held around the call (see store.disk.NativeLane). A `with` per lock does not
            # fit a set of locks that varies per plan, and ExitStack costs microseconds on this path.
            held = 0
            try:
                for lane, layers in plan.natives:
                    lane.lock.acquire()
                    held += 1
                    handle = lane.handle()
                    for i in layers:
                        cp.set_engine(i, handle)
                stop, why = cp.run(ids, start)
            finally:
                for lane, _ in plan.natives[:held]:
                    lane.lock.release()
            self._unread = min(stop + 1, n_layers)   # layers before this one have results to take
            # Taken now where layer `stop` stopped the call: an id outside its table, or pages for Python to submit.
            if stop < n_layers:
                self._take_results()
            if self.check:
                for run in runs[start:self._unread]:
                    run.ids = ids[:, run.axis, :].copy()   # the checker reads them at gather
            if stop == n_layers:
                return
            run = runs[stop]
            res = run.res
            if why == WHY_BAD:
                self._refuse_row(run, ids[:, run.axis, :], res.bad_index)
            sc = run.scratch
            self._reads.submit(run.spec.layer, run.spec.source, PageReads(
                region=sc.page_region[:res.pages], page=sc.page_no[:res.pages], buffer=sc.page_buf[:res.pages]),
                self._pool)
            run.clock = (run.clock[0], run.clock[1], perf_counter_ns())
            start = stop + 1

    def _take_results(self) -> None:
        """Take the compiled pass's results of the layers it resolved since the last take, and book the jobs
        it queued on C engine clients as tickets of their sources (each under its client's lock). Every use
        of a layer's result or reads in the step (gather, end_step, an abort) takes them first."""
        lo, hi = self._taken, self._unread
        if lo >= hi:
            return
        self._taken = hi
        plan = self._plan
        runs, lanes, pool, reads = plan.runs, plan.lanes, plan.pool, self._reads
        for i, (res, job, clock) in enumerate(plan.cp.results(lo, hi - 1), lo):
            run = runs[i]
            run.res = res
            run.resolved = True   # whatever it claimed must be released on abort
            run.clock = clock
            if job:
                lane = lanes[i]
                with lane.lock:
                    ticket = lane.adopt(job, res.pages, pool)
                reads.adopt(run.spec.layer, lane.source, ticket, res.pages)

    def _build_plan(self) -> _Plan:
        """The cache's compiled pass over the engine's layers, cache and scratch as they are now, with the
        device queue client each layer's pages go to."""
        runs = [self._layers[layer] for layer in self._order]
        lanes: list[object | None] = []
        natives: dict[int, tuple[object | None, list[int]]] = {}   # per source: its NativeLane or None, its layers
        for i, run in enumerate(runs):
            source = run.spec.source
            if id(source) not in natives:   # native_lane: a capability of sources whose queue has a lane
                make = getattr(source, "native_lane", None)
                natives[id(source)] = (make() if callable(make) else None, [])
            lane, layers = natives[id(source)]
            if lane is not None:
                layers.append(i)
            lanes.append(lane)
        cp = self.cache.compiled_pass(
            [PassLayer(run.spec.layer, run.axis, run.spec.geometry, run.scratch) for run in runs],
            columns=self.columns, owned_only=self.owned_only, lossy=self.lossy, pad_id=self.pad_id,
            pool_base=self._pool.base, pool_buffers=self._pool.capacity)
        for i, lane in enumerate(lanes):   # each lane's own submit: st_eng_submit, or another of its signature
            if lane is not None:
                cp.set_submit_fn(i, lane.submit_address)
        return _Plan(cp, self._pool, runs, lanes, [(lane, layers) for lane, layers in natives.values() if lane])

    def _refuse_row(self, run: _LayerRun, lookups: np.ndarray, bad: int) -> None:
        spec = run.spec
        token, column = divmod(bad, self.columns)
        raise SlackTierError(ErrorKind.BAD_INPUT, f"row id {int(lookups[token, column])} (token {token}, column "
                             f"{column}) outside the table's rows [{spec.row_start}, "
                             f"{spec.row_start + spec.rows})", layer=spec.layer,
                             fix="hash with the layout the table was staged for (a process serving one rank's "
                             "shard: StepEngine(..., owned_only=True))")

    @staticmethod
    def _count(run: _LayerRun) -> LayerCounters:
        """The step's counters of `run`: its pass's result and clock readings, and what gather added."""
        c = run.counters
        t0, t1, t2 = run.clock
        fill_from_pass(c, run.res)
        c.resolve_us = (t1 - t0) / 1e3
        c.submit_us = (t2 - t1) / 1e3
        return c

    def _wait(self, run: _LayerRun) -> None:
        """Wait for `run`'s reads; on failure forget the slots they would have filled, then raise."""
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

    def _forget_fills(self, run: _LayerRun) -> None:
        if run.resolved and run.res.misses:
            self.cache.forget(run.spec.layer, run.scratch.miss_slot[:run.res.misses])

    def gather(self, layer: int) -> torch.Tensor:
        """Rows of `layer` for this step: bf16 [T, 24, 256] on the engine's device (waits for its reads only)."""
        self._refuse_if_closed()
        if not self._in_step:
            raise SlackTierError(ErrorKind.BAD_INPUT, "gather outside a step", layer=layer,
                                 fix="call begin_step(ids) first")
        run = self._run(layer)
        self._take_results()
        self._wait(run)
        sc = run.scratch
        n, n_miss, n_foreign = run.res.lookups, run.res.misses, run.res.foreign
        t0 = perf_counter_ns()
        if self.gather_impl == "numba":
            bits = np.empty((n, ROW_VALUES), dtype=np.uint16)
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
            self._check(run, out)
        return out.view(self._tokens, self.columns, ROW_VALUES)

    def _check(self, run: _LayerRun, out: torch.Tensor) -> None:
        kinds = run.scratch.desc_kind[:run.res.lookups]
        if run.res.zero or run.res.foreign or run.res.padded or run.res.outside:
            keep = np.flatnonzero(kinds <= KIND_MISS)   # zero and foreign rows are not the table's
            ours = out[torch.from_numpy(keep)]
            local = run.ids.reshape(-1)[keep] - run.spec.row_start
        else:
            keep = np.arange(run.res.lookups)
            ours = out
            local = run.ids.reshape(-1) - run.spec.row_start
        ref = reference_gather(self._reader(run).read(local), self.convention)
        differ = mismatching_rows(ours, ref)
        bad = int(differ.sum())
        run.counters.checked_rows += int(keep.size)
        run.counters.mismatches += bad
        if bad:
            log.error("checker: %d of %d rows of layer %d differ from the reference gather", bad, keep.size,
                      run.spec.layer)
            if self.check_raise:
                raise self._refuse_mismatch(run, keep[differ.numpy()], local[differ.numpy()], bad, keep.size)

    def _refuse_mismatch(self, run: _LayerRun, lookups: np.ndarray, local: np.ndarray, bad: int,
                         checked: int) -> SlackTierError:
        """The CHECKSUM error of rows the checker found wrong, naming the first one's rank and page; the slots
        those rows were cached in (hits or this step's fills) are forgotten, so no later step serves them."""
        sc = run.scratch
        kind, idx = sc.desc_kind[lookups], sc.desc_idx[lookups]
        slots = np.where(kind == KIND_MISS, sc.miss_slot[np.where(kind == KIND_MISS, idx, 0)], idx)
        self.cache.forget(run.spec.layer, slots.astype(np.int32))
        row = int(local[0]) + run.spec.row_start   # global row id of the first wrong row
        region = next(r for r in run.spec.regions if r.row_start <= row < r.row_start + r.rows)
        shard_row = row - region.row_start
        exc = SlackTierError(ErrorKind.CHECKSUM, f"{bad} of {checked} gathered rows differ from the table's source "
                             f"(first: row {row}, shard row {shard_row}); none is served", layer=run.spec.layer,
                             rank=region.rank, page=shard_row // ROWS_PER_PAGE,
                             fix="the medium or the manifest does not hold the table: run `slacktier verify` on "
                                 "its manifest and stage it again")
        if self.metrics is not None:
            self.metrics.error(exc)
        return exc

    def end_step(self) -> StepCounters:
        """Release the step's pins, publish and return its counters; raises a read error of a layer never gathered."""
        self._refuse_if_closed()
        if not self._in_step:
            raise SlackTierError(ErrorKind.BAD_INPUT, "end_step without begin_step", fix="call begin_step first")
        self._take_results()
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
            c = self._count(run)
            counters.layers[layer] = c
            self.totals[layer].add(c)
            run.ids = None
            if c.out_of_table and layer not in self._warned_outside:
                self._warned_outside.add(layer)
                log.warning("layer %d: %d ids outside the layer were served as zero rows (as the serving engines' "
                            "own lookups serve them; counted in out_of_table): the hasher's layout may not be the "
                            "table's", layer, c.out_of_table)
        self._finish_step()
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

    def _abort_step(self) -> None:
        """Undo an open step after an error: wait out submitted reads, forget their fills, release pins."""
        self._take_results()
        for exc in self._reads.drain():   # the step is being abandoned; the first error is already raised
            log.warning("layer %s: read error while aborting the step: %s", exc.layer, exc)
        for run in self._layers.values():
            if not run.gathered:
                self._forget_fills(run)
            run.resolved = False
        self._finish_step()

    def _finish_step(self) -> None:
        if self.device.type == "cuda":  # pragma: no cover - needs a GPU
            # The step's host->device copies read pinned staging that the next step rewrites.
            torch.cuda.current_stream(self.device).synchronize()
        if self._reads.tainted:
            # A read timed out and may still land: its buffers are never handed out again. The old pool
            # stays alive for as long as the source holds it; the next step reads into a fresh one.
            log.warning("a read timed out: retiring the page buffer pool (%d buffers)", self._pool.capacity)
            self._unpin_pool()
            self._pool = PageBufferPool(self._pool.capacity)
            if self.device.type == "cuda":
                self._pin_pool()
            self.retired_pools += 1
        self._reads = LayerReads(self.wait_timeout_s)
        self.cache.release_pins()
        for run in self._layers.values():   # the next step's, made here rather than on its critical path
            run.counters = LayerCounters()
            run.resolved = run.gathered = False
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
        self._finalizer.detach()
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

    # ---- control file (engine.build) ------------------------------------------------------------
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

    @property
    def config(self) -> ControlFile | None:
        """The control file this engine serves, when it was built from one."""
        return self._applied.control if self._applied is not None else None

    @property
    def control_state(self) -> B.Applied | None:
        """engine.build's record of the control file served (its resolved tables and open sources), if any."""
        return self._applied

    def apply(self, cfg: ControlFile) -> None:
        """Switch to `cfg` between steps, in place, rebuilding only what changed (engine.build.apply)."""
        B.apply(self, cfg)

    def reload(self, path: str | Path) -> None:
        """Switch to the control file at `path` between steps, without a new process."""
        B.reload(self, path)


@dataclass
class _Plan:
    """The step's compiled pass and the device queue clients its layers' pages go to (`_build_plan`)."""

    cp: CompiledPass
    pool: PageBufferPool            # the page pool it names; a new pool needs a new plan
    runs: list[_LayerRun]           # the engine's layer runs, in window order
    lanes: list[object | None]      # their sources' NativeLane (store.disk), None: Python submits
    natives: list[tuple[object, list[int]]]   # (NativeLane, the indices of its layers), one per such client


@dataclass
class _Layout:
    """A configuration change, checked and allocated by `StepEngine._prepare`, served once committed."""

    tables: list[TableSpec]
    runs: dict[int, _LayerRun]
    order: list[int]
    cache: RowCache           # the engine's cache, or a new one that replaces it
    slots: int                # the cache's slot budget
    invalidate: tuple[int, ...]
    pool: PageBufferPool | None
    tokens: int               # steps of up to this many tokens fit the runs' scratch and the pool
    lossy: bool = False       # served lossy: cached rows outside a table's seen-set are dropped on commit


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


def _forget_unseen(cache: RowCache, table: TableSpec) -> None:
    """Drop the cached rows of `table` that its seen-set does not hold: a lossy row outside the seen-set is
    zeros, so a row cached under a wider seen-set (or before lossy mode) must not be served from the cache.
    Worked example: seen bitmap [0b00000101] (rows 0 and 2), cached rows 0, 1, 2 -> the slot of row 1 is freed."""
    if table.seen is None:
        return
    rows, slots = cache.cached(table.layer)   # [n] int64 local rows, [n] int32 slots
    if not rows.shape[0]:
        return
    seen = (table.seen[rows >> 3] >> (rows & 7).astype(np.uint8)) & 1
    unseen = slots[seen == 0]
    if unseen.shape[0]:
        cache.forget(table.layer, unseen)
        log.info("layer %d: %d cached rows outside the seen-set dropped", table.layer, unseen.shape[0])


def _widened_ids(ids: np.ndarray) -> np.ndarray:
    """int32 ids widened to int64 (exact); any other dtype is refused naming it (BAD_INPUT).

    Only signed int64 (the hashers' output) and signed int32 (a serving engine's int32 index tensors) are
    ids. Unsigned ids are never cast: uint64 2**64-1 would wrap to -1, the pad id, and be served as a
    zero row; floats (12.7 -> 12) and bools would be truncated into another row."""
    if ids.dtype == np.int32:
        return ids.astype(np.int64)
    raise SlackTierError(ErrorKind.BAD_INPUT, f"ids are {ids.dtype}, want int64 (or int32) row ids",
                         fix="pass the hasher's int64 row ids; an unsigned, float or bool array is never cast")


def _checked_timeout(timeout_s: float | None) -> float | None:
    """`timeout_s` when None (no bound) or a number in (0, 86400] (a day, as the control file's wait_timeout_ms);
    anything else (inf, NaN, 1e13 overflow the platform's wait) is refused naming it (BAD_INPUT)."""
    if timeout_s is None:
        return None
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not 0 < timeout_s <= 86_400:
        raise SlackTierError(ErrorKind.BAD_INPUT, f"wait_timeout_s {timeout_s!r} is outside (0, 86400]",
                             fix="bound reads' waits by at most a day (or None for no bound)")
    return float(timeout_s)


def _checked_pad_id(pad_id: int) -> int:
    """`pad_id` as an int; refuses one that could be a row id (>= 0)."""
    if int(pad_id) >= 0:
        raise SlackTierError(ErrorKind.BAD_INPUT, f"pad_id {pad_id} is a row id",
                             fix="pad with a negative id (-1, as vLLM does)")
    return int(pad_id)

