"""Ids at every region edge, both partitions, TP 1/2/4/8: each id gives its own row or the stock path's zeros.

The stock lookups (SGLang's `_owned_rows` and all-reduce, vLLM's `_engram_lookup_kernel`) give a +0.0 row for
an id outside the table and for the pad id. The step engine must give the same, counted, in a process serving
the whole table and summed over per-rank processes (`owned_only`), under the contiguous columns partition and
the balanced one, whose stored rows (padding between spans included) outnumber the table's: an id a few rows
past the layer's end is a stored row's number there, and must never be served as that row.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from slacktier.config import from_dict, write_control
from slacktier.engine.step import StepEngine
from slacktier.errors import SlackTierError
from slacktier.tables.codec import dequantize_bits
from slacktier.tables.engram_hash import EngramLayout
from slacktier.tables.manifest import Manifest
from slacktier.tables.stage import SyntheticSource, stage_synthetic
from slacktier.testing.store import supports_o_direct

LAYOUT = EngramLayout.scaled(200)   # layers 1 and 14: 6,660 and 10,150 rows, 24 columns of 3 orders x 8 heads
SEED = 5
TOKENS = 4
CASES = [(tp, kind) for tp in (1, 2, 4, 8) for kind in ("columns", "balanced")]


@pytest.fixture(scope="module")
def staged(tmp_path_factory) -> dict[tuple[int, str], Manifest]:
    tmp = tmp_path_factory.mktemp("edges")
    if not supports_o_direct(tmp):
        pytest.skip("tmp_path does not support O_DIRECT")
    return {(tp, kind): stage_synthetic([tmp / f"{kind}{tp}.bin"], LAYOUT, tp, SEED, progress=False, partition=kind)
            for tp, kind in CASES}


def _control(tmp: Path, name: str, m: Manifest, rank: int, **engine: object) -> str:
    tables = [{"layer": layer, "manifest": str(m.path), "cache_share": 0.5, "order": i, "rank": rank,
               "partition": m.partition_kind} for i, layer in enumerate(LAYOUT.layer_ids)]
    doc = {"engine": {"cache_rows": 400, "check": True, **engine}, "table": tables}
    return str(write_control(from_dict(doc), tmp / name))


def _edge_ids(m: Manifest, layer: int) -> list[int]:
    """Ids within 3 of every edge: each column's and each rank region's first and last rows, the layer's end, the
    stored rows' end (a partition's padding makes it later), and the negative ids (pad -1 among them)."""
    rows = m.layout.rows[layer]
    rm = m.row_map(layer)
    stored = rm.stored_rows if rm is not None else rows
    edges = {0, rows, stored, *m.layout.column_bounds[layer]}
    edges |= {r.row_start for r in m.regions if r.layer == layer} | {r.row_start + r.rows for r in m.regions
                                                                        if r.layer == layer}
    ids = {e + d for e in edges for d in range(-3, 4)}
    return sorted(ids | {stored - rows + rows // 2 + rows, 2**40, -(2**40)})


def _expected(ids: np.ndarray, rows: int, truth: SyntheticSource, layer: int) -> np.ndarray:
    """[N, 256] int16 bf16 bits the stock path gives: the id's own row inside [0, rows), +0.0 elsewhere."""
    inside = (ids >= 0) & (ids < rows)
    want = dequantize_bits(truth.rows(layer, np.where(inside, ids, 0))).view(np.int16)
    want[~inside] = 0
    return want


def _wrong(got: torch.Tensor, want: np.ndarray) -> np.ndarray:
    """Lookups whose row differs from `want` in any bit: [N] bool."""
    return (got.reshape(-1, 256).view(torch.int16).numpy() != want).any(axis=1)


def _serve(engines: list[StepEngine], ids: np.ndarray) -> dict[int, tuple[torch.Tensor, list]]:
    """One step of `ids` on every engine: per layer, the rows summed over the engines and each one's counters."""
    rows = {}
    try:
        for e in engines:
            e.begin_step(ids)
        for layer in LAYOUT.layer_ids:
            parts = [e.gather(layer) for e in engines]
            total = parts[0]
            for p in parts[1:]:
                total = total + p
            rows[layer] = total
        counts = [e.end_step().layers for e in engines]
    finally:   # after a failure, the steps still open are ended (their own errors are the first one's echo)
        for e in engines:
            if e.in_step:
                try:
                    e.end_step()
                except SlackTierError:
                    pass
    return {layer: (rows[layer], [c[layer] for c in counts]) for layer in LAYOUT.layer_ids}


@pytest.mark.parametrize("tp,kind", CASES)
def test_every_id_near_an_edge_gives_its_own_row_or_the_stock_zeros(staged, tmp_path: Path, tp: int,
                                                                      kind: str) -> None:
    m = staged[(tp, kind)]
    truth = SyntheticSource(m.layout, SEED)
    other = SyntheticSource(m.layout, SEED + 1)   # negative control: another table's rows
    cands = {layer: _edge_ids(m, layer) for layer in LAYOUT.layer_ids}
    whole = [StepEngine.from_control(_control(tmp_path, "whole.toml", m, -1))]
    ranks = [StepEngine.from_control(_control(tmp_path, f"r{k}.toml", m, k, owned_only=True)) for k in range(tp)]

    ids_st = st.tuples(*[st.lists(st.sampled_from(cands[layer]), min_size=TOKENS * 24, max_size=TOKENS * 24)
                         for layer in LAYOUT.layer_ids])

    @settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(ids_st)
    def check(columns: tuple[list[int], ...]) -> None:
        ids = np.stack([np.array(c, dtype=np.int64).reshape(TOKENS, 24) for c in columns], axis=1)
        for engines in (whole, ranks):
            served = _serve(engines, ids)
            for j, layer in enumerate(LAYOUT.layer_ids):
                g = ids[:, j, :].reshape(-1)
                rows = m.layout.rows[layer]
                got, counts = served[layer]
                assert not _wrong(got, _expected(g, rows, truth, layer)).any()
                outside = int(((g < 0) | (g >= rows)).sum()) - int((g == -1).sum())
                for c in counts:   # every process sees every id: each counts the ids outside the layer
                    assert (c.out_of_table, c.padded) == (outside, int((g == -1).sum()))
                # negative controls: the comparison finds another table's rows, and a neighbour's row
                inside = (g >= 0) & (g < rows)
                if inside.any():
                    assert _wrong(got, _expected(g, rows, other, layer))[inside].all()
                    shifted = np.where(inside, (g + 1) % rows, g)
                    assert _wrong(got, _expected(shifted, rows, truth, layer))[inside].all()
        for e in (*whole, *ranks):
            assert sum(c.mismatches for c in e.totals.values()) == 0

    try:
        check()
    finally:
        for e in (*whole, *ranks):
            e.close()


def test_ids_past_a_balanced_layers_end_are_zero_rows_not_stored_rows(staged, tmp_path: Path, caplog) -> None:
    """Every id from the layer's end to past its stored rows, at TP 4 balanced: +0.0 rows, counted, logged once."""
    m = staged[(4, "balanced")]
    layer = LAYOUT.layer_ids[0]
    rows, stored = m.layout.rows[layer], m.row_map(layer).stored_rows
    assert stored > rows   # the padding between spans: ids in [rows, stored) are stored rows' numbers
    past = np.arange(rows, stored + 2, dtype=np.int64)
    tokens = -(-past.size // 24)
    first = np.zeros(tokens * 24, dtype=np.int64)
    first[:past.size] = past
    ids = np.zeros((tokens, len(LAYOUT.layer_ids), 24), dtype=np.int64)
    ids[:, 0, :] = first.reshape(tokens, 24)
    with caplog.at_level(logging.WARNING, logger="slacktier.engine.step"):
        with StepEngine.from_control(_control(tmp_path, "one.toml", m, -1)) as e:
            for _ in range(2):
                e.begin_step(ids)
                out = e.gather(layer).reshape(-1, 256)[:past.size]
                c = e.end_step().layers[layer]
                assert not out.view(torch.int16).any()
                assert c.out_of_table == past.size and c.rows_read + c.hits + c.reused == ids.shape[0] * 24 - past.size
    assert len([r for r in caplog.records if "outside the layer" in r.getMessage()]) == 1


def test_tp1_serves_an_id_outside_the_table_as_a_zero_row(staged, tmp_path: Path) -> None:
    """Stock SGLang at TP 1 masks an id outside its table to a +0.0 row; so does a whole-table process."""
    m = staged[(1, "columns")]
    truth = SyntheticSource(m.layout, SEED)
    rows = [m.layout.rows[layer] for layer in LAYOUT.layer_ids]
    ids = np.array([[[5, rows[0], rows[0] + 7, -2] * 6, [rows[1] - 1, rows[1], 2**40, -1] * 6]], dtype=np.int64)
    with StepEngine.from_control(_control(tmp_path, "tp1.toml", m, -1)) as e:
        e.begin_step(ids)
        for j, layer in enumerate(LAYOUT.layer_ids):
            g = ids[0, j]
            assert not _wrong(e.gather(layer), _expected(g, rows[j], truth, layer)).any()
        c = e.end_step().layers
    assert (c[1].out_of_table, c[1].padded) == (18, 0) and (c[14].out_of_table, c[14].padded) == (12, 6)


@settings(max_examples=60, deadline=None, database=None)
@given(st.sampled_from([2, 4, 8]), st.lists(st.integers(-50, 7_000), min_size=1, max_size=64))
def test_a_row_map_puts_only_table_rows_in_the_stored_rows(tp, ids):
    """RowMap.to_stored (balanced, layer 1's 6,660 rows): an id lands inside the stored rows exactly when it is a
    row of the table, and maps back to itself; ids past the table (the padding's numbers among them) land past
    the stored rows."""
    from slacktier.tables.partition import RankPartition, RowMap, stored_spans

    layer = LAYOUT.layer_ids[0]
    bounds = LAYOUT.layer_column_bounds(layer)
    rows = bounds[-1]
    rm = RowMap.of(stored_spans(RankPartition.make("balanced", 24, tp, 8), bounds, rows, tp), rows)
    assert rm.stored_rows > rows   # the padding's numbers exist: ids in [rows, stored_rows) are the risk
    g = np.array(ids + [rows, rm.stored_rows - 1], dtype=np.int64)
    stored = rm.to_stored(g)
    table = (g >= 0) & (g < rows)
    assert np.array_equal((stored >= 0) & (stored < rm.stored_rows), table)
    assert np.array_equal(rm.to_global(stored[table]), g[table])
    assert np.array_equal(stored[g < 0], g[g < 0])
