"""The bit-exact checker: the reference DRAM gather beside ours, on every lookup.

The reference reads each looked-up row from what the table is meant to hold:
regenerated from the manifest's own source (a synthetic seed, the
checkpoint) for an engine built from a control file, or from host arrays or
the region files (plain pread) given by the caller; never through the source,
the page pool or the cache, and dequantizes it with `codec.reference_dequant` (torch). A row
mismatches when any of its 256 bf16 values differs in bits, except that two
NaNs count as equal (the codec's contract: torch itself writes different NaN
bits on different CPU paths).

Worked example: lookup of row 531 of a two-rank table (ranks [0, 500), [500, 1000))
-> rank 1's region file, page 2, bytes 264..527, dequantized by torch.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from slacktier.errors import ErrorKind, SlackTierError
from slacktier.tables.checkpoint_source import CheckpointSource
from slacktier.tables.codec import reference_dequant, split_raw
from slacktier.tables.layout import PAGE_BYTES, ROW_BYTES, ROWS_PER_PAGE
from slacktier.tables.manifest import Manifest
from slacktier.tables.partition import RowMap
from slacktier.tables.regions import Region
from slacktier.tables.synthetic_source import SyntheticSource


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
    """Rows of a table's rank regions, read with plain pread from their files (buffered, no O_DIRECT).

    pread, not a memory map: a file truncated under a running engine then gives a
    short read, which is an error naming layer, rank and row, where a mapped page
    would kill the process with SIGBUS.
    """

    def __init__(self, layer: int, shard_starts: Sequence[int], shard_rows: Sequence[int],
                 regions: Sequence[Region]) -> None:
        self.layer = layer
        self.starts = np.asarray(shard_starts, dtype=np.int64)   # [R] local row of each shard's row 0
        self.regions = tuple(regions)
        self._fds: list[int] = []
        for spec in self.regions:
            try:
                self._fds.append(os.open(spec.path, os.O_RDONLY | os.O_CLOEXEC))
            except OSError as exc:
                self.close()
                raise SlackTierError(ErrorKind.MISSING, f"checker cannot open {spec.path}: {exc.strerror}",
                                     layer=spec.layer, rank=spec.rank,
                                     fix="give the checker the table's files or a host copy") from exc

    def read(self, local_rows: np.ndarray) -> np.ndarray:
        """local_rows [n] -> [n, 264] uint8 (row r of a shard: page r // 15, byte (r % 15) * 264)."""
        out = np.empty((local_rows.shape[0], ROW_BYTES), dtype=np.uint8)
        which = np.searchsorted(self.starts, local_rows, side="right") - 1
        for i, (k, row) in enumerate(zip(which.tolist(), local_rows.tolist())):
            spec = self.regions[k]
            r = row - int(self.starts[k])
            at = spec.offset_bytes + (r // ROWS_PER_PAGE) * PAGE_BYTES + (r % ROWS_PER_PAGE) * ROW_BYTES
            got = os.pread(self._fds[k], ROW_BYTES, at)
            if len(got) != ROW_BYTES:
                raise SlackTierError(ErrorKind.IO, f"checker: short read of row {r} ({len(got)} of {ROW_BYTES} "
                                     f"bytes): {spec.path} is shorter than its manifest says", layer=spec.layer,
                                     rank=spec.rank, page=r // ROWS_PER_PAGE, fix="stage the table again")
            out[i] = np.frombuffer(got, dtype=np.uint8)
        return out

    def close(self) -> None:
        """Close the region files."""
        for fd in self._fds:
            os.close(fd)
        self._fds.clear()

    def __del__(self) -> None:
        self.close()


class SourceRowReader:
    """Rows regenerated from the table's own source (the manifest's synthetic seed or checkpoint), not the medium.

    The checker then compares what the engine serves with what the table is
    meant to hold: corruption on the medium, or a medium that holds another
    table, shows up as mismatches instead of agreeing with itself. A synthetic
    source's digest is recomputed and compared with the manifest's; a
    checkpoint's tensors are checked for names and shapes (its sha256 would
    mean reading the whole checkpoint, so it is not recomputed here).
    """

    def __init__(self, manifest: Manifest, layer: int, row_start: int, row_map: RowMap | None = None) -> None:
        spec = manifest.source
        kind = spec.get("kind")
        if kind == "synthetic":
            self.source = SyntheticSource(manifest.layout, int(spec["seed"]))
            if self.source.digest != manifest.source_digest:
                raise SlackTierError(ErrorKind.CHECKSUM, f"synthetic source of {manifest.path} gives digest "
                                     f"{self.source.digest}, the manifest says {manifest.source_digest}",
                                     layer=layer, fix="stage the table again with this version")
        elif kind == "checkpoint":
            files = [Path(f) for f in spec.get("files", [])]
            missing = [str(f) for f in files if not f.is_file()]
            if not files or missing:
                raise SlackTierError(ErrorKind.MISSING, f"the checker reads the checkpoint {manifest.path} was "
                                     f"staged from; missing: {', '.join(missing) or 'no files recorded'}",
                                     layer=layer, fix="restore the checkpoint, or turn check off")
            self.source = CheckpointSource([str(f) for f in files], layers=[layer])
        else:
            raise SlackTierError(ErrorKind.BAD_INPUT, f"manifest {manifest.path} has a source of kind {kind!r}",
                                 layer=layer, fix="stage the table again")
        self.layer = layer
        self.row_start = int(row_start)
        self.row_map = row_map   # local rows are stored rows of a partition (tables.partition): to global ids

    def read(self, local_rows: np.ndarray) -> np.ndarray:
        """local_rows [n] -> [n, 264] uint8, from the source."""
        rows = np.asarray(local_rows, dtype=np.int64) + self.row_start
        return self.source.rows(self.layer, rows if self.row_map is None else self.row_map.to_global(rows))


def reference_gather(raw_rows: np.ndarray, convention: str = "torch") -> torch.Tensor:
    """The reference gather: raw rows [n, 264] uint8 -> bf16 [n, 256] by `codec.reference_dequant` (in the
    dequant `convention` the engine serves)."""
    weight, scale = split_raw(torch.from_numpy(np.ascontiguousarray(raw_rows)))
    return reference_dequant(weight, scale, convention)


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
