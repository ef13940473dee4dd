"""`CheckpointSource`: a safetensors checkpoint's Engram tables, read through memory maps.

Per layer the checkpoint holds `layers.{layer}.engram.embed.weight` [rows, 256]
float8_e4m3fn and `layers.{layer}.engram.embed.scale` [rows, 8] float8_e8m0fnu
(DeepSeek's checkpoint names, which SGLang loads as
`model.layers.{layer}.engram.embed.*`; both spellings are accepted). A missing
tensor, a wrong dtype or shape, or rows that differ from an expected layout are
refused when the source is built, before staging writes anything.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numba
import numpy as np

from slacktier.errors import ErrorKind, SlackTierError
from slacktier.tables.identity import source_identity
from slacktier.tables.layout import PAGE_BYTES, PAGE_USED_BYTES, PAGE_WORDS, ROW_BYTES, ROW_SCALES, ROW_VALUES, \
    ROWS_PER_PAGE
from slacktier.tables.manifest import MAX_LAYER_ID, StagedLayout, sha256_file
from slacktier.tables.pagecrc import HW_CRC32C, crc_page_words, page_crcs

CHECKPOINT_NAME_TEMPLATES = ("layers.{layer}.engram.embed.{part}", "model.layers.{layer}.engram.embed.{part}")

# numba's cache=True keys a kernel on this file only: after editing pagecrc.crc_page_words, delete
# __pycache__/checkpoint_source.*.nbi/.nbc.

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
    for j in range(PAGE_USED_BYTES, PAGE_BYTES):
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


@dataclass(frozen=True)
class _TensorInfo:
    file: str
    dtype: str
    shape: tuple[int, ...]
    offset_bytes: int   # absolute offset of the tensor's first byte in the file
    nbytes: int


# bytes per element of the safetensors dtypes; a tensor of another (sub-byte or newer) dtype is only bounds-checked
_DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "I16": 2, "U16": 2,
                "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8, "C64": 8}
_MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit


def _bad(path: str, what: str) -> SlackTierError:
    return SlackTierError(ErrorKind.CHECKPOINT, f"{path} is not a valid safetensors file: {what}",
                          fix="re-download or re-save the checkpoint file")


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _read_safetensors_header(path: str) -> dict[str, _TensorInfo]:
    """Tensor name -> where its bytes are, from a safetensors file's JSON header.

    Layout: 8 bytes little-endian header length n, n bytes of JSON
    {name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}},
    then the data section; offsets are relative to its start (byte 8 + n).
    Every field is checked, so a malformed header is a CHECKPOINT error naming
    the tensor and the file, never a crash and never rows read from the wrong bytes.
    """
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) != 8:
                raise _bad(path, f"{len(head)} bytes, shorter than the 8-byte header length")
            n = struct.unpack("<Q", head)[0]
            if n > _MAX_HEADER_BYTES or 8 + n > size:
                raise _bad(path, f"header length {n} runs past the end of the {size}-byte file")
            raw = f.read(n)
    except OSError as exc:
        raise SlackTierError(ErrorKind.CHECKPOINT, f"cannot read checkpoint {path}: {exc}",
                             fix="check the path and its permissions") from exc
    try:
        meta = json.loads(raw)
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
        raise _bad(path, f"the header is not JSON ({exc})") from exc
    if not isinstance(meta, dict):
        raise _bad(path, f"the header is a JSON {type(meta).__name__}, not an object")
    data_bytes = size - 8 - n
    out: dict[str, _TensorInfo] = {}
    extra = meta.get("__metadata__", {})
    if not isinstance(extra, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in extra.items()):
        raise _bad(path, f"its __metadata__ is {type(extra).__name__} {str(extra)[:60]!r}, not a map of strings "
                         "to strings")
    for name, t in meta.items():
        if name == "__metadata__":
            continue
        where = f"tensor {name} in {path}"
        if not isinstance(t, dict):
            raise _bad(path, f"{where} is described by a JSON {type(t).__name__}, not an object")
        dtype, shape, offsets = t.get("dtype"), t.get("shape"), t.get("data_offsets")
        if not isinstance(dtype, str):
            raise _bad(path, f"{where} has no dtype")
        if not isinstance(shape, list) or not all(_is_int(x) and x >= 0 for x in shape):
            raise _bad(path, f"{where} has shape {shape!r}, not a list of non-negative integers")
        if (not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_int(x) for x in offsets)):
            raise _bad(path, f"{where} has data_offsets {offsets!r}, not [begin, end]")
        begin, end = offsets
        if not 0 <= begin <= end:
            raise _bad(path, f"{where} has data_offsets [{begin}, {end}]: begin must be >= 0 and <= end")
        if end > data_bytes:
            raise SlackTierError(ErrorKind.CHECKPOINT, f"{where} runs past the end of the file (data_offsets end "
                                 f"{end}, {data_bytes} data bytes; truncated?)", fix="re-download the checkpoint file")
        elements = 1
        for x in shape:
            elements *= x
        if dtype in _DTYPE_BYTES and elements * _DTYPE_BYTES[dtype] != end - begin:
            raise _bad(path, f"{where} has shape {shape} of {dtype} ({elements * _DTYPE_BYTES[dtype]} bytes) but "
                             f"data_offsets span {end - begin} bytes")
        out[name] = _TensorInfo(path, dtype, tuple(shape), 8 + n + begin, end - begin)
    return out


def header_entry(name: str, info: _TensorInfo) -> dict[str, Any]:
    """A tensor's safetensors header entry as an identity records it (offsets absolute in its file)."""
    return {"name": name, "file": info.file, "dtype": info.dtype, "shape": list(info.shape),
            "offset_bytes": info.offset_bytes, "nbytes": info.nbytes}


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


def checkpoint_tensors(files: list) -> dict[str, _TensorInfo]:
    """Every tensor of a checkpoint's safetensors files by name (headers only); a name in two files is refused."""
    tensors: dict[str, _TensorInfo] = {}
    for f in files:
        for name, info in _read_safetensors_header(f).items():
            if name in tensors:
                raise SlackTierError(ErrorKind.CHECKPOINT, f"tensor {name} is in both {tensors[name].file} and "
                                     f"{f}", fix="pass each checkpoint shard once, and only one checkpoint")
            tensors[name] = info
    return tensors


def files_digest(files: list) -> str:
    """sha256 of one checkpoint file, or of the list of (name, sha256) of several: a table's source digest."""
    if len(files) == 1:
        return "sha256:" + sha256_file(files[0])
    lines = "".join(f"{Path(f).name} {sha256_file(f)}\n" for f in files)
    return "sha256:" + hashlib.sha256(lines.encode()).hexdigest()


class CheckpointSource:
    """A safetensors checkpoint's Engram tables, read through memory maps (nothing loaded whole).

    `layers` None takes every layer that has an `...engram.embed.weight`.
    `expected` (a StagedLayout) makes any rows mismatch a refusal. Digest: the
    sha256 of the checkpoint file for one file; for several, the sha256 of the
    lines "<file name> <sha256>\\n" over the files that hold the table, sorted.
    """

    kind = "checkpoint"

    def __init__(self, checkpoint: str | Path | list[str | Path], layers: list[int] | None = None,
                 column_bounds: dict[int, tuple[int, ...]] | None = None,
                 expected: StagedLayout | None = None) -> None:
        self.files = _checkpoint_files(checkpoint)
        tensors = checkpoint_tensors(self.files)
        if layers is None:
            found = set()
            for name in tensors:
                m = re.fullmatch(r"(?:model\.)?layers\.(\d+)\.engram\.embed\.weight", name)
                if m:
                    if int(m.group(1)) > MAX_LAYER_ID:   # 10**30: a corrupt or hostile name, not a model layer
                        raise SlackTierError(ErrorKind.CHECKPOINT, f"tensor {name} names layer {m.group(1)[:40]}, "
                                             f"outside 0..{MAX_LAYER_ID}", fix="check the checkpoint's tensor names")
                    found.add(int(m.group(1)))
            if not found:
                raise SlackTierError(ErrorKind.CHECKPOINT, f"no tensor named like "
                                     f"{CHECKPOINT_NAME_TEMPLATES[0].format(layer='L', part='weight')} in "
                                     f"{', '.join(self.files)}", fix="pass the checkpoint that holds the Engram tables")
            layers = sorted(found)
        self.names: dict[int, dict[str, str]] = {}
        self._weight: dict[int, np.ndarray] = {}
        self._scale: dict[int, np.ndarray] = {}
        self._tensors: dict[int, tuple[_TensorInfo, _TensorInfo]] = {}
        rows: dict[int, int] = {}
        for layer in layers:
            names = self._names_for(layer, tensors)
            w, s = tensors[names["weight"]], tensors[names["scale"]]
            self._check(layer, names, w, s, expected)
            rows[layer] = w.shape[0]
            self.names[layer] = names
            self._tensors[layer] = (w, s)
            self._weight[layer] = np.memmap(w.file, dtype=np.uint8, mode="r", offset=w.offset_bytes,
                                            shape=(w.shape[0], ROW_VALUES))
            self._scale[layer] = np.memmap(s.file, dtype=np.uint8, mode="r", offset=s.offset_bytes,
                                           shape=(s.shape[0], ROW_SCALES))
        self.layout = StagedLayout(rows, dict(column_bounds or {}))
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
               expected: StagedLayout | None) -> None:
        for info, name, dtype in ((w, names["weight"], "F8_E4M3"), (s, names["scale"], "F8_E8M0")):
            if info.dtype != dtype:
                torch_name = "float8_e4m3fn" if dtype == "F8_E4M3" else "float8_e8m0fnu"
                raise SlackTierError(ErrorKind.CHECKPOINT, f"tensor {name} in {info.file} has dtype {info.dtype}, "
                                     f"want {dtype} ({torch_name})",
                                     fix="stage the FP8 checkpoint, not a converted one", layer=layer)
        if len(w.shape) != 2 or w.shape[1] != ROW_VALUES or w.shape[0] == 0:
            raise SlackTierError(ErrorKind.CHECKPOINT, f"tensor {names['weight']} in {w.file} has shape "
                                 f"{list(w.shape)}, want [rows > 0, {ROW_VALUES}]",
                                 fix="check the checkpoint's Engram shapes", layer=layer)
        if len(s.shape) != 2 or s.shape != (w.shape[0], ROW_SCALES):
            raise SlackTierError(ErrorKind.CHECKPOINT, f"tensor {names['scale']} in {s.file} has shape "
                                 f"{list(s.shape)}, want [{w.shape[0]}, {ROW_SCALES}]",
                                 fix="check the checkpoint's Engram shapes", layer=layer)
        if expected is not None and expected.rows.get(layer) != w.shape[0]:
            raise SlackTierError(ErrorKind.CHECKPOINT, f"layer {layer} has {w.shape[0]} rows in the checkpoint, the "
                                 f"layout expects {expected.rows.get(layer)}", fix="check the layout against the "
                                 "checkpoint", layer=layer)

    @property
    def digest(self) -> str:
        """sha256 of the checkpoint file(s) holding the table (see the class docstring)."""
        if self._digest is None:
            self._digest = files_digest(self._files_used)
        return self._digest

    def spec(self) -> dict[str, Any]:
        """The manifest's "source" object: files, tensor names and identity (tables.identity)."""
        headers = {layer: {part: [header_entry(names[part], info)] for part, info in zip(("weight", "scale"),
                                                                                        self._tensors[layer])}
                   for layer, names in self.names.items()}
        return {"kind": self.kind, "digest": self.digest, "files": self._files_used,
                "tensors": {str(k): v for k, v in sorted(self.names.items())},
                "identity": source_identity(self, tensors=headers)}

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
        """Global rows `row_ids` [n] of `layer` -> raw [n, 264] uint8, read with pread.

        pread, not the memory maps staging packs pages from: the checker and `verify` call this while the
        checkpoint may be truncated or replaced underneath, and a mapped page past a file's end kills the
        process with SIGBUS, where a short read is an IO error naming the file and the row."""
        ids = np.asarray(row_ids, dtype=np.int64)
        w, s = self._tensors[layer]
        out = np.empty((ids.shape[0], ROW_BYTES), dtype=np.uint8)
        uniq, where = np.unique(ids, return_inverse=True)
        got = np.empty((uniq.shape[0], ROW_BYTES), dtype=np.uint8)
        if uniq.shape[0] and not (0 <= uniq[0] and uniq[-1] < w.shape[0]):
            raise SlackTierError(ErrorKind.BAD_INPUT, f"rows outside the checkpoint's 0..{w.shape[0] - 1}",
                                 layer=layer, fix="ask for rows of the table")
        cuts = np.flatnonzero(np.diff(uniq) != 1) + 1   # runs of consecutive rows: one pread per tensor each
        with _opened(w.file) as wfd, _opened(s.file) as sfd:
            for lo, hi in zip([0, *cuts.tolist()], [*cuts.tolist(), uniq.shape[0]]):
                first, n = int(uniq[lo]), hi - lo
                got[lo:hi, :ROW_VALUES] = _pread_rows(wfd, w, ROW_VALUES, first, n, layer)
                got[lo:hi, ROW_VALUES:] = _pread_rows(sfd, s, ROW_SCALES, first, n, layer)
        out[:] = got[where.reshape(-1)]
        return out


class _opened:
    """An O_RDONLY descriptor of `path` for a `with` block; an open error is CHECKPOINT naming the file."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __enter__(self) -> int:
        try:
            self.fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:
            raise SlackTierError(ErrorKind.CHECKPOINT, f"cannot open checkpoint {self.path}: {exc.strerror}",
                                 fix="check the checkpoint's path and permissions") from None
        return self.fd

    def __exit__(self, *exc: object) -> None:
        os.close(self.fd)


def _pread_rows(fd: int, t: _TensorInfo, row_bytes: int, first: int, n: int, layer: int) -> np.ndarray:
    """Rows first..first+n-1 of tensor `t` -> [n, row_bytes] uint8; a short read is IO naming the file."""
    want = n * row_bytes
    data = os.pread(fd, want, t.offset_bytes + first * row_bytes)
    if len(data) != want:
        raise SlackTierError(ErrorKind.IO, f"checkpoint {t.file} ends inside rows {first}..{first + n - 1} "
                             f"({len(data)} of {want} bytes read): it was truncated or replaced after it was opened",
                             layer=layer, fix="restore the checkpoint the table was staged from, or turn check off")
    return np.frombuffer(data, dtype=np.uint8).reshape(n, row_bytes)
