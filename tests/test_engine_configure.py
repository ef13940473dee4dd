"""`StepEngine.apply(Change(...))`: tables, cache and cache budget changed between steps, all or nothing."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from slacktier.cache import RowCache
from slacktier.engine import Change, StepEngine
from slacktier.engine.checker import reference_gather
from slacktier.errors import ErrorKind, SlackTierError
from slacktier.testing.engine import array_tables

ROWS = {1: 3000, 14: 2000}


def _engine(cache_rows: int = 1000) -> tuple[StepEngine, dict[int, np.ndarray]]:
    tables, _, raws = array_tables(ROWS)
    return StepEngine(tables, RowCache(4000, slots=cache_rows), max_tokens=16), raws


def _step(engine: StepEngine, ids: np.ndarray, raws: dict[int, np.ndarray]) -> dict[int, object]:
    """One step of `ids` [T, 2, 24]; every layer's rows equal the reference gather; its counters."""
    engine.begin_step(ids)
    for axis, layer in enumerate(engine.ids_layers):
        rows = engine.gather(layer)
        want = reference_gather(raws[layer][ids[:, axis, :].reshape(-1)])
        assert torch.equal(rows.reshape(-1, 256).view(torch.int16), want.view(torch.int16))
    return engine.end_step().layers


def _ids(seed: int, tokens: int = 8) -> np.ndarray:
    rng = np.random.default_rng(seed)
    # distinct rows per layer: a hit is a row cached by an earlier step, never one repeated within the step
    return np.stack([rng.choice(ROWS[layer], tokens * 24, replace=False).reshape(tokens, 24)
                     for layer in sorted(ROWS)], axis=1)


def test_a_cache_budget_change_keeps_tables_and_serves_exactly() -> None:
    engine, raws = _engine()
    ids = _ids(0)
    _step(engine, ids, raws)
    assert all(c.hits > 0 for c in _step(engine, ids, raws).values())   # cached by the first step
    engine.apply(Change(cache_rows=0))
    assert engine.cache.slots == 0 and engine.layers == (1, 14)
    assert all(c.hits == 0 for c in _step(engine, ids, raws).values())
    engine.apply(Change(cache_rows=2000))
    _step(engine, ids, raws)
    assert all(c.hits > 0 for c in _step(engine, ids, raws).values())
    engine.close()


def test_a_new_cache_replaces_the_old_one() -> None:
    engine, raws = _engine()
    ids = _ids(1)
    _step(engine, ids, raws)
    fresh = RowCache(500)
    engine.apply(Change(cache=fresh))
    assert engine.cache is fresh and engine.cache.slots == 500
    assert all(c.hits == 0 for c in _step(engine, ids, raws).values())   # nothing carried over
    engine.close()


def test_a_refused_change_leaves_the_engine_as_it_was() -> None:
    engine, raws = _engine()
    ids = _ids(2)
    _step(engine, ids, raws)
    before = (engine.cache.slots, engine.layers, engine.ids_layers, engine.lossy)
    with pytest.raises(SlackTierError) as err:
        engine.apply(Change(cache_rows=10**6))   # more than the cache reserved
    assert err.value.kind == ErrorKind.CAPACITY
    with pytest.raises(SlackTierError) as err:
        engine.apply(Change(lossy=True))          # no seen-sets
    assert err.value.kind == ErrorKind.BAD_INPUT
    with pytest.raises(SlackTierError) as err:
        engine.apply(Change(tables=[engine.table(1), engine.table(1)]))
    assert err.value.kind == ErrorKind.BAD_INPUT
    assert (engine.cache.slots, engine.layers, engine.ids_layers, engine.lossy) == before
    assert all(c.hits > 0 for c in _step(engine, ids, raws).values())   # its cached rows kept
    engine.close()


def test_tables_change_and_the_ids_axis_follows_them() -> None:
    engine, raws = _engine()
    engine.apply(Change(tables=[engine.table(14), engine.table(1)], ids_layers=(14, 1)))
    assert engine.layers == (14, 1) and engine.ids_layers == (14, 1)
    ids = _ids(3)[:, ::-1, :].copy()   # the ids' layer axis now reads layer 14 first
    _step(engine, ids, raws)
    engine.apply(Change(cache_rows=500))   # tables not given: the axis stays
    assert engine.ids_layers == (14, 1)
    engine.apply(Change(tables=[engine.table(1)]))
    assert engine.layers == (1,) and engine.ids_layers == (1,)
    engine.close()


def test_apply_is_refused_during_a_step_after_close_and_for_other_types() -> None:
    engine, _ = _engine()
    engine.begin_step(_ids(4))
    with pytest.raises(SlackTierError) as err:
        engine.apply(Change(cache_rows=0))
    assert err.value.kind == ErrorKind.BAD_INPUT and "end_step" in (err.value.fix or "")
    engine.end_step()
    with pytest.raises(SlackTierError) as err:
        engine.apply({"cache_rows": 0})
    assert err.value.kind == ErrorKind.BAD_INPUT
    engine.close()
    with pytest.raises(SlackTierError) as err:
        engine.apply(Change(cache_rows=0))
    assert err.value.kind == ErrorKind.CLOSED
