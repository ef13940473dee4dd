"""What a step engine serves, and its one way to change it between steps: `apply`, all or nothing.

`StepEngine.apply(what)` forwards here. `what` is one of
- a `ControlFile`: switch to it, rebuilding only what changed (engine.build tells what: a table whose tier
  and regions are unchanged keeps its open source, one whose bytes are unchanged keeps its cached rows);
- a path (str or Path): the control file there, its errors naming the file;
- a `Change`: tables, a new cache, a cache budget or a mode, given directly (any engine, built from a
  control file or not).

All or nothing: a change is built in full (`prepare`: checks, cache geometry, scratch, page pool, checker
readers; for a control file also its sources, seen-sets and manifests) before anything the engine serves
changes (`commit`), so a refused change leaves the engine exactly as it was and closes what it opened.

Worked example: `engine.apply(Change(cache_rows=0))` -> every layer keeps its table and source, the cache
is resized to no slots (its rows dropped), the next step reads every row; `engine.apply("tier.toml")` with
layer 14 moved from disk to redis over the same manifest -> a Redis source opens, the disk source closes,
layer 14's cached rows stay.

This module and engine.step are the only code that writes the engine's state; this one between steps only.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from slacktier.cache import ADMISSIONS, NO_HEAT, PassScratch, RowCache, token_heat
from slacktier.cache.rowcache import available_bytes, split_slots
from slacktier.cache.rowdir import ROW_LIMIT
from slacktier.config import ControlFile, load_control, named_by
from slacktier.engine import build as B
from slacktier.engine.counters import LayerCounters
from slacktier.engine.hooks import bind_metrics, row_reader
from slacktier.engine.reads import LayerReads
from slacktier.engine.runs import LayerRun
from slacktier.engine.tables import TableSpec
from slacktier.errors import ErrorKind, SlackTierError
from slacktier.store.base import PageBufferPool, PageSource
from slacktier.tables.layout import PAGE_BYTES, ROW_BYTES

if TYPE_CHECKING:
    from slacktier.engine.metrics import EngineMetrics

log = logging.getLogger(__name__)

KEEP: Any = object()   # a Change field left at KEEP keeps the engine's value (where None is a value)
# PassScratch's arrays per lookup: desc_kind 1, desc_idx 8, miss_buf/inpage/slot 4 each, miss_row 8,
# page_region 4, page_no 8, page_buf 4, own_pos 4, own_row 8
SCRATCH_BYTES_PER_LOOKUP = 57


@dataclass(frozen=True)
class Change:
    """A change of what an engine serves, applied between steps (`StepEngine.apply`); fields left out keep theirs.

    `tables`: the tables to serve (unchanged layers keep their cached rows); `ids_layers`: the ids' layer
    axis (None: ascending layer ids when `tables` is given, the current axis otherwise); `invalidate`: layers
    whose bytes changed (their cached rows are dropped); `cache`: a new (empty) cache to serve from, possibly
    on another device; `cache_rows`: the cache's slot budget; `owned_sources`: the sources the engine closes
    on `close` from now on; `owned_only`: per-rank mode (ids outside a table's rows are foreign, not errors);
    `pad_id`: the id padded lookups carry (negative); `evict_ahead`: whether end_step empties the next step's
    victim slots; `admission`: the cache's admission rule (`cache.ADMISSIONS`); `wait_timeout_s`, `metrics`
    (None: off) and `control` (engine.build's record of the control file served, None: none) replace the
    engine's unless left at KEEP.
    """

    tables: Sequence[TableSpec] | None = None
    cache: RowCache | None = None
    cache_rows: int | None = None
    ids_layers: Sequence[int] | None = None
    invalidate: Sequence[int] = ()
    owned_sources: Sequence[PageSource] | None = None
    lossy: bool | None = None
    check: bool | None = None
    owned_only: bool | None = None
    pad_id: int | None = None
    evict_ahead: bool | None = None
    admission: str | None = None
    wait_timeout_s: float | None = KEEP
    metrics: EngineMetrics | None = KEEP
    control: B.Applied | None = KEEP


@dataclass
class Layout:
    """A configuration change, checked and allocated by `prepare`, served once committed."""

    tables: list[TableSpec]
    runs: dict[int, LayerRun]
    order: list[int]
    cache: RowCache           # the engine's cache, or a new one that replaces it
    slots: int                # the cache's slot budget
    invalidate: tuple[int, ...]
    pool: PageBufferPool | None
    tokens: int               # steps of up to this many tokens fit the runs' scratch and the pool
    lossy: bool = False       # served lossy: cached rows outside a table's seen-set are dropped on commit


def apply(engine: Any, what: ControlFile | str | Path | Change) -> None:
    """Switch `engine` (a StepEngine) to `what` between steps, all or nothing (module doc)."""
    if engine.closed:
        raise SlackTierError(ErrorKind.CLOSED, "the step engine is closed",
                             fix="build a new engine; a closed one takes no more work")
    if engine.in_step:
        raise SlackTierError(ErrorKind.BAD_INPUT, "apply during a step", fix="call end_step first")
    if isinstance(what, Change):
        _switch(engine, what)
    elif isinstance(what, ControlFile):
        _apply_control(engine, what)
    elif isinstance(what, (str, Path)):
        cfg = load_control(what)
        with named_by(what):
            _apply_control(engine, cfg)
    else:
        raise SlackTierError(ErrorKind.BAD_INPUT, f"apply takes a ControlFile, a path or a Change, not "
                             f"{type(what).__name__}", fix="pass the control file (or its path) to serve")


def _apply_control(engine: Any, cfg: ControlFile) -> None:
    """Switch to control file `cfg`: resolve and open everything it needs, then one `_switch`; on a refusal
    close what was opened, on success the sources nothing serves any more."""
    live: B.Applied | None = engine.control_state
    if live is None:
        raise SlackTierError(ErrorKind.BAD_INPUT, "this engine was not built from a control file",
                             fix="build it with StepEngine.from_config(cfg) or from_control(path)")
    eng = cfg.engine
    resolved = B.resolve_control(cfg)
    opened: dict[int, PageSource] = {}
    sources: dict[int, PageSource] = {}
    try:
        for t in cfg.tables:
            old = live.resolved.get(t.layer)
            if old is not None and old.source_key == resolved[t.layer].source_key:
                B.check_kept_source(resolved[t.layer])
                sources[t.layer] = live.sources[t.layer]
            else:
                sources[t.layer] = opened[t.layer] = B.open_table_source(resolved[t.layer])
                if old is not None:
                    B.refuse_queue_change(old, resolved[t.layer], sources[t.layer])
        specs = [B.table_spec(resolved[t.layer], sources[t.layer], eng.check) for t in cfg.tables]
        invalidate = [layer for layer, r in resolved.items()
                      if layer in live.resolved and live.resolved[layer].data_key != r.data_key]
        old_eng = live.control.engine
        cache = None
        if (eng.device, eng.max_cache_rows) != (old_eng.device, old_eng.max_cache_rows):
            B.check_device(eng.device)
            cache = RowCache(eng.max_cache_rows, eng.device, slots=0)
        metrics = engine.metrics
        if eng.metrics and metrics is None:
            from slacktier.engine.metrics import EngineMetrics
            metrics = EngineMetrics()
        elif not eng.metrics and old_eng.metrics:
            metrics = None   # switched off by the control file (a host-given one stays otherwise)
        _switch(engine, Change(tables=specs, cache_rows=eng.cache_rows, invalidate=invalidate,
                               owned_sources=list(sources.values()), lossy=eng.lossy, check=eng.check,
                               owned_only=eng.owned_only, pad_id=eng.pad_id, evict_ahead=eng.evict_ahead,
                               admission=eng.admission,
                               cache=cache, wait_timeout_s=eng.wait_timeout_ms / 1e3, metrics=metrics,
                               control=B.Applied(cfg, resolved, sources)))
    except BaseException:
        for s in opened.values():
            s.close()
        raise
    for s in live.sources.values():
        if all(s is not kept for kept in sources.values()):
            s.close()
    log.info("applied a control file: %d tables, %d sources reopened, %d layers' cache dropped",
             len(cfg.tables), len(opened), len(invalidate))


def _switch(engine: Any, ch: Change) -> None:
    """Apply `ch`: every check first, then `commit`, then the plain settings (none of which can be refused)."""
    if ch.pad_id is not None:
        checked_pad_id(ch.pad_id)
    if ch.admission is not None:
        checked_admission(ch.admission)
    timeout = ch.wait_timeout_s if ch.wait_timeout_s is KEEP else checked_timeout(ch.wait_timeout_s)
    if ch.cache is not None and ch.cache.device.type == "cuda" and not torch.cuda.is_available():
        raise SlackTierError(ErrorKind.UNAVAILABLE, "device cuda asked but torch sees no CUDA device",
                             fix='use device="cpu" or run on a machine with a GPU')
    if ch.tables is None:
        tables = [engine._layers[layer].spec for layer in engine._order]
        ids_layers = engine.ids_layers if ch.ids_layers is None else ch.ids_layers
    else:
        tables, ids_layers = list(ch.tables), ch.ids_layers
    lossy = engine.lossy if ch.lossy is None else bool(ch.lossy)
    check = engine.check if ch.check is None else bool(ch.check)
    commit(engine, prepare(engine, tables, ids_layers, ch.invalidate, ch.cache_rows,
                           engine.cache if ch.cache is None else ch.cache, lossy, check))
    engine.lossy, engine.check = lossy, check
    if ch.owned_only is not None:
        engine.owned_only = bool(ch.owned_only)
    if ch.owned_sources is not None:
        engine._owned_sources[:] = list(ch.owned_sources)   # in place: the engine's finalizer holds the list
    if ch.pad_id is not None:
        engine.pad_id = int(ch.pad_id)
    if ch.evict_ahead is not None:
        engine.evict_ahead = bool(ch.evict_ahead)
    if ch.admission is not None:
        engine.admission = ch.admission
    if timeout is not KEEP:
        engine.wait_timeout_s = timeout
        engine._reads = LayerReads(timeout)
    if ch.control is not KEEP:
        engine._applied = ch.control
    if ch.metrics is not KEEP:
        engine.metrics = ch.metrics
    if engine.metrics is not None:
        bind_metrics(engine.metrics, [engine._layers[layer] for layer in engine._order], engine._applied,
                     engine.cache, engine.owned_only)


def prepare(engine: Any, tables: list[TableSpec], ids_layers: Sequence[int] | None, invalidate: Sequence[int],
            cache_rows: int | None, cache: RowCache, lossy: bool, check: bool) -> Layout:
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
    runs: dict[int, LayerRun] = {}
    for t in tables:
        run = LayerRun(spec=t, axis=axis.index(t.layer), scratch=PassScratch(1))
        old = engine._layers.get(t.layer)
        if old is not None and t.layer not in invalidate and old.spec.regions == t.regions:
            run.reader = old.reader if t.reference is None else None
        runs[t.layer] = run
    pool, tokens = _allocate(engine, list(runs.values()), engine._token_capacity)
    if check:
        for run in runs.values():
            row_reader(run)
    return Layout(tables, runs, layer_ids, cache, slots, tuple(invalidate), pool, tokens, lossy)


def commit(engine: Any, layout: Layout) -> None:
    """Serve `layout` (built by `prepare`): from here on nothing is refused."""
    moved = layout.cache.device != engine.device
    if layout.cache is not engine.cache:
        for layer in list(engine.cache.layers):
            engine.cache.remove_layer(layer)
        engine.cache = layout.cache
    cache = engine.cache
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
    engine._layers = layout.runs
    engine._order = layout.order
    # (axis, map) of every layer served under a rank partition other than columns (tables.partition)
    engine._row_maps = [(run.axis, run.spec.row_map) for run in engine._layers.values()
                        if run.spec.row_map is not None]
    engine._plan = None
    for t in layout.tables:
        engine.totals.setdefault(t.layer, LayerCounters())
    if layout.pool is not engine._pool or moved:
        unpin(engine)   # on the device its copies ran on
        if moved:
            engine.device = layout.cache.device
            engine.gather_impl = "numba" if engine.device.type == "cpu" else "torch"
        set_pool(engine, layout.pool)
    engine._token_capacity = layout.tokens


def grow(engine: Any, tokens: int) -> None:
    """Scratch and page pool for steps of up to `tokens` tokens (refused, CAPACITY, before allocating what
    host memory cannot hold; the engine is unchanged then)."""
    if tokens <= engine._token_capacity:
        return
    pool, _ = _allocate(engine, list(engine._layers.values()), tokens)
    engine._plan = None
    if pool is not engine._pool:
        set_pool(engine, pool)
    engine._token_capacity = tokens


def _allocate(engine: Any, runs: list[LayerRun], tokens: int) -> tuple[PageBufferPool | None, int]:
    """Scratch (into `runs`) and a page pool for steps of up to `tokens` tokens; the current pool when it
    is the right size. Refused (CAPACITY) before allocating when host memory cannot hold them."""
    if tokens <= 0:
        return engine._pool, 0
    n = tokens * engine.columns
    pages = n * max(1, len(runs))
    need = len(runs) * n * SCRATCH_BYTES_PER_LOOKUP + pages * PAGE_BYTES
    available_bytes(torch.device("cpu")).refuse(need, f"scratch and page buffers for steps of {tokens} tokens "
                                                      f"({pages} pages)")
    pool = engine._pool
    try:
        scratch = [PassScratch(n) for _ in runs]
        if pool is None or pool.capacity != pages:
            pool = PageBufferPool(pages)
    except (MemoryError, OSError) as exc:
        raise SlackTierError(ErrorKind.CAPACITY, f"scratch and page buffers for steps of {tokens} tokens "
                             f"({need / 2**30:.2f} GiB) could not be allocated: {exc}",
                             fix="send fewer tokens per step (split the batch), or lower max_tokens") from None
    for run, s in zip(runs, scratch, strict=True):
        run.scratch = s
    return pool, tokens


def set_pool(engine: Any, pool: PageBufferPool | None) -> None:
    """Read the next steps' pages into `pool`; on CUDA with a pinned staging buffer the missed rows are packed
    into before their host->device copy.

    The page pool itself stays pageable: gather picks the missed rows out of it on the host (264 of every
    4,096 bytes), so only those bytes cross to the device, from pinned memory, non_blocking.
    """
    unpin(engine)
    engine._pool = pool
    if pool is not None and engine.device.type == "cuda":  # pragma: no cover - needs a GPU
        engine._staging = torch.empty(pool.capacity * ROW_BYTES, dtype=torch.uint8, pin_memory=True)


def unpin(engine: Any) -> None:
    """Drop the pinned staging buffer, once the copies that read it are done."""
    if engine._staging is not None:  # pragma: no cover - needs a GPU
        torch.cuda.synchronize(engine.device)
        engine._staging = None


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


def checked_timeout(timeout_s: float | None) -> float | None:
    """`timeout_s` when None (no bound) or a number in (0, 86400] (a day, as the control file's wait_timeout_ms);
    anything else (inf, NaN, 1e13 overflow the platform's wait) is refused naming it (BAD_INPUT)."""
    if timeout_s is None:
        return None
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not 0 < timeout_s <= 86_400:
        raise SlackTierError(ErrorKind.BAD_INPUT, f"wait_timeout_s {timeout_s!r} is outside (0, 86400]",
                             fix="bound reads' waits by at most a day (or None for no bound)")
    return float(timeout_s)


def checked_pad_id(pad_id: int) -> int:
    """`pad_id` as an int; refuses one that could be a row id (>= 0)."""
    if int(pad_id) >= 0:
        raise SlackTierError(ErrorKind.BAD_INPUT, f"pad_id {pad_id} is a row id",
                             fix="pad with a negative id (-1, as vLLM does)")
    return int(pad_id)


def checked_admission(admission: str) -> str:
    """`admission` when it names one of the cache's rules (`cache.ADMISSIONS`); refused otherwise."""
    if admission not in ADMISSIONS:
        raise SlackTierError(ErrorKind.BAD_INPUT, f"admission {admission!r}", fix=f"use one of {ADMISSIONS}")
    return admission


#: per rule, its two heat codes indexed by a token's decode flag: [prefill code, decode code] (`cache.token_heat`'s
#: codes), which the compiled pass reads (`CompiledPass.set_heat_lut`); "off" has none (plain CLOCK)
_HEAT_BY_FLAG = {rule: token_heat(rule, np.array([True, False])) for rule in ADMISSIONS if rule != "off"}
_FLAG_BYTES = np.dtype(np.uint8)


def heat_lut(admission: str) -> np.ndarray | None:
    """The compiled pass's heat codes under `admission`, [prefill code, decode code]; None for "off"."""
    return _HEAT_BY_FLAG.get(admission)


def step_flags(admission: str, decode: Any, tokens: int) -> np.ndarray:
    """begin_step's decode flags as the compiled pass takes them under `admission`: [T] 0/1 bytes (a view of the
    flags, no copy), or NO_HEAT for "off" (plain CLOCK). The pass turns them into each token's heat code
    (`heat_lut`), so begin_step, which runs with the CPU's caches cold, spends no numpy call making them.

    Flags must be bool, one per token: 0/1 integers or another length are refused (also when the rule is
    "off"), so a swapped argument cannot silently turn admission off."""
    flags = decode
    if type(flags) is not np.ndarray:
        if isinstance(flags, torch.Tensor):
            flags = flags.detach().cpu().numpy()
        flags = np.asarray(flags)
    if flags.dtype != np.bool_ or flags.shape != (tokens,):
        raise SlackTierError(ErrorKind.BAD_INPUT, f"decode flags are {flags.dtype} {flags.shape}, want "
                             f"[{tokens}] bool", fix="pass one bool per token of the step: True for decode, "
                             "False for prefill")
    if admission == "off":
        return NO_HEAT
    return flags.view(_FLAG_BYTES) if flags.flags.c_contiguous else np.ascontiguousarray(flags).view(_FLAG_BYTES)
