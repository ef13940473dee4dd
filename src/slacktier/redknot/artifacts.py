"""Offline Local-head artifacts: page layout, certificates, atomic publication, validation.

One artifact = one document x one tensor-parallel rank: for every covered
reusable layer, the rows' Local-head contribution after the sliced wo_a,
z_off [rows, groups_of_rank * o_lora_rank], packed into 4 KiB pages of one data
file (one page-aligned region per layer), plus a JSON certificate next to it
(never inside the pages) binding the model/weights digest, the token digest
(and the digest of any context the document was prefilled after), profile,
head policy, TP geometry, generation and covered layers, with one CRC32C per page.

Publication order (a reader never sees a partial artifact):
  data -> <doc>/rank<r>.g<gen>.bin.tmp, fsync, rename to .bin
  certificate -> .cert.json.tmp, fsync, rename           <- the publish point
Only a certificate makes data visible, and it is written after every layer.

Page layout, worked example: tiny model, 2 groups x 16 channels float64 = 256 B
rows, 16 rows per page; row 37 of layer 3 -> page 2 of the layer-3 region, byte
(37 % 16) * 256 = 1280. Rows wider than a page (Flash, TP1: 8 x 1024 x 2 B =
16 KiB) take ceil(row_bytes / 4096) whole pages each.
"""

from __future__ import annotations

import enum
import hashlib
import json
import logging
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

import crc32c
import numpy as np
import torch

from slacktier.errors import ErrorKind, SlackTierError
from slacktier.tables.layout import PAGE_BYTES

log = logging.getLogger(__name__)

FORMAT = "slacktier-redknot-artifact-v1"
_DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class FallbackReason(enum.Enum):
    """Why a request was fully recomputed instead of reusing artifacts."""

    NO_ARTIFACT = "no_artifact"                # no document of the request has an artifact
    MISSING_LAYER = "missing_layer"            # certificate does not cover every reusable layer
    TOKEN_MISMATCH = "token_mismatch"          # tokens (or prefill context) differ from the certificate's
    MODEL_MISMATCH = "model_mismatch"          # model/weights digest differs
    PROFILE_MISMATCH = "profile_mismatch"      # fence/head profile differs
    HEAD_POLICY_MISMATCH = "head_policy_mismatch"
    STALE_GENERATION = "stale_generation"      # the document was invalidated after this build
    GEOMETRY_MISMATCH = "geometry_mismatch"    # TP size, output groups, row format differ
    RANK_DISAGREEMENT = "rank_disagreement"    # the ranks' certificates do not describe one build
    UNREADABLE = "unreadable"                  # a certified data file cannot be opened by the page source


def tokens_digest(tokens) -> str:
    """sha256 of the token ids as little-endian int64."""
    return hashlib.sha256(np.asarray(list(tokens), dtype="<i8").tobytes()).hexdigest()


@dataclass(frozen=True)
class TPGeometry:
    """Tensor-parallel split of the wo_a output groups: rank r owns groups [r*G/T, (r+1)*G/T)."""

    tp_size: int
    o_groups: int

    def __post_init__(self) -> None:
        if self.tp_size < 1 or self.o_groups % self.tp_size:
            raise SlackTierError(ErrorKind.BAD_INPUT, f"tp_size {self.tp_size} does not split {self.o_groups} groups",
                                 fix="tp_size must divide o_groups (Flash: 1, 2, 4 or 8)")

    def groups(self, rank: int) -> tuple[int, int]:
        """[lo, hi) output groups of `rank`; group 5 of 8 with TP4 lives on rank 2."""
        per = self.o_groups // self.tp_size
        return rank * per, (rank + 1) * per


@dataclass(frozen=True)
class RowFormat:
    """How z_off rows of one rank sit in 4 KiB pages."""

    values: int       # channels per row (groups_of_rank * o_lora_rank)
    dtype: str        # "float32", ...

    @property
    def row_bytes(self) -> int:
        """Bytes of one row."""
        return self.values * torch.empty(0, dtype=_DTYPES[self.dtype]).element_size()

    @property
    def rows_per_page(self) -> int:
        """Rows in one page (1 when a row spans pages)."""
        return max(PAGE_BYTES // self.row_bytes, 1)

    @property
    def pages_per_row(self) -> int:
        """Pages of one row (1 when rows share pages)."""
        return -(-self.row_bytes // PAGE_BYTES) if self.row_bytes > PAGE_BYTES else 1

    def pages_for(self, rows: int) -> int:
        """Pages for `rows` rows."""
        if self.row_bytes > PAGE_BYTES:
            return rows * self.pages_per_row
        return -(-rows // self.rows_per_page)

    def pack(self, z: torch.Tensor) -> np.ndarray:
        """z [rows, values] -> pages [P, 4096] uint8 (unused bytes zero)."""
        rows = z.shape[0]
        raw = z.detach().to(_DTYPES[self.dtype]).contiguous().view(torch.uint8).numpy().reshape(rows, self.row_bytes)
        pages = np.zeros((self.pages_for(rows), PAGE_BYTES), dtype=np.uint8)
        if self.row_bytes > PAGE_BYTES:
            flat = pages.reshape(rows, self.pages_per_row * PAGE_BYTES)
            flat[:, :self.row_bytes] = raw
        else:
            rpp = self.rows_per_page
            padded = np.zeros((pages.shape[0] * rpp, self.row_bytes), dtype=np.uint8)
            padded[:rows] = raw
            pages[:, :rpp * self.row_bytes] = padded.reshape(pages.shape[0], rpp * self.row_bytes)
        return pages

    def unpack(self, pages: np.ndarray, rows: int) -> torch.Tensor:
        """pages [P, 4096] uint8 -> z [rows, values]."""
        if self.row_bytes > PAGE_BYTES:
            raw = pages.reshape(-1, self.pages_per_row * PAGE_BYTES)[:rows, :self.row_bytes]
        else:
            rpp = self.rows_per_page
            raw = pages[:, :rpp * self.row_bytes].reshape(-1, self.row_bytes)[:rows]
        raw = np.ascontiguousarray(raw)
        return torch.from_numpy(raw).view(_DTYPES[self.dtype]).reshape(rows, self.values)


@dataclass(frozen=True)
class Certificate:
    """What one published artifact (document x rank) is valid for."""

    doc_id: str
    rank: int
    tp_size: int
    o_groups: int
    o_lora_rank: int
    model_digest: str
    tokens_digest: str
    context_digest: str
    rows: int
    profile_name: str
    profile_digest: str
    head_policy_digest: str
    generation: int
    covered_layers: tuple[int, ...]
    dtype: str
    data_file: str
    region_offsets_bytes: tuple[int, ...]   # per covered layer, into data_file
    region_pages: tuple[int, ...]
    page_crc32c: tuple[tuple[int, ...], ...]
    format: str = FORMAT

    def to_json(self) -> str:
        """JSON text."""
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> Certificate:
        """Parse; raises SlackTierError(CERTIFICATE) on a foreign or broken file."""
        try:
            data = json.loads(text)
            if data.get("format") != FORMAT:
                raise ValueError(f"format {data.get('format')!r}")
            for key in ("covered_layers", "region_offsets_bytes", "region_pages"):
                data[key] = tuple(int(v) for v in data[key])
            data["page_crc32c"] = tuple(tuple(int(v) for v in sums) for sums in data["page_crc32c"])
            return cls(**data)
        except (ValueError, TypeError, KeyError) as exc:
            raise SlackTierError(ErrorKind.CERTIFICATE, f"unreadable certificate: {exc}",
                                 fix="rebuild the artifact with `slacktier redknot build`") from exc

    def agreement_key(self) -> tuple:
        """Fields every rank of one build must share."""
        return (self.tp_size, self.o_groups, self.model_digest, self.tokens_digest, self.context_digest, self.rows,
                self.profile_digest, self.head_policy_digest, self.generation, self.covered_layers, self.dtype)

    @property
    def row_format(self) -> RowFormat:
        """Row layout of this rank's pages."""
        lo_hi = self.o_groups // self.tp_size
        return RowFormat(lo_hi * self.o_lora_rank, self.dtype)


@dataclass(frozen=True)
class Expectation:
    """What the serving side requires of a certificate."""

    model_digest: str
    profile_name: str
    profile_digest: str
    head_policy_digest: str
    reusable_layers: tuple[int, ...]
    tp: TPGeometry
    o_lora_rank: int
    dtype: str


def _fsync_write(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@dataclass
class ArtifactStore:
    """A directory of artifacts: <root>/<doc_id>/rank<r>.cert.json, rank<r>.g<gen>.bin, floor.json."""

    root: Path
    publishes: int = field(default=0)

    def __post_init__(self) -> None:
        self.root = Path(self.root)
        self.root.mkdir(parents=True, exist_ok=True)

    def doc_dir(self, doc_id: str) -> Path:
        """Directory of one document (doc ids are file-name safe: [A-Za-z0-9._-])."""
        if not doc_id or any(not (c.isalnum() or c in "._-") for c in doc_id) or doc_id.startswith("."):
            raise SlackTierError(ErrorKind.BAD_INPUT, f"document id {doc_id!r} is not file-name safe",
                                 fix="use letters, digits, '.', '_' and '-'")
        return self.root / doc_id

    def certificate(self, doc_id: str, rank: int) -> Certificate | None:
        """The published certificate of (doc, rank), or None."""
        path = self.doc_dir(doc_id) / f"rank{rank}.cert.json"
        try:
            text = path.read_text()
        except FileNotFoundError:
            return None
        return Certificate.from_json(text)

    def documents(self, rank: int) -> list[str]:
        """Ids of the documents with a published certificate for `rank`, sorted."""
        return sorted(d.name for d in self.root.iterdir() if (d / f"rank{rank}.cert.json").is_file())

    def data_path(self, cert: Certificate) -> Path:
        """Data file a certificate points at."""
        return self.doc_dir(cert.doc_id) / cert.data_file

    def floor(self, doc_id: str) -> int:
        """Lowest generation still valid for the document (0 if never invalidated)."""
        path = self.doc_dir(doc_id) / "floor.json"
        try:
            return int(json.loads(path.read_text())["min_generation"])
        except FileNotFoundError:
            return 0

    def invalidate(self, doc_id: str) -> int:
        """Make every published generation of the document stale; returns the new floor."""
        d = self.doc_dir(doc_id)
        d.mkdir(parents=True, exist_ok=True)
        gens = [c.generation for c in self._all_certs(doc_id)]
        floor = max(gens + [self.floor(doc_id) - 1]) + 1
        tmp = d / "floor.json.tmp"
        _fsync_write(tmp, json.dumps({"min_generation": floor}).encode())
        os.replace(tmp, d / "floor.json")
        _fsync_dir(d)
        return floor

    def next_generation(self, doc_id: str) -> int:
        """Generation for a new build: above every published one and at least the floor."""
        gens = [c.generation for c in self._all_certs(doc_id)]
        return max(gens + [self.floor(doc_id) - 1]) + 1

    def _all_certs(self, doc_id: str) -> list[Certificate]:
        d = self.doc_dir(doc_id)
        if not d.exists():
            return []
        return [Certificate.from_json(p.read_text()) for p in sorted(d.glob("rank*.cert.json"))]

    def publish(self, *, doc_id: str, rank: int, layer_pages: list[tuple[int, np.ndarray]], fields: dict,
                on_layer=None) -> Certificate:
        """Write every layer's pages, then the certificate; nothing is visible until the final rename.

        `on_layer(layer)` runs after each layer's pages are written (tests use it
        to interrupt a build); an exception removes the partial data file.
        """
        d = self.doc_dir(doc_id)
        d.mkdir(parents=True, exist_ok=True)
        gen = fields["generation"]
        data_name = f"rank{rank}.g{gen}.bin"
        tmp = d / (data_name + ".tmp")
        offsets, pages_n, sums, layers = [], [], [], []
        try:
            with open(tmp, "wb") as f:
                offset = 0
                for layer, pages in layer_pages:
                    f.write(pages.tobytes())
                    offsets.append(offset)
                    pages_n.append(int(pages.shape[0]))
                    sums.append(tuple(int(crc32c.crc32c(p.tobytes())) for p in pages))
                    layers.append(layer)
                    offset += pages.shape[0] * PAGE_BYTES
                    if on_layer is not None:
                        on_layer(layer)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, d / data_name)
            cert = Certificate(doc_id=doc_id, rank=rank, covered_layers=tuple(layers),
                               data_file=data_name, region_offsets_bytes=tuple(offsets),
                               region_pages=tuple(pages_n), page_crc32c=tuple(sums), **fields)
            ctmp = d / f"rank{rank}.cert.json.tmp"
            _fsync_write(ctmp, cert.to_json().encode())
            os.replace(ctmp, d / f"rank{rank}.cert.json")  # publish point
            _fsync_dir(d)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        for old in d.glob(f"rank{rank}.g*.bin"):
            if old.name != data_name:
                old.unlink(missing_ok=True)
        self.publishes += 1
        return cert


EMPTY_DIGEST = tokens_digest([])


def validate(certs: list[Certificate | None], exp: Expectation, tokens, preceding_tokens, floor: int
             ) -> FallbackReason | None:
    """Check one document's per-rank certificates; the first problem found, or None if reusable.

    Called for every document before any reuse work; any reason sends the whole
    request to full recompute. A document with no certificate on any rank is not
    a problem here (its rows are served as new rows).
    """
    present = [c for c in certs if c is not None]
    if not present:
        return None
    for c in present:
        if c.tp_size != exp.tp.tp_size or c.o_groups != exp.tp.o_groups or c.o_lora_rank != exp.o_lora_rank \
                or c.dtype != exp.dtype:
            return FallbackReason.GEOMETRY_MISMATCH
    if len(present) != len(certs) or any(c.rank != r for r, c in enumerate(certs)):
        return FallbackReason.RANK_DISAGREEMENT
    if len({c.agreement_key() for c in present}) != 1:
        return FallbackReason.RANK_DISAGREEMENT
    c = present[0]
    if c.model_digest != exp.model_digest:
        return FallbackReason.MODEL_MISMATCH
    if c.tokens_digest != tokens_digest(tokens) or c.rows != len(tokens):
        return FallbackReason.TOKEN_MISMATCH
    # canonical artifacts (built alone at position 0) serve any context; a context-bound
    # one only the exact tokens it was prefilled after
    if c.context_digest != EMPTY_DIGEST and c.context_digest != tokens_digest(preceding_tokens):
        return FallbackReason.TOKEN_MISMATCH
    if c.profile_digest != exp.profile_digest or c.profile_name != exp.profile_name:
        return FallbackReason.PROFILE_MISMATCH
    if c.head_policy_digest != exp.head_policy_digest:
        return FallbackReason.HEAD_POLICY_MISMATCH
    if c.generation < floor:
        return FallbackReason.STALE_GENERATION
    if not set(exp.reusable_layers) <= set(c.covered_layers):
        return FallbackReason.MISSING_LAYER
    return None
