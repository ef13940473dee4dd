"""The "1 disk" benchmark's table and the planner's prediction of its rows (benchmarks/paper, issue 27).

No timing: the table is built from given runs, parsed back as table2_predict.py reads the bench log, and the
prediction is checked against a worked example.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from slacktier.errors import SlackTierError
from slacktier.plan.readmodel import DeviceReadModel
from slacktier.serve.timeline import TimelineSummary

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.paper import bench_one_disk  # noqa: E402
from benchmarks.paper.full_rank import FullRankRun  # noqa: E402
from benchmarks.paper.table2_predict import one_disk_exposure, one_disk_rows  # noqa: E402


def _run(placement: str, rank: int, rep: int, stalls: tuple[float, ...], pages: dict[int, float],
         s_ms: float) -> FullRankRun:
    layers = tuple(pages)
    summary = TimelineSummary(steps=len(stalls), stall_ms=sum(stalls) / len(stalls), predicted_ms=0.0,
                              p99_stall_ms=max(stalls), s_ms=s_ms, read_ms={l: 10.0 + rank for l in layers},
                              stall_layer_ms={l: 0.0 for l in layers}, gather_ms={l: 0.0 for l in layers},
                              pages=pages, hit_rate={l: 0.0 for l in layers})
    return FullRankRun(placement, 128, rep, 0, 29.41, summary, layers, 0, 4, 0, 1.0, True, stalls, (7, 8))


def test_one_disk_table_round_trips_through_the_predictors_parser(tmp_path):
    per_rank = {0: [], 1: []}
    for rep, (a, b) in enumerate(((1.0, 3.0), (2.0, 6.0))):   # TP stall per step: the slowest rank's
        per_rank[0] += [_run("disk", 0, rep, (a, b), {1: 700.0, 14: 710.0}, 0.5),
                        _run("l1-dram-l14-disk", 0, rep, (a, a), {14: 600.0}, 0.4)]
        per_rank[1] += [_run("disk", 1, rep, (b, a), {1: 760.0, 14: 750.0}, 0.7),
                        _run("l1-dram-l14-disk", 1, rep, (b, b), {14: 640.0}, 0.6)]
    text = bench_one_disk.table(per_rank, 2)
    log = tmp_path / "table2.md"
    log.write_text('#### "1 disk": 2 rank processes on one disk, agent, B=128, 2026-12-03 17:00 UTC\n\n```\n'
                   + text + "\n```\n")
    rows = {r["placement"]: r for r in one_disk_rows(log)}
    assert rows["disk"]["rounds"] == [3.0, 6.0]   # per round: mean over steps of max(rank 0, rank 1)
    assert rows["disk"]["stall"] == 4.5
    assert rows["disk"]["ranks"] == [{"pages": {1: 700.0, 14: 710.0}, "s": 0.5},
                                     {"pages": {1: 760.0, 14: 750.0}, "s": 0.7}]
    assert rows["l1-dram-l14-disk"]["ranks"][1] == {"pages": {14: 640.0}, "s": 0.6}
    assert rows["l1-dram-l14-disk"]["rounds"] == [3.0, 6.0]


def test_one_disk_exposure_counts_the_other_ranks_pages_ahead():
    model = DeviceReadModel(1.0, 0.01, 0.01, 0.0)
    ranks = [{"pages": {1: 100.0, 14: 200.0}, "s": 0.2}, {"pages": {1: 300.0, 14: 100.0}, "s": 0.3}]
    # rank 1's layer 1: 1 + 0.01 * 300 + 0.01 * 100 (rank 0's layer-1 pages ahead) = 5 ms; d_1 = 0.3 + 5 - 0.5;
    # its layer 14: 1 + 0.01 * 100 + 0.01 * (200 + 400) = 8 ms, inside W_14 = 10 ms plus d_1: no stall
    assert one_disk_exposure(ranks, {1: 0.5, 14: 10.0}, model) == pytest.approx(4.8)
    # W_14 = 3 ms: rank 0 stalls 4.7 + (0.2 + 8 - 3 - 4.7) = 5.2, rank 1 4.8 + (0.3 + 8 - 3 - 4.8) = 5.3: the TP
    # step waits for the slowest rank
    assert one_disk_exposure(ranks, {1: 0.5, 14: 3.0}, model) == pytest.approx(5.3)


def test_one_disk_refuses_a_negative_start_before_staging(tmp_path):
    with pytest.raises(SlackTierError, match="start_decode_steps -1"):
        bench_one_disk.main(["--whole-sessions", "--start-decode-steps", "-1", "--workdir", str(tmp_path)])
    assert not any(tmp_path.iterdir())
