"""Rank partitions: which hash columns (heads) of a table each tensor-parallel rank serves, and where they are stored.

A TP step waits for its slowest rank. SGLang and vLLM shard an Engram layer by
contiguous hash columns (`columns`): on V4.1 at TP4 rank 0 owns only 2-gram
heads and rank 3 only 4-gram heads, and 4-gram rows are far less cacheable, so
rank 3 reads several times rank 0's pages per step (BENCHMARKS.md, "Rank partitions", has every
rank's pages per step). `balanced` gives every rank the same number of heads of each
n-gram order: with 3 orders x 8 heads at TP4, rank k owns heads 2k and 2k + 1 of
every order. Any partition is served correctly by an engine whose ranks each
fill the rows they do not own with zeros and sum (SGLang's all-reduce); an
engine that all-gathers each rank's columns (vLLM) needs the gathered columns
put back in column order (`gathered_order`).

Storage. A rank's region holds its columns' rows one column span after another
(adjacent owned columns merge into one span), each span starting on a page
boundary; the regions of a layer, in rank order, make the layer's *stored*
row space, which the engine's directory and the regions' `row_start`/`rows`
index. Under `columns` the stored space is the global one (one span per rank,
no padding): manifests written before partitions existed are `columns`.
`RowMap` maps a global row id to its stored row (one piecewise shift).

Worked example: 24 columns of 100 rows, TP4, balanced, 8 heads per order ->
rank 0 owns columns (0, 1, 8, 9, 16, 17): spans [0, 200), [800, 1000),
[1600, 1800), stored at rows 0, 210 (200 rounded up to whole pages of 15) and
420 of its region; the region holds 620 stored rows. Global row 805 -> rank 0,
stored row 215, page 14 of rank 0's region.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
from numba import njit

from slacktier.errors import ErrorKind, SlackTierError
from slacktier.tables.layout import ROWS_PER_PAGE

PARTITIONS = ("columns", "balanced")
DEFAULT_PARTITION = "columns"


def _round_up_page(rows: int) -> int:
    return -(-rows // ROWS_PER_PAGE) * ROWS_PER_PAGE


def rank_columns(kind: str, n_columns: int, ranks: int, heads_per_order: int) -> tuple[tuple[int, ...], ...]:
    """The hash columns each rank owns under partition `kind` (columns in (order, head) order).

    columns: rank k owns [k C/R, (k+1) C/R). balanced: of every order's `heads_per_order` heads, rank k owns
    [k h/R, (k+1) h/R). Example: 24 columns, 8 heads per order, 4 ranks, balanced -> rank 1 owns 2, 3, 10,
    11, 18, 19.
    """
    if kind not in PARTITIONS:
        raise SlackTierError(ErrorKind.BAD_INPUT, f"unknown rank partition {kind!r}",
                             fix=f"choose one of {', '.join(PARTITIONS)}")
    if ranks < 1 or n_columns % ranks:
        raise SlackTierError(ErrorKind.BAD_INPUT, f"{ranks} ranks cannot own whole heads of {n_columns} hash "
                             "columns", fix=f"use a rank count that divides {n_columns}")
    if kind == "columns":
        per = n_columns // ranks
        return tuple(tuple(range(k * per, (k + 1) * per)) for k in range(ranks))
    if heads_per_order < 1 or n_columns % heads_per_order or heads_per_order % ranks:
        raise SlackTierError(ErrorKind.BAD_INPUT, f"the balanced partition needs every rank to own as many heads of "
                             f"each order: {heads_per_order} heads per order do not split over {ranks} ranks",
                             fix=f"use a rank count that divides {heads_per_order}, or --partition columns")
    per = heads_per_order // ranks
    orders = n_columns // heads_per_order
    return tuple(tuple(o * heads_per_order + k * per + h for o in range(orders) for h in range(per))
                 for k in range(ranks))


def columns_text(columns: Sequence[int]) -> str:
    """"0..5" for a run of columns, "0,1,8,9,16,17" otherwise."""
    cols = sorted(int(c) for c in columns)
    if cols == list(range(cols[0], cols[-1] + 1)):
        return f"{cols[0]}..{cols[-1]}"
    return ",".join(map(str, cols))


@dataclass(frozen=True)
class RankPartition:
    """A table's rank partition as the manifest records it: its kind and the columns of every rank."""

    kind: str
    heads_per_order: int
    columns: tuple[tuple[int, ...], ...]     # [ranks] ascending columns each rank owns

    @classmethod
    def make(cls, kind: str, n_columns: int, ranks: int, heads_per_order: int) -> RankPartition:
        """The partition `kind` of `n_columns` columns over `ranks` ranks."""
        return cls(kind, heads_per_order, rank_columns(kind, n_columns, ranks, heads_per_order))

    @property
    def ranks(self) -> int:
        """Ranks the columns are split over."""
        return len(self.columns)

    @property
    def n_columns(self) -> int:
        """Hash columns of the table."""
        return sum(len(c) for c in self.columns)

    def check(self, n_columns: int, ranks: int, where: str) -> None:
        """Refuse (BAD_INPUT) a partition that does not give every column to exactly one of `ranks` ranks, or
        whose columns are not its kind's rule."""
        fix = "restore the manifest staging wrote, or stage the table again (slacktier stage --partition)"
        if self.ranks != ranks:
            raise SlackTierError(ErrorKind.BAD_INPUT, f"{where}: the partition lists {self.ranks} ranks, the "
                                 f"table {ranks}", fix=fix)
        seen = sorted(c for cols in self.columns for c in cols)
        if seen != list(range(n_columns)):
            twice = sorted({c for c in seen if seen.count(c) > 1})
            missing = sorted(set(range(n_columns)) - set(seen))
            raise SlackTierError(ErrorKind.BAD_INPUT, f"{where}: the partition does not cover every hash column "
                                 f"exactly once (columns twice: {twice}, missing: {missing}, of 0..{n_columns - 1})",
                                 fix=fix)
        want = rank_columns(self.kind, n_columns, ranks, self.heads_per_order)
        if tuple(tuple(sorted(c)) for c in self.columns) != want:
            raise SlackTierError(ErrorKind.BAD_INPUT, f"{where}: the columns recorded per rank are not the "
                                 f"{self.kind!r} partition's {[list(c) for c in want]}", fix=fix)

    def owner(self) -> np.ndarray:
        """[C] int32: the rank owning each column."""
        own = np.empty(self.n_columns, dtype=np.int32)
        for k, cols in enumerate(self.columns):
            own[list(cols)] = k
        return own

    def gathered_order(self) -> np.ndarray:
        """[C] int64: where column c sits when each rank's columns (ascending) are concatenated in rank order,
        as an all-gather of per-rank outputs lays them out; `gathered[:, order]` puts them in column order.
        Columns: the identity. Balanced 24 / TP4: column 8 (rank 0's third) -> 2."""
        pos = np.empty(self.n_columns, dtype=np.int64)
        at = 0
        for cols in self.columns:
            for c in sorted(cols):
                pos[c] = at
                at += 1
        return pos

    def spans(self, bounds: Sequence[int], rank: int) -> list[tuple[int, int]]:
        """Global row spans [(start, end)] of `rank`'s columns, adjacent columns merged, in column order."""
        out: list[tuple[int, int]] = []
        for c in sorted(self.columns[rank]):
            lo, hi = int(bounds[c]), int(bounds[c + 1])
            if out and out[-1][1] == lo:
                out[-1] = (out[-1][0], hi)
            else:
                out.append((lo, hi))
        return out

    def to_json(self) -> dict[str, Any]:
        """The manifest's "partition" object."""
        return {"kind": self.kind, "heads_per_order": self.heads_per_order,
                "rank_columns": [list(c) for c in self.columns]}


@dataclass(frozen=True)
class StoredSpan:
    """Global rows [start, start + rows) of one rank, stored from row `stored_start` of the layer's stored space."""

    start: int
    rows: int
    stored_start: int


def stored_spans(part: RankPartition | None, bounds: Sequence[int] | None, layer_rows: int,
                 ranks: int) -> list[list[StoredSpan]]:
    """Per rank, its spans and where they are stored; regions follow one another in rank order.

    `part` None or "columns": one span per rank, stored where it lies (shard_bounds' rows, so the stored space is
    the global one). Otherwise every span starts on a page boundary of its rank's region (see the module docstring).
    """
    from slacktier.tables.layout import shard_bounds

    if part is None or part.kind == "columns":
        out = []
        for k in range(ranks):
            lo, hi = shard_bounds(layer_rows, tuple(bounds) if bounds is not None else None, k, ranks)
            out.append([StoredSpan(lo, hi - lo, lo)])
        return out
    if bounds is None:
        raise SlackTierError(ErrorKind.BAD_INPUT, f"the {part.kind!r} partition needs the table's hash-column bounds",
                             fix="stage from the model's hash layout (--engram v41, or a checkpoint)")
    out, at = [], 0
    for k in range(ranks):
        spans = []
        for lo, hi in part.spans(bounds, k):
            spans.append(StoredSpan(lo, hi - lo, at))
            at += _round_up_page(hi - lo)
        # the region's last span is not padded: the region ends with its last row
        at -= _round_up_page(spans[-1].rows) - spans[-1].rows
        out.append(spans)
    return out


def region_extent(spans: Sequence[StoredSpan]) -> tuple[int, int]:
    """(stored row_start, stored rows) of a region made of `spans` (padding between them included)."""
    return spans[0].stored_start, spans[-1].stored_start + spans[-1].rows - spans[0].stored_start


BUCKET_BITS = 12   # a RowMap's coarse index: 4096 buckets of row ids, each naming the span its first row is in


@njit(nogil=True, cache=True)
def _to_stored(ids, starts, shifts, first, bucket_shift, rows, stored_rows, out):
    """out[t, c] = ids[t, c] moved by its span's shift where it is in [0, rows); an id in [rows, stored_rows)
    (outside the table, but a stored row's number) -> stored_rows; other ids (pad, negative, past the stored
    space) copied: every id outside the table stays outside the stored space.

    ids, out: [T, C] int64, any strides (a layer's slice of the step's [T, L, C] ids). The span of g is found
    from its bucket's first span (first[g >> bucket_shift]) by a short forward scan: one compare where a bucket
    lies inside one span, as almost all do."""
    n_spans = starts.shape[0]
    for t in range(ids.shape[0]):
        for c in range(ids.shape[1]):
            g = ids[t, c]
            if g >= 0 and g < rows:
                k = first[g >> bucket_shift]
                while k + 1 < n_spans and starts[k + 1] <= g:
                    k += 1
                out[t, c] = g + shifts[k]
            elif g >= rows and g < stored_rows:
                out[t, c] = stored_rows
            else:
                out[t, c] = g


@dataclass(frozen=True)
class RowMap:
    """Global row id -> stored row of one layer under a partition whose stored space is not the global one.

    Worked example (the module docstring's): ids [805, -1, 2405] -> [215, -1, 2480] (a pad id is left as it
    is; 2405, past the 2,400 rows but a stored row's number, goes past the 2,480 stored rows instead).
    """

    rows: int                 # the layer's global rows
    starts: np.ndarray        # [S] int64 global start of each span, ascending
    shifts: np.ndarray        # [S] int64 stored_start - start
    stored_rows: int          # rows of the layer's stored space (padding included)
    bucket_shift: int = 0     # row id >> bucket_shift: its bucket (at most 2**BUCKET_BITS of them)
    first: np.ndarray = field(default_factory=lambda: np.zeros(1, dtype=np.int64))  # [B] span of each bucket's row 0

    def __post_init__(self) -> None:
        shift = max(0, int(self.rows - 1).bit_length() - BUCKET_BITS)
        lows = np.arange(((self.rows - 1) >> shift) + 1, dtype=np.int64) << shift
        object.__setattr__(self, "bucket_shift", shift)
        object.__setattr__(self, "first", np.searchsorted(self.starts, lows, side="right").astype(np.int64) - 1)

    @classmethod
    def of(cls, spans: Sequence[Sequence[StoredSpan]], rows: int) -> RowMap | None:
        """The map of a layer's stored spans (all ranks), or None where it is the identity (`columns`)."""
        flat = sorted((s for rank in spans for s in rank), key=lambda s: s.start)
        if all(s.stored_start == s.start for s in flat):
            return None
        at = 0
        for s in flat:   # exactly once: the spans tile [0, rows)
            if s.start != at:
                raise SlackTierError(ErrorKind.BAD_INPUT, f"rank spans leave rows [{at}, {s.start}) unserved"
                                     if s.start > at else f"rank spans overlap at row {s.start}",
                                     fix="stage the table again (slacktier stage --partition)")
            at += s.rows
        if at != rows:
            raise SlackTierError(ErrorKind.BAD_INPUT, f"rank spans end at row {at}, the layer has {rows}",
                                 fix="stage the table again (slacktier stage --partition)")
        stored = max(s.stored_start + s.rows for s in flat)
        return cls(rows, np.array([s.start for s in flat], dtype=np.int64),
                   np.array([s.stored_start - s.start for s in flat], dtype=np.int64), stored)

    def to_stored(self, ids: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """ids (int64, any shape; 2-D ones with any strides) -> stored rows, into `out` (same shape) when given;
        an id outside [0, rows) stays outside the stored rows [0, stored_rows) (never another row's place)."""
        ids = np.asarray(ids, dtype=np.int64)
        if out is None:
            out = np.empty(ids.shape, dtype=np.int64)
        if ids.ndim == 2:
            _to_stored(ids, self.starts, self.shifts, self.first, self.bucket_shift, self.rows, self.stored_rows, out)
        else:
            flat = np.ascontiguousarray(ids).reshape(1, -1)
            res = np.empty_like(flat)
            _to_stored(flat, self.starts, self.shifts, self.first, self.bucket_shift, self.rows, self.stored_rows, res)
            out[...] = res.reshape(ids.shape)
        return out

    def to_global(self, stored: np.ndarray) -> np.ndarray:
        """Stored rows -> global row ids (every stored row must be a real row, not padding)."""
        stored = np.asarray(stored, dtype=np.int64)
        sstart = self.starts + self.shifts
        order = np.argsort(sstart)
        k = order[np.searchsorted(sstart[order], stored, side="right") - 1]
        g = stored - self.shifts[k]
        ends = np.append(self.starts[1:], self.rows)
        if np.any(g >= ends[k]):
            raise SlackTierError(ErrorKind.BAD_INPUT, "a stored row in the padding between two column spans",
                                 fix="address only rows the table holds")
        return g
