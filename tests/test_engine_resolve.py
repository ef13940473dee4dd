"""The directory pass keeps each lookup's directory entry from its first (prefetch) load; these cases
make that entry stale within a step and check the rows that come out."""

from __future__ import annotations

import numpy as np
import torch

from slacktier.cache import RowCache
from slacktier.engine.step import StepEngine
from slacktier.engine.testing import array_tables
from slacktier.tables.codec import dequantize_bits


def _engine(slots: int) -> tuple[StepEngine, np.ndarray]:
    tables, _, raws = array_tables({1: 600}, ranks=2)
    return StepEngine(tables, RowCache(slots), max_tokens=8, columns=1, check=True, check_raise=True), raws[1]


def _step(engine: StepEngine, rows: list[int], raw: np.ndarray):
    engine.begin_step(np.array(rows, dtype=np.int64).reshape(-1, 1, 1))
    out = engine.gather(1)
    c = engine.end_step().layers[1]
    want = torch.from_numpy(dequantize_bits(raw[rows])).view(torch.bfloat16).reshape(out.shape)
    assert torch.equal(out.view(torch.int16), want.view(torch.int16))
    return c


def test_row_evicted_earlier_in_the_same_step_is_read_again() -> None:
    engine, raw = _engine(2)
    c = _step(engine, [10, 400], raw)                 # both cached
    assert c.rows_read == 2
    # 20 and 500 miss first and take both slots (CLOCK clears the reference bits, then evicts 10 and
    # 400); 10 and 400 were cached when the step began, but their slots now hold 20 and 500.
    c = _step(engine, [20, 500, 10, 400], raw)
    assert c.hits == 0 and c.rows_read == 4 and c.bypass == 2 and c.evictions == 2
    c = _step(engine, [20, 500], raw)
    assert c.hits == 2


def test_row_filled_earlier_in_the_same_step_is_reused() -> None:
    engine, raw = _engine(4)
    c = _step(engine, [7, 7, 300, 7, 300], raw)
    assert c.rows_read == 2 and c.reused == 3 and c.hits == 0
    c = _step(engine, [7, 300, 7], raw)
    assert c.hits == 3 and c.rows_read == 0
