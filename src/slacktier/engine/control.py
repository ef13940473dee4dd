"""The control file: which tier serves each table, the cache size and split, the window order.

A TOML file, loaded with `tomllib` into typed dataclasses validated in
`__post_init__`. `StepEngine.from_control(path)` builds an engine from it;
`engine.reload(path)` switches a running engine to another file between steps
without restarting the process, rebuilding only what changed: a table whose
source settings are unchanged keeps its source; a table whose bytes are
unchanged (same regions) keeps its cached rows even when its tier changes; the
cache is resized in place unless the device or the reserved maximum changed.

Schema (every key but `layer` and one of `manifest` / `rows`+`region` has a default):

    [engine]
    device = "cpu"              # "cpu" | "cuda" | "cuda:N"
    cache_rows = 0              # cache slots in use, split over tables by cache_share
    max_cache_rows = 0          # slots reserved on the device (>= cache_rows; 0 = cache_rows)
    io_threads = 1              # disk: I/O workers per device
    queue_depth = 128           # disk: reads in flight per worker
    disk_engine = "auto"        # disk: "auto" | "io_uring" | "threads"
    verify_reads = false        # check every read page's CRC32C against the manifest
    lossy = false               # rows outside a table's seen-set are not read, come out as zeros
    check = false               # run the reference gather beside ours on every lookup
    owned_only = false          # per-rank process: ids outside this process's rows come out as -0.0 (not errors)
    max_tokens = 256            # tokens per step the buffers are sized for (grown on demand)

    [[table]]
    layer = 1                   # table layer id (Engram: 1 and 14)
    source = "disk"             # "dram" | "disk" | "redis"
    manifest = "t.manifest.json"   # a staged table (slacktier.tables.manifest); regions of `layer` from it
    rank = -1                   # with a manifest: serve only this rank's region (-1: every rank); pair with owned_only
    targets = []                # optional: replace the manifest's target paths, by device index
    cache_share = 0.5           # fraction f_l of cache_rows for this layer (shares sum to <= 1)
    order = 0                   # window order: lower is resolved and submitted first (short window first)
    redis_url = "redis://127.0.0.1:6379/0"   # redis: the server
    redis_prefix = ""           # redis: key prefix (default: each region's path)
    seen = ""                   # lossy: .npy of int64 row ids (local rows) or of a packed uint8 bitmap

    # Without a manifest, give the rows and every rank's region explicitly:
    rows = 1000                 # rows of the layer's table
    row_start = 0               # first row this process serves (0: all of them)
    [[table.region]]
    rank = 0
    path = "/data/l1.bin"
    offset_bytes = 0
    device = 0
    row_start = 0               # global first row of the shard (default: shard_bounds over the ranks)
    rows = 500                  # rows of the shard (default: shard_bounds)

Worked example: two tables, layer 1 (order 0, share 0.7) and layer 14 (order 1,
share 0.3), cache_rows = 1,000,000 -> layer 1 owns 700,000 slots and its pages
are submitted before layer 14 is resolved.
"""

from __future__ import annotations

import logging
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np

from slacktier.errors import ErrorKind, SlackTierError
from slacktier.store.base import PageSource, RegionSpec
from slacktier.tables.layout import pages_for_rows, shard_bounds

log = logging.getLogger(__name__)

SOURCES = ("dram", "disk", "redis")
DISK_ENGINES = ("auto", "io_uring", "threads")


def _bad(message: str, fix: str, **where: Any) -> SlackTierError:
    return SlackTierError(ErrorKind.BAD_INPUT, f"control file: {message}", fix=fix, **where)


@dataclass(frozen=True)
class RegionConfig:
    """One rank's region, given explicitly (no manifest)."""

    rank: int
    path: str
    offset_bytes: int = 0
    device: int = 0
    row_start: int = -1   # -1: from shard_bounds
    rows: int = -1        # -1: from shard_bounds

    def __post_init__(self) -> None:
        if self.rank < 0 or self.device < 0 or self.offset_bytes < 0:
            raise _bad(f"region rank {self.rank}, device {self.device}, offset {self.offset_bytes}",
                       "use non-negative rank, device and offset", rank=self.rank)


@dataclass(frozen=True)
class EngineConfig:
    """The [engine] section."""

    device: str = "cpu"
    cache_rows: int = 0
    max_cache_rows: int = 0
    io_threads: int = 1
    queue_depth: int = 128
    disk_engine: str = "auto"
    verify_reads: bool = False
    lossy: bool = False
    check: bool = False
    max_tokens: int = 256
    owned_only: bool = False

    def __post_init__(self) -> None:
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise _bad(f"device {self.device!r}", 'use "cpu" or "cuda[:N]"')
        if self.cache_rows < 0 or self.max_cache_rows < 0:
            raise _bad(f"cache_rows {self.cache_rows}, max_cache_rows {self.max_cache_rows}", "use >= 0")
        if self.max_cache_rows == 0:
            object.__setattr__(self, "max_cache_rows", self.cache_rows)
        if self.cache_rows > self.max_cache_rows:
            raise _bad(f"cache_rows {self.cache_rows} above max_cache_rows {self.max_cache_rows}",
                       "reserve at least cache_rows")
        if self.io_threads < 1 or not 1 <= self.queue_depth <= 4096 or self.max_tokens < 1:
            raise _bad(f"io_threads {self.io_threads}, queue_depth {self.queue_depth}, max_tokens "
                       f"{self.max_tokens}", "use io_threads >= 1, 1 <= queue_depth <= 4096, max_tokens >= 1")
        if self.disk_engine not in DISK_ENGINES:
            raise _bad(f"disk_engine {self.disk_engine!r}", f"choose one of {', '.join(DISK_ENGINES)}")


@dataclass(frozen=True)
class TableConfig:
    """One [[table]] entry."""

    layer: int
    source: str = "disk"
    manifest: str = ""
    targets: tuple[str, ...] = ()
    cache_share: float = 0.0
    order: int = 0
    redis_url: str = "redis://127.0.0.1:6379/0"
    redis_prefix: str = ""
    seen: str = ""
    rows: int = 0
    row_start: int = 0
    rank: int = -1
    region: tuple[RegionConfig, ...] = ()

    def __post_init__(self) -> None:
        if self.source not in SOURCES:
            raise _bad(f"source {self.source!r}", f"choose one of {', '.join(SOURCES)}", layer=self.layer)
        if not 0.0 <= self.cache_share <= 1.0:
            raise _bad(f"cache_share {self.cache_share}", "use a fraction in 0..1", layer=self.layer)
        if bool(self.manifest) == bool(self.region):
            raise _bad("give either manifest or explicit [[table.region]] entries",
                       "point `manifest` at a staged table, or list rows and regions", layer=self.layer)
        if self.rank >= 0 and not self.manifest:
            raise _bad("`rank` selects a region of a manifest", "list only that rank's [[table.region]] instead",
                       layer=self.layer)
        if self.region and self.rows <= 0:
            raise _bad("explicit regions need `rows`", "set rows to the layer's table rows", layer=self.layer)


@dataclass(frozen=True)
class ControlFile:
    """A whole control file; `tables` sorted by window order."""

    engine: EngineConfig
    tables: tuple[TableConfig, ...]
    path: str = ""

    def __post_init__(self) -> None:
        if not self.tables:
            raise _bad("no [[table]] entries", "list at least one table")
        layers = [t.layer for t in self.tables]
        if len(set(layers)) != len(layers):
            raise _bad(f"layers {layers} listed twice", "give each layer once")
        if sum(t.cache_share for t in self.tables) > 1.0 + 1e-9:
            raise _bad("cache shares sum above 1", "make the shares fractions of one cache")
        object.__setattr__(self, "tables", tuple(sorted(self.tables, key=lambda t: (t.order, t.layer))))


def _typed(cls: type, data: dict[str, Any], where: str) -> Any:
    known = {f.name for f in fields(cls)}
    unknown = set(data) - known
    if unknown:
        raise _bad(f"unknown keys {sorted(unknown)} in {where}", f"use only {sorted(known)}")
    return cls(**data)


def parse_control(text: str, path: str = "") -> ControlFile:
    """A ControlFile from TOML text."""
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise _bad(f"{path or 'text'} is not TOML: {exc}", "fix the syntax") from exc
    unknown = set(doc) - {"engine", "table"}
    if unknown:
        raise _bad(f"unknown sections {sorted(unknown)}", "use [engine] and [[table]]")
    engine = _typed(EngineConfig, dict(doc.get("engine", {})), "[engine]")
    tables = []
    base = Path(path).parent if path else Path(".")
    for raw in doc.get("table", []):
        raw = dict(raw)
        raw["region"] = tuple(_typed(RegionConfig, dict(r), "[[table.region]]") for r in raw.get("region", []))
        raw["targets"] = tuple(raw.get("targets", ()))
        for key in ("manifest", "seen"):
            if raw.get(key) and not Path(raw[key]).is_absolute():
                raw[key] = str(base / raw[key])
        tables.append(_typed(TableConfig, raw, "[[table]]"))
    return ControlFile(engine=engine, tables=tuple(tables), path=path)


def load_control(path: str | Path) -> ControlFile:
    """Read and validate a control file."""
    p = Path(path)
    if not p.exists():
        raise SlackTierError(ErrorKind.MISSING, f"control file {p} does not exist", fix="write one (see the schema)")
    return parse_control(p.read_text(), str(p))


# ---- from configuration to tables and sources ------------------------------------------------------
@dataclass
class ResolvedTable:
    """A table's regions and checksums, before any source is opened."""

    layer: int
    rows: int
    row_start: int
    regions: tuple[RegionSpec, ...]          # in rank order
    shards: tuple[tuple[int, int], ...]      # global (row_start, rows) per rank
    crcs: tuple[np.ndarray, ...] | None      # per region, when a manifest gives them
    data_key: tuple                          # identity of the bytes (regions + source digest)
    source_key: tuple = field(default=())    # identity of the source settings
    file_regions: tuple[RegionSpec, ...] = ()  # where the bytes are staged (the checker reads these)


def resolve_table(t: TableConfig, eng: EngineConfig) -> ResolvedTable:
    """Regions of one table from its manifest or explicit entries."""
    crcs: tuple[np.ndarray, ...] | None = None
    if t.manifest:
        from slacktier.tables.manifest import Manifest
        m = Manifest.load(t.manifest)
        if t.layer not in m.layout.rows:
            raise SlackTierError(ErrorKind.MISSING, f"manifest {t.manifest} has no layer {t.layer} (it has "
                                 f"{list(m.layout.rows)})", layer=t.layer, fix="point the table at its manifest")
        mine = sorted((r for r in m.regions if r.layer == t.layer), key=lambda r: r.rank)
        if t.rank >= 0:
            mine = [r for r in mine if r.rank == t.rank]
            if not mine:
                raise SlackTierError(ErrorKind.MISSING, f"manifest {t.manifest} has no rank {t.rank} region of "
                                     f"layer {t.layer}", layer=t.layer, rank=t.rank,
                                     fix="pick a rank the table was staged with")
        targets = list(m.targets)
        for i, override in enumerate(t.targets):
            if override:
                targets[i] = override
        regions = tuple(RegionSpec(layer=r.layer, rank=r.rank, path=targets[r.device], offset_bytes=r.offset_bytes,
                                   pages=r.pages, device=r.device) for r in mine)
        shards = tuple((r.row_start, r.rows) for r in mine)
        rows, row_start = m.layout.rows[t.layer], 0
        if t.rank >= 0:  # one rank's shard: the directory covers only its rows
            rows, row_start = mine[0].rows, mine[0].row_start
        if eng.verify_reads:
            every = m.checksums()
            crcs = tuple(np.ascontiguousarray(every[r.crc_first_page:r.crc_first_page + r.pages]) for r in mine)
        digest = m.source_digest
    else:
        ranks = len(t.region)
        rows, row_start = t.rows, t.row_start
        out, shards = [], []
        for rc in sorted(t.region, key=lambda r: r.rank):
            lo, hi = shard_bounds(rows, None, rc.rank, ranks)
            start = rc.row_start if rc.row_start >= 0 else row_start + lo
            n = rc.rows if rc.rows >= 0 else hi - lo
            out.append(RegionSpec(layer=t.layer, rank=rc.rank, path=rc.path, offset_bytes=rc.offset_bytes,
                                  pages=pages_for_rows(n), device=rc.device))
            shards.append((start, n))
        regions, shards = tuple(out), tuple(shards)
        rows = sum(n for _, n in shards)
        row_start = min(s for s, _ in shards)
        if eng.verify_reads:
            raise _bad("verify_reads needs a manifest (page checksums)", "stage the table, or turn verify off",
                       layer=t.layer)
        digest = ""
    file_regions = regions
    if t.source == "redis" and t.redis_prefix:
        regions = tuple(RegionSpec(layer=r.layer, rank=r.rank, path=t.redis_prefix, offset_bytes=0,
                                   pages=r.pages, device=r.device) for r in regions)
    # The bytes' identity: where they were staged (not the tier reading them) and the staged source's digest.
    data_key = (tuple((r.path, r.offset_bytes, r.pages) for r in file_regions), shards, digest)
    source_key = (t.source, regions, eng.verify_reads, eng.io_threads, eng.queue_depth, eng.disk_engine,
                  t.redis_url if t.source == "redis" else "")
    return ResolvedTable(t.layer, rows, row_start, regions, shards, crcs, data_key, source_key, file_regions)


def open_table_source(t: TableConfig, r: ResolvedTable, eng: EngineConfig) -> PageSource:
    """Open the page source of one table (its own source over its own regions)."""
    from slacktier.store.factory import open_source
    opts: dict[str, Any] = {"verify_reads": eng.verify_reads, "page_crc32c": r.crcs}
    if t.source == "disk":
        opts |= {"engine": eng.disk_engine, "queue_depth": eng.queue_depth, "workers_per_device": eng.io_threads}
    elif t.source == "redis":
        opts |= {"url": t.redis_url}
    source = open_source(t.source, list(r.regions), **opts)
    log.info("layer %d: %s source over %d regions", t.layer, t.source, len(r.regions))
    return source


def _seen(t: TableConfig, rows: int) -> np.ndarray | None:
    if not t.seen:
        return None
    from slacktier.engine.tables import seen_bitmap
    p = Path(t.seen)
    if not p.exists():
        raise SlackTierError(ErrorKind.MISSING, f"seen-set {p} does not exist", layer=t.layer,
                             fix="write the seen rows as a .npy file")
    arr = np.load(p)
    if arr.dtype == np.uint8:
        return arr
    return seen_bitmap(rows, arr.astype(np.int64))


def _table_spec(t: TableConfig, r: ResolvedTable, source: PageSource) -> Any:
    from slacktier.engine.tables import RankRegion, TableSpec
    ranks = tuple(RankRegion(rank=spec.rank, row_start=start, rows=n, region=i)
                  for i, (spec, (start, n)) in enumerate(zip(r.regions, r.shards)))
    return TableSpec(layer=t.layer, row_start=r.row_start, rows=r.rows, ranks=ranks, source=source,
                     cache_share=t.cache_share, seen=_seen(t, r.rows), regions=r.file_regions or r.regions)


@dataclass
class _Live:
    """What an engine built from a control file keeps to reload it."""

    control: ControlFile
    resolved: dict[int, ResolvedTable]
    sources: dict[int, PageSource]


def build_engine(cfg: ControlFile, **overrides: Any) -> Any:
    """A StepEngine for `cfg`; it owns (and closes) the sources it opened. overrides go to StepEngine."""
    from slacktier.cache.rowcache import RowCache
    from slacktier.engine.step import StepEngine
    eng = cfg.engine
    resolved = {t.layer: resolve_table(t, eng) for t in cfg.tables}
    sources: dict[int, PageSource] = {}
    try:
        for t in cfg.tables:
            sources[t.layer] = open_table_source(t, resolved[t.layer], eng)
        specs = [_table_spec(t, resolved[t.layer], sources[t.layer]) for t in cfg.tables]
        cache = RowCache(eng.max_cache_rows, eng.device, slots=eng.cache_rows)
        kwargs: dict[str, Any] = {"max_tokens": eng.max_tokens, "lossy": eng.lossy, "check": eng.check,
                                  "owned_only": eng.owned_only}
        kwargs |= overrides
        engine = StepEngine(specs, cache, eng.device, owned_sources=list(sources.values()), **kwargs)
    except BaseException:
        for s in sources.values():
            s.close()
        raise
    engine._control = _Live(cfg, resolved, sources)
    return engine


def apply_control(engine: Any, cfg: ControlFile) -> None:
    """Switch `engine` to `cfg` between steps, rebuilding only what changed (see the module docstring)."""
    from slacktier.cache.rowcache import RowCache
    live: _Live | None = getattr(engine, "_control", None)
    if live is None:
        raise SlackTierError(ErrorKind.BAD_INPUT, "this engine was not built from a control file",
                             fix="build it with StepEngine.from_control(path)")
    if engine.in_step:
        raise SlackTierError(ErrorKind.BAD_INPUT, "reload during a step", fix="call end_step first")
    eng = cfg.engine
    resolved = {t.layer: resolve_table(t, eng) for t in cfg.tables}
    opened: dict[int, PageSource] = {}
    sources: dict[int, PageSource] = {}
    try:
        for t in cfg.tables:
            old = live.resolved.get(t.layer)
            if old is not None and old.source_key == resolved[t.layer].source_key:
                sources[t.layer] = live.sources[t.layer]
            else:
                sources[t.layer] = opened[t.layer] = open_table_source(t, resolved[t.layer], eng)
        specs = [_table_spec(t, resolved[t.layer], sources[t.layer]) for t in cfg.tables]
    except BaseException:
        for s in opened.values():
            s.close()
        raise
    invalidate = [layer for layer, r in resolved.items()
                  if layer in live.resolved and live.resolved[layer].data_key != r.data_key]
    old_eng = live.control.engine
    try:
        if (eng.device, eng.max_cache_rows) != (old_eng.device, old_eng.max_cache_rows):
            engine.replace_cache(RowCache(eng.max_cache_rows, eng.device, slots=0))
        engine.reconfigure(specs, cache_rows=eng.cache_rows, invalidate=invalidate,
                           owned_sources=list(sources.values()), lossy=eng.lossy, check=eng.check,
                           owned_only=eng.owned_only)
    except BaseException:
        for s in opened.values():
            s.close()
        raise
    for layer, s in live.sources.items():
        if s not in sources.values():
            s.close()
    engine._control = _Live(cfg, resolved, sources)
    log.info("reloaded %s: %d tables, %d sources reopened, %d layers' cache dropped", cfg.path, len(cfg.tables),
             len(opened), len(invalidate))
