"""A staged table's identity: what the checkpoint a serving engine loads must match before the table is served.

Staging records, per layer, the sha256 of a fixed sample of the table's rows
(`SAMPLE_ROWS` rows, chosen by `sample_rows` from the row count alone: one row
in each of SAMPLE_ROWS equal strata, the first and last row always in), apart
for the 256 value bytes and the 8 block-scale bytes of each row, and, for a
checkpoint, the safetensors header entry of every tensor the rows came from
(name, file, dtype, shape, data offsets). It goes in the manifest's "source"
object as "identity":

    {"method": "sampled-rows-v1", "sample_rows": 4096,
     "layers": {"1": {"rows": R, "values": "sha256:...", "scales": "sha256:..." | null,
                      "tensor_rows": R', "tensors": {"weight": [{name, file, dtype, shape, data_offsets}], ...}}}}

At start-up each plug-in hands `IdentityCheck` the tensors its engine's weight
loader is handed (whole, or in shards with their first row), and the check
refuses, in one line naming both sides, rows whose sampled digest differs.

Why a sample, not every byte: the check runs inside every serving rank's
start-up, where a full digest would read the whole table (a DeepSeek-V4.1
checkpoint's Engram tables are about 203 GB) once per rank; the sample reads
4096 rows of 264 B per layer whatever the table's size, so its cost is flat.
What it gives up: it tells another checkpoint (retrained, another seed,
another release: such tables differ in nearly every row) from the staged one,
not one corrupted row; the staged pages' integrity is the page checksums'
job, and `slacktier verify` compares every row with the source. A table whose
checkpoint differs from the staged one in a few rows only (a hand edit) can
pass. `scales` is null for a source without per-row scales (a Qwen3.8 PLE
table: one per-tensor scale that stays the engine's; the staged block scales
are a constant), and `tensor_rows` is the row count of the engine's tensor
(a PLE table's is padded), checked when the loader is handed it whole.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import mmap
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from slacktier.errors import ErrorKind, SlackTierError
from slacktier.tables.layout import ROW_SCALES, ROW_VALUES

log = logging.getLogger(__name__)

METHOD = "sampled-rows-v1"
SAMPLE_ROWS = 4096
PARTS = {"values": ROW_VALUES, "scales": ROW_SCALES}   # part -> bytes per row of its tensor

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer over a uint64 array."""
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def sample_rows(rows: int, count: int = SAMPLE_ROWS) -> np.ndarray:
    """The rows whose bytes a table's identity digests: [min(rows, count)] int64, ascending, distinct.

    Row i of the sample lies in stratum [i * rows // k, (i + 1) * rows // k), at an offset mixed from i and
    `rows`; the first and the last row of the table are always in. A function of `rows` and `count` only, so
    staging and every plug-in pick the same rows. Worked example: rows 10, count 4 -> strata [0,2) [2,5) [5,7)
    [7,10): row 0, one of 2..4, one of 5..6, row 9.
    """
    if rows < 1:
        raise SlackTierError(ErrorKind.BAD_INPUT, f"a table of {rows} rows has no identity", fix="stage rows")
    k = min(rows, count)
    i = np.arange(k, dtype=np.uint64)
    lo = (i * np.uint64(rows)) // np.uint64(k)   # rows < 2**62 and k <= 4096: no overflow
    hi = ((i + np.uint64(1)) * np.uint64(rows)) // np.uint64(k)
    with np.errstate(over="ignore"):
        pick = lo + _mix(i * _GOLDEN + np.uint64(rows)) % (hi - lo)
    out = pick.astype(np.int64)
    out[0], out[-1] = 0, rows - 1
    return out


def digest_bytes(rows: np.ndarray) -> str:
    """"sha256:<hex>" of sampled rows [k, n] uint8, in sample order."""
    return "sha256:" + hashlib.sha256(np.ascontiguousarray(rows, dtype=np.uint8).tobytes()).hexdigest()


def layer_identity(raw: np.ndarray, rows: int, tensor_rows: int, has_scales: bool,
                   tensors: Mapping[str, list[dict[str, Any]]] | None = None) -> dict[str, Any]:
    """One layer's identity record from its sampled rows `raw` [k, 264] uint8 (the rows `sample_rows(rows)`)."""
    return {"rows": int(rows), "tensor_rows": int(tensor_rows), "values": digest_bytes(raw[:, :ROW_VALUES]),
            "scales": digest_bytes(raw[:, ROW_VALUES:]) if has_scales else None,
            "tensors": {k: list(v) for k, v in (tensors or {}).items()}}


def table_identity(layers: Mapping[int, dict[str, Any]]) -> dict[str, Any]:
    """The manifest's source "identity" object from each layer's `layer_identity`."""
    return {"method": METHOD, "sample_rows": SAMPLE_ROWS, "layers": {str(k): v for k, v in sorted(layers.items())}}


def source_identity(source: Any, has_scales: bool = True,
                    tensors: Mapping[int, Mapping[str, list[dict[str, Any]]]] | None = None,
                    tensor_rows: Mapping[int, int] | None = None) -> dict[str, Any]:
    """The identity of a row source (tables.row_source.RowSource): its sampled rows of every layer."""
    out = {}
    for layer in source.layout.layer_ids:
        rows = source.layout.rows[layer]
        raw = source.rows(layer, sample_rows(rows))
        out[layer] = layer_identity(raw, rows, (tensor_rows or {}).get(layer, rows), has_scales,
                                    (tensors or {}).get(layer))
    return table_identity(out)


def check_identity_json(d: Any, bad: Callable[[str, Any, str], Exception]) -> None:
    """Refuse a malformed source "identity" object (`bad(key, value, want)` builds the manifest's error)."""
    key = "$.source.identity"
    if not isinstance(d, dict) or d.get("method") != METHOD:
        raise bad(f"{key}.method", d.get("method") if isinstance(d, dict) else d, repr(METHOD))
    if d.get("sample_rows") != SAMPLE_ROWS:
        raise bad(f"{key}.sample_rows", d.get("sample_rows"), str(SAMPLE_ROWS))
    layers = d.get("layers")
    if not isinstance(layers, dict) or not layers:
        raise bad(f"{key}.layers", layers, "an object {layer id: identity}")
    for k, v in layers.items():
        where = f"{key}.layers.{str(k)[:20]}"
        if not str(k).isdigit() or not isinstance(v, dict):
            raise bad(where, v, "a layer id and its identity object")
        for name in ("rows", "tensor_rows"):
            if type(v.get(name)) is not int or v[name] < 1:
                raise bad(f"{where}.{name}", v.get(name), "a row count >= 1")
        for name in ("values", "scales"):
            text = v.get(name)
            if text is None and name == "scales":
                continue
            if not isinstance(text, str) or not text.startswith("sha256:") or len(text) != 71:
                raise bad(f"{where}.{name}", text, "a sha256 digest" + (" or null" if name == "scales" else ""))
        if not isinstance(v.get("tensors"), dict):
            raise bad(f"{where}.tensors", v.get("tensors"), "an object {part: [header entries]}")


class _random_access:
    """Within the block, the page-aligned interior of a CPU tensor's bytes is advised MADV_RANDOM, then NORMAL.

    An engine may hand a tensor memory-mapped from the checkpoint file. A cold page fault there reads around
    the page (the device's read-ahead, often megabytes), so touching 4096 rows spread over a large table would
    read most of it; advised random, each sampled row costs one page read. No effect on anonymous memory, and
    no advice where libc has no madvise (the read is the same, only slower when cold).
    """

    def __init__(self, t: Any) -> None:
        self.span: tuple[int, int] | None = None
        if t.device.type != "cpu" or _LIBC is None:
            return
        page = mmap.PAGESIZE
        begin, end = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
        lo, hi = -(-begin // page) * page, end // page * page
        if hi - lo >= 16 * page:
            self.span = (lo, hi - lo)

    def _advise(self, advice: int) -> None:
        if self.span is not None:
            _LIBC.madvise(ctypes.c_void_p(self.span[0]), ctypes.c_size_t(self.span[1]), advice)

    def __enter__(self) -> None:
        self._advise(mmap.MADV_RANDOM)

    def __exit__(self, *exc: object) -> None:
        self._advise(mmap.MADV_NORMAL)


def _libc() -> Any:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        return libc if hasattr(mmap, "MADV_RANDOM") else None
    except (OSError, AttributeError):
        return None


_LIBC = _libc()


@dataclass(frozen=True)
class Recorded:
    """What a manifest recorded for one layer's identity, and where its rows came from (for messages)."""

    manifest: str
    layer: int
    rows: int
    tensor_rows: int
    digests: dict[str, str | None]   # part -> "sha256:..." (None: the source had no such part)
    source: str                      # "checkpoint a.safetensors, b.safetensors (sha256:...)" or "synthetic seed 3"
    tensor_names: dict[str, list[str]]


def recorded_identity(manifest: Any, layer: int) -> Recorded | None:
    """The identity `manifest` (a tables.manifest.Manifest) recorded for `layer`; None for a manifest staged
    before identities were recorded."""
    src = manifest.source
    ident = src.get("identity")
    if ident is None:
        return None
    rec = ident["layers"].get(str(layer))
    if rec is None:
        raise SlackTierError(ErrorKind.MISSING, f"manifest {manifest.path} records no identity for layer {layer}",
                             layer=layer, fix="restage the table")
    if src["kind"] == "synthetic":
        origin = f"a synthetic table (generator {src.get('generator')}, seed {src.get('seed')}), not a checkpoint"
    else:
        origin = f"checkpoint {', '.join(str(f) for f in src.get('files', []))} ({src['digest']})"
    names = {part: [str(t.get("name")) for t in entries] for part, entries in rec["tensors"].items()}
    return Recorded(str(manifest.path), layer, rec["rows"], rec["tensor_rows"],
                    {"values": rec["values"], "scales": rec["scales"]}, origin, names)


class IdentityCheck:
    """Compares the tensors a serving engine's weight loader is handed for one table with its manifest's identity.

    `feed(part, tensor)` takes a whole tensor, `feed(part, shard, start, whole=False)` a shard of rows
    [start, start + n); once every sampled row of the part has been seen, its digest is compared and a mismatch
    raises CHECKPOINT in one line naming the manifest, its source and digest, the engine's tensor and
    checkpoint, and the fix. Cost: the sampled rows only (an index of SAMPLE_ROWS rows per part), whatever the
    table's size; their pages are read under MADV_RANDOM (`_random_access`), then the advice is reset to NORMAL.
    """

    def __init__(self, recorded: Recorded, engine: str, loaded_from: str,
                 parts: tuple[str, ...] = tuple(PARTS)) -> None:
        self.recorded = recorded
        self.parts = parts   # what the engine's loader hands over (a PLE table: its values only)
        self.engine = engine
        self.loaded_from = loaded_from
        self.ids = sample_rows(recorded.rows)
        self._got = {part: np.zeros((self.ids.shape[0], n), dtype=np.uint8) for part, n in PARTS.items()}
        self._seen = {part: np.zeros(self.ids.shape[0], dtype=bool) for part in PARTS}
        self.checked: set[str] = set()

    @property
    def done(self) -> bool:
        """Whether every part the manifest recorded and this engine hands over has been compared (and matched)."""
        return not self.pending_parts()

    def pending_parts(self) -> list[str]:
        """The parts still to compare: recorded, handed over by this engine, and not yet seen whole."""
        return [p for p in self.parts if self.recorded.digests.get(p) is not None and p not in self.checked]

    def _refuse(self, part: str, what: str, name: str) -> SlackTierError:
        r = self.recorded
        return SlackTierError(
            ErrorKind.CHECKPOINT, f"layer {r.layer}: {self.engine} loaded {name or part} from {self.loaded_from}, "
            f"{what}; {r.manifest} was staged from {r.source}", layer=r.layer,
            fix=f"restage the table from the checkpoint {self.engine} loads (slacktier stage --checkpoint "
                f"{self.loaded_from} ...), or serve the checkpoint the table was staged from")

    def feed(self, part: str, tensor: Any, start: int = 0, name: str = "", whole: bool = True) -> None:
        """The engine's loader was handed `tensor` (torch or numpy, [n, 256] values or [n, 8] scales) holding
        rows [start, start + n) of this table's `part` ("values" or "scales"): the whole tensor, or (`whole`
        False) one shard of it."""
        import torch

        width = PARTS[part]
        r = self.recorded
        if r.digests.get(part) is None:
            return   # the source had no such part (a PLE table's per-row scales are staged constants)
        t = tensor.detach() if isinstance(tensor, torch.Tensor) else torch.from_numpy(np.asarray(tensor))
        if t.dim() != 2 or t.shape[1] != width or t.element_size() != 1:
            raise self._refuse(part, f"a tensor of shape {list(t.shape)} {t.dtype}, where the staged table's "
                               f"{part} are [rows, {width}] of one byte", name)
        n = int(t.shape[0])
        if whole and n != r.tensor_rows:
            raise self._refuse(part, f"{n} rows, where the staged table's tensor has {r.tensor_rows}", name)
        lo, hi = np.searchsorted(self.ids, [start, start + n])
        if hi > lo:
            local = torch.from_numpy(self.ids[lo:hi] - start)
            with _random_access(t):
                self._got[part][lo:hi] = t.view(torch.uint8).index_select(0, local.to(t.device)).cpu().numpy()
            self._seen[part][lo:hi] = True
        if part not in self.checked and self._seen[part].all():
            got = digest_bytes(self._got[part])
            if got != r.digests[part]:
                raise self._refuse(part, f"whose sampled rows digest to {got}, not the staged table's "
                                   f"{r.digests[part]}", name)
            self.checked.add(part)
            log.info("layer %d: the %s %s loads match the staged table's (%s sampled rows of %s)", r.layer,
                     self.engine, part, self.ids.shape[0], r.manifest)


__all__ = ["METHOD", "PARTS", "SAMPLE_ROWS", "IdentityCheck", "Recorded", "check_identity_json", "digest_bytes",
           "layer_identity", "recorded_identity", "sample_rows", "source_identity", "table_identity"]
