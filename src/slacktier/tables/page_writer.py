"""The page writer: a row source's (layer, rank) regions onto files or raw block devices, then the manifest.

Everything that can be refused is refused before the first byte is written: a
target too small for its regions, a target (or manifest) that already holds
another table unless `overwrite` (a checkpoint source refuses its own problems
when it is built). Writes are O_DIRECT, in large aligned chunks (4 MiB) from
page-aligned buffers: filler threads fill the next chunks (rows, and each
page's CRC32C while the page is still in L1) while writer threads (4 by
default, so 4 writes in flight, each at its own offset) write. Every target
starts with a header page carrying the run's `stage_id` (derived from what it writes), marked "staging"
before anything else on any target changes (its size included) and "complete"
only after all of its regions are written and fsynced; a run that fails or is
interrupted leaves "staging", which `manifest.check_target_header` refuses.
The manifest and checksum file are written last, so a manifest never describes
a table that is not fully on its targets.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import logging
import os
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
from tqdm import tqdm

from slacktier.errors import ErrorKind, SlackTierError
from slacktier.tables.layout import PAGE_BYTES, ROWS_PER_PAGE, binary_bytes, pages_for_rows
from slacktier.tables.manifest import TARGET_HEADER_BYTES, Manifest, default_manifest_path, header_page, \
    layer_spans, content_stage_id, parse_header, plan_regions, region_pieces, target_bytes
from slacktier.tables.memfs import ram_backed
from slacktier.tables.odirect import DirectFile, aligned_array, lock_target, os_error, probe_target, write_file_atomic
from slacktier.tables.packing import PackedTable, PackPlan, PackRequest, fill_packed_pages, index_file_bytes, \
    place_packed_regions, plan_packing, save_indexes
from slacktier.tables.pagecrc import page_crcs
from slacktier.tables.partition import DEFAULT_PARTITION, RankPartition, RowMap, rank_columns
from slacktier.tables.regions import StagedRegion
from slacktier.tables.row_source import RowSource

log = logging.getLogger(__name__)

DEFAULT_CHUNK_BYTES = 4 << 20
DEFAULT_FILLERS = min(2, os.cpu_count() or 1)  # threads filling chunks
DEFAULT_WRITERS = 4                             # threads writing chunks = O_DIRECT writes in flight


# ---------------------------------------------------------------- checks before writing

def _read_head(path: str) -> bytes:
    with open(path, "rb", buffering=0) as f:
        return f.read(TARGET_HEADER_BYTES)


def filesystem_free_bytes(path: str) -> tuple[int, int]:
    """(filesystem id, bytes free to this user) of the filesystem holding `path` (a file or one to be created)."""
    parent = os.path.dirname(os.path.abspath(path))
    vfs = os.statvfs(parent)
    return os.stat(parent).st_dev, vfs.f_bavail * vfs.f_frsize


def check_free_space(targets: list[str], need_bytes: list[int], size_bytes: list[int],
                     free_space: Callable[[str], tuple[int, int]] = filesystem_free_bytes) -> None:
    """Refuse (SlackTierError TARGET) regular-file targets whose filesystem lacks the space they must grow by.

    Targets on one filesystem are summed: two 30 GB files on a disk with 50 GB
    free are refused, though each alone would fit. `free_space(path)` gives
    (filesystem id, free bytes); tests pass a fake small figure.
    Worked example: targets a (needs 3 GB, holds 1 GB) and b (needs 2 GB, new)
    on one filesystem with 3.5 GB free: they grow by 4 GB -> refused.
    """
    grow: dict[int, int] = {}
    free: dict[int, int] = {}
    names: dict[int, list[str]] = {}
    for path, need, size in zip(targets, need_bytes, size_bytes):
        fs, avail = free_space(path)
        grow[fs] = grow.get(fs, 0) + max(0, need - size)
        free[fs] = avail
        names.setdefault(fs, []).append(path)
    for fs, more in grow.items():
        if more > free[fs]:
            where = ", ".join(names[fs])
            raise SlackTierError(ErrorKind.TARGET, f"not enough disk space: the table needs {binary_bytes(more)} more "
                                 f"on the filesystem of {where}, which has {binary_bytes(free[fs])} free; nothing "
                                 "was written", fix="free space, stage elsewhere, or stage fewer rows or ranks "
                                 "(--only-ranks)")


def check_targets(targets: list[str], need_bytes: list[int], source_digest: str, manifest_path: Path,
                  overwrite: bool, max_bytes: int | None,
                  free_space: Callable[[str], tuple[int, int]] = filesystem_free_bytes,
                  side_bytes: int = 0) -> list[bool]:
    """Refuse (SlackTierError TARGET) a target too small or holding another table; returns is-block-device per target.

    Too small: a block device shorter than its regions; a regular file whose
    `max_bytes` cap is below what its regions need; regular files whose
    filesystem's free space is below what they must grow by, summed over the
    targets on that filesystem (`check_free_space`), with `side_bytes` (the checksum file and manifest)
    on the manifest's filesystem. Another table: a header page with another source
    digest, a first page of unknown non-zero data, or a manifest at
    `manifest_path` with another digest; `overwrite` accepts all three.
    """
    check_manifest_dir(manifest_path)
    is_block: list[bool] = []
    files: list[tuple[str, int, int]] = []   # regular-file targets: path, bytes needed, bytes held now
    for path, need in zip(targets, need_bytes):
        info = probe_target(path, max_bytes)
        is_block.append(info.is_block_device)
        if info.capacity_bytes is not None and need > info.capacity_bytes:
            what = "block device" if info.is_block_device else "file (capped by --max-bytes)"
            raise SlackTierError(ErrorKind.TARGET, f"target {path} is too small: its regions need {need} bytes, the "
                                 f"{what} holds {info.capacity_bytes}",
                                 fix="use a larger target, more targets, or fewer rows")
        if not info.is_block_device:
            files.append((path, need, info.size_bytes))
        if info.exists and info.size_bytes > 0 and not overwrite:
            head = _read_head(path)
            header = parse_header(head)
            if header is not None and header.get("source_digest") != source_digest:
                raise SlackTierError(ErrorKind.TARGET, f"target {path} already holds another table (source "
                                     f"{header.get('source_digest')})", fix="pass --overwrite to replace it")
            if header is None and any(head):
                raise SlackTierError(ErrorKind.TARGET, f"target {path} holds data that is not a SlackTier table",
                                     fix="pass --overwrite to replace it, or pick an empty target")
    if side_bytes:
        files.append((str(manifest_path), side_bytes, 0))
    if files:
        check_free_space([f[0] for f in files], [f[1] for f in files], [f[2] for f in files], free_space=free_space)
    if manifest_path.exists() and not overwrite:
        try:
            old = json.loads(manifest_path.read_text()).get("source", {}).get("digest")
        except (OSError, json.JSONDecodeError, AttributeError):
            old = None
        if old != source_digest:
            raise SlackTierError(ErrorKind.TARGET, f"manifest {manifest_path} already describes another table "
                                 f"(source {old})", fix="pass --overwrite to replace it, or another --manifest")
    return is_block


def check_manifest_dir(manifest_path: Path) -> None:
    """Refuse (SlackTierError TARGET) a manifest path whose directory is missing or not writable."""
    parent = manifest_path.parent
    if manifest_path.is_dir():
        raise SlackTierError(ErrorKind.TARGET, f"manifest path {manifest_path} is a directory",
                             fix="pass a file path for --manifest, e.g. DIR/table.manifest.json")
    if not parent.is_dir():
        raise SlackTierError(ErrorKind.TARGET, f"the manifest's directory {parent} does not exist",
                             fix="create the directory first, or pass another --manifest")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise SlackTierError(ErrorKind.TARGET, f"the manifest's directory {parent} is not writable",
                             fix="pass a --manifest in a directory you can write")


# ---------------------------------------------------------------- the writer

@dataclass
class StageStats:
    """What one staging run cost (filled in by `stage_table` when passed `stats=`)."""

    bytes_written: int = 0
    seconds: float = 0.0          # whole call: checks, preallocation, writes, fsync, manifest
    writer_busy_s: float = 0.0    # time the busiest writer thread spent inside pwrite
    fill_s: float = 0.0           # filler time (rows + CRCs), summed over filler threads

    @property
    def writer_busy_fraction(self) -> float:
        """Near 1: disk-bound; well below 1: the fillers (CPU) held the disk up."""
        return self.writer_busy_s / self.seconds if self.seconds else 0.0


class _Writer:
    """Threads that pwrite filled chunks while the caller fills the next ones, over a few reused aligned buffers.

    `n_threads` writers each take the next filled chunk and write it at its own
    offset, so up to `n_threads` O_DIRECT writes are in flight at once (queue
    depth n_threads). The fill kernels (rows and page checksums) and pwrite all
    release the GIL, so filling and writing overlap; the first write error
    surfaces on the caller in take()/finish() and later chunks are not written.
    """

    def __init__(self, files: list[DirectFile], n_buffers: int, chunk_bytes: int, n_threads: int = 1) -> None:
        if n_threads < 1:
            raise SlackTierError(ErrorKind.BAD_INPUT, f"{n_threads} writer threads", fix="use 1 or more writers")
        self.files = files
        self.free: queue.Queue[np.ndarray] = queue.Queue()
        for _ in range(n_buffers):
            self.free.put(aligned_array(chunk_bytes))
        self.todo: queue.Queue[tuple[int, np.ndarray, int, int] | None] = queue.Queue()
        self.error: BaseException | None = None
        self._busy_s = [0.0] * n_threads   # per writer thread: seconds inside pwrite
        self.threads = [threading.Thread(target=self._run, args=(i,), name=f"slacktier-stage-writer-{i}", daemon=True)
                        for i in range(n_threads)]
        for t in self.threads:
            t.start()

    @property
    def busy_s(self) -> float:
        """The busiest writer thread's seconds inside pwrite."""
        return max(self._busy_s)

    def _run(self, i: int) -> None:
        while (item := self.todo.get()) is not None:
            device, buf, nbytes, offset = item
            try:
                if self.error is None:
                    t0 = time.perf_counter()
                    self.files[device].pwrite(buf[:nbytes], offset)
                    self._busy_s[i] += time.perf_counter() - t0
            except BaseException as exc:  # handed to the caller in take()/finish()
                if self.error is None:
                    self.error = exc
            self.free.put(buf)

    def take(self) -> np.ndarray:
        """A free chunk buffer (waits for one); raises the first write error, if any."""
        buf = self.free.get()
        if self.error is not None:
            raise self.error
        return buf

    def put(self, device: int, buf: np.ndarray, nbytes: int, offset: int) -> None:
        """Queue buf[:nbytes] for a write at `offset` of target `device`."""
        self.todo.put((device, buf, nbytes, offset))

    def finish(self) -> None:
        """Stop the writer threads after the queued writes; raises the first write error, if any."""
        for _ in self.threads:
            self.todo.put(None)
        for t in self.threads:
            t.join()
        if self.error is not None:
            raise self.error


def stage_table(source: RowSource, targets: list[str | Path], ranks: int, *,
                manifest_path: str | Path | None = None, max_bytes: int | None = None, overwrite: bool = False,
                chunk_bytes: int = DEFAULT_CHUNK_BYTES, buffered: bool = False, progress: bool = True,
                fillers: int = DEFAULT_FILLERS, writers: int = DEFAULT_WRITERS,
                stats: StageStats | None = None, only_ranks: Sequence[int] | None = None,
                partition: str = DEFAULT_PARTITION, heads_per_order: int = 8,
                pack: PackRequest | None = None) -> Manifest:
    """Stage `source` as `ranks` shards per layer onto `targets` (ranks round-robin); returns the saved manifest.

    `partition` picks the hash columns of each rank's region (tables.partition: "columns", the engines' own
    sharding, or "balanced", as many heads of each order per rank; `heads_per_order`: 8 on V4.1 and Qwen3.8).

    `stats`, if given, receives the run's bytes, time and writer busy time. `only_ranks` writes only those
    ranks' shards (cut for `ranks` ranks; see manifest.plan_regions), as one rank's machine holds them.

    `pack` (context packing, tables.packing): a pack list and its per-rank budgets; each staged (layer, rank)
    gets a packed region after every row region, on its rank's target, and the index is written beside the
    manifest.
    """
    t_start = time.perf_counter()
    if writers < 1 or fillers < 1:
        raise SlackTierError(ErrorKind.BAD_INPUT, f"{fillers} filler and {writers} writer threads",
                             fix="use at least one filler and one writer")
    if chunk_bytes <= 0 or chunk_bytes % PAGE_BYTES:
        raise SlackTierError(ErrorKind.BAD_INPUT, f"chunk of {chunk_bytes} bytes is not whole pages",
                             fix="use a multiple of 4096, e.g. 4 MiB")
    paths = [os.path.abspath(str(t)) for t in targets]
    if len(set(paths)) != len(paths):
        raise SlackTierError(ErrorKind.BAD_INPUT, "a target is listed twice", fix="list each target once")
    layout = source.layout
    part = None
    if partition != DEFAULT_PARTITION:
        cols = {len(b) - 1 for b in layout.column_bounds.values()}
        if len(cols) != 1 or len(layout.column_bounds) != len(layout.rows):
            raise SlackTierError(ErrorKind.BAD_INPUT, f"the {partition!r} partition needs every layer's hash-column "
                                 "bounds, the same column count in each", fix="stage with the model's hash layout "
                                 "(--engram VOCAB|v41; a checkpoint with its config.json: --config), or --partition "
                                 "columns")
        part = RankPartition.make(partition, cols.pop(), ranks, heads_per_order)
    regions = plan_regions(layout, ranks, paths, only_ranks, part)
    packing = None
    if pack is not None:
        packing = _plan_packing(pack, layout, ranks, part, heads_per_order)
        place_packed_regions(packing, regions, paths, target_bytes(regions, len(paths)),
                             sum(r.pages for r in regions))
    need = target_bytes(regions + (packing.regions if packing is not None else []), len(paths))
    for path, nbytes in zip(paths, need):
        in_memory = ram_backed(path)
        if in_memory:
            log.warning("target %s is in host memory (%s): its %.1f MiB take DRAM as a DRAM-tier copy would, "
                        "whichever tier reads it (slacktier inspect and plan count them as host memory)",
                        path, in_memory, nbytes / 2**20)
    block_targets = [os.path.exists(p) and Path(p).is_block_device() for p in paths]
    if manifest_path is None:
        if block_targets[0]:
            raise SlackTierError(ErrorKind.BAD_INPUT, f"target {paths[0]} is a block device, so the manifest cannot "
                                 "sit beside it", fix="pass --manifest PATH")
        manifest_path = default_manifest_path(paths[0])
    manifest_path = Path(manifest_path).absolute()
    locks = _lock_targets(paths)   # before anything is checked or written: no engine serves from them now
    try:
        return _stage_locked(source, ranks, paths, regions, need, manifest_path, locks, t_start, part,
                             max_bytes=max_bytes, overwrite=overwrite, chunk_bytes=chunk_bytes, buffered=buffered,
                             progress=progress, fillers=fillers, writers=writers, stats=stats, packing=packing)
    finally:
        for fd in locks.values():
            os.close(fd)


def _plan_packing(pack: PackRequest, layout: Any, ranks: int, part: RankPartition | None,
                  heads_per_order: int) -> PackPlan:
    """The contexts a staging run packs (tables.packing.plan_packing), under its rank partition."""
    cols = {len(b) - 1 for b in layout.column_bounds.values()}
    owned = None
    if part is not None:
        owned = part.columns
    elif ranks > 1:
        if len(cols) != 1 or len(layout.column_bounds) != len(layout.rows) or next(iter(cols)) % ranks:
            raise SlackTierError(ErrorKind.BAD_INPUT, f"--pack-list needs every rank to own whole hash columns: "
                                 f"{ranks} ranks over the layers' {sorted(cols) or 'unknown'} columns do not",
                                 fix="stage from the model's hash layout (--engram, a checkpoint's config.json) "
                                     "with a rank count that divides its columns")
        owned = rank_columns(DEFAULT_PARTITION, cols.pop(), ranks, heads_per_order)

    to_stored = None
    if part is not None and part.kind != DEFAULT_PARTITION:
        def to_stored(layer: int, ids: np.ndarray) -> np.ndarray:
            row_map = RowMap.of(layer_spans(layout, layer, ranks, part), layout.rows[layer])
            return ids if row_map is None else row_map.to_stored(ids)
    return plan_packing(pack, dict(layout.rows), dict(layout.column_bounds), owned, ranks, to_stored)


def _lock_targets(paths: list[str]) -> dict[str, int]:
    """Exclusive locks on the existing targets (tables.odirect.lock_target): {path: fd holding the lock}.
    Refused (TARGET), naming the target, while an engine serves from one; nothing is written then."""
    locks: dict[str, int] = {}
    try:
        for p in paths:
            if not os.path.exists(p):
                continue
            try:
                fd = os.open(p, os.O_RDONLY | os.O_CLOEXEC)
            except OSError as exc:
                raise SlackTierError(ErrorKind.IO, f"cannot open target {p}: {exc.strerror}",
                                     fix="check the target's path and permissions") from None
            locks[p] = fd
            lock_target(fd, p, exclusive=True)
    except BaseException:
        for fd in locks.values():
            os.close(fd)
        raise
    return locks


def _stage_locked(source: RowSource, ranks: int, paths: list[str], regions: list, need: list[int],
                  manifest_path: Path, locks: dict[str, int], t_start: float, part: RankPartition | None, *,
                  max_bytes: int | None, overwrite: bool, chunk_bytes: int, buffered: bool, progress: bool,
                  fillers: int, writers: int, stats: StageStats | None,
                  packing: PackPlan | None = None) -> Manifest:
    """stage_table once its existing targets are locked (`locks`)."""
    layout = source.layout
    digest = source.digest
    packed = packing.regions if packing is not None else []
    total_pages = sum(r.pages for r in regions) + sum(r.pages for r in packed)
    side = 4 * total_pages + (1 << 20)   # the checksum file (4 B per page) and the manifest, beside it
    is_block = check_targets(paths, need, digest, manifest_path, overwrite, max_bytes, side_bytes=side)

    if manifest_path.exists():
        manifest_path.unlink()  # checks passed: a stale manifest must not outlive the bytes it describes
    files = [DirectFile(p, write=True, create=not b, buffered=buffered) for p, b in zip(paths, is_block)]
    index_data = index_file_bytes(packing.indexes) if packing is not None else b""
    index_digest = hashlib.sha256(index_data).hexdigest() if packing is not None else ""
    stage_id = content_stage_id(digest, layout, ranks, regions, part, need, packed, index_digest)
    crcs = np.zeros(total_pages, dtype=np.uint32)
    try:
        for f in files:
            if f.path not in locks:   # created by this run: locked before its header is written
                lock_target(f.fd, f.path, exclusive=True)
        # Every target says "staging" (this run's id) before any of them changes in any other way, so a run
        # that stops anywhere after this loop leaves every target refused by check_target_header.
        head = aligned_array(TARGET_HEADER_BYTES)
        for i, f in enumerate(files):
            head[:] = header_page(digest, i, len(files), "staging", stage_id, need[i])
            f.pwrite(head, 0)
        for f in files:
            f.sync()
        for f, n, b in zip(files, need, is_block):
            if not b:
                try:
                    os.ftruncate(f.fd, n)
                    os.posix_fallocate(f.fd, 0, n)  # reserve the space now: no ENOSPC halfway through
                except OSError as exc:
                    raise os_error(exc, f"reserving {n} bytes for {f.path}") from None
        pieces = [p for region in regions for p in (region_pieces(region, layer_spans(
            layout, region.layer, ranks, part)[region.rank]) if part is not None else [region])]
        chunks = [(piece, first_row) for piece in pieces
                  for first_row in range(0, piece.rows, (chunk_bytes // PAGE_BYTES) * ROWS_PER_PAGE)]
        if packing is not None:   # marked -1 - first context: `_stage_chunk` hands them to `_stage_packed_chunk`
            per = max(1, chunk_bytes // (packing.pages_per_context * PAGE_BYTES))
            chunks += [(r, -1 - c0) for r in packed for c0 in range(0, r.pages // packing.pages_per_context, per)]
        writer = _Writer(files, n_buffers=8 + writers, chunk_bytes=chunk_bytes, n_threads=writers)
        fill_total_s = 0.0
        bar = tqdm(total=total_pages * PAGE_BYTES, unit="B", unit_scale=True, desc="stage", disable=not progress)
        try:
            # Fill kernels release the GIL, so `fillers` threads fill chunks side by side.
            pool = ThreadPoolExecutor(max_workers=max(1, fillers), thread_name_prefix="slacktier-stage-fill")
            try:
                for nbytes, fill_s in pool.map(lambda c: _stage_chunk(source, c[0], c[1], writer, chunk_bytes, crcs,
                                                                      packing), chunks):
                    bar.update(nbytes)
                    fill_total_s += fill_s
            except BaseException:
                pool.shutdown(wait=True, cancel_futures=True)   # chunks not started are dropped, not filled
                raise
            pool.shutdown(wait=True)
        finally:
            writer.finish()
            bar.close()
        for f in files:
            f.sync()  # every target's regions are durable before any target says "complete"
        for i, f in enumerate(files):
            head[:] = header_page(digest, i, len(files), "complete", stage_id, need[i])
            f.pwrite(head, 0)
            f.sync()
    finally:
        for f in files:
            f.close()

    crc_file = manifest_path.with_suffix("").name + ".crc" if manifest_path.suffix == ".json" else \
        manifest_path.name + ".crc"
    crc_bytes = crcs.astype("<u4").tobytes()
    crc_path = manifest_path.parent / crc_file
    write_file_atomic(crc_path, crc_bytes, what="checksum file")
    index_path = None
    packed_table = None
    if packing is not None:
        index_path = manifest_path.parent / (crc_file.removesuffix(".crc") + ".pack.npz")
        save_indexes(index_path, index_data)
        req = packing.request
        packed_table = PackedTable(
            regions=tuple(packed), contexts={k: int(packing.ids[k].shape[0]) for k in packing.layers},
            pages_per_context=packing.pages_per_context, rank_columns=packing.rank_columns,
            index_file=index_path.name, index_sha256=index_digest, index_bytes_per_rank=packing.index_bytes_per_rank,
            disk_bytes_per_rank=packing.disk_bytes_per_rank, budget_disk_bytes=req.disk_bytes,
            budget_index_bytes=req.index_bytes,
            pack_list={"file": Path(req.pack_list.path).name, "meta": req.pack_list.meta})
    manifest = Manifest(layout=layout, ranks=ranks, targets=paths, regions=regions, source=source.spec(),
                        crc_file=crc_file, crc_sha256=hashlib.sha256(crc_bytes).hexdigest(), total_pages=total_pages,
                        stage_id=stage_id, partition=part, packing=packed_table,
                        created_utc=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"))
    try:
        manifest.save(manifest_path)
    except BaseException:
        crc_path.unlink(missing_ok=True)   # no checksum file without the manifest that names it
        if index_path is not None:
            index_path.unlink(missing_ok=True)
        raise
    if stats is not None:
        stats.bytes_written = sum(need)
        stats.seconds = time.perf_counter() - t_start
        stats.writer_busy_s = writer.busy_s
        stats.fill_s = fill_total_s
    log.info("staged %d regions, %d pages to %s; manifest %s", len(regions), total_pages, paths, manifest_path)
    return manifest


def _stage_packed_chunk(source: RowSource, region: StagedRegion, first_context: int, writer: _Writer,
                        chunk_bytes: int, crcs: np.ndarray, packing: PackPlan) -> tuple[int, float]:
    """Fill one chunk of packed region `region` from context `first_context` (tables.packing's page layout, and
    page CRCs) and queue its write. Returns (bytes queued, seconds spent filling)."""
    ppc = packing.pages_per_context
    n_ctx = region.pages // ppc
    n = min(max(1, chunk_bytes // (ppc * PAGE_BYTES)), n_ctx - first_context)
    owned = list(packing.rank_columns[region.rank])
    ids = packing.ids[region.layer][first_context:first_context + n][:, owned]   # [n, owned] global ids
    buf = writer.take()
    npages = n * ppc
    pages = buf[:npages * PAGE_BYTES].reshape(npages, PAGE_BYTES)
    at = region.crc_first_page + first_context * ppc
    t0 = time.perf_counter()
    try:
        rows = source.rows(region.layer, ids.reshape(-1))
        fill_packed_pages(rows, ids, first_context, pages)
        page_crcs(pages, crcs[at:at + npages])
    except BaseException:
        writer.free.put(buf)
        raise
    fill_s = time.perf_counter() - t0
    writer.put(region.device, buf, npages * PAGE_BYTES, region.offset_bytes + first_context * ppc * PAGE_BYTES)
    return npages * PAGE_BYTES, fill_s


def _stage_chunk(source: RowSource, region: StagedRegion, first_row: int, writer: _Writer, chunk_bytes: int,
                 crcs: np.ndarray, packing: PackPlan | None = None) -> tuple[int, float]:
    """Fill one chunk of `region` from shard row `first_row` (rows and page CRCs) and queue its write; a
    negative `first_row` is packed region `region`'s chunk from context -1 - first_row.

    Returns (bytes queued, seconds spent filling)."""
    if first_row < 0 and packing is not None:
        return _stage_packed_chunk(source, region, -1 - first_row, writer, chunk_bytes, crcs, packing)
    n = min((chunk_bytes // PAGE_BYTES) * ROWS_PER_PAGE, region.rows - first_row)
    npages = pages_for_rows(n)
    page0 = first_row // ROWS_PER_PAGE
    buf = writer.take()
    pages = buf[:npages * PAGE_BYTES].reshape(npages, PAGE_BYTES)
    at = region.crc_first_page + page0
    t0 = time.perf_counter()
    try:
        source.fill_pages(region.layer, region.row_start + first_row, n, pages, crcs[at:at + npages])
    except BaseException:
        writer.free.put(buf)   # a chunk that failed gives its buffer back: the other fillers must not wait for it
        raise
    fill_s = time.perf_counter() - t0
    writer.put(region.device, buf, npages * PAGE_BYTES, region.offset_bytes + page0 * PAGE_BYTES)
    return npages * PAGE_BYTES, fill_s
