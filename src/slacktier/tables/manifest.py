"""The manifest of a staged table: JSON beside the data, never inside the pages.

`<manifest>.json` records the format version, the table layout (`StagedLayout`:
layer ids, rows per layer, column bounds, row/page geometry), the rank count,
the targets, every (layer, rank) region (`tables.regions.StagedRegion`: target,
device index, byte offset, pages, global rows),
the source digest, and a reference to the per-page checksums. Checksums
(CRC32C of each whole 4 KiB page, little-endian uint32, regions concatenated in
manifest order) live in a binary file beside the manifest, `<manifest stem>.crc`,
whose sha256 the manifest records: a 16M-row table has over a million pages.

Every target also starts with one 4 KiB header page (`TARGET_HEADER_BYTES`)
holding a signature and the source digest, so a device that already holds
another table is recognised even without its manifest. Regions start after it.

Worked example: 2 layers x 1,000 rows, 2 ranks, one target -> regions
(layer 1, rank 0) at offset 4096 with 34 pages (500 rows), (layer 1, rank 1) at
4096 + 34 * 4096, and so on; checksum of page 3 of (layer 1, rank 1) is entry
34 + 3 of the .crc file.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from slacktier.errors import ErrorKind, SlackTierError
from slacktier.tables.layout import PAGE_BYTES, ROW_BYTES, ROWS_PER_PAGE, pages_for_rows, shard_bounds
from slacktier.tables.regions import Region, StagedRegion
from slacktier.tables.table_layout import TableLayout

FORMAT = "slacktier-table"
FORMAT_VERSION = 1
TARGET_HEADER_BYTES = PAGE_BYTES
TARGET_MAGIC = b"SLACKTIER-TABLE\x00"  # first 16 bytes of a target's header page


@dataclass(frozen=True)
class StagedLayout:
    """The manifest's record of a table layout: rows per layer id, and column bounds where the hash has columns.

    Build it from any `TableLayout` (EngramLayout, PleLayout) with `from_layout`,
    or from `{layer_id: rows}` with `from_rows`.
    """

    rows: dict[int, int]                                   # layer id -> rows
    column_bounds: dict[int, tuple[int, ...]] = field(default_factory=dict)  # layer id -> bounds (len cols+1)

    def __post_init__(self) -> None:
        if not self.rows:
            raise SlackTierError(ErrorKind.BAD_INPUT, "a table needs at least one layer", fix="pass {layer: rows}")
        for layer, n in self.rows.items():
            if n <= 0:
                raise SlackTierError(ErrorKind.BAD_INPUT, f"layer {layer} has {n} rows", fix="give every layer rows",
                                     layer=layer)
        for layer, bounds in self.column_bounds.items():
            if layer not in self.rows:
                raise SlackTierError(ErrorKind.BAD_INPUT, f"column bounds for layer {layer}, which has no rows",
                                     fix="give bounds only for the table's layers", layer=layer)
            if bounds[0] != 0 or bounds[-1] != self.rows[layer] or any(b > c for b, c in zip(bounds, bounds[1:])):
                raise SlackTierError(ErrorKind.BAD_INPUT, f"column bounds of layer {layer} must rise from 0 to "
                                     f"{self.rows[layer]}", fix="use the layout's own column bounds", layer=layer)

    @classmethod
    def from_layout(cls, layout: TableLayout) -> StagedLayout:
        """The record of a hashed table's layout: every layer's rows and column bounds."""
        bounds = {int(layer): tuple(int(b) for b in layout.layer_column_bounds(layer)) for layer in layout.layer_ids}
        return cls({layer: b[-1] for layer, b in bounds.items()}, bounds)

    @classmethod
    def from_rows(cls, rows: Mapping[int, int],
                  column_bounds: Mapping[int, Sequence[int]] | None = None) -> StagedLayout:
        """A layout from `{layer_id: rows}` and, optionally, some layers' column bounds: {1: 400} -> one layer."""
        return cls({int(k): int(v) for k, v in rows.items()},
                   {int(k): tuple(int(x) for x in v) for k, v in (column_bounds or {}).items()})

    @property
    def layer_ids(self) -> tuple[int, ...]:
        """Layer ids, ascending."""
        return tuple(sorted(self.rows))

    def shard(self, layer: int, rank: int, ranks: int) -> tuple[int, int]:
        """Global rows [start, end) of `rank`'s shard of `layer` (slacktier.tables.layout.shard_bounds)."""
        return shard_bounds(self.rows[layer], self.column_bounds.get(layer), rank, ranks)

    def to_json(self) -> dict[str, Any]:
        """The manifest's "layout" object."""
        return {"layers": list(self.layer_ids), "rows": {str(k): self.rows[k] for k in self.layer_ids},
                "column_bounds": {str(k): list(v) for k, v in sorted(self.column_bounds.items())},
                "row_bytes": ROW_BYTES, "page_bytes": PAGE_BYTES, "rows_per_page": ROWS_PER_PAGE}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> StagedLayout:
        """Read the manifest's "layout" object, refusing another row/page geometry."""
        if (d.get("row_bytes"), d.get("page_bytes"), d.get("rows_per_page")) != (ROW_BYTES, PAGE_BYTES, ROWS_PER_PAGE):
            raise SlackTierError(ErrorKind.BAD_INPUT, "manifest row/page geometry differs from this build's "
                                 f"({ROW_BYTES} B rows, {PAGE_BYTES} B pages)", fix="restage the table")
        return cls({int(k): int(v) for k, v in d["rows"].items()},
                   {int(k): tuple(int(x) for x in v) for k, v in d.get("column_bounds", {}).items()})


def plan_regions(layout: StagedLayout, ranks: int, targets: list[str]) -> list[StagedRegion]:
    """Place every (layer, rank) region: rank r on target r % len(targets), packed after each header page.

    Regions are ordered by (layer, rank); each target's regions follow one
    another from byte 4096 on.
    """
    if ranks <= 0 or not targets:
        raise SlackTierError(ErrorKind.BAD_INPUT, f"need ranks >= 1 and at least one target, got {ranks} and "
                             f"{len(targets)}", fix="pass --ranks and --target")
    next_offset = [TARGET_HEADER_BYTES] * len(targets)
    regions: list[StagedRegion] = []
    crc_first = 0
    for layer in layout.layer_ids:
        for rank in range(ranks):
            start, end = layout.shard(layer, rank, ranks)
            device = rank % len(targets)
            pages = pages_for_rows(end - start)
            regions.append(StagedRegion(layer, rank, device, targets[device], next_offset[device], pages, start,
                                        end - start, crc_first))
            next_offset[device] += pages * PAGE_BYTES
            crc_first += pages
    return regions


def target_bytes(regions: list[StagedRegion], n_targets: int) -> list[int]:
    """Bytes each target needs: header page + its regions."""
    need = [TARGET_HEADER_BYTES] * n_targets
    for r in regions:
        need[r.device] = max(need[r.device], r.offset_bytes + r.nbytes)
    return need


def sha256_file(path: str | Path, chunk_bytes: int = 8 << 20) -> str:
    """sha256 hex digest of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(chunk_bytes):
            h.update(chunk)
    return h.hexdigest()


@dataclass
class Manifest:
    """A staged table: layout, ranks, targets, regions, checksums, source. See the module docstring."""

    layout: StagedLayout
    ranks: int
    targets: list[str]
    regions: list[StagedRegion]
    source: dict[str, Any]          # {"kind": "synthetic"|"checkpoint", "digest": "sha256:...", ...}
    crc_file: str                   # checksum file name, relative to the manifest's directory
    crc_sha256: str
    total_pages: int
    path: str = ""                  # where this manifest was loaded from / saved to
    format_version: int = FORMAT_VERSION
    created_utc: str = ""

    @property
    def source_digest(self) -> str:
        """The "sha256:..." identity of the staged rows."""
        return str(self.source["digest"])

    def region(self, layer: int, rank: int) -> StagedRegion:
        """The staged region of (layer, rank)."""
        for r in self.regions:
            if r.layer == layer and r.rank == rank:
                return r
        raise SlackTierError(ErrorKind.MISSING, f"no region for layer {layer} rank {rank}",
                             fix="check the layer ids and rank count", layer=layer, rank=rank)

    def runtime_regions(self, layer: int | None = None, rank: int | None = None,
                        targets: Sequence[str] = ()) -> list[Region]:
        """The regions a source reads, in manifest order (layer, then rank), rows filled in.

        `layer` / `rank` keep only that layer's / rank's regions; `targets[d]`, where
        given and non-empty, replaces the staged path of device d (a moved file or
        device, a key prefix). A filter that matches nothing is refused.
        """
        if len(targets) > len(self.targets):
            raise SlackTierError(ErrorKind.BAD_INPUT, f"{len(targets)} target overrides for {len(self.targets)} "
                                 "staged targets", fix="give at most one override per staged target")
        picked = [r.runtime(targets[r.device] if r.device < len(targets) and targets[r.device] else None)
                  for r in self.regions
                  if (layer is None or r.layer == layer) and (rank is None or r.rank == rank)]
        if not picked:
            raise SlackTierError(ErrorKind.MISSING, f"manifest {self.path} has no region of layer {layer} rank {rank} "
                                 f"(layers {list(self.layout.layer_ids)}, {self.ranks} ranks)",
                                 fix="pick a layer and rank the table was staged with", layer=layer, rank=rank)
        return picked

    def crc_path(self) -> Path:
        """The checksum file, beside the manifest."""
        return Path(self.path).parent / self.crc_file

    def checksums(self) -> np.ndarray:
        """[total_pages] uint32 page CRC32Cs, after checking the file's sha256 against the manifest."""
        p = self.crc_path()
        if not p.exists():
            raise SlackTierError(ErrorKind.MISSING, f"checksum file {p} is missing", fix="restage the table")
        data = p.read_bytes()
        if hashlib.sha256(data).hexdigest() != self.crc_sha256:
            raise SlackTierError(ErrorKind.CHECKSUM, f"checksum file {p} does not match its manifest digest",
                                 fix="restage the table")
        crcs = np.frombuffer(data, dtype="<u4")
        if crcs.shape[0] != self.total_pages:
            raise SlackTierError(ErrorKind.CHECKSUM, f"checksum file has {crcs.shape[0]} pages, manifest "
                                 f"{self.total_pages}", fix="restage the table")
        return crcs

    def to_json(self) -> dict[str, Any]:
        """The manifest as a JSON object (see the module docstring)."""
        return {
            "format": FORMAT, "format_version": self.format_version, "created_utc": self.created_utc,
            "layout": self.layout.to_json(), "ranks": self.ranks,
            "targets": [{"device": i, "path": t} for i, t in enumerate(self.targets)],
            "regions": [asdict(r) for r in self.regions],
            "checksums": {"algorithm": "crc32c", "unit": "page", "file": self.crc_file, "sha256": self.crc_sha256,
                          "pages": self.total_pages},
            "source": self.source,
        }

    def save(self, path: str | Path) -> None:
        """Write the manifest JSON atomically (temp file + rename)."""
        path = Path(path)
        self.path = str(path)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(self.to_json(), indent=1) + "\n")
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str | Path) -> Manifest:
        """Read a manifest JSON written by `save`."""
        path = Path(path)
        if not path.exists():
            raise SlackTierError(ErrorKind.MISSING, f"manifest {path} does not exist",
                                 fix="stage the table first (slacktier stage) or pass the manifest's path")
        try:
            d = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise SlackTierError(ErrorKind.BAD_INPUT, f"manifest {path} is not JSON: {exc}",
                                 fix="restage the table") from exc
        if d.get("format") != FORMAT or d.get("format_version") != FORMAT_VERSION:
            raise SlackTierError(ErrorKind.BAD_INPUT, f"{path} is not a {FORMAT} v{FORMAT_VERSION} manifest",
                                 fix="restage the table with this version")
        cs = d["checksums"]
        return cls(layout=StagedLayout.from_json(d["layout"]), ranks=int(d["ranks"]),
                   targets=[t["path"] for t in sorted(d["targets"], key=lambda t: t["device"])],
                   regions=[StagedRegion(**r) for r in d["regions"]], source=d["source"], crc_file=cs["file"],
                   crc_sha256=cs["sha256"], total_pages=int(cs["pages"]), path=str(path),
                   format_version=int(d["format_version"]), created_utc=d.get("created_utc", ""))


def default_manifest_path(target: str) -> Path:
    """`<target>.manifest.json` for a regular-file target."""
    return Path(str(target) + ".manifest.json")


def header_page(source_digest: str, device: int, n_targets: int, state: str) -> np.ndarray:
    """The 4 KiB header page of a target: signature, then JSON (digest, device index, state), zero padded."""
    body = json.dumps({"format": FORMAT, "format_version": FORMAT_VERSION, "source_digest": source_digest,
                       "device": device, "targets": n_targets, "state": state}).encode()
    page = np.zeros(TARGET_HEADER_BYTES, dtype=np.uint8)
    raw = TARGET_MAGIC + len(body).to_bytes(4, "little") + body
    if len(raw) > TARGET_HEADER_BYTES:
        raise SlackTierError(ErrorKind.BAD_INPUT, "target header does not fit a page", fix="shorten the digest")
    page[:len(raw)] = np.frombuffer(raw, dtype=np.uint8)
    return page


def parse_header(page: bytes) -> dict[str, Any] | None:
    """The header JSON of a target's first page, or None when the page is not a SlackTier header."""
    if page[:len(TARGET_MAGIC)] != TARGET_MAGIC:
        return None
    n = int.from_bytes(page[len(TARGET_MAGIC):len(TARGET_MAGIC) + 4], "little")
    start = len(TARGET_MAGIC) + 4
    try:
        return json.loads(page[start:start + n].decode())
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None
