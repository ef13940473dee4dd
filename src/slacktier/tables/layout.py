"""The page layout shared by every tier: 264-byte rows, 15 to a 4 KiB page.

A table layer is split over tensor-parallel ranks; each (layer, rank) shard is
stored as its own region of whole pages. Row r of a shard lives at page r // 15,
byte (r % 15) * 264 inside that page; the last 136 bytes of a page are zero.

Worked example: row 31 of a shard -> page 2, byte 264 (31 = 2 * 15 + 1).
"""

from __future__ import annotations

import numpy as np

from slacktier.errors import ErrorKind, SlackTierError

ROW_VALUES = 256            # fp8 e4m3 values per row
SCALE_BLOCK = 32            # values per e8m0 scale
ROW_SCALES = ROW_VALUES // SCALE_BLOCK  # 8
ROW_BYTES = ROW_VALUES + ROW_SCALES     # 264: 256 B of fp8 then 8 B of e8m0
PAGE_BYTES = 4096
ROWS_PER_PAGE = PAGE_BYTES // ROW_BYTES  # 15 (15 * 264 = 3960 B used)
PAGE_USED_BYTES = ROWS_PER_PAGE * ROW_BYTES  # 3960; the last 136 bytes of a page are zero
# The same geometry in 8-byte words, for the compiled page fillers (rows are 8-byte aligned in a page).
PAGE_WORDS = PAGE_BYTES // 8                 # 512
ROW_WORDS = ROW_BYTES // 8                   # 33
PAGE_USED_WORDS = ROWS_PER_PAGE * ROW_WORDS  # 495: words 495..511 of a page are zero


def binary_bytes(n_bytes: float) -> str:
    """A byte count in binary units, the one family every verb prints memory and sizes in (KiB, MiB, GiB, TiB:
    powers of 1024, as `free -h`, PyTorch's and the page geometry's 4 KiB): 4_000_000_000 -> "3.73 GiB",
    78_643_200 -> "75.0 MiB", 4096 -> "4.0 KiB", 100 -> "100 B"."""
    if abs(n_bytes) < 1024:
        return f"{n_bytes:.0f} B"
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n_bytes) >= scale:
            return f"{n_bytes / scale:.2f} {unit}" if unit in ("TiB", "GiB") else f"{n_bytes / scale:.1f} {unit}"
    raise AssertionError("unreachable")


def pages_for_rows(rows: int) -> int:
    """Pages a region of `rows` rows occupies: 16 rows -> 2 pages."""
    return (rows + ROWS_PER_PAGE - 1) // ROWS_PER_PAGE


def page_of_row(row: int) -> int:
    """Page holding shard row `row`: row 31 -> page 2."""
    return row // ROWS_PER_PAGE


def offset_in_page(row: int) -> int:
    """Byte offset of shard row `row` inside its page: row 31 -> 264."""
    return (row % ROWS_PER_PAGE) * ROW_BYTES


def shard_bounds(rows: int, column_bounds: tuple[int, ...] | None, rank: int, ranks: int) -> tuple[int, int]:
    """Global rows [start, end) owned by `rank` of `ranks`.

    On hash-column boundaries when the column count divides by the rank count (a
    rank owns whole per-head subtables), else the equal-row split. This is the
    sharding SGLang's Engram embedding uses, so a rank's region holds the same
    rows as that rank's host table. Example: 24 columns over 4 ranks -> rank 1
    owns columns 6..11.
    """
    if not 0 <= rank < ranks:
        raise SlackTierError(ErrorKind.BAD_INPUT, f"rank {rank} outside 0..{ranks - 1}",
                             fix="pass a rank below the rank count")
    if column_bounds is not None:
        if column_bounds[-1] != rows:
            raise SlackTierError(ErrorKind.BAD_INPUT,
                                 f"column bounds end at {column_bounds[-1]} but the table has {rows} rows",
                                 fix="use the layout's own column bounds")
        cols = len(column_bounds) - 1
        if cols % ranks == 0:
            per = cols // ranks
            return column_bounds[rank * per], column_bounds[(rank + 1) * per]
    return rows * rank // ranks, rows * (rank + 1) // ranks


def pack_rows_into_pages(raw_rows: np.ndarray) -> np.ndarray:
    """raw_rows [N, 264] uint8 -> pages [ceil(N/15), 4096] uint8, zero-padded."""
    if raw_rows.ndim != 2 or raw_rows.shape[1] != ROW_BYTES or raw_rows.dtype != np.uint8:
        raise SlackTierError(ErrorKind.BAD_INPUT, f"rows must be [N, {ROW_BYTES}] uint8, got "
                             f"{raw_rows.shape} {raw_rows.dtype}", fix="encode rows with slacktier.tables.codec")
    n = raw_rows.shape[0]
    npages = pages_for_rows(n)
    body = np.zeros((npages * ROWS_PER_PAGE, ROW_BYTES), dtype=np.uint8)
    body[:n] = raw_rows
    pages = np.zeros((npages, PAGE_BYTES), dtype=np.uint8)
    # Assign through the 2-D slice: reshaping the strided slice would copy it.
    pages[:, :PAGE_USED_BYTES] = body.reshape(npages, PAGE_USED_BYTES)
    return pages


def rows_from_pages(pages: np.ndarray, rows: int) -> np.ndarray:
    """pages [P, 4096] uint8 -> the first `rows` rows [rows, 264] uint8 (a copy: pages are strided)."""
    npages = pages.shape[0]
    body = pages[:, :PAGE_USED_BYTES].reshape(npages * ROWS_PER_PAGE, ROW_BYTES)
    return body[:rows]
