"""The planner's value types: a table to place (`TableDemand`), and the answer (`Plan` of `TablePlan`s)."""

from __future__ import annotations

import math

from dataclasses import dataclass

from slacktier.errors import ErrorKind, SlackTierError


@dataclass(frozen=True)
class TableDemand:
    """One table to place: the layer that reads it, its rows (this rank's shard), its manifest, its window.

    `in_memory_bytes`: bytes of its staged files that sit in host memory (a target on tmpfs or a RAM disk,
    tables.memfs); they count as host memory on every tier, since the files take DRAM whichever tier reads them.
    """

    layer: int
    rows: int
    manifest: str
    window_ms: float
    in_memory_bytes: int = 0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.window_ms) and 0 <= self.window_ms <= 1e6) or not 0 <= self.rows <= 2**62:
            raise SlackTierError(ErrorKind.BAD_INPUT, f"rows {self.rows}, window {self.window_ms} ms",
                                 fix="rows and windows are finite and >= 0", layer=self.layer)
        if not 0 <= self.in_memory_bytes <= 2**62:
            raise SlackTierError(ErrorKind.BAD_INPUT, f"in_memory_bytes {self.in_memory_bytes}",
                                 fix="give the staged bytes held in host memory, >= 0", layer=self.layer)


@dataclass(frozen=True)
class TablePlan:
    """Where one table goes and what the model predicts for it."""

    layer: int
    manifest: str
    source: str            # tier name
    order: int             # window order, 0 = shortest window (submitted first)
    cache_share: float     # f_l
    cache_rows: float      # f_l * C
    window_ms: float
    pages_per_step: float  # P_l(f_l * C)
    read_ms: float         # T_l
    stall_ms: float        # d_l
    host_bytes: int


@dataclass(frozen=True)
class Plan:
    """A placement with its predicted slowdown and host memory."""

    tables: tuple[TablePlan, ...]  # window order
    cache_rows: int
    target_ms: float
    kappa_ms: float
    resolve_ms: float
    slowdown_ms: float
    host_bytes: int
    split_cost_ms: float
    assignments_tried: int
    assignments_feasible: int
