"""The two region types: where a staged shard was written, and where a source reads it at run time.

A table layer's rows are split over tensor-parallel ranks; each rank's shard
is one region of whole 4 KiB pages (row r of the shard at page r // 15, byte
(r % 15) * 264).

- `StagedRegion` is the manifest's record: the target it was written to, its
  byte offset, global rows, and where its pages' checksums start in the
  manifest's checksum file.
- `Region` is what a page source reads and what the engine maps row ids onto:
  a path (a file or block device for disk, a key prefix for Redis), an offset,
  pages, the device it maps to, and the global rows it holds.

Worked example: rank 1 of a 1,000-row layer over 2 ranks holds rows [500, 1000):
row 531 -> shard row 31 -> page 2 of rank 1's region, byte 264.
"""

from __future__ import annotations

from dataclasses import dataclass

from slacktier.errors import ErrorKind, SlackTierError
from slacktier.tables.layout import PAGE_BYTES, pages_for_rows


@dataclass(frozen=True)
class Region:
    """Where one (layer, rank) shard is read from at run time: global rows [row_start, row_start + rows).

    `path` is a file or raw block device (disk), a key prefix (Redis) or a name
    (DRAM); `offset_bytes` is 4 KiB aligned; `device` is the index of the disk
    or device the region maps to (ranks map round-robin). `rows` 0 means the
    region's row range is not known (a bare page store, as in store tests).
    `packed`: the (layer, rank)'s packed region of context packing
    (tables.packing), pages of packed contexts rather than a row range (rows 0),
    beside the row region of the same (layer, rank) in one source.
    """

    layer: int
    rank: int
    path: str
    offset_bytes: int
    pages: int
    device: int = 0
    row_start: int = 0
    rows: int = 0
    packed: bool = False

    def __post_init__(self) -> None:
        if self.offset_bytes % PAGE_BYTES or self.offset_bytes < 0:
            raise SlackTierError(ErrorKind.BAD_INPUT, f"region offset {self.offset_bytes} is not 4 KiB aligned",
                                 fix="stage regions on page boundaries", layer=self.layer, rank=self.rank)
        if self.pages <= 0 or self.device < 0 or self.rank < 0 or self.row_start < 0 or self.rows < 0:
            raise SlackTierError(ErrorKind.BAD_INPUT, f"region with {self.pages} pages, device {self.device}, "
                                 f"rows {self.rows} from {self.row_start}", layer=self.layer, rank=self.rank,
                                 fix="give a region at least one page and non-negative indices")
        if self.packed and (self.rows or self.row_start):
            raise SlackTierError(ErrorKind.BAD_INPUT, f"a packed region with rows {self.rows} from {self.row_start}",
                                 layer=self.layer, rank=self.rank, fix="a packed region holds contexts: rows 0")
        if self.rows and pages_for_rows(self.rows) > self.pages:
            raise SlackTierError(ErrorKind.BAD_INPUT, f"{self.rows} rows do not fit {self.pages} pages",
                                 layer=self.layer, rank=self.rank, fix="stage the region with all of its rows")

    @property
    def nbytes(self) -> int:
        """Bytes of the region's pages."""
        return self.pages * PAGE_BYTES


@dataclass(frozen=True)
class StagedRegion:
    """One (layer, rank) shard as the manifest records it: global rows [row_start, row_start + rows)."""

    layer: int
    rank: int
    device: int            # index into the manifest's targets
    path: str              # the target file or block device
    offset_bytes: int      # 4 KiB aligned, past the target's header page
    pages: int
    row_start: int
    rows: int
    crc_first_page: int    # index of this region's first page in the checksum file

    @property
    def nbytes(self) -> int:
        """Bytes of the region's pages."""
        return self.pages * PAGE_BYTES

    def runtime(self, path: str | None = None) -> Region:
        """The region a source reads: the staged one, at `path` when given (a moved target, a key prefix)."""
        return Region(layer=self.layer, rank=self.rank, path=self.path if path is None else path,
                      offset_bytes=self.offset_bytes, pages=self.pages, device=self.device,
                      row_start=self.row_start, rows=self.rows)
