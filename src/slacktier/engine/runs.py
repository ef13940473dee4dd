"""A served layer's state: what configuration builds for it (engine.configure) and what a step fills in (engine.step).

Worked example: layer 14 at axis 1 of steps of up to 64 tokens -> LayerRun(spec, axis=1, scratch of 64 * 24
lookups per array); after begin_step its `res` holds the directory pass's counts, after gather `gathered`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from slacktier.cache import PassResult, PassScratch
from slacktier.engine.counters import LayerCounters
from slacktier.engine.tables import TableSpec

NO_PASS = PassResult(0, 0, 0, 0, 0, 0, 0, 0, -1)   # a layer's result before its first pass


@dataclass
class LayerRun:
    """A layer's state within the engine (what `prepare` builds) and within the current step (what it fills)."""

    spec: TableSpec
    axis: int                      # index in ids' layer axis
    scratch: PassScratch           # the compiled pass's outputs, [T * 24] per array
    ids: np.ndarray | None = None  # [T, 24] int64 this step's row ids, copied only when checking
    res: PassResult = NO_PASS      # this step's directory pass (valid once `resolved`)
    clock: tuple[int, int, int] = (0, 0, 0)   # perf_counter_ns before the pass, after it, after submitting
    resolved: bool = False
    gathered: bool = False
    counters: LayerCounters = field(default_factory=LayerCounters)   # this step's, filled at end_step
    reader: object | None = None   # the checker's reference rows (hooks.row_reader), kept across changes
