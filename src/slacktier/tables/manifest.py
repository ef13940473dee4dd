"""The manifest of a staged table: JSON beside the data, never inside the pages.

`<manifest>.json` records the format version, the table layout (`StagedLayout`:
layer ids, rows per layer, column bounds, row/page geometry), the rank count,
the targets, every (layer, rank) region (`tables.regions.StagedRegion`: target,
device index, byte offset, pages, global rows),
the source digest and identity (tables.identity: sampled rows' digests and the
checkpoint tensors' header entries, which the plug-ins compare with the weights
their engine loads), and a reference to the per-page checksums. Checksums
(CRC32C of each whole 4 KiB page, little-endian uint32, regions concatenated in
manifest order) live in a binary file beside the manifest, `<manifest stem>.crc`,
whose sha256 the manifest records: a 16M-row table has over a million pages.

Every target also starts with one 4 KiB header page (`TARGET_HEADER_BYTES`)
holding a signature and JSON: format, format_version, source_digest, stage_id,
device, targets, target_bytes and state ("staging" while a staging run writes,
"complete" after its fsync), so a device that already holds another table is
recognised even without its manifest. Regions start after it. Each staging run
derives its `stage_id` from what it writes (`content_stage_id`: the rows'
digest, layout, ranks, partition and region geometry, not the target paths),
recorded in the manifest and in every header: `check_target_header` refuses,
at open time, a target restaged since the manifest was written with other
content, a half-written restage (its header says "staging" until the end) and
a truncated target. Restaging an identical source keeps the stage id, so the
manifests of both runs open the target (its bytes are the same) and a Redis
copy loaded under "st-<stage id>" is still found.

The manifest also records `manifest_digest`, the sha256 of its own content
(every other key, as canonical JSON: sorted keys, no spaces), checked by
`Manifest.load` before anything is served: an edited manifest (a region's
offset moved, another seed) is refused, and so is one written before manifests
carried a digest; after a deliberate edit, `slacktier verify MANIFEST
--redigest` checks the table (every page, rows against the source) and, only
when it is intact, records the new digest. Every field is checked for type and
range at load (integers are JSON integers, never floats or booleans; a region's
device, rank, rows, offset and checksum range agree with the rest of the
manifest), so a malformed manifest is refused naming its key.

Rank partition (`tables.partition`): which hash columns each rank's region
holds. A manifest without a "partition" key is `columns`, the engines' own
contiguous head shards (every manifest written before partitions existed);
another partition is recorded as {"kind", "heads_per_order", "rank_columns"},
checked at load to give every column to exactly one rank by its kind's rule,
and then a region's row_start/rows are its rows in the layer's stored space
(`Manifest.pieces` maps them to global rows).

The "sharding" record states how the rank regions were cut and each rank's
global row spans per layer ({"rule": "hash-columns" | "balanced" |
"equal-rows", "ranks", "rank_rows": {layer: [[[start, end], ...] per rank]}}):
the bounds the serving engines' own TP shards are compared with
(tables.tp_sharding). It is derived from the layout, ranks and partition, and a
record that disagrees with them is refused at load; manifests written before it
existed have none and read the same.

Worked example: 2 layers x 1,000 rows, 2 ranks, one target -> regions
(layer 1, rank 0) at offset 4096 with 34 pages (500 rows), (layer 1, rank 1) at
4096 + 34 * 4096, and so on; checksum of page 3 of (layer 1, rank 1) is entry
34 + 3 of the .crc file.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from slacktier.errors import ErrorKind, SlackTierError
from slacktier.tables.identity import check_identity_json
from slacktier.tables.layout import PAGE_BYTES, ROW_BYTES, ROWS_PER_PAGE, pages_for_rows, shard_bounds
from slacktier.tables.odirect import write_file_atomic
from slacktier.tables.packing import PackedTable
from slacktier.tables.partition import (DEFAULT_PARTITION, RankPartition, RowMap, StoredSpan, columns_text,
                                       region_extent, stored_spans)
from slacktier.tables.regions import Region, StagedRegion
from slacktier.tables.table_layout import TableLayout

FORMAT = "slacktier-table"
FORMAT_VERSION = 1
DIGEST_KEY = "manifest_digest"   # "sha256:<hex>" of the manifest's own content (`manifest_digest`)
MAX_LAYER_ID = 2**31 - 1         # layer ids are a model's decoder-layer indices; anything larger is a typo
MAX_INDEX = 2**62                # bound of every count, offset and row id a manifest may hold
REDIGEST = "slacktier verify {path} --redigest"
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
            if not 0 <= layer <= MAX_LAYER_ID:
                raise SlackTierError(ErrorKind.BAD_INPUT, f"layer id {layer} is outside 0..{MAX_LAYER_ID}",
                                     fix="layer ids are the model's decoder-layer indices (Engram: 1 and 14)")
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


@dataclass(frozen=True)
class TableIdentity:
    """What a target's header must match for a manifest to serve it: the rows' digest and the staging run."""

    source_digest: str   # "sha256:..." of the staged rows (checkpoint bytes, or generator + seed + layout)
    stage_id: str        # a digest of what the staging run wrote (content_stage_id); "" before stage ids existed


def content_stage_id(source_digest: str, layout: StagedLayout, ranks: int, regions: Sequence[StagedRegion],
                     partition: RankPartition | None, need_bytes: Sequence[int],
                     packed: Sequence[StagedRegion] = (), index_sha256: str = "") -> str:
    """A staging run's id (32 hex digits), derived from what it writes: the same source staged the same way
    (layout, ranks, partition, each region's device, offset and size, each target's size, and the packed
    regions and index of context packing, tables.packing) gets the same id wherever its targets are, and any
    other content or geometry another one."""
    doc = [FORMAT, FORMAT_VERSION, source_digest, layout.to_json(), ranks,
           partition.to_json() if partition is not None else None,
           [{k: v for k, v in asdict(r).items() if k != "path"} for r in regions], [int(n) for n in need_bytes]]
    if packed:   # a table without packing keeps the id it always had
        doc.append([{k: v for k, v in asdict(r).items() if k != "path"} for r in packed])
        doc.append(index_sha256)
    return hashlib.sha256(json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:32]


def plan_regions(layout: StagedLayout, ranks: int, targets: list[str],
                 only_ranks: Sequence[int] | None = None, partition: RankPartition | None = None) -> list[StagedRegion]:
    """Place every (layer, rank) region: the i-th staged rank on target i % len(targets), packed after each header
    page (all ranks staged: rank r on target r % len(targets)).

    Regions are ordered by (layer, rank); each target's regions follow one
    another from byte 4096 on. `only_ranks` stages just those ranks' shards (one
    TP rank's machine holds only its own): the shards are still cut for `ranks`
    ranks, so rank 3 of 4 alone holds the same rows as in the whole table.
    Worked example: 24 columns, ranks 4, only_ranks (3,), one target -> per
    layer one region, columns 18..23, from byte 4096 (layer 1) and right after it (layer 14).
    """
    if ranks <= 0 or not targets:
        raise SlackTierError(ErrorKind.BAD_INPUT, f"need ranks >= 1 and at least one target, got {ranks} and "
                             f"{len(targets)}", fix="pass --ranks and --target")
    staged = list(range(ranks)) if only_ranks is None else sorted({int(r) for r in only_ranks})
    if not staged or staged[0] < 0 or staged[-1] >= ranks:
        raise SlackTierError(ErrorKind.BAD_INPUT, f"ranks to stage {list(only_ranks or [])} outside 0..{ranks - 1}",
                             fix=f"pick ranks below --ranks {ranks}")
    for layer in layout.layer_ids:
        if layout.rows[layer] < ranks:   # a rank of no rows: an empty region no tier can serve
            raise SlackTierError(ErrorKind.BAD_INPUT, f"layer {layer} has {layout.rows[layer]} rows, fewer than its "
                                 f"{ranks} ranks", layer=layer, fix="use at most one rank per row (--ranks)")
    next_offset = [TARGET_HEADER_BYTES] * len(targets)
    regions: list[StagedRegion] = []
    crc_first = 0
    for layer in layout.layer_ids:
        spans = layer_spans(layout, layer, ranks, partition)
        for i, rank in enumerate(staged):
            start, rows = region_extent(spans[rank])
            end = start + rows
            device = i % len(targets)
            pages = pages_for_rows(end - start)
            regions.append(StagedRegion(layer, rank, device, targets[device], next_offset[device], pages, start,
                                        end - start, crc_first))
            next_offset[device] += pages * PAGE_BYTES
            crc_first += pages
    return regions


def layer_spans(layout: StagedLayout, layer: int, ranks: int,
                partition: RankPartition | None) -> list[list[StoredSpan]]:
    """Per rank, the global row spans of `layer` its region holds and where they are stored (tables.partition)."""
    return stored_spans(partition, layout.column_bounds.get(layer), layout.rows[layer], ranks)


def region_pieces(region: StagedRegion, spans: Sequence[StoredSpan]) -> list[StagedRegion]:
    """`region` as one piece per span: contiguous global rows (row_start global) at their own pages and checksums.

    Staging and verification read and write rows through these. Worked example (tables.partition's): rank 0's
    balanced region -> pieces of rows [0, 200) at its page 0, [800, 1000) at page 14, [1600, 1800) at page 28.
    """
    out = []
    for s in spans:
        page0 = (s.stored_start - region.row_start) // ROWS_PER_PAGE
        out.append(dataclasses.replace(region, offset_bytes=region.offset_bytes + page0 * PAGE_BYTES,
                                       pages=pages_for_rows(s.rows), row_start=s.start, rows=s.rows,
                                       crc_first_page=region.crc_first_page + page0))
    return out


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
    stage_id: str = ""              # the staging run's random id, also in every target header ("" before it existed)
    partition: RankPartition | None = None   # None: columns (contiguous head shards, the engines' own)
    packing: PackedTable | None = None       # context packing's regions and index (tables.packing), if staged

    @property
    def partition_kind(self) -> str:
        """The rank partition's name: "columns" (also every manifest written before partitions) or "balanced"."""
        return self.partition.kind if self.partition is not None else DEFAULT_PARTITION

    def spans(self, layer: int, rank: int) -> list[StoredSpan]:
        """The global row spans of (layer, rank)'s region and their stored rows (one span under columns)."""
        if not 0 <= rank < self.ranks:
            raise SlackTierError(ErrorKind.BAD_INPUT, f"rank {rank} outside 0..{self.ranks - 1}",
                                 fix="pass a rank the table was staged with", layer=layer, rank=rank)
        return layer_spans(self.layout, layer, self.ranks, self.partition)[rank]

    def row_map(self, layer: int) -> RowMap | None:
        """Global row id -> stored row of `layer`; None where they are the same (columns)."""
        if self.partition is None or self.partition.kind == DEFAULT_PARTITION:
            return None
        return RowMap.of(layer_spans(self.layout, layer, self.ranks, self.partition), self.layout.rows[layer])

    def pieces(self, region: StagedRegion) -> list[StagedRegion]:
        """`region` as pieces of contiguous global rows (`region_pieces`); the region itself under columns."""
        if self.row_map(region.layer) is None:
            return [region]
        return region_pieces(region, self.spans(region.layer, region.rank))

    @property
    def sharding_rule(self) -> str:
        """How the rank regions were cut: "hash-columns" (each rank whole, contiguous hash columns: the engines'
        own TP sharding at `ranks`), "balanced" (tables.partition) or "equal-rows" (no hash-column bounds, or a
        rank count that does not divide the columns: no serving engine's sharding at TP > 1)."""
        if self.partition is not None and self.partition.kind != DEFAULT_PARTITION:
            return self.partition.kind
        for layer in self.layout.layer_ids:
            bounds = self.layout.column_bounds.get(layer)
            if self.ranks > 1 and (bounds is None or (len(bounds) - 1) % self.ranks):
                return "equal-rows"
        return "hash-columns"

    def rank_rows(self, layer: int) -> list[list[tuple[int, int]]]:
        """Per rank, the global rows [start, end) of `layer` its region holds (one span except under balanced)."""
        return [[(s.start, s.start + s.rows) for s in spans]
                for spans in layer_spans(self.layout, layer, self.ranks, self.partition)]

    def sharding_json(self) -> dict[str, Any]:
        """The manifest's "sharding" record: the rule and every rank's global row spans per layer, the bounds the
        serving engines' TP shards are compared with (tables.tp_sharding)."""
        return {"rule": self.sharding_rule, "ranks": self.ranks,
                "rank_rows": {str(layer): [[list(s) for s in spans] for spans in self.rank_rows(layer)]
                              for layer in self.layout.layer_ids}}

    @property
    def source_digest(self) -> str:
        """The "sha256:..." identity of the staged rows."""
        return str(self.source["digest"])

    @property
    def identity(self) -> TableIdentity:
        """The identity every target header of this table must carry (see `check_target_header`)."""
        return TableIdentity(self.source_digest, self.stage_id)

    def target_need_bytes(self) -> list[int]:
        """Bytes each target needs: its header page and regions (packed regions included)."""
        return target_bytes(self.regions + list(self.packed_regions()), len(self.targets))

    def packed_regions(self, layer: int | None = None, rank: int | None = None) -> tuple[StagedRegion, ...]:
        """The packed regions (tables.packing) of `layer` / `rank` (None: all), in manifest order; () without
        packing."""
        if self.packing is None:
            return ()
        return tuple(r for r in self.packing.regions
                     if (layer is None or r.layer == layer) and (rank is None or r.rank == rank))

    def packed_checksums(self, regions: Sequence[StagedRegion]) -> list[np.ndarray]:
        """The page CRC32Cs ([pages] uint32) of packed `regions` (from `checksums`)."""
        every = self.checksums()
        return [np.ascontiguousarray(every[r.crc_first_page:r.crc_first_page + r.pages]) for r in regions]

    def index_path(self) -> Path:
        """The pack index file (tables.packing), beside the manifest."""
        if self.packing is None:
            raise SlackTierError(ErrorKind.MISSING, f"manifest {self.path} has no context packing",
                                 fix="stage the table with --pack-list")
        return Path(self.path).parent / self.packing.index_file

    def check_targets(self, targets: Sequence[str] = ()) -> None:
        """`check_target_header` on every target (`targets[d]`, where given and non-empty, replaces target d)."""
        for d, (path, need) in enumerate(zip(self.targets, self.target_need_bytes())):
            where = targets[d] if d < len(targets) and targets[d] else path
            check_target_header(where, d, self.identity, need_bytes=need)

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

    def region_checksums(self) -> list[np.ndarray]:
        """Each region's page CRC32Cs ([pages] uint32, contiguous), in `regions` order (from `checksums`)."""
        every = self.checksums()
        return [np.ascontiguousarray(every[r.crc_first_page:r.crc_first_page + r.pages]) for r in self.regions]

    def checksums(self) -> np.ndarray:
        """[total_pages] uint32 page CRC32Cs, after checking the file's sha256 against the manifest."""
        p = self.crc_path()
        if not p.exists():
            raise SlackTierError(ErrorKind.MISSING, f"checksum file {p} is missing", fix="restage the table")
        try:
            data = p.read_bytes()
        except OSError as exc:
            raise SlackTierError(ErrorKind.IO, f"cannot read checksum file {p}: {exc.strerror}",
                                 fix="check the file's permissions (the engine's user must read it)") from None
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
            "source": self.source, "stage_id": self.stage_id, "sharding": self.sharding_json(),
        } | ({"partition": self.partition.to_json()} if self.partition is not None else {}) \
            | ({"packing": self.packing.to_json()} if self.packing is not None else {})

    def save(self, path: str | Path) -> None:
        """Write the manifest JSON, with its own digest, atomically (temp file + rename; nothing left on failure)."""
        path = Path(path)
        self.path = str(path)
        doc = self.to_json()
        doc[DIGEST_KEY] = manifest_digest(doc)
        write_file_atomic(path, (json.dumps(doc, indent=1) + "\n").encode(), what="manifest")

    @classmethod
    def load(cls, path: str | Path, *, check_digest: bool = True) -> Manifest:
        """Read a manifest JSON written by `save`; anything else is refused with a SlackTierError.

        `check_digest` False reads one whose own digest is missing or does not match (only for
        `slacktier verify --redigest`, which records it after checking the whole table)."""
        path = Path(path)
        if not path.exists():
            raise SlackTierError(ErrorKind.MISSING, f"manifest {path} does not exist",
                                 fix="stage the table first (slacktier stage) or pass the manifest's path")
        if not path.is_file():
            raise SlackTierError(ErrorKind.BAD_INPUT, f"manifest {path} is not a file",
                                 fix="pass the table's .manifest.json file, not its directory")
        try:
            d = json.loads(path.read_bytes().decode("utf-8"))
        except OSError as exc:
            raise SlackTierError(ErrorKind.IO, f"cannot read manifest {path}: {exc}",
                                 fix="check the path and its permissions") from exc
        except (ValueError, RecursionError) as exc:  # JSONDecodeError and UnicodeDecodeError (a binary file)
            raise SlackTierError(ErrorKind.BAD_INPUT, f"manifest {path} is not JSON: {exc}",
                                 fix="pass the table's .manifest.json file, or restage the table") from exc
        if not isinstance(d, dict) or d.get("format") != FORMAT or d.get("format_version") != FORMAT_VERSION:
            raise SlackTierError(ErrorKind.BAD_INPUT, f"{path} is not a {FORMAT} v{FORMAT_VERSION} manifest",
                                 fix="restage the table with this version")
        m = _manifest_from_json(d, str(path))
        if check_digest:
            check_manifest_digest(d, str(path))
        return m


def manifest_digest(doc: Mapping[str, Any]) -> str:
    """"sha256:<hex>" of a manifest document's content: every key but the digest itself, as canonical JSON."""
    body = {k: v for k, v in doc.items() if k != DIGEST_KEY}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()


def check_manifest_digest(doc: Mapping[str, Any], path: str) -> None:
    """Refuse a manifest document whose recorded digest is missing (BAD_INPUT) or not its content's (CHECKSUM)."""
    recorded = doc.get(DIGEST_KEY)
    redigest = REDIGEST.format(path=path)
    if recorded is None:
        raise SlackTierError(ErrorKind.BAD_INPUT, f"manifest {path} records no {DIGEST_KEY} (written before "
                             "manifests carried a digest of their own content), so an edit could not be told",
                             fix=f"stage the table again (slacktier stage), or run `{redigest}`: it checks every "
                                 "page and rows against the source, then records the digest")
    got = manifest_digest(doc)
    if recorded != got:
        raise SlackTierError(ErrorKind.CHECKSUM, f"manifest {path} was edited since it was written: its content "
                             f"is {got}, its {DIGEST_KEY} says {recorded}",
                             fix=f"restore the manifest staging wrote, or stage the table again; after a deliberate "
                                 f"edit, `{redigest}` checks the table and records the new digest")


_REGION_KEYS = ("layer", "rank", "device", "path", "offset_bytes", "pages", "row_start", "rows", "crc_first_page")
_TOP_KEYS = {"format", "format_version", "created_utc", "layout", "ranks", "targets", "regions", "checksums",
             "source", "stage_id", "partition", "sharding", "packing", DIGEST_KEY}


class _Fields:
    """Typed reads of a manifest document, each refusal naming the manifest and the key ($.regions[2].device)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def bad(self, key: str, value: Any, want: str) -> SlackTierError:
        shown = repr(value)
        if len(shown) > 60:
            shown = shown[:57] + "..."
        return SlackTierError(ErrorKind.BAD_INPUT, f"manifest {self.path}: {key} is {shown}, want {want}",
                              fix="restore the manifest staging wrote, or stage the table again (slacktier stage)")

    def get(self, d: Any, name: str, key: str) -> Any:
        if not isinstance(d, dict):
            raise self.bad(key.rsplit(".", 1)[0] or "$", d, "an object")
        if name not in d:
            raise SlackTierError(ErrorKind.BAD_INPUT, f"manifest {self.path}: {key} is missing",
                                 fix="restore the manifest staging wrote, or stage the table again")
        return d[name]

    def int(self, value: Any, key: str, lo: int = 0, hi: int = MAX_INDEX) -> int:
        # a JSON integer only: 1e3, 1e400 (inf), true and "3" are refused, never rounded
        if type(value) is not int or not lo <= value <= hi:
            raise self.bad(key, value, f"an integer in {lo}..{hi}")
        return value

    def str(self, value: Any, key: str) -> str:
        if not isinstance(value, str):
            raise self.bad(key, value, "a string")
        return value

    def list(self, value: Any, key: str, nonempty: bool = True) -> list:
        if not isinstance(value, list) or (nonempty and not value):
            raise self.bad(key, value, "a non-empty list" if nonempty else "a list")
        return value

    def keys(self, d: dict, allowed: set[str] | tuple[str, ...], key: str) -> None:
        extra = sorted(set(d) - set(allowed))
        if extra:
            raise SlackTierError(ErrorKind.BAD_INPUT, f"manifest {self.path}: {key}.{extra[0][:40]} is not a key of "
                                 f"a {FORMAT} v{FORMAT_VERSION} manifest",
                                 fix="restore the manifest staging wrote, or stage the table again (slacktier stage)")


def _digest_text(value: Any, key: str, f: _Fields) -> str:
    text = f.str(value, key)
    hexpart = text.removeprefix("sha256:")
    if len(hexpart) != 64 or any(c not in "0123456789abcdef" for c in hexpart):
        raise f.bad(key, value, "a sha256 hex digest")
    return text


def _layout_from_json(d: Any, f: _Fields) -> StagedLayout:
    f.keys(d if isinstance(d, dict) else {}, ("layers", "rows", "column_bounds", "row_bytes", "page_bytes",
                                               "rows_per_page"), "$.layout")
    rows_doc = f.get(d, "rows", "$.layout.rows")
    if not isinstance(rows_doc, dict) or not rows_doc:
        raise f.bad("$.layout.rows", rows_doc, "an object {layer id: rows}")
    rows: dict[int, int] = {}
    for k, v in rows_doc.items():
        if not k.isdigit() or int(k) > MAX_LAYER_ID:
            raise f.bad(f"$.layout.rows.{k[:20]}", k, f"a layer id in 0..{MAX_LAYER_ID}")
        rows[int(k)] = f.int(v, f"$.layout.rows.{k}", 1)
    bounds: dict[int, tuple[int, ...]] = {}
    bounds_doc = d.get("column_bounds", {})
    if not isinstance(bounds_doc, dict):
        raise f.bad("$.layout.column_bounds", bounds_doc, "an object {layer id: bounds}")
    for k, v in bounds_doc.items():
        key = f"$.layout.column_bounds.{k[:20]}"
        if not k.isdigit() or int(k) not in rows:
            raise f.bad(key, k, "a layer id of $.layout.rows")
        bounds[int(k)] = tuple(f.int(x, f"{key}[{i}]") for i, x in enumerate(f.list(v, key)))
        if len(bounds[int(k)]) < 2:
            raise f.bad(key, v, "at least two bounds")
    layers = d.get("layers", sorted(rows))
    if layers != sorted(rows):
        raise f.bad("$.layout.layers", layers, f"the layer ids of $.layout.rows, {sorted(rows)}")
    try:
        return StagedLayout.from_json(d)
    except SlackTierError as exc:
        raise SlackTierError(exc.kind, f"manifest {f.path}: $.layout: {exc.message}", layer=exc.layer,
                             fix=exc.fix) from None


def _source_from_json(d: Any, f: _Fields) -> dict[str, Any]:
    if not isinstance(d, dict):
        raise f.bad("$.source", d, "an object")
    kind = f.get(d, "kind", "$.source.kind")
    _digest_text(f.get(d, "digest", "$.source.digest"), "$.source.digest", f)
    if kind == "synthetic":
        f.str(f.get(d, "generator", "$.source.generator"), "$.source.generator")
        f.int(f.get(d, "seed", "$.source.seed"), "$.source.seed", -(2**63), 2**64 - 1)
    elif kind == "checkpoint":
        files = f.list(f.get(d, "files", "$.source.files"), "$.source.files")
        for i, x in enumerate(files):
            f.str(x, f"$.source.files[{i}]")
    else:
        raise f.bad("$.source.kind", kind, '"synthetic" or "checkpoint"')
    if "identity" in d:   # absent in manifests staged before identities were recorded
        check_identity_json(d["identity"], f.bad)
    return dict(d)


def _manifest_from_json(d: dict[str, Any], path: str) -> Manifest:
    """A Manifest from a parsed document, every field checked for type and range (see the module docstring)."""
    f = _Fields(path)
    f.keys(d, _TOP_KEYS, "$")
    layout = _layout_from_json(f.get(d, "layout", "$.layout"), f)
    ranks = f.int(f.get(d, "ranks", "$.ranks"), "$.ranks", 1, 1 << 16)
    targets_doc = f.list(f.get(d, "targets", "$.targets"), "$.targets")
    targets: list[str] = [""] * len(targets_doc)
    for i, t in enumerate(targets_doc):
        key = f"$.targets[{i}]"
        f.keys(t if isinstance(t, dict) else {}, ("device", "path"), key)
        device = f.int(f.get(t, "device", f"{key}.device"), f"{key}.device", 0, len(targets_doc) - 1)
        if targets[device]:
            raise f.bad(f"{key}.device", device, "each device index once")
        targets[device] = f.str(f.get(t, "path", f"{key}.path"), f"{key}.path")
        if not targets[device]:
            raise f.bad(f"{key}.path", "", "a file or block device path")
    cs = f.get(d, "checksums", "$.checksums")
    f.keys(cs if isinstance(cs, dict) else {}, ("algorithm", "unit", "file", "sha256", "pages"), "$.checksums")
    if f.get(cs, "algorithm", "$.checksums.algorithm") != "crc32c" or cs.get("unit", "page") != "page":
        raise f.bad("$.checksums.algorithm", cs.get("algorithm"), '"crc32c" per "page"')
    crc_file = f.str(f.get(cs, "file", "$.checksums.file"), "$.checksums.file")
    if not crc_file or "/" in crc_file or crc_file in (".", ".."):
        raise f.bad("$.checksums.file", crc_file, "a file name beside the manifest")
    crc_sha = _digest_text(f.get(cs, "sha256", "$.checksums.sha256"), "$.checksums.sha256", f)
    total_pages = f.int(f.get(cs, "pages", "$.checksums.pages"), "$.checksums.pages", 1)
    partition = _partition_from_json(d.get("partition"), layout, ranks, f)
    spans = {layer: layer_spans(layout, layer, ranks, partition) for layer in layout.layer_ids}
    regions: list[StagedRegion] = []
    crc_next = 0
    end_of: dict[int, list[tuple[int, int, int]]] = {}
    seen: set[tuple[int, int]] = set()
    for i, r in enumerate(f.list(f.get(d, "regions", "$.regions"), "$.regions")):
        key = f"$.regions[{i}]"
        f.keys(r if isinstance(r, dict) else {}, _REGION_KEYS, key)
        v = {name: f.get(r, name, f"{key}.{name}") for name in _REGION_KEYS}
        layer = f.int(v["layer"], f"{key}.layer", 0, MAX_LAYER_ID)
        if layer not in layout.rows:
            raise f.bad(f"{key}.layer", layer, f"a layer of $.layout.rows, {list(layout.layer_ids)}")
        rank = f.int(v["rank"], f"{key}.rank", 0, ranks - 1)
        if (layer, rank) in seen:
            raise f.bad(f"{key}.rank", rank, f"each (layer, rank) once; layer {layer} lists it twice")
        seen.add((layer, rank))
        device = f.int(v["device"], f"{key}.device", 0, len(targets) - 1)
        if f.str(v["path"], f"{key}.path") != targets[device]:
            raise f.bad(f"{key}.path", v["path"], f"the path of target {device}, {targets[device]!r}")
        offset = f.int(v["offset_bytes"], f"{key}.offset_bytes", TARGET_HEADER_BYTES)
        if offset % PAGE_BYTES:
            raise f.bad(f"{key}.offset_bytes", offset, "a multiple of 4096")
        lo, n = region_extent(spans[layer][rank])
        hi = lo + n
        row_start = f.int(v["row_start"], f"{key}.row_start")
        rows = f.int(v["rows"], f"{key}.rows", 1)
        if row_start != lo:
            raise f.bad(f"{key}.row_start", row_start, f"{lo}, where rank {rank}'s shard of layer {layer} starts")
        if rows != hi - lo:
            raise f.bad(f"{key}.rows", rows, f"{hi - lo}, the rows of rank {rank}'s shard of layer {layer}")
        pages = f.int(v["pages"], f"{key}.pages", 1)
        if pages != pages_for_rows(rows):
            raise f.bad(f"{key}.pages", pages, f"{pages_for_rows(rows)} pages for its {rows} rows")
        crc_first = f.int(v["crc_first_page"], f"{key}.crc_first_page")
        if crc_first != crc_next:   # checksums are the regions' pages concatenated in manifest order
            raise f.bad(f"{key}.crc_first_page", crc_first, f"{crc_next}, the pages of the regions before it")
        crc_next += pages
        end_of.setdefault(device, []).append((offset, offset + pages * PAGE_BYTES, i))
        regions.append(StagedRegion(layer, rank, device, targets[device], offset, pages, row_start, rows, crc_first))
    packing = None
    if "packing" in d:
        packing, crc_next = _packing_from_json(d["packing"], layout, ranks, targets, regions, crc_next, end_of, f)
    if crc_next != total_pages:
        raise f.bad("$.checksums.pages", total_pages, f"{crc_next}, the regions' pages")
    for spans in end_of.values():   # two regions of one target never share a byte
        spans.sort()
        for (_, end, _), (start, _, i) in zip(spans, spans[1:]):
            if start < end:
                raise f.bad(f"$.regions[{i}].offset_bytes", start, f"past byte {end}, where another region on "
                            "its target ends")
    if DIGEST_KEY in d:
        _digest_text(d[DIGEST_KEY], f"$.{DIGEST_KEY}", f)
    m = Manifest(layout=layout, ranks=ranks, targets=targets, regions=regions,
                    source=_source_from_json(f.get(d, "source", "$.source"), f),
                    crc_file=crc_file, crc_sha256=crc_sha, total_pages=total_pages, path=path,
                    format_version=FORMAT_VERSION, created_utc=f.str(d.get("created_utc", ""), "$.created_utc"),
                    stage_id=f.str(d.get("stage_id", ""), "$.stage_id"), partition=partition, packing=packing)
    # written by manifests since they record it; always what the layout, ranks and partition give
    if "sharding" in d and d["sharding"] != m.sharding_json():
        raise f.bad("$.sharding", d["sharding"], f"{m.sharding_rule!r} rank rows as the layout, ranks and "
                    "partition give them")
    return m


def _packing_from_json(d: Any, layout: StagedLayout, ranks: int, targets: list[str], regions: list[StagedRegion],
                       crc_next: int, end_of: dict[int, list[tuple[int, int, int]]],
                       f: _Fields) -> tuple[PackedTable, int]:
    """The manifest's "packing" record (tables.packing), every field checked: a packed region per (layer,
    staged rank) of each packed layer, on that rank's target, its pages the layer's contexts' and its
    checksums after the row regions'; returns it and the checksum count after it."""
    key = "$.packing"
    f.keys(d if isinstance(d, dict) else {}, ("regions", "contexts", "pages_per_context", "rank_columns", "index",
                                               "disk_bytes_per_rank", "budgets", "pack_list"), key)
    ppc = f.int(f.get(d, "pages_per_context", f"{key}.pages_per_context"), f"{key}.pages_per_context", 1, 64)
    cols = f.list(f.get(d, "rank_columns", f"{key}.rank_columns"), f"{key}.rank_columns")
    rank_columns = tuple(tuple(f.int(c, f"{key}.rank_columns[{k}][{i}]") for i, c in
                               enumerate(f.list(rc, f"{key}.rank_columns[{k}]"))) for k, rc in enumerate(cols))
    if len(rank_columns) != ranks or len({len(c) for c in rank_columns}) != 1 \
            or ppc != -(-len(rank_columns[0]) // ROWS_PER_PAGE):
        raise f.bad(f"{key}.rank_columns", cols, f"{ranks} ranks' columns, as many each, in {ppc} page(s)")
    ctx_doc = f.get(d, "contexts", f"{key}.contexts")
    if not isinstance(ctx_doc, dict) or not ctx_doc:
        raise f.bad(f"{key}.contexts", ctx_doc, "an object {layer id: contexts}")
    contexts: dict[int, int] = {}
    for k, v in ctx_doc.items():
        if not k.isdigit() or int(k) not in layout.rows:
            raise f.bad(f"{key}.contexts.{k[:20]}", k, "a layer id of $.layout.rows")
        contexts[int(k)] = f.int(v, f"{key}.contexts.{k}", 1)
    staged = {(r.layer, r.rank): r for r in regions}
    packed: list[StagedRegion] = []
    seen: set[tuple[int, int]] = set()
    for i, r in enumerate(f.list(f.get(d, "regions", f"{key}.regions"), f"{key}.regions")):
        rk = f"{key}.regions[{i}]"
        f.keys(r if isinstance(r, dict) else {}, _REGION_KEYS, rk)
        v = {name: f.get(r, name, f"{rk}.{name}") for name in _REGION_KEYS}
        layer = f.int(v["layer"], f"{rk}.layer", 0, MAX_LAYER_ID)
        if layer not in contexts:
            raise f.bad(f"{rk}.layer", layer, f"a layer of {key}.contexts, {sorted(contexts)}")
        rank = f.int(v["rank"], f"{rk}.rank", 0, ranks - 1)
        row_region = staged.get((layer, rank))
        if row_region is None or (layer, rank) in seen:
            raise f.bad(f"{rk}.rank", rank, f"a staged rank of layer {layer}, once")
        seen.add((layer, rank))
        device = f.int(v["device"], f"{rk}.device", 0, len(targets) - 1)
        if device != row_region.device or f.str(v["path"], f"{rk}.path") != targets[device]:
            raise f.bad(f"{rk}.device", device, f"{row_region.device}, the target of its rank's row region")
        offset = f.int(v["offset_bytes"], f"{rk}.offset_bytes", TARGET_HEADER_BYTES)
        if offset % PAGE_BYTES:
            raise f.bad(f"{rk}.offset_bytes", offset, "a multiple of 4096")
        pages = f.int(v["pages"], f"{rk}.pages", 1)
        if pages != contexts[layer] * ppc:
            raise f.bad(f"{rk}.pages", pages, f"{contexts[layer] * ppc}, {ppc} per packed context")
        if f.int(v["row_start"], f"{rk}.row_start") != 0 or f.int(v["rows"], f"{rk}.rows") != 0:
            raise f.bad(f"{rk}.rows", v["rows"], "0 (a packed region holds contexts, not a row range)")
        crc_first = f.int(v["crc_first_page"], f"{rk}.crc_first_page")
        if crc_first != crc_next:
            raise f.bad(f"{rk}.crc_first_page", crc_first, f"{crc_next}, the pages of the regions before it")
        crc_next += pages
        end_of.setdefault(device, []).append((offset, offset + pages * PAGE_BYTES, len(regions) + i))
        packed.append(StagedRegion(layer, rank, device, targets[device], offset, pages, 0, 0, crc_first))
    for layer in contexts:
        want = {r.rank for r in regions if r.layer == layer}
        if {r.rank for r in packed if r.layer == layer} != want:
            raise f.bad(f"{key}.regions", "...", f"a packed region of layer {layer} for each staged rank")
    ix = f.get(d, "index", f"{key}.index")
    f.keys(ix if isinstance(ix, dict) else {}, ("file", "sha256", "bytes_per_rank"), f"{key}.index")
    index_file = f.str(f.get(ix, "file", f"{key}.index.file"), f"{key}.index.file")
    if not index_file or "/" in index_file or index_file in (".", ".."):
        raise f.bad(f"{key}.index.file", index_file, "a file name beside the manifest")
    index_sha = _digest_text(f.get(ix, "sha256", f"{key}.index.sha256"), f"{key}.index.sha256", f)
    budgets = f.get(d, "budgets", f"{key}.budgets")
    f.keys(budgets if isinstance(budgets, dict) else {}, ("disk_bytes_per_rank", "index_bytes_per_rank"),
           f"{key}.budgets")
    pack_list = f.get(d, "pack_list", f"{key}.pack_list")
    if not isinstance(pack_list, dict):
        raise f.bad(f"{key}.pack_list", pack_list, "an object (the pack list's meta)")
    table = PackedTable(
        regions=tuple(packed), contexts=contexts, pages_per_context=ppc, rank_columns=rank_columns,
        index_file=index_file, index_sha256=index_sha,
        index_bytes_per_rank=f.int(f.get(ix, "bytes_per_rank", f"{key}.index.bytes_per_rank"),
                                   f"{key}.index.bytes_per_rank"),
        disk_bytes_per_rank=f.int(f.get(d, "disk_bytes_per_rank", f"{key}.disk_bytes_per_rank"),
                                  f"{key}.disk_bytes_per_rank"),
        budget_disk_bytes=f.int(f.get(budgets, "disk_bytes_per_rank", f"{key}.budgets.disk_bytes_per_rank"),
                                f"{key}.budgets.disk_bytes_per_rank", 1),
        budget_index_bytes=f.int(f.get(budgets, "index_bytes_per_rank", f"{key}.budgets.index_bytes_per_rank"),
                                 f"{key}.budgets.index_bytes_per_rank", 1),
        pack_list=pack_list)
    return table, crc_next


def _partition_from_json(d: Any, layout: StagedLayout, ranks: int, f: _Fields) -> RankPartition | None:
    """The manifest's "partition" (absent: columns), refused unless it gives every hash column of every layer to
    exactly one rank, by its kind's rule."""
    if d is None:
        return None
    f.keys(d if isinstance(d, dict) else {}, ("kind", "heads_per_order", "rank_columns"), "$.partition")
    kind = f.str(f.get(d, "kind", "$.partition.kind"), "$.partition.kind")
    hpo = f.int(f.get(d, "heads_per_order", "$.partition.heads_per_order"), "$.partition.heads_per_order", 1)
    cols = f.list(f.get(d, "rank_columns", "$.partition.rank_columns"), "$.partition.rank_columns")
    columns = tuple(tuple(f.int(c, f"$.partition.rank_columns[{k}][{i}]") for i, c in
                          enumerate(f.list(rc, f"$.partition.rank_columns[{k}]"))) for k, rc in enumerate(cols))
    part = RankPartition(kind, hpo, columns)
    for layer in layout.layer_ids:
        bounds = layout.column_bounds.get(layer)
        if bounds is None:
            raise f.bad(f"$.layout.column_bounds.{layer}", None, f"the hash-column bounds a {kind!r} partition needs")
        try:
            part.check(len(bounds) - 1, ranks, f"manifest {f.path}: $.partition")
        except SlackTierError as exc:
            raise SlackTierError(exc.kind, exc.message, fix=exc.fix) from None
    return part


def default_manifest_path(target: str) -> Path:
    """`<target>.manifest.json` for a regular-file target."""
    return Path(str(target) + ".manifest.json")


def header_page(source_digest: str, device: int, n_targets: int, state: str, stage_id: str = "",
                target_bytes: int = 0) -> np.ndarray:
    """The 4 KiB header page of a target: signature, then JSON (see the module docstring), zero padded."""
    body = json.dumps({"format": FORMAT, "format_version": FORMAT_VERSION, "source_digest": source_digest,
                       "stage_id": stage_id, "device": device, "targets": n_targets, "target_bytes": target_bytes,
                       "state": state}).encode()
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
        header = json.loads(page[start:start + n].decode())
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None
    return header if isinstance(header, dict) else None


def read_target_header(path: str | Path) -> tuple[dict[str, Any] | None, int]:
    """(header JSON or None, size in bytes) of a file or block device: one plain 4 KiB pread."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError as exc:
        raise SlackTierError(ErrorKind.MISSING, f"target {path} does not exist",
                             fix="restage the table, or pass the target's current path") from exc
    except OSError as exc:
        raise SlackTierError(ErrorKind.IO, f"cannot open target {path}: {exc}",
                             fix="check the path and its permissions") from exc
    try:
        page = os.pread(fd, TARGET_HEADER_BYTES, 0)
        size_bytes = os.lseek(fd, 0, os.SEEK_END)  # also a block device's size, where fstat says 0
    except OSError as exc:
        raise SlackTierError(ErrorKind.IO, f"cannot read the header page of target {path}: {exc}",
                             fix="check the device") from exc
    finally:
        os.close(fd)
    return (parse_header(page) if len(page) == TARGET_HEADER_BYTES else None), size_bytes


def header_mismatch(path: str | Path, header: dict[str, Any] | None, device: int,
                    identity: TableIdentity) -> tuple[str, str] | None:
    """(problem, fix) when `header` does not say target `device` holds `identity`, complete; None when it does."""
    restage = "restage the table, or open it with the manifest of the table the target now holds"
    if header is None:
        return f"target {path} has no SlackTier header page", f"the target was overwritten or never staged: {restage}"
    if header.get("source_digest") != identity.source_digest:
        return (f"target {path} holds another table (source {header.get('source_digest')}, the manifest's "
                f"{identity.source_digest})", restage)
    theirs = str(header.get("stage_id") or "")
    if theirs and identity.stage_id and theirs != identity.stage_id:
        return (f"target {path} was staged again since its manifest was written (stage {theirs}, the manifest's "
                f"{identity.stage_id})", "open the table with the manifest of the latest staging run")
    if header.get("device") != device:
        return (f"target {path} is device {header.get('device')} of its table, the manifest expects device "
                f"{device} there", "list the targets in staging order")
    if header.get("state") != "complete":
        return (f"target {path} is in state {header.get('state')!r}: a staging run did not finish",
                "stage the table again and let it complete")
    return None


def check_target_header(path: str | Path, device: int, identity: TableIdentity, *,
                        need_bytes: int | None = None) -> None:
    """Refuse (SlackTierError TARGET) a target whose header page does not say it holds `identity`, complete.

    Refused: no SlackTier header; another source digest (another table);
    another stage_id (the target was staged again, when both sides have one);
    another device index; a state other than "complete" (a staging run that
    did not finish); a target shorter than its regions need (`need_bytes`, and
    the size its header records). Works on a file or a block device and costs
    one plain 4 KiB pread. A missing target raises MISSING, an unreadable one IO.
    """
    header, size_bytes = read_target_header(path)
    problem = header_mismatch(path, header, device, identity)
    if problem is not None:
        raise SlackTierError(ErrorKind.TARGET, problem[0], fix=problem[1])
    need = max(int(need_bytes or 0), int((header or {}).get("target_bytes") or 0))
    if size_bytes < need:
        raise SlackTierError(ErrorKind.TARGET, f"target {path} is truncated: {size_bytes} bytes, its header page "
                             f"and regions need {need}", fix="restage the table")


def check_tp_sharding(manifest: Manifest, tp_size: int, layers: Sequence[int] | None = None) -> None:
    """Refuse (BAD_INPUT) a manifest whose rank regions are not `tp_size` ranks' whole heads under its partition.

    The serving engines split an Engram layer's hash heads (columns) over the
    tensor-parallel ranks, each rank holding whole per-head subtables. Under
    `columns` (the engines' own sharding) rank k of `tp_size` owns columns
    [k * C / tp, (k + 1) * C / tp), i.e. global rows [bounds[k * C / tp], bounds[(k + 1) * C / tp]);
    under `balanced` it owns as many heads of each order (tables.partition). So the
    manifest must have been staged with `ranks == tp_size` (num_shards == TP),
    every layer must record its column bounds, the column count must divide by
    `tp_size`, and each (layer, rank) region must hold exactly its rank's rows.

    Worked example: 24 columns of 100 rows each, tp 4, columns -> rank 1 owns columns 6..11,
    rows [600, 1200); a table staged with ranks = 2 is refused for tp 4.
    """
    if tp_size < 1:
        raise SlackTierError(ErrorKind.BAD_INPUT, f"tensor-parallel size {tp_size}", fix="pass a TP size >= 1")
    where = manifest.path or "the manifest"
    kind = manifest.partition_kind
    if manifest.ranks != tp_size:
        raise SlackTierError(ErrorKind.BAD_INPUT, f"{where} was staged with {manifest.ranks} ranks (num_shards), "
                             f"the serving engine runs TP {tp_size}: rank regions would not match its head shards",
                             fix=f"stage the table again with --ranks {tp_size} --partition {kind}")
    for layer in (manifest.layout.layer_ids if layers is None else layers):
        bounds = manifest.layout.column_bounds.get(layer)
        if bounds is None:
            raise SlackTierError(ErrorKind.BAD_INPUT, f"{where}: layer {layer} records no hash-column bounds, so "
                                 "its rank regions cannot be checked against head sharding", layer=layer,
                                 fix="stage from the model's hash layout (--engram v41, or a checkpoint)")
        cols = len(bounds) - 1
        if cols % tp_size:
            raise SlackTierError(ErrorKind.BAD_INPUT, f"{where}: layer {layer} has {cols} hash columns, which "
                                 f"TP {tp_size} cannot split into whole heads", layer=layer,
                                 fix=f"run TP at a divisor of {cols}")
        spans = layer_spans(manifest.layout, layer, tp_size, manifest.partition)
        owned = (manifest.partition.columns if manifest.partition is not None
                 else [range(k * cols // tp_size, (k + 1) * cols // tp_size) for k in range(tp_size)])
        # a table staged for some ranks only (`stage --only-ranks`, one rank's machine) is checked on those
        staged = sorted({r.rank for r in manifest.regions if r.layer == layer}) or list(range(tp_size))
        for rank in staged:
            lo, n = region_extent(spans[rank])
            r = manifest.region(layer, rank)
            if (r.row_start, r.rows) != (lo, n):
                raise SlackTierError(ErrorKind.BAD_INPUT, f"{where}: layer {layer} rank {rank} region holds rows "
                                     f"[{r.row_start}, {r.row_start + r.rows}), TP {tp_size} {kind} sharding gives "
                                     f"that rank columns {columns_text(owned[rank])}, rows [{lo}, {lo + n})",
                                     layer=layer, rank=rank, fix=f"stage the table again with --ranks {tp_size} "
                                     f"--partition {kind} from the model's hash layout")
