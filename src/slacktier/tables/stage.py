"""Staging: write a table's (layer, rank) regions of whole 4 KiB pages onto files or raw block devices.

Sources: a safetensors checkpoint (`CheckpointSource`) holding, per layer,
`layers.{layer}.engram.embed.weight` [rows, 256] float8_e4m3fn and
`layers.{layer}.engram.embed.scale` [rows, 8] float8_e8m0fnu (DeepSeek's
checkpoint names, which SGLang loads as `model.layers.{layer}.engram.embed.*`;
both spellings are accepted), or a seeded synthetic table of any layout
(`SyntheticSource`).

Everything that can be refused is refused before the first byte is written:
a target too small for its regions, a checkpoint tensor missing or of a wrong
dtype or shape, a target (or manifest) that already holds another table unless
`overwrite`. Writes are O_DIRECT, in large aligned chunks (4 MiB) from
page-aligned buffers: filler threads fill the next chunks (rows, and each
page's CRC32C while the page is still in L1) while writer threads (4 by
default, so 4 writes in flight, each at its own offset) write. The
manifest and checksum file are written last, after fsync, so a manifest never
describes a table that is not fully on its targets.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import logging
import os
import queue
import re
import struct
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numba
import numpy as np
from tqdm import tqdm

from slacktier.errors import ErrorKind, SlackTierError
from slacktier.tables.codec import _mix64, synthetic_row_into, synthetic_seed
from slacktier.tables.layout import PAGE_BYTES, ROW_BYTES, ROW_SCALES, ROW_VALUES, ROWS_PER_PAGE, pages_for_rows
from slacktier.tables.manifest import (
    TARGET_HEADER_BYTES,
    Manifest,
    Region,
    TableLayout,
    default_manifest_path,
    header_page,
    parse_header,
    plan_regions,
    sha256_file,
    table_layout_from,
    target_bytes,
)
from slacktier.tables.odirect import DirectFile, aligned_array, probe_target
from slacktier.tables.pagecrc import HW_CRC32C, crc_page_words, page_crcs

log = logging.getLogger(__name__)

SYNTHETIC_GENERATOR = "slacktier-splitmix64-fp8-v1"
CHECKPOINT_NAME_TEMPLATES = ("layers.{layer}.engram.embed.{part}", "model.layers.{layer}.engram.embed.{part}")
DEFAULT_CHUNK_BYTES = 4 << 20
DEFAULT_FILLERS = min(2, os.cpu_count() or 1)  # threads filling chunks
DEFAULT_WRITERS = 4                             # threads writing chunks = O_DIRECT writes in flight
PAGE_WORDS = PAGE_BYTES // 8            # 512 uint64 words per page
ROW_WORDS = ROW_BYTES // 8              # 33
USED_WORDS = ROWS_PER_PAGE * ROW_WORDS  # 495: words 495..511 of a page are zero padding


# ---------------------------------------------------------------- compiled page fillers
# numba's cache=True keys a kernel on this file only: after editing codec.synthetic_row_into or
# pagecrc.crc_page_words, delete __pycache__/stage.*.nbi/.nbc (the tests compare against both and
# would fail on a stale kernel).

@numba.njit(nogil=True, cache=True, inline="always")
def _synthetic_page(seed: np.uint64, row_start: np.int64, rows: np.int64, pages64: np.ndarray, p: np.int64) -> None:
    # page p of the chunk: rows p*15 .. p*15+14 (zeros past `rows`), then 17 zero words of padding
    base = p * PAGE_WORDS
    for k in range(ROWS_PER_PAGE):
        i = p * ROWS_PER_PAGE + k
        if i < rows:
            synthetic_row_into(seed, row_start + i, pages64, base + k * ROW_WORDS)
        else:
            for w in range(ROW_WORDS):
                pages64[base + k * ROW_WORDS + w] = 0
    for w in range(USED_WORDS, PAGE_WORDS):
        pages64[base + w] = 0


@numba.njit(nogil=True, cache=True)
def _synthetic_pages(seed: np.uint64, row_start: np.int64, rows: np.int64, pages64: np.ndarray) -> None:
    # pages64: [P * 512] uint64 for P = ceil(rows / 15) pages; row i -> page i // 15, word (i % 15) * 33
    for p in range((rows + ROWS_PER_PAGE - 1) // ROWS_PER_PAGE):
        _synthetic_page(seed, row_start, rows, pages64, p)


@numba.njit(nogil=True, cache=True)
def _synthetic_pages_crc(seed: np.uint64, row_start: np.int64, rows: np.int64, pages64: np.ndarray,
                         crcs: np.ndarray) -> None:
    # as _synthetic_pages, and each page's CRC32C while it is still in L1: crcs [P] uint32
    for p in range((rows + ROWS_PER_PAGE - 1) // ROWS_PER_PAGE):
        _synthetic_page(seed, row_start, rows, pages64, p)
        crcs[p] = crc_page_words(pages64, p * PAGE_WORDS)


@numba.njit(nogil=True, cache=True)
def _synthetic_gather(seed: np.uint64, row_ids: np.ndarray, out64: np.ndarray) -> None:
    # row_ids: [n] int64 global rows; out64: [n * 33] uint64
    for i in range(row_ids.shape[0]):
        synthetic_row_into(seed, row_ids[i], out64, i * ROW_WORDS)


@numba.njit(nogil=True, cache=True, inline="always")
def _pack_page(weight: np.ndarray, scale: np.ndarray, pages: np.ndarray, p: np.int64) -> None:
    n = weight.shape[0]
    for k in range(ROWS_PER_PAGE):
        i = p * ROWS_PER_PAGE + k
        at = k * ROW_BYTES
        if i < n:
            for j in range(ROW_VALUES):
                pages[p, at + j] = weight[i, j]
            for j in range(ROW_SCALES):
                pages[p, at + ROW_VALUES + j] = scale[i, j]
        else:
            for j in range(ROW_BYTES):
                pages[p, at + j] = 0
    for j in range(ROWS_PER_PAGE * ROW_BYTES, PAGE_BYTES):
        pages[p, j] = 0


@numba.njit(nogil=True, cache=True)
def _pack_pages(weight: np.ndarray, scale: np.ndarray, pages: np.ndarray) -> None:
    # weight: [n, 256] uint8, scale: [n, 8] uint8 -> pages: [ceil(n / 15), 4096] uint8, zero padded
    for p in range(pages.shape[0]):
        _pack_page(weight, scale, pages, p)


@numba.njit(nogil=True, cache=True)
def _pack_pages_crc(weight: np.ndarray, scale: np.ndarray, pages: np.ndarray, crcs: np.ndarray) -> None:
    # as _pack_pages, and each page's CRC32C while it is still in L1: crcs [P] uint32
    words = pages.reshape(-1).view(np.uint64)
    for p in range(pages.shape[0]):
        _pack_page(weight, scale, pages, p)
        crcs[p] = crc_page_words(words, p * PAGE_WORDS)


# ---------------------------------------------------------------- sources

class RowSource(Protocol):
    """Where a table's rows come from: fills pages for staging, returns rows for verification."""

    layout: TableLayout

    @property
    def digest(self) -> str: ...

    def spec(self) -> dict[str, Any]: ...

    def fill_pages(self, layer: int, row_start: int, rows: int, pages: np.ndarray,
                   crcs: np.ndarray | None = None) -> None: ...

    def rows(self, layer: int, row_ids: np.ndarray) -> np.ndarray: ...


def layer_seed(seed: int, layer: int) -> np.uint64:
    """The generator seed of one layer: a mix of the table seed and the layer id."""
    with np.errstate(over="ignore"):
        return np.uint64(_mix64(synthetic_seed(seed) ^ (np.uint64(layer) * np.uint64(0xA24BAED4963EE407))))


class SyntheticSource:
    """A seeded synthetic table: row bytes are a pure function of (seed, layer, global row id).

    Layer `l`'s row `r` equals `codec.synthetic_rows(s, r, 1)` for the seed
    `s = layer_seed(seed, l)` (as an int), so any row can be regenerated alone.
    """

    kind = "synthetic"

    def __init__(self, layout: TableLayout, seed: int) -> None:
        self.layout = layout
        self.seed = int(seed)
        spec = {"generator": SYNTHETIC_GENERATOR, "seed": self.seed, "layout": layout.to_json()}
        self._digest = "sha256:" + hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()

    @property
    def digest(self) -> str:
        return self._digest

    def spec(self) -> dict[str, Any]:
        return {"kind": self.kind, "digest": self.digest, "generator": SYNTHETIC_GENERATOR, "seed": self.seed}

    def fill_pages(self, layer: int, row_start: int, rows: int, pages: np.ndarray,
                   crcs: np.ndarray | None = None) -> None:
        """Fill pages [P = ceil(rows/15), 4096] uint8 (C-contiguous) with global rows [row_start, row_start + rows),
        and their CRC32Cs into `crcs` [P] uint32 if given."""
        words = pages.reshape(-1).view(np.uint64)
        seed = layer_seed(self.seed, layer)
        if crcs is not None and HW_CRC32C:
            _synthetic_pages_crc(seed, np.int64(row_start), np.int64(rows), words, crcs)
            return
        _synthetic_pages(seed, np.int64(row_start), np.int64(rows), words)
        if crcs is not None:
            page_crcs(pages, crcs)

    def rows(self, layer: int, row_ids: np.ndarray) -> np.ndarray:
        """Global rows `row_ids` [n] of `layer` -> raw [n, 264] uint8."""
        ids = np.ascontiguousarray(row_ids, dtype=np.int64)
        out = np.empty((ids.shape[0], ROW_BYTES), dtype=np.uint8)
        _synthetic_gather(layer_seed(self.seed, layer), ids, out.reshape(-1).view(np.uint64))
        return out


@dataclass(frozen=True)
class _TensorInfo:
    file: str
    dtype: str
    shape: tuple[int, ...]
    offset_bytes: int   # absolute offset of the tensor's first byte in the file
    nbytes: int


def _read_safetensors_header(path: str) -> dict[str, _TensorInfo]:
    """Tensor name -> where its bytes are, from a safetensors file's JSON header."""
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) != 8:
                raise ValueError("shorter than 8 bytes")
            n = struct.unpack("<Q", head)[0]
            if n > 100 << 20:
                raise ValueError(f"header length {n} is implausible")
            meta = json.loads(f.read(n))
    except (OSError, ValueError) as exc:
        raise SlackTierError(ErrorKind.CHECKPOINT, f"{path} is not a readable safetensors file: {exc}",
                             fix="pass a .safetensors checkpoint file or a directory of them") from exc
    size = os.path.getsize(path)
    out: dict[str, _TensorInfo] = {}
    for name, t in meta.items():
        if name == "__metadata__":
            continue
        begin, end = t["data_offsets"]
        info = _TensorInfo(path, t["dtype"], tuple(int(x) for x in t["shape"]), 8 + n + begin, end - begin)
        if info.offset_bytes + info.nbytes > size:
            raise SlackTierError(ErrorKind.CHECKPOINT, f"tensor {name} runs past the end of {path} (truncated?)",
                                 fix="re-download the checkpoint file")
        out[name] = info
    return out


def _checkpoint_files(checkpoint: str | Path | list[str | Path]) -> list[str]:
    items = checkpoint if isinstance(checkpoint, list) else [checkpoint]
    files: list[str] = []
    for item in items:
        p = Path(item)
        if p.is_dir():
            files += sorted(str(f.resolve()) for f in p.glob("*.safetensors"))
        elif p.is_file():
            files.append(str(p.resolve()))
        else:
            raise SlackTierError(ErrorKind.MISSING, f"checkpoint {p} does not exist",
                                 fix="pass a .safetensors file or a directory holding them")
    if not files:
        raise SlackTierError(ErrorKind.MISSING, f"no .safetensors files in {checkpoint}",
                             fix="pass a .safetensors file or a directory holding them")
    return files


class CheckpointSource:
    """A safetensors checkpoint's Engram tables, read through memory maps (nothing loaded whole).

    `layers` None takes every layer that has an `...engram.embed.weight`.
    `expected` (a TableLayout) makes any rows mismatch a refusal. Digest: the
    sha256 of the checkpoint file for one file; for several, the sha256 of the
    lines "<file name> <sha256>\\n" over the files that hold the table, sorted.
    """

    kind = "checkpoint"

    def __init__(self, checkpoint: str | Path | list[str | Path], layers: list[int] | None = None,
                 column_bounds: dict[int, tuple[int, ...]] | None = None,
                 expected: TableLayout | None = None) -> None:
        self.files = _checkpoint_files(checkpoint)
        tensors: dict[str, _TensorInfo] = {}
        for f in self.files:
            tensors.update(_read_safetensors_header(f))
        if layers is None:
            found = set()
            for name in tensors:
                m = re.fullmatch(r"(?:model\.)?layers\.(\d+)\.engram\.embed\.weight", name)
                if m:
                    found.add(int(m.group(1)))
            if not found:
                raise SlackTierError(ErrorKind.CHECKPOINT, f"no tensor named like "
                                     f"{CHECKPOINT_NAME_TEMPLATES[0].format(layer='L', part='weight')} in "
                                     f"{', '.join(self.files)}", fix="pass the checkpoint that holds the Engram tables")
            layers = sorted(found)
        self.names: dict[int, dict[str, str]] = {}
        self._weight: dict[int, np.ndarray] = {}
        self._scale: dict[int, np.ndarray] = {}
        rows: dict[int, int] = {}
        for layer in layers:
            names = self._names_for(layer, tensors)
            w, s = tensors[names["weight"]], tensors[names["scale"]]
            self._check(layer, names, w, s, expected)
            rows[layer] = w.shape[0]
            self.names[layer] = names
            self._weight[layer] = np.memmap(w.file, dtype=np.uint8, mode="r", offset=w.offset_bytes,
                                            shape=(w.shape[0], ROW_VALUES))
            self._scale[layer] = np.memmap(s.file, dtype=np.uint8, mode="r", offset=s.offset_bytes,
                                           shape=(s.shape[0], ROW_SCALES))
        self.layout = TableLayout(rows, dict(column_bounds or {}))
        self._files_used = sorted({tensors[n].file for names in self.names.values() for n in names.values()})
        self._digest: str | None = None

    @staticmethod
    def _names_for(layer: int, tensors: dict[str, _TensorInfo]) -> dict[str, str]:
        for template in CHECKPOINT_NAME_TEMPLATES:
            names = {part: template.format(layer=layer, part=part) for part in ("weight", "scale")}
            if names["weight"] in tensors or names["scale"] in tensors:
                for part, name in names.items():
                    if name not in tensors:
                        raise SlackTierError(ErrorKind.CHECKPOINT, f"checkpoint has no tensor {name}",
                                             fix=f"the checkpoint must hold both {names['weight']} and "
                                             f"{names['scale']}", layer=layer)
                return names
        raise SlackTierError(ErrorKind.CHECKPOINT, f"checkpoint has no tensor "
                             f"{CHECKPOINT_NAME_TEMPLATES[0].format(layer=layer, part='weight')} (nor the "
                             f"model.-prefixed name)", fix="check the layer ids against the checkpoint", layer=layer)

    @staticmethod
    def _check(layer: int, names: dict[str, str], w: _TensorInfo, s: _TensorInfo,
               expected: TableLayout | None) -> None:
        for info, name, dtype in ((w, names["weight"], "F8_E4M3"), (s, names["scale"], "F8_E8M0")):
            if info.dtype != dtype:
                torch_name = "float8_e4m3fn" if dtype == "F8_E4M3" else "float8_e8m0fnu"
                raise SlackTierError(ErrorKind.CHECKPOINT, f"tensor {name} has dtype {info.dtype}, want {dtype} "
                                     f"({torch_name})", fix="stage the FP8 checkpoint, not a converted one",
                                     layer=layer)
        if len(w.shape) != 2 or w.shape[1] != ROW_VALUES:
            raise SlackTierError(ErrorKind.CHECKPOINT, f"tensor {names['weight']} has shape {list(w.shape)}, want "
                                 f"[rows, {ROW_VALUES}]", fix="check the checkpoint's Engram shapes", layer=layer)
        if len(s.shape) != 2 or s.shape != (w.shape[0], ROW_SCALES):
            raise SlackTierError(ErrorKind.CHECKPOINT, f"tensor {names['scale']} has shape {list(s.shape)}, want "
                                 f"[{w.shape[0]}, {ROW_SCALES}]", fix="check the checkpoint's Engram shapes",
                                 layer=layer)
        if expected is not None and expected.rows.get(layer) != w.shape[0]:
            raise SlackTierError(ErrorKind.CHECKPOINT, f"layer {layer} has {w.shape[0]} rows in the checkpoint, the "
                                 f"layout expects {expected.rows.get(layer)}", fix="check the layout against the "
                                 "checkpoint", layer=layer)

    @property
    def digest(self) -> str:
        if self._digest is None:
            if len(self._files_used) == 1:
                self._digest = "sha256:" + sha256_file(self._files_used[0])
            else:
                lines = "".join(f"{Path(f).name} {sha256_file(f)}\n" for f in self._files_used)
                self._digest = "sha256:" + hashlib.sha256(lines.encode()).hexdigest()
        return self._digest

    def spec(self) -> dict[str, Any]:
        return {"kind": self.kind, "digest": self.digest, "files": self._files_used,
                "tensors": {str(k): v for k, v in sorted(self.names.items())}}

    def fill_pages(self, layer: int, row_start: int, rows: int, pages: np.ndarray,
                   crcs: np.ndarray | None = None) -> None:
        """Fill pages [P = ceil(rows/15), 4096] uint8 with the checkpoint's rows [row_start, row_start + rows),
        and their CRC32Cs into `crcs` [P] uint32 if given."""
        end = row_start + rows
        weight, scale = self._weight[layer][row_start:end], self._scale[layer][row_start:end]
        if crcs is not None and HW_CRC32C:
            _pack_pages_crc(weight, scale, pages, crcs)
            return
        _pack_pages(weight, scale, pages)
        if crcs is not None:
            page_crcs(pages, crcs)

    def rows(self, layer: int, row_ids: np.ndarray) -> np.ndarray:
        """Global rows `row_ids` [n] of `layer` -> raw [n, 264] uint8."""
        ids = np.asarray(row_ids, dtype=np.int64)
        return np.concatenate([self._weight[layer][ids], self._scale[layer][ids]], axis=1)


def source_from_manifest(manifest: Manifest, checkpoint: str | Path | list[str | Path] | None = None) -> RowSource:
    """Rebuild the row source a manifest was staged from (`checkpoint` overrides the recorded files)."""
    src = manifest.source
    if src["kind"] == "synthetic":
        if src.get("generator") != SYNTHETIC_GENERATOR:
            raise SlackTierError(ErrorKind.BAD_INPUT, f"synthetic generator {src.get('generator')} is not "
                                 f"{SYNTHETIC_GENERATOR}", fix="restage the table with this version")
        return SyntheticSource(manifest.layout, int(src["seed"]))
    if src["kind"] == "checkpoint":
        return CheckpointSource(checkpoint if checkpoint is not None else list(src["files"]),
                                layers=list(manifest.layout.layer_ids), column_bounds=manifest.layout.column_bounds,
                                expected=manifest.layout)
    raise SlackTierError(ErrorKind.BAD_INPUT, f"unknown source kind {src['kind']!r}", fix="restage the table")


# ---------------------------------------------------------------- checks before writing

def _read_head(path: str) -> bytes:
    with open(path, "rb", buffering=0) as f:
        return f.read(TARGET_HEADER_BYTES)


def check_targets(targets: list[str], need_bytes: list[int], source_digest: str, manifest_path: Path,
                  overwrite: bool, max_bytes: int | None) -> list[bool]:
    """Refuse (SlackTierError TARGET) a target too small or holding another table; returns is-block-device per target.

    Too small: a block device shorter than its regions; a regular file whose
    `max_bytes` cap, or whose filesystem's free space plus its current size, is
    below what its regions need. Another table: a header page with another source
    digest, a first page of unknown non-zero data, or a manifest at
    `manifest_path` with another digest; `overwrite` accepts all three.
    """
    is_block: list[bool] = []
    for path, need in zip(targets, need_bytes):
        info = probe_target(path, max_bytes)
        is_block.append(info.is_block_device)
        if info.capacity_bytes is not None and need > info.capacity_bytes:
            what = "block device" if info.is_block_device else "file (capped by --max-bytes)"
            raise SlackTierError(ErrorKind.TARGET, f"target {path} is too small: its regions need {need} bytes, the "
                                 f"{what} holds {info.capacity_bytes}",
                                 fix="use a larger target, more targets, or fewer rows")
        if not info.is_block_device and info.free_bytes is not None and need > info.free_bytes + info.size_bytes:
            raise SlackTierError(ErrorKind.TARGET, f"target {path} is too small: its regions need {need} bytes, its "
                                 f"filesystem has {info.free_bytes} free", fix="free space or stage elsewhere")
        if info.exists and info.size_bytes > 0 and not overwrite:
            head = _read_head(path)
            header = parse_header(head)
            if header is not None and header.get("source_digest") != source_digest:
                raise SlackTierError(ErrorKind.TARGET, f"target {path} already holds another table (source "
                                     f"{header.get('source_digest')})", fix="pass --overwrite to replace it")
            if header is None and any(head):
                raise SlackTierError(ErrorKind.TARGET, f"target {path} holds data that is not a SlackTier table",
                                     fix="pass --overwrite to replace it, or pick an empty target")
    if manifest_path.exists() and not overwrite:
        try:
            old = json.loads(manifest_path.read_text()).get("source", {}).get("digest")
        except (OSError, json.JSONDecodeError, AttributeError):
            old = None
        if old != source_digest:
            raise SlackTierError(ErrorKind.TARGET, f"manifest {manifest_path} already describes another table "
                                 f"(source {old})", fix="pass --overwrite to replace it, or another --manifest")
    return is_block


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
        buf = self.free.get()
        if self.error is not None:
            raise self.error
        return buf

    def put(self, device: int, buf: np.ndarray, nbytes: int, offset: int) -> None:
        self.todo.put((device, buf, nbytes, offset))

    def finish(self) -> None:
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
                stats: StageStats | None = None) -> Manifest:
    """Stage `source` as `ranks` shards per layer onto `targets` (ranks round-robin); returns the saved manifest.

    `stats`, if given, receives the run's bytes, time and writer busy time.
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
    regions = plan_regions(layout, ranks, paths)
    need = target_bytes(regions, len(paths))
    block_targets = [os.path.exists(p) and Path(p).is_block_device() for p in paths]
    if manifest_path is None:
        if block_targets[0]:
            raise SlackTierError(ErrorKind.BAD_INPUT, f"target {paths[0]} is a block device, so the manifest cannot "
                                 "sit beside it", fix="pass --manifest PATH")
        manifest_path = default_manifest_path(paths[0])
    manifest_path = Path(manifest_path).absolute()
    digest = source.digest
    is_block = check_targets(paths, need, digest, manifest_path, overwrite, max_bytes)

    if manifest_path.exists():
        manifest_path.unlink()  # checks passed: a stale manifest must not outlive the bytes it describes
    files = [DirectFile(p, write=True, create=not b, buffered=buffered) for p, b in zip(paths, is_block)]
    total_pages = sum(r.pages for r in regions)
    crcs = np.zeros(total_pages, dtype=np.uint32)
    try:
        for f, n, b in zip(files, need, is_block):
            if not b:
                try:
                    os.ftruncate(f.fd, n)
                    os.posix_fallocate(f.fd, 0, n)  # reserve the space now: no ENOSPC halfway through
                except OSError as exc:
                    raise SlackTierError(ErrorKind.TARGET, f"cannot reserve {n} bytes for {f.path}: {exc}",
                                         fix="free space or stage elsewhere") from exc
        head = aligned_array(TARGET_HEADER_BYTES)
        for i, f in enumerate(files):
            head[:] = header_page(digest, i, len(files), "staging")
            f.pwrite(head, 0)
        chunks = [(region, first_row) for region in regions
                  for first_row in range(0, region.rows, (chunk_bytes // PAGE_BYTES) * ROWS_PER_PAGE)]
        writer = _Writer(files, n_buffers=8 + writers, chunk_bytes=chunk_bytes, n_threads=writers)
        fill_total_s = 0.0
        bar = tqdm(total=total_pages * PAGE_BYTES, unit="B", unit_scale=True, desc="stage", disable=not progress)
        try:
            # Fill kernels release the GIL, so `fillers` threads fill chunks side by side.
            with ThreadPoolExecutor(max_workers=max(1, fillers), thread_name_prefix="slacktier-stage-fill") as pool:
                for nbytes, fill_s in pool.map(lambda c: _stage_chunk(source, c[0], c[1], writer, chunk_bytes, crcs),
                                               chunks):
                    bar.update(nbytes)
                    fill_total_s += fill_s
        finally:
            writer.finish()
            bar.close()
        for i, f in enumerate(files):
            f.sync()
            head[:] = header_page(digest, i, len(files), "complete")
            f.pwrite(head, 0)
            f.sync()
    finally:
        for f in files:
            f.close()

    crc_file = manifest_path.with_suffix("").name + ".crc" if manifest_path.suffix == ".json" else \
        manifest_path.name + ".crc"
    crc_bytes = crcs.astype("<u4").tobytes()
    crc_path = manifest_path.parent / crc_file
    tmp = crc_path.with_name(crc_path.name + ".tmp")
    tmp.write_bytes(crc_bytes)
    os.replace(tmp, crc_path)
    manifest = Manifest(layout=layout, ranks=ranks, targets=paths, regions=regions, source=source.spec(),
                        crc_file=crc_file, crc_sha256=hashlib.sha256(crc_bytes).hexdigest(), total_pages=total_pages,
                        created_utc=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"))
    manifest.save(manifest_path)
    if stats is not None:
        stats.bytes_written = sum(need)
        stats.seconds = time.perf_counter() - t_start
        stats.writer_busy_s = writer.busy_s
        stats.fill_s = fill_total_s
    log.info("staged %d regions, %d pages to %s; manifest %s", len(regions), total_pages, paths, manifest_path)
    return manifest


def _stage_chunk(source: RowSource, region: Region, first_row: int, writer: _Writer, chunk_bytes: int,
                 crcs: np.ndarray) -> tuple[int, float]:
    """Fill one chunk of `region` from shard row `first_row` (rows and page CRCs) and queue its write.

    Returns (bytes queued, seconds spent filling)."""
    n = min((chunk_bytes // PAGE_BYTES) * ROWS_PER_PAGE, region.rows - first_row)
    npages = pages_for_rows(n)
    page0 = first_row // ROWS_PER_PAGE
    buf = writer.take()
    pages = buf[:npages * PAGE_BYTES].reshape(npages, PAGE_BYTES)
    at = region.crc_first_page + page0
    t0 = time.perf_counter()
    source.fill_pages(region.layer, region.row_start + first_row, n, pages, crcs[at:at + npages])
    fill_s = time.perf_counter() - t0
    writer.put(region.device, buf, npages * PAGE_BYTES, region.offset_bytes + page0 * PAGE_BYTES)
    return npages * PAGE_BYTES, fill_s


# ---------------------------------------------------------------- entry points

def stage_synthetic(targets: list[str | Path], layers: Any, ranks: int, seed: int,
                    column_bounds: dict[int, tuple[int, ...]] | None = None, overwrite: bool = False,
                    **kwargs: Any) -> Manifest:
    """Stage a seeded synthetic table; `layers` is `{layer_id: rows}` or an Engram-style layout object.

    kwargs go to `stage_table` (manifest_path, max_bytes, chunk_bytes, buffered, progress, fillers, writers).
    """
    layout = table_layout_from(layers, column_bounds)
    return stage_table(SyntheticSource(layout, seed), targets, ranks, overwrite=overwrite, **kwargs)


def stage_checkpoint(checkpoint: str | Path | list[str | Path], targets: list[str | Path], ranks: int,
                     layers: list[int] | None = None, column_bounds: dict[int, tuple[int, ...]] | None = None,
                     overwrite: bool = False, expected: Any = None, **kwargs: Any) -> Manifest:
    """Stage a safetensors checkpoint's Engram tables (all layers found, or `layers`).

    `expected` ({layer: rows} or a layout object) refuses a checkpoint whose
    row counts differ. kwargs go to `stage_table`.
    """
    exp = table_layout_from(expected) if expected is not None else None
    if exp is not None and column_bounds is None:
        column_bounds = exp.column_bounds
    source = CheckpointSource(checkpoint, layers=layers, column_bounds=column_bounds, expected=exp)
    return stage_table(source, targets, ranks, overwrite=overwrite, **kwargs)
