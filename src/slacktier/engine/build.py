"""From a control file (`slacktier.config.ControlFile`) to what the engine serves: tables, regions, sources.

`resolve(table, engine_config)` reads the table's manifest and says which
regions it serves, where their bytes are staged, and two identities:
`data_key` (the staged bytes: their files, offsets and the source checkpoint's
digest) and `source_key` (the tier and its options over those regions). The
engine's `apply` compares them with what it serves now: a table whose
source_key is unchanged keeps its open source; one whose data_key is unchanged
keeps its cached rows, even when its tier changes (DRAM -> disk reads the
same bytes).

Worked example: layer 14 moves from disk to redis with the same manifest ->
source_key differs (a Redis source is opened, the disk source closed),
data_key is equal (the cached rows of layer 14 stay).

`build_engine(StepEngine, cfg)` builds an engine serving a control file (what
`StepEngine.from_config` forwards to); switching a running one to another
control file is `engine.apply(cfg)` (engine.configure, built on the functions
here). The step itself stays in `engine.step`; this module imports nothing of
it, so the class is passed in (and annotated `Any`: a StepEngine).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from slacktier.cache import RowCache
from slacktier.config import ControlFile, EngineConfig, TableConfig, load_control, named_by, tier_facts
from slacktier.engine.checker import SourceRowReader
from slacktier.engine.tables import TablePacking, TableSpec, seen_bitmap
from slacktier.errors import ErrorKind, SlackTierError
from slacktier.store.base import PageSource
from slacktier.store.registry import get_tier, open_source, verify_identity
from slacktier.tables.manifest import Manifest, check_tp_sharding
from slacktier.tables.packing import column_slots, load_index
from slacktier.tables.partition import RowMap
from slacktier.tables.regions import Region

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Resolved:
    """A table's regions and checksums, before any source is opened."""

    config: TableConfig
    manifest: Manifest
    rows: int
    row_start: int
    regions: tuple[Region, ...]            # what the source reads, in rank order
    crcs: tuple[np.ndarray, ...] | None    # per region, when reads are verified or the tier has stored_crc32c
    data_key: tuple
    source_key: tuple
    row_map: RowMap | None = None          # global row id -> stored row (None under the columns partition)
    verify: bool = False                   # each read page's CRC32C checked (verify_reads)
    table_rows: int = 0                    # the whole layer's rows, all ranks (stored rows under a partition)
    packing: TablePacking | None = None    # context packing: packed regions follow `regions` in the source

    @property
    def source_regions(self) -> tuple[Region, ...]:
        """What the table's source reads: its row regions, then its packed regions (context packing)."""
        return self.regions + (self.packing.regions if self.packing is not None else ())


def resolve_control(cfg: ControlFile) -> dict[int, Resolved]:
    """Every table of `cfg` resolved and checked as the engine checks a control file before it opens a source.

    `build_engine`, `apply` and `slacktier inspect` run this one function, so a file that inspect passes
    does not fail these checks at open: each manifest loads and holds its table's layer, was staged with
    the table's rank partition and has its rank, target overrides are at most one per staged target, the
    checksum file matches where reads are verified, and a table served per rank is staged as the serving
    engine's head shards. What only opening a source can tell (a file's size, a server's keys) is the tier's.
    """
    resolved = {t.layer: resolve(t, cfg.engine) for t in cfg.tables}
    check_rank_sharding(resolved)
    return resolved


def check_device(device: str) -> None:
    """Refuse, in one line (UNAVAILABLE), a device this process cannot allocate on, before anything is: "cuda"
    with a torch built without CUDA or on a machine without a GPU, "cuda:N" past its GPUs."""
    d = torch.device(device)
    if d.type != "cuda":
        return
    if not torch.cuda.is_available():
        why = ("this torch is built without CUDA" if torch.version.cuda is None else
               "torch sees no CUDA device on this machine")
        raise SlackTierError(ErrorKind.UNAVAILABLE, f"device {device!r}: {why} (torch {torch.__version__})",
                             fix='set device = "cpu" in [engine], or serve on a GPU machine with a CUDA build of '
                                 "torch")
    if d.index is not None and d.index >= torch.cuda.device_count():
        raise SlackTierError(ErrorKind.UNAVAILABLE, f"device {device!r}: this machine has "
                             f"{torch.cuda.device_count()} CUDA devices", fix="pick a device index below that")


def _manifest(t: TableConfig) -> Manifest:
    """Table `t`'s manifest; a missing or bad one is refused naming the table's layer."""
    try:
        return Manifest.load(t.manifest)
    except SlackTierError as exc:
        fix = exc.fix
        if exc.kind is ErrorKind.MISSING:
            fix = ("stage the table first (slacktier stage), or point the table's `manifest` at it (in a control "
                   "file a relative path is read from the file's folder)")
        raise SlackTierError(exc.kind, exc.message, layer=t.layer, fix=fix) from None


def resolve(t: TableConfig, eng: EngineConfig) -> Resolved:
    """The regions of table `t` from its manifest (one rank's region when `t.rank` >= 0)."""
    m = _manifest(t)
    if t.layer not in m.layout.rows:
        raise SlackTierError(ErrorKind.MISSING, f"manifest {t.manifest} has no layer {t.layer} (it has "
                             f"{sorted(m.layout.rows)})", layer=t.layer, fix="point the table at its manifest")
    if t.partition != m.partition_kind:
        raise SlackTierError(ErrorKind.BAD_INPUT, f"manifest {t.manifest} was staged with the {m.partition_kind!r} "
                             f"rank partition, the control file serves layer {t.layer} as {t.partition!r}: its rank "
                             "regions would hold other hash columns", layer=t.layer,
                             fix=f'set partition = "{m.partition_kind}" on the table (or restage the table with '
                                 f'--partition {t.partition})')
    rank = t.rank if t.rank >= 0 else None
    # In rank order, with the control file's target overrides (a Redis tier reads its own key prefix).
    regions = tuple(m.runtime_regions(layer=t.layer, rank=rank, targets=t.targets))
    facts = tier_facts(t.source)
    if reads_staged_files(facts):
        for r in regions:
            if not os.path.exists(r.path):
                moved = r.device < len(t.targets) and t.targets[r.device]
                named = "the table's `targets`" if moved else f"manifest {m.path}"
                raise SlackTierError(ErrorKind.MISSING, f"target {r.path} (named by {named}) does not exist",
                                     layer=t.layer, rank=r.rank, fix="restage the table, or point the table's "
                                     "`targets` at where its files are now")
    rows, row_start = m.layout.rows[t.layer], 0
    row_map = m.row_map(t.layer)
    if row_map is not None:   # the regions' rows are stored rows (tables.partition): so is the directory
        rows = row_map.stored_rows
    table_rows = rows
    if rank is not None:   # one rank's shard: the directory covers only its rows
        rows, row_start = regions[0].rows, regions[0].row_start
    crcs = None
    verify = verifies(t, eng)
    packing = _packing(m, t, rank, regions, facts)
    if verify or get_tier(t.source).source_cls.stored_crc32c:   # a stored CRC32C is compared on every read
        crcs = tuple(sums for r, sums in zip(m.regions, m.region_checksums(), strict=True)
                     if r.layer == t.layer and (rank is None or r.rank == rank))
        if packing is not None:
            crcs += tuple(m.packed_checksums(m.packed_regions(t.layer, rank)))
    packed = packing.regions if packing is not None else ()
    data_key = (tuple((r.path, r.offset_bytes, r.pages) for r in regions + packed), m.identity)
    source_key = (t.source, t.options, regions + packed, verify, m.identity)
    return Resolved(t, m, rows, row_start, regions, crcs, data_key, source_key, row_map, verify, table_rows, packing)


def reads_staged_files(facts: Any) -> bool:
    """Whether a tier with these facts (config.tier_facts) reads the manifest's staged files on this host: its
    devices are files, or it copies the table into host memory from them (the DRAM tier; a tier over a device
    model, which lands reads from a host copy), so every region of the files, packed ones included, is there."""
    return facts.device_kind in ("file", "model") or facts.holds_host_copy


def _packing(m: Manifest, t: TableConfig, rank: int | None, regions: tuple[Region, ...],
             facts: Any) -> TablePacking | None:
    """Table `t`'s context packing, when its manifest packed its layer (tables.packing): the packed regions (with
    the control file's target overrides), the index (checked against the manifest's sha256), column slots.

    A tier that does not read the staged files (a Redis copy, which `slacktier load` fills with row pages
    only) serves the layer without packing: logged, never silent."""
    pk = m.packing
    if pk is None or t.layer not in pk.contexts:
        return None
    if not reads_staged_files(facts):
        log.warning("layer %d: the %s tier holds no packed pages; the layer is served without context packing",
                    t.layer, t.source)
        return None
    staged = m.packed_regions(t.layer, rank)
    packed = tuple(dataclasses.replace(r.runtime(t.targets[r.device] if r.device < len(t.targets)
                                                 and t.targets[r.device] else None), packed=True) for r in staged)
    index = load_index(m.index_path(), pk.index_sha256, t.layer, pk.contexts[t.layer])
    return TablePacking(regions=packed, region_index=tuple(range(len(regions), len(regions) + len(packed))),
                        index=index, slots=column_slots(pk.rank_columns, sum(len(c) for c in pk.rank_columns)),
                        pages_per_context=pk.pages_per_context)


def verifies(t: TableConfig, eng: EngineConfig) -> bool:
    """Whether table `t`'s reads are checked against the manifest's CRC32Cs: [engine] verify_reads, or with
    "auto" the tier's own default (on where the tier has no end-to-end checksum of its own)."""
    if eng.verify_reads == "auto":
        return bool(get_tier(t.source).source_cls.verify_by_default)
    return bool(eng.verify_reads)


def open_table_source(r: Resolved) -> PageSource:
    """Open the page source of one table: its tier over its own regions, checking it holds the manifest's table."""
    source = open_source(r.config.source, r.source_regions, r.config.options, page_crc32c=r.crcs,
                         identity=r.manifest.identity, verify_pages=r.verify)
    log.info("layer %d: %s source over %d regions%s", r.config.layer, r.config.source, len(r.regions),
             ", reads verified" if r.verify else "")
    return source


def check_kept_source(r: Resolved) -> None:
    """A source kept across `apply` still reads the manifest's table (a target restaged underneath is refused)."""
    verify_identity(r.config.source, r.source_regions, r.config.options, r.manifest.identity)


def table_spec(r: Resolved, source: PageSource, check: bool) -> TableSpec:
    """What the engine serves for one resolved table; with `check`, the checker regenerates rows from the
    manifest's own source (seed or checkpoint) rather than reading the medium the engine reads."""
    reference = SourceRowReader(r.manifest, r.config.layer, r.row_start, r.row_map) if check else None
    return TableSpec(layer=r.config.layer, row_start=r.row_start, rows=r.rows, regions=r.regions, source=source,
                     cache_share=r.config.cache_share, seen=_seen(r.config, r.rows),
                     reference=reference, row_map=r.row_map, table_rows=r.table_rows, packing=r.packing)


def _seen(t: TableConfig, rows: int) -> np.ndarray | None:
    if not t.seen:
        return None
    return load_seen(t.seen, rows, t.layer)


def load_seen(path: str | Path, rows: int, layer: int) -> np.ndarray:
    """A lossy seen-set file as a packed bitmap [ceil(rows / 8)] uint8; anything but a .npy array of integer
    local row ids, or a uint8 bitmap of exactly ceil(rows / 8) bytes, is refused naming the file (BAD_INPUT).

    Refused: another file type (a pickle, .npz, text), object arrays, floats (1.5 would be read as row 1),
    bools (a mask is not a list of row ids: write np.flatnonzero(mask)), more than one dimension, and rows
    outside the layer. Worked example: 20 rows, file [0, 9] int64 -> bitmap [1, 2, 0]."""
    p = Path(path)
    fix = "write the seen rows as a .npy file: np.save(path, rows.astype(np.int64)), or a packed uint8 bitmap"
    if not p.is_file():
        raise SlackTierError(ErrorKind.MISSING, f"seen-set {p} does not exist", layer=layer, fix=fix)
    if p.suffix != ".npy":
        raise SlackTierError(ErrorKind.BAD_INPUT, f"seen-set {p} is not a .npy file", layer=layer, fix=fix)
    try:
        with open(p, "rb") as f:
            if f.read(6) != b"\x93NUMPY":
                raise ValueError("no .npy header (a pickle or another format)")
            f.seek(0)
            arr = np.lib.format.read_array(f, allow_pickle=False)
    except (ValueError, EOFError, OSError) as exc:
        raise SlackTierError(ErrorKind.BAD_INPUT, f"seen-set {p} is not a .npy array: {exc}", layer=layer,
                             fix=fix) from None
    if arr.ndim != 1:
        raise SlackTierError(ErrorKind.BAD_INPUT, f"seen-set {p} is {arr.ndim}-dimensional {arr.shape}, want a "
                             "list of row ids or a bitmap", layer=layer, fix=fix)
    if arr.dtype == np.uint8:
        need = (rows + 7) // 8
        if arr.shape[0] != need:
            raise SlackTierError(ErrorKind.BAD_INPUT, f"seen-set {p} is a uint8 bitmap of {arr.shape[0]} bytes, "
                                 f"layer {layer}'s {rows} rows need {need}", layer=layer,
                                 fix="pack it with seen_bitmap(rows, ids), or save row ids as int64")
        return arr
    try:
        return seen_bitmap(rows, arr)
    except SlackTierError as exc:
        raise SlackTierError(exc.kind, f"seen-set {p}: {exc.message}", layer=layer, fix=exc.fix) from None


# ---- an engine from a control file, and switching it to another ----------------------------------------------

@dataclass
class Applied:
    """What an engine built from a control file serves, to tell what a new one changes."""

    control: ControlFile
    resolved: dict[int, Resolved]
    sources: dict[int, PageSource]


def build_engine(cls: Any, cfg: ControlFile, **overrides: object) -> Any:
    """An engine (`cls`, a StepEngine) serving control file `cfg`; it owns (and closes) the sources it opens.

    `overrides` go to the constructor (ids_layers, columns, gather_impl, check_raise, metrics, ...).
    """
    eng = cfg.engine
    check_device(eng.device)
    resolved = resolve_control(cfg)
    sources: dict[int, PageSource] = {}
    try:
        for t in cfg.tables:
            sources[t.layer] = open_table_source(resolved[t.layer])
        specs = [table_spec(resolved[t.layer], sources[t.layer], eng.check) for t in cfg.tables]
        kwargs: dict[str, object] = {"max_tokens": eng.max_tokens, "lossy": eng.lossy, "check": eng.check,
                                     "owned_only": eng.owned_only, "wait_timeout_s": eng.wait_timeout_ms / 1e3,
                                     "pad_id": eng.pad_id, "evict_ahead": eng.evict_ahead,
                                     "admission": eng.admission}
        kwargs |= overrides
        if kwargs.get("metrics") is None and eng.metrics:
            from slacktier.engine.metrics import EngineMetrics
            kwargs["metrics"] = EngineMetrics()
        return cls(specs, RowCache(eng.max_cache_rows, eng.device, slots=eng.cache_rows), eng.device,
                   owned_sources=list(sources.values()), control=Applied(cfg, resolved, sources), **kwargs)
    except BaseException:
        for s in sources.values():
            s.close()
        raise


def build_engine_from_file(cls: Any, path: str | Path, **overrides: object) -> Any:
    """An engine built from a control file on disk (schema: slacktier.config); its errors name the file."""
    cfg = load_control(path)
    with named_by(path):
        return build_engine(cls, cfg, **overrides)


def refuse_queue_change(old: Resolved, new: Resolved, source: PageSource) -> None:
    """Refuse (BAD_INPUT, naming the key) a reload that changes a table's device-queue setting which its device's
    queue does not take: the queue belongs to the device and runs as the table that opened it asked, and the
    sources this reload replaces still hold it, so the engine would serve at the old value while its control
    file says the new one."""
    kept = getattr(source, "queue_settings_kept", None)
    if kept is None:
        return
    for key, asked, runs, device in kept():
        was = getattr(old.config.options, key, None) if old.config.source == new.config.source else None
        if was == asked:
            continue   # unchanged by this reload: served as when the engine was built (logged then)
        layer = new.config.layer
        raise SlackTierError(ErrorKind.BAD_INPUT, f"layer {layer}: a reload cannot change [table.{new.config.source}] "
                             f"{key} to {asked}: device {device}'s read queue runs {key} = {runs} and stays open "
                             "while a served table reads through it", layer=layer,
                             fix=f"keep {key} = {runs} in this control file, or start a new engine (process) with "
                                 f"the new value: the first table to open a device's queue sets it")


def check_rank_sharding(resolved: dict[int, Resolved]) -> None:
    """A table served per rank (`rank` set) must be staged as the serving engine's TP head shards.

    TP size is the manifest's rank count; layers that record no hash-column bounds (a table staged from
    bare row counts) have no heads to match and are not checked.
    """
    for layer, r in resolved.items():
        if r.config.rank >= 0 and layer in r.manifest.layout.column_bounds:
            check_tp_sharding(r.manifest, r.manifest.ranks, [layer])
