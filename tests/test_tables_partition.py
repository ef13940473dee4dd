"""Rank partitions (tables.partition): columns and balanced, staged, verified, recorded and refused."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from slacktier.errors import SlackTierError
from slacktier.tables.codec import synthetic_rows
from slacktier.tables.engram_hash import EngramLayout
from slacktier.tables.layout import PAGE_BYTES, ROW_BYTES, ROWS_PER_PAGE, offset_in_page, page_of_row
from slacktier.tables.manifest import Manifest, check_tp_sharding, manifest_digest
from slacktier.tables.partition import RankPartition, RowMap, rank_columns, stored_spans
from slacktier.tables.stage import layer_seed, stage_synthetic
from slacktier.tables.verify import verify_table

LAYOUT = EngramLayout.scaled(1000)   # ~24,000 rows per layer, 24 columns (3 orders x 8 heads)


def test_balanced_gives_each_rank_two_heads_of_each_order_at_tp4() -> None:
    cols = rank_columns("balanced", 24, 4, 8)
    assert cols[0] == (0, 1, 8, 9, 16, 17) and cols[3] == (6, 7, 14, 15, 22, 23)
    assert rank_columns("columns", 24, 4, 8)[1] == tuple(range(6, 12))
    assert rank_columns("balanced", 24, 8, 8)[5] == (5, 13, 21)
    with pytest.raises(SlackTierError, match="do not split over 3 ranks"):
        rank_columns("balanced", 24, 3, 8)
    with pytest.raises(SlackTierError, match="unknown rank partition"):
        rank_columns("rows", 24, 4, 8)


def test_the_worked_example_of_the_module_docstring() -> None:
    bounds = tuple(range(0, 2401, 100))
    part = RankPartition.make("balanced", 24, 4, 8)
    spans = stored_spans(part, bounds, 2400, 4)
    assert [(s.start, s.rows, s.stored_start) for s in spans[0]] == [(0, 200, 0), (800, 200, 210), (1600, 200, 420)]
    rm = RowMap.of(spans, 2400)
    # 2400 is past the table but stored row 2400 is global row 2320 (rank 3's last span): it goes past the
    # 2,480 stored rows instead, so no id outside the table lands on another row's place
    assert rm.stored_rows == 2480
    assert rm.to_stored(np.array([805, -1, 2400, 2479, 2480, 10**12])).tolist() == [215, -1, 2480, 2480, 2480,
                                                                                       10**12]
    assert rm.to_global(np.array([2400])).tolist() == [2320]
    assert page_of_row(215) == 14
    every = np.arange(2400)
    stored = rm.to_stored(every)
    assert np.unique(stored).size == 2400 and rm.to_global(stored).tolist() == every.tolist()
    # rank 1's region follows rank 0's (620 stored rows): its first span, columns 2..3, at stored row 620
    assert spans[1][0].stored_start == 620 and spans[1][0].start == 200
    assert RowMap.of(stored_spans(None, bounds, 2400, 4), 2400) is None   # columns: the identity


def _row_at(m: Manifest, layer: int, g: int) -> np.ndarray:
    """Global row g of `layer` as the staged file holds it, found through the manifest's pieces."""
    for region in m.regions:
        for p in m.pieces(region):
            if p.layer == layer and p.row_start <= g < p.row_start + p.rows:
                local = g - p.row_start
                with open(p.path, "rb") as f:
                    f.seek(p.offset_bytes + page_of_row(local) * PAGE_BYTES + offset_in_page(local))
                    return np.frombuffer(f.read(ROW_BYTES), dtype=np.uint8)
    raise AssertionError(f"row {g} in no piece")


@pytest.mark.parametrize("kind", ["columns", "balanced"])
def test_a_staged_table_holds_every_row_once_and_verifies(tmp_path: Path, kind: str) -> None:
    m = stage_synthetic([tmp_path / "a.bin", tmp_path / "b.bin"], LAYOUT, 4, seed=3, progress=False, partition=kind)
    again = Manifest.load(m.path)
    assert again.partition_kind == kind and again.regions == m.regions
    report = verify_table(m.path, rows_per_region=50, progress=False)
    assert report.ok, report
    layer = LAYOUT.layer_ids[1]
    rows = LAYOUT.layer_rows(layer)
    for g in (0, 1, 14, 15, rows // 2, rows - 1, *LAYOUT.layer_column_bounds(layer)[1:-1]):
        want = synthetic_rows(layer_seed(3, layer), g, 1)[0]
        assert np.array_equal(_row_at(m, layer, g), want), g
    check_tp_sharding(again, 4)
    if kind == "balanced":   # each rank's region holds 6 of 24 columns, a quarter of the rows and a little padding
        r0 = again.region(layer, 0)
        owned = sum(s.rows for s in again.spans(layer, 0))
        assert owned < r0.rows < owned + 3 * ROWS_PER_PAGE
        assert json.loads(Path(m.path).read_text())["partition"]["rank_columns"][0] == [0, 1, 8, 9, 16, 17]
    else:   # the layout every manifest had before partitions: no "partition" key at all
        assert "partition" not in json.loads(Path(m.path).read_text())


def _edit(m: Manifest, change) -> None:
    doc = json.loads(Path(m.path).read_text())
    change(doc)
    doc.pop("manifest_digest")
    doc["manifest_digest"] = manifest_digest(doc)   # a deliberate, redigested edit: only the cover check is left
    Path(m.path).write_text(json.dumps(doc))


@pytest.mark.parametrize("change, message", [
    (lambda d: d["partition"]["rank_columns"][0].__setitem__(0, 2), "exactly once"),
    (lambda d: d["partition"]["rank_columns"].pop(), "lists 3 ranks"),
    (lambda d: (d["partition"]["rank_columns"][0].__setitem__(0, 6),
                d["partition"]["rank_columns"][3].__setitem__(0, 0)), "not the 'balanced' partition's"),
    (lambda d: d["partition"].__setitem__("kind", "rows"), "unknown rank partition"),
    (lambda d: d.pop("partition"), "rank 0.s shard"),   # balanced regions read as columns: rows differ
])
def test_a_hand_edited_partition_is_refused_at_load(tmp_path: Path, change, message) -> None:
    m = stage_synthetic([tmp_path / "t.bin"], LAYOUT, 4, seed=1, progress=False, partition="balanced")
    _edit(m, change)
    with pytest.raises(SlackTierError, match=message):
        Manifest.load(m.path)


def test_balanced_needs_column_bounds_and_whole_heads(tmp_path: Path) -> None:
    with pytest.raises(SlackTierError, match="hash-column"):
        stage_synthetic([tmp_path / "t.bin"], {1: 1000}, 2, seed=1, progress=False, partition="balanced")
    with pytest.raises(SlackTierError, match="do not split over 3 ranks"):
        stage_synthetic([tmp_path / "u.bin"], LAYOUT, 3, seed=1, progress=False, partition="balanced")
