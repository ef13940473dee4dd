"""What the step engine serves: per-layer table specs (rows, rank regions, source, cache share).

A table layer's rows [row_start, row_start + rows) are split over R ranks,
each rank's shard stored as one region (`slacktier.tables.regions.Region`,
whose row_start/rows say which global rows it holds) of a page source. Row ids in a step are
the layer's table rows (what the hasher returns); a row maps to its rank by the
shard bounds, then to a page and byte inside that rank's region.

Worked example: 1,000 rows over 2 ranks (shards [0, 500) and [500, 1000)):
row 531 -> rank 1, shard row 31 -> page 2 of rank 1's region, byte 264.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from slacktier.cache import LayerGeometry
from slacktier.cache.directory import PackedGeometry
from slacktier.errors import ErrorKind, SlackTierError
from slacktier.store.base import PageSource
from slacktier.tables.layout import pages_for_rows, shard_bounds
from slacktier.tables.packing import PackIndex
from slacktier.tables.partition import RowMap
from slacktier.tables.regions import Region


@dataclass(frozen=True)
class TablePacking:
    """A layer's context packing as the engine serves it (tables.packing): its ranks' packed regions, where the
    source holds them, the index, and each column's place in its owner's packed pages."""

    regions: tuple[Region, ...]           # one per served rank
    region_index: tuple[int, ...]         # each one's index in the source's region list
    index: PackIndex
    slots: np.ndarray                     # [C] int32 (tables.packing.column_slots)
    pages_per_context: int

    @property
    def index_bytes(self) -> int:
        """Host bytes of the index this process holds."""
        return self.index.nbytes


@dataclass
class TableSpec:
    """One table layer as the engine serves it.

    `seen` (lossy mode): a packed bitmap [ceil(rows / 8)] uint8 over local rows
    (bit r % 8 of byte r // 8, little bit order); rows whose bit is clear are
    not read and come out as zeros. `reference` (checker): where to read the
    rows independently of the source; None lets the checker map the regions'
    files itself. `row_map` (a rank partition other than columns, tables.partition):
    the step's global row ids -> the stored rows `row_start`/`rows` and the
    regions index; begin_step maps the ids before its directory pass. `table_rows`: the whole layer's
    rows in that same space (all ranks; a partition's padding included), when known: an id outside them (other
    than the pad id) is a zero row counted in out_of_table, as the serving engines' own lookups give it; 0 (not
    known): such an id is another rank's row (owned_only) or an error.
    """

    layer: int
    row_start: int
    rows: int
    regions: tuple[Region, ...]           # one per rank, each with its global row_start and rows
    source: PageSource
    cache_share: float = 0.0
    seen: np.ndarray | None = None
    reference: object | None = None       # a slacktier.engine.checker.RowReader
    region_index: tuple[int, ...] = ()    # regions[i]'s index in the source's region list (default: i)
    row_map: RowMap | None = None         # global row id -> stored row; None: they are the same (columns)
    table_rows: int = 0                   # the whole layer's rows (all ranks), 0: not known
    packing: TablePacking | None = None   # context packing (tables.packing); None: rows come from row pages only
    geometry: LayerGeometry = field(init=False, repr=False)   # what the directory pass needs (cache room)

    def __post_init__(self) -> None:
        if self.rows <= 0 or self.row_start < 0:
            raise SlackTierError(ErrorKind.BAD_INPUT, f"table rows {self.rows} from {self.row_start}",
                                 fix="give the table a non-empty row range", layer=self.layer)
        if not 0.0 <= self.cache_share <= 1.0:
            raise SlackTierError(ErrorKind.BAD_INPUT, f"cache share {self.cache_share} outside 0..1",
                                 fix="give the layer a fraction of the cache", layer=self.layer)
        if not self.regions:
            raise SlackTierError(ErrorKind.MISSING, "table has no rank regions", layer=self.layer,
                                 fix="list one region per rank")
        index = self.region_index or tuple(range(len(self.regions)))
        if len(index) != len(self.regions):
            raise SlackTierError(ErrorKind.BAD_INPUT, f"{len(index)} region indices for {len(self.regions)} "
                                 "regions", layer=self.layer, fix="give one source index per region")
        order = sorted(range(len(self.regions)), key=lambda i: self.regions[i].row_start)
        at = self.row_start
        for i in order:
            r = self.regions[i]
            if r.rows <= 0:
                raise SlackTierError(ErrorKind.BAD_INPUT, f"rank region holds {r.rows} rows", layer=self.layer,
                                     rank=r.rank, fix="give each rank region its rows (rank_regions_for)")
            if r.row_start != at:
                raise SlackTierError(ErrorKind.MISSING, f"no region holds rows [{at}, {r.row_start})" if
                                     r.row_start > at else f"rank regions overlap at row {r.row_start}",
                                     layer=self.layer, rank=r.rank, fix="list every rank's region exactly once")
            at += r.rows
        if at != self.row_start + self.rows:
            raise SlackTierError(ErrorKind.MISSING, f"regions end at row {at}, table ends at "
                                 f"{self.row_start + self.rows}", layer=self.layer, rank=len(self.regions),
                                 fix="list every rank's region")
        self.regions = tuple(self.regions[i] for i in order)
        self.region_index = tuple(int(index[i]) for i in order)
        if self.seen is not None:
            seen = np.ascontiguousarray(self.seen, dtype=np.uint8)
            if seen.ndim != 1 or seen.shape[0] < (self.rows + 7) // 8:
                raise SlackTierError(ErrorKind.BAD_INPUT, f"seen bitmap has {seen.shape} bytes, need "
                                     f"{(self.rows + 7) // 8}", layer=self.layer, fix="use seen_bitmap(rows, ...)")
            self.seen = seen
        packed = None
        if self.packing is not None:   # per served rank (in row order): its packed region's source index, -1 none
            by_rank = {r.rank: i for r, i in zip(self.packing.regions, self.packing.region_index)}
            pk = self.packing
            packed = PackedGeometry(pk.index.keys, pk.index.ordinals,
                                    np.array([by_rank.get(r.rank, -1) for r in self.regions], dtype=np.int32),
                                    pk.slots, pk.pages_per_context)
        self.geometry = LayerGeometry(
            row_start=self.row_start, rows=self.rows,
            rank_starts=np.array([r.row_start - self.row_start for r in self.regions] + [self.rows], dtype=np.int64),
            rank_region=np.array(self.region_index, dtype=np.int32), seen=self.seen, table_end=int(self.table_rows),
            packed=packed)


def seen_bitmap(rows: int, seen_rows: np.ndarray) -> np.ndarray:
    """Packed bitmap [ceil(rows / 8)] uint8 with the bits of local `seen_rows` set: rows 0 and 9 -> [1, 2].

    `seen_rows` are integers (any signed or unsigned width, compared before any cast, so uint64 2**64-1 is
    out of range rather than -1); floats and bools are refused, never truncated into other rows."""
    seen_rows = np.asarray(seen_rows)
    if seen_rows.dtype.kind not in "iu" and seen_rows.size:
        raise SlackTierError(ErrorKind.BAD_INPUT, f"seen rows are {seen_rows.dtype}, want integer row ids",
                             fix="give local row ids as int64 (a bool mask: np.flatnonzero(mask))")
    if seen_rows.size and (seen_rows.min() < 0 or seen_rows.max() >= rows):
        raise SlackTierError(ErrorKind.BAD_INPUT, f"seen rows outside 0..{rows - 1} (from {seen_rows.min()} to "
                             f"{seen_rows.max()})", fix="give local rows of the table layer")
    seen_rows = seen_rows.astype(np.int64).reshape(-1)
    bits = np.zeros(rows, dtype=bool)
    bits[seen_rows] = True
    return np.packbits(bits, bitorder="little")


def rank_regions_for(layer: int, rows: int, regions: Sequence[Region], *,
                     column_bounds: tuple[int, ...] | None = None, row_start: int = 0) -> tuple[Region, ...]:
    """The given (layer's) regions, one per rank, with the global rows `shard_bounds` gives each rank."""
    ranks = len(regions)
    if ranks == 0:
        raise SlackTierError(ErrorKind.MISSING, "no regions for the table", layer=layer,
                             fix="stage the table or list its regions")
    by_rank = sorted(range(ranks), key=lambda i: regions[i].rank)
    if [regions[i].rank for i in by_rank] != list(range(ranks)):
        present = sorted(r.rank for r in regions)
        missing = sorted(set(range(max(present) + 1)) - set(present))
        raise SlackTierError(ErrorKind.MISSING, f"regions for ranks {present}, missing {missing or 'none'}",
                             layer=layer, rank=missing[0] if missing else None,
                             fix="list one region per rank, ranks 0..R-1")
    out = []
    for i in by_rank:
        spec = regions[i]
        lo, hi = shard_bounds(rows, column_bounds, spec.rank, ranks)
        if hi - lo <= 0:
            raise SlackTierError(ErrorKind.BAD_INPUT, "rank owns no rows", layer=layer, rank=spec.rank,
                                 fix="use fewer ranks than rows")
        if spec.pages < pages_for_rows(hi - lo):
            raise SlackTierError(ErrorKind.MISSING, f"region has {spec.pages} pages, shard needs "
                                 f"{pages_for_rows(hi - lo)}", layer=layer, rank=spec.rank,
                                 fix="stage the region with all of the shard's rows")
        out.append(dataclasses.replace(spec, row_start=row_start + lo, rows=hi - lo))
    return tuple(out)
