"""The bit-exact checker: the reference DRAM gather beside ours, on every lookup.

The reference reads each looked-up row straight from where the table lives
(the region files, memory-mapped read-only with ordinary page-cache I/O; or
host arrays given by the caller), never through the source, the page pool or
the cache, and dequantizes it with `codec.reference_dequant` (torch). A row
mismatches when any of its 256 bf16 values differs in bits, except that two
NaNs count as equal (the codec's contract: torch itself writes different NaN
bits on different CPU paths).

Worked example: lookup of row 531 of a two-rank table (ranks [0, 500), [500, 1000))
-> rank 1's region file, page 2, bytes 264..527, dequantized by torch.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Sequence
from typing import Protocol

import numpy as np
import torch

from slacktier.errors import ErrorKind, SlackTierError
from slacktier.tables.regions import Region
from slacktier.tables.codec import reference_dequant, split_raw
from slacktier.tables.layout import PAGE_BYTES, ROW_BYTES, ROWS_PER_PAGE


class RowReader(Protocol):
    """Raw rows of one table layer, read independently of the engine."""

    def read(self, local_rows: np.ndarray) -> np.ndarray:
        """local_rows [n] int64 -> raw rows [n, 264] uint8."""


class ArrayRowReader:
    """Rows held in a host array [rows, 264] uint8 (a DRAM table as the host-table gather sees it)."""

    def __init__(self, raw_rows: np.ndarray) -> None:
        if raw_rows.ndim != 2 or raw_rows.shape[1] != ROW_BYTES or raw_rows.dtype != np.uint8:
            raise SlackTierError(ErrorKind.BAD_INPUT, f"reference rows are {raw_rows.shape} {raw_rows.dtype}",
                                 fix=f"pass [rows, {ROW_BYTES}] uint8")
        self.raw_rows = raw_rows

    def read(self, local_rows: np.ndarray) -> np.ndarray:
        """local_rows [n] -> [n, 264] uint8."""
        return self.raw_rows[local_rows]


class FileRowReader:
    """Rows of a table's rank regions, memory-mapped read-only from their files (buffered, no O_DIRECT)."""

    def __init__(self, layer: int, shard_starts: Sequence[int], shard_rows: Sequence[int],
                 regions: Sequence[Region]) -> None:
        self.layer = layer
        self.starts = np.asarray(shard_starts, dtype=np.int64)   # [R] local row of each shard's row 0
        self._shards: list[np.ndarray] = []
        self._maps: list[mmap.mmap] = []
        for spec, rows in zip(regions, shard_rows):
            try:
                fd = os.open(spec.path, os.O_RDONLY | os.O_CLOEXEC)
            except OSError as exc:
                raise SlackTierError(ErrorKind.MISSING, f"checker cannot open {spec.path}: {exc.strerror}",
                                     layer=spec.layer, rank=spec.rank,
                                     fix="give the checker the table's files or a host copy") from exc
            try:
                mm = mmap.mmap(fd, spec.pages * PAGE_BYTES, prot=mmap.PROT_READ, offset=spec.offset_bytes)
            except (OSError, ValueError) as exc:
                raise SlackTierError(ErrorKind.MISSING, f"checker cannot map {spec.path}: {exc}",
                                     layer=spec.layer, rank=spec.rank,
                                     fix="stage the whole region before checking") from exc
            finally:
                os.close(fd)
            self._maps.append(mm)
            pages = np.frombuffer(mm, dtype=np.uint8).reshape(spec.pages, PAGE_BYTES)
            # [pages, 15, 264] view (layout.rows_from_pages reshapes a strided slice, which copies).
            self._shards.append(pages[:, :ROWS_PER_PAGE * ROW_BYTES].reshape(spec.pages, ROWS_PER_PAGE, ROW_BYTES))

    def read(self, local_rows: np.ndarray) -> np.ndarray:
        """local_rows [n] -> [n, 264] uint8."""
        out = np.empty((local_rows.shape[0], ROW_BYTES), dtype=np.uint8)
        which = np.searchsorted(self.starts, local_rows, side="right") - 1
        for k, shard in enumerate(self._shards):
            sel = np.flatnonzero(which == k)
            if sel.size:
                shard_rows = local_rows[sel] - self.starts[k]
                out[sel] = shard[shard_rows // ROWS_PER_PAGE, shard_rows % ROWS_PER_PAGE]
        return out


def reference_gather(raw_rows: np.ndarray) -> torch.Tensor:
    """The reference gather: raw rows [n, 264] uint8 -> bf16 [n, 256] by `codec.reference_dequant`."""
    weight, scale = split_raw(torch.from_numpy(np.ascontiguousarray(raw_rows)))
    return reference_dequant(weight, scale)


def mismatching_rows(ours: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Bool [n]: rows of bf16 [n, 256] whose bits differ somewhere (NaN equals NaN)."""
    a = ours.detach().to("cpu").view(torch.int16)
    b = ref.view(torch.int16)
    if torch.equal(a, b):
        return torch.zeros(a.shape[0], dtype=torch.bool)
    differ = a != b
    if bool(differ.any()):
        differ &= ~(torch.isnan(ours.detach().to("cpu")) & torch.isnan(ref))
    return differ.any(dim=1)
