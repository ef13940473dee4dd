"""What the step engine serves: per-layer table specs (rows, rank regions, source, cache share).

A table layer's rows [row_start, row_start + rows) are split over R ranks,
each rank's shard stored as one region of a page source. Row ids in a step are
the layer's table rows (what the hasher returns); a row maps to its rank by the
shard bounds, then to a page and byte inside that rank's region.

Worked example: 1,000 rows over 2 ranks (shards [0, 500) and [500, 1000)):
row 531 -> rank 1, shard row 31 -> page 2 of rank 1's region, byte 264.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from slacktier.errors import ErrorKind, SlackTierError
from slacktier.store.base import PageSource, RegionSpec
from slacktier.tables.layout import pages_for_rows, shard_bounds


@dataclass(frozen=True)
class RankRegion:
    """One rank's shard of a table layer: global rows [row_start, row_start + rows) in source region `region`."""

    rank: int
    row_start: int
    rows: int
    region: int   # index into the source's region list

    def __post_init__(self) -> None:
        if self.rows <= 0 or self.row_start < 0 or self.region < 0:
            raise SlackTierError(ErrorKind.BAD_INPUT, f"rank shard rows {self.rows}, start {self.row_start}, "
                                 f"region {self.region}", fix="give each rank a non-empty shard and a region index",
                                 rank=self.rank)


@dataclass
class TableSpec:
    """One table layer as the engine serves it.

    `seen` (lossy mode): a packed bitmap [ceil(rows / 8)] uint8 over local rows
    (bit r % 8 of byte r // 8, little bit order); rows whose bit is clear are
    not read and come out as zeros. `reference` (checker): where to read the
    rows independently of the source; None lets the checker map the regions'
    files itself.
    """

    layer: int
    row_start: int
    rows: int
    ranks: tuple[RankRegion, ...]
    source: PageSource
    cache_share: float = 0.0
    seen: np.ndarray | None = None
    reference: object | None = None   # a slacktier.engine.checker.RowReader
    regions: tuple[RegionSpec, ...] = ()   # the RegionSpecs of `ranks`, for the checker and error messages
    rank_starts: np.ndarray = field(init=False, repr=False)   # [R + 1] int64 local-row bounds
    rank_region: np.ndarray = field(init=False, repr=False)   # [R] int32

    def __post_init__(self) -> None:
        if self.rows <= 0 or self.row_start < 0:
            raise SlackTierError(ErrorKind.BAD_INPUT, f"table rows {self.rows} from {self.row_start}",
                                 fix="give the table a non-empty row range", layer=self.layer)
        if not 0.0 <= self.cache_share <= 1.0:
            raise SlackTierError(ErrorKind.BAD_INPUT, f"cache share {self.cache_share} outside 0..1",
                                 fix="give the layer a fraction of the cache", layer=self.layer)
        ranks = tuple(sorted(self.ranks, key=lambda r: r.row_start))
        if not ranks:
            raise SlackTierError(ErrorKind.MISSING, "table has no rank regions", layer=self.layer,
                                 fix="list one region per rank")
        at = self.row_start
        for r in ranks:
            if r.row_start != at:
                raise SlackTierError(ErrorKind.MISSING, f"no region holds rows [{at}, {r.row_start})" if
                                     r.row_start > at else f"rank regions overlap at row {r.row_start}",
                                     layer=self.layer, rank=r.rank, fix="list every rank's region exactly once")
            at += r.rows
        if at != self.row_start + self.rows:
            raise SlackTierError(ErrorKind.MISSING, f"regions end at row {at}, table ends at "
                                 f"{self.row_start + self.rows}", layer=self.layer, rank=len(ranks),
                                 fix="list every rank's region")
        self.ranks = ranks
        self.rank_starts = np.array([r.row_start - self.row_start for r in ranks] + [self.rows], dtype=np.int64)
        self.rank_region = np.array([r.region for r in ranks], dtype=np.int32)
        if self.seen is not None:
            seen = np.ascontiguousarray(self.seen, dtype=np.uint8)
            if seen.ndim != 1 or seen.shape[0] < (self.rows + 7) // 8:
                raise SlackTierError(ErrorKind.BAD_INPUT, f"seen bitmap has {seen.shape} bytes, need "
                                     f"{(self.rows + 7) // 8}", layer=self.layer, fix="use seen_bitmap(rows, ...)")
            self.seen = seen

    def rank_of(self, rank_index: int) -> int:
        """Rank id of the `rank_index`-th shard (shards sorted by row)."""
        return self.ranks[rank_index].rank


def seen_bitmap(rows: int, seen_rows: np.ndarray) -> np.ndarray:
    """Packed bitmap [ceil(rows / 8)] uint8 with the bits of local `seen_rows` set: rows 0 and 9 -> [1, 2]."""
    seen_rows = np.asarray(seen_rows, dtype=np.int64)
    if seen_rows.size and (seen_rows.min() < 0 or seen_rows.max() >= rows):
        raise SlackTierError(ErrorKind.BAD_INPUT, f"seen rows outside 0..{rows - 1}",
                             fix="give local rows of the table layer")
    bits = np.zeros(rows, dtype=bool)
    bits[seen_rows] = True
    return np.packbits(bits, bitorder="little")


def rank_regions_for(layer: int, rows: int, regions: Sequence[RegionSpec], *,
                     column_bounds: tuple[int, ...] | None = None, row_start: int = 0,
                     region_index: Sequence[int] | None = None) -> tuple[RankRegion, ...]:
    """Shards of a table of `rows` rows over the given (layer's) regions, one per rank, by `shard_bounds`.

    region_index[i] is regions[i]'s index in its source (default: i).
    """
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
        out.append(RankRegion(rank=spec.rank, row_start=row_start + lo, rows=hi - lo,
                              region=int(region_index[i]) if region_index is not None else i))
    return tuple(out)
