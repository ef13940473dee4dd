"""Where an Engram/PLE layer's rows come from during a step: the `RowProvider` interface.

A provider sees every lookup of a step at once (`begin_step`, when the step
starts), hands each lookup layer its dequantized rows when the model reaches it
(`rows`), and releases the step (`end_step`). The stock provider is the DRAM
table with the reference gather; the SlackTier provider wraps the step engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import numpy as np
import torch

from slacktier.errors import ErrorKind, SlackTierError
from slacktier.tables.codec import reference_dequant, split_raw, synthetic_rows
from slacktier.tables.layout import ROW_BYTES


@runtime_checkable
class RowProvider(Protocol):
    """Rows of every lookup layer for one step at a time."""

    layer_ids: tuple[int, ...]

    def begin_step(self, ids: torch.Tensor) -> None:
        """ids: [T, L, C] int64 row ids, L in `layer_ids` order; issued when the step starts."""

    def rows(self, layer_id: int) -> torch.Tensor:
        """bf16 [T, C, 256] rows of `layer_id` for the step begun last."""

    def end_step(self) -> None:
        """Release the step's buffers and pins."""


def _check_ids(ids: torch.Tensor, layers: int) -> None:
    if ids.dtype != torch.int64 or ids.ndim != 3 or ids.shape[1] != layers:
        raise SlackTierError(ErrorKind.BAD_INPUT, f"row ids must be [T, {layers}, C] int64, got "
                             f"{tuple(ids.shape)} {ids.dtype}", fix="hash tokens with the model's layout")


@dataclass
class DramTable:
    """One layer's table in host DRAM as the checkpoint stores it: fp8 weight [N, 256] + e8m0 scale [N, 8]."""

    weight: torch.Tensor  # [N, 256] float8_e4m3fn
    scale: torch.Tensor   # [N, 8] float8_e8m0fnu

    @classmethod
    def from_raw(cls, raw: np.ndarray | torch.Tensor) -> "DramTable":
        """raw [N, 264] uint8 rows -> table (views, no copy)."""
        raw_t = torch.from_numpy(raw) if isinstance(raw, np.ndarray) else raw
        weight, scale = split_raw(raw_t)
        return cls(weight=weight, scale=scale)

    @classmethod
    def synthetic(cls, seed: int, rows: int, chunk_rows: int = 1 << 18) -> "DramTable":
        """The synthetic table `tables.codec.synthetic_rows(seed, 0, rows)`, built in chunks."""
        raw = np.empty((rows, ROW_BYTES), dtype=np.uint8)
        for start in range(0, rows, chunk_rows):
            n = min(chunk_rows, rows - start)
            raw[start:start + n] = synthetic_rows(seed, start, n)
        return cls.from_raw(raw)

    @classmethod
    def from_source(cls, source, layer: int, rows: int, chunk_rows: int = 1 << 18) -> "DramTable":
        """Rows [0, rows) of `layer` from a staging RowSource (tables.stage: SyntheticSource, CheckpointSource)."""
        raw = np.empty((rows, ROW_BYTES), dtype=np.uint8)
        for start in range(0, rows, chunk_rows):
            n = min(chunk_rows, rows - start)
            raw[start:start + n] = source.rows(layer, np.arange(start, start + n, dtype=np.int64))
        return cls.from_raw(raw)

    @property
    def rows(self) -> int:
        return int(self.weight.shape[0])

    @property
    def nbytes(self) -> int:
        return self.rows * ROW_BYTES

    def gather(self, ids: torch.Tensor) -> torch.Tensor:
        """The reference gather: ids [...] int64 -> bf16 [..., 256]."""
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.rows):
            raise SlackTierError(ErrorKind.BAD_INPUT, f"row id outside 0..{self.rows - 1}",
                                 fix="hash with the layout the table was staged from")
        return reference_dequant(self.weight[ids], self.scale[ids])


@dataclass
class DramRowProvider:
    """The stock path: every layer's table in DRAM, gathered with the reference dequant at the layer."""

    tables: dict[int, DramTable]
    layer_ids: tuple[int, ...]
    _ids: torch.Tensor | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        missing = [l for l in self.layer_ids if l not in self.tables]
        if missing:
            raise SlackTierError(ErrorKind.MISSING, f"no DRAM table for layers {missing}",
                                 fix="build one DramTable per lookup layer")
        self.layer_ids = tuple(self.layer_ids)

    def begin_step(self, ids: torch.Tensor) -> None:
        """Remember the step's ids: [T, L, C] int64."""
        _check_ids(ids, len(self.layer_ids))
        self._ids = ids

    def rows(self, layer_id: int) -> torch.Tensor:
        """bf16 [T, C, 256] by the reference gather."""
        if self._ids is None:
            raise SlackTierError(ErrorKind.BAD_INPUT, "rows() outside a step", fix="call begin_step first")
        return self.tables[layer_id].gather(self._ids[:, self.layer_ids.index(layer_id)])

    def end_step(self) -> None:
        """Forget the step's ids."""
        self._ids = None

    @property
    def host_bytes(self) -> int:
        return sum(t.nbytes for t in self.tables.values())


class EngineRowProvider:
    """SlackTier's path: a step engine (slacktier.engine.StepEngine or anything with its three calls)."""

    def __init__(self, engine, layer_ids: tuple[int, ...]) -> None:
        self.engine = engine
        self.layer_ids = tuple(layer_ids)
        self.last_counters = None

    def begin_step(self, ids: torch.Tensor) -> None:
        """Issue every lookup of the step: ids [T, L, C] int64."""
        _check_ids(ids, len(self.layer_ids))
        self.engine.begin_step(ids.numpy())

    def rows(self, layer_id: int) -> torch.Tensor:
        """Wait for `layer_id`'s reads only, then gather: bf16 [T, 24, 256]."""
        return self.engine.gather(layer_id)

    def end_step(self) -> None:
        """Release pins and publish the step's counters (kept in `last_counters`)."""
        self.last_counters = self.engine.end_step()
