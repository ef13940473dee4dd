"""Served runs and the end-to-end harness: side-by-side replay catches a wrong row, sessions are clipped, typed
records round-trip, the harness's jobs, exposure fit and report section.

The harness lives beside the package (benchmarks/e2e/); its tests import it with the repo root on sys.path.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest

from slacktier.models.deepseek_v41 import V41Config, V41Model
from slacktier.models.rows import DramRowProvider, DramTable
from slacktier.serve.loop import replay
from slacktier.serve.report import placement_rows
from slacktier.serve.runs import LayerStats, RigConfig, RunRecord, clip_sessions
from slacktier.serve.runners import V41Runner
from slacktier.tables.engram_hash import EngramLayout
from slacktier.workloads.hashing import EngramLookupHasher
from slacktier.workloads.replay import ReplayConfig, replay_steps
from slacktier.workloads.sessions import TokenSession

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.e2e.analysis import exposure_fit  # noqa: E402
from benchmarks.rig.records import record_from_json, record_to_json  # noqa: E402
from benchmarks.rig.report import format_placement_table  # noqa: E402
from benchmarks.e2e.config import E2EConfig  # noqa: E402
from benchmarks.e2e.jobs import Experiment, placements, plan_jobs  # noqa: E402
from benchmarks.e2e.markdown import SECTION, write_section  # noqa: E402
from benchmarks.e2e.run import E2ERun, Results  # noqa: E402


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _session(i: int, n: int = 40) -> TokenSession:
    toks = np.random.default_rng(i).integers(3, 129_280, n).astype(np.int32)
    return TokenSession(f"s{i}", "src", "agent", toks, np.array([20]), np.array([26]))


def test_paired_replay_counts_steps_whose_logits_differ() -> None:
    cfg = V41Config.preset("tiny")
    layout = EngramLayout.scaled(1000, cfg.engram_layer_ids)
    rows = [layout.rows(i) for i in range(2)]
    same = {l: DramTable.synthetic(3 + i, rows[i]) for i, l in enumerate(cfg.engram_layer_ids)}
    other = dict(same)
    other[cfg.engram_layer_ids[1]] = DramTable.synthetic(99, rows[1])   # another table for the second layer
    runner = V41Runner(V41Model(cfg))
    sessions = [_session(0), _session(1)]
    rc = ReplayConfig(batch=2, decode_tokens=3, prefill_chunk_tokens=64)
    hasher = EngramLookupHasher(layout)
    ids = cfg.engram_layer_ids
    ok = replay(runner, sessions, replay_steps(sessions, hasher, rc), 3,
                arms=[DramRowProvider(same, ids), DramRowProvider(dict(same), ids)])
    bad = replay(runner, sessions, replay_steps(sessions, hasher, rc), 3,
                 arms=[DramRowProvider(same, ids), DramRowProvider(other, ids)])
    assert sum(s.mismatch for s in ok.steps) == 0
    assert all(s.mismatch == 1 for s in bad.steps)
    assert all(len(s.arm_ms) == 2 for s in ok.steps)
    # the outputs recorded are arm 0's (the DRAM table here), whatever the other arm returns
    assert len(ok.turns) == 2 and [t.tokens for t in ok.turns] == [t.tokens for t in bad.turns]


def test_clip_sessions_keeps_whole_turns_within_the_budget() -> None:
    toks = np.arange(100, dtype=np.int32)
    s = TokenSession("a", "src", "chat", toks, np.array([10, 40, 80]), np.array([20, 50, 90]))
    (c,) = clip_sessions([s], max_tokens=60, max_turns=5)
    assert c.num_tokens == 50 and list(c.reply_start) == [10, 40] and list(c.reply_end) == [20, 50]
    (c,) = clip_sessions([s], max_tokens=100, max_turns=1)
    assert c.num_tokens == 20 and c.num_replies == 1
    assert clip_sessions([s], max_tokens=15, max_turns=5) == []
    # None: no cap of that kind; whole sessions keep every turn (up to the last reply's end)
    (c,) = clip_sessions([s], max_tokens=None, max_turns=None)
    assert c.num_tokens == 90 and list(c.reply_start) == [10, 40, 80]
    (c,) = clip_sessions([s], max_tokens=None, max_turns=2)
    assert c.num_tokens == 50 and c.num_replies == 2
    (c,) = clip_sessions([s], max_tokens=60, max_turns=None)
    assert c.num_replies == 2


def _record(placement: str, rep: int, t1: float, t2: float, slow: float, delays=None) -> RunRecord:
    return RunRecord("agent", 8, placement, rep, 0, paired=True, base_ms=100.0, step_ms=100.0 + slow,
                     overhead_pct=slow, decode_steps=4,
                     layers={1: LayerStats(window_ms=20.0, read_ms=t1), 3: LayerStats(window_ms=70.0, read_ms=t2)},
                     step_reads_ms=[{1: t1, 3: t2}], delays_ms=delays or {})


def test_exposure_fit_predicts_injected_delays_it_was_not_fitted_on() -> None:
    # Synthetic runs built from Eq. 1 itself plus a constant: the fit must recover kappa and predict exactly.
    from slacktier.plan.exposure import LayerRead, exposure

    runs = []
    for i, (t1, t2) in enumerate([(5, 10), (40, 10), (20, 90), (60, 120), (80, 150), (10, 200)]):
        slow = exposure([LayerRead(1, 20.0, t1), LayerRead(3, 70.0, t2)]).slowdown_ms + 1.5
        experiment = Experiment.TABLE2 if i < 4 else Experiment.DELAY
        runs.append(E2ERun(experiment, None, _record("disk" if i < 4 else f"delay{i}", i % 2, t1, t2, slow)))
    fit = exposure_fit(runs, (1, 3))
    assert fit.kappa_ms == pytest.approx(1.5)
    assert fit.held_rmse_ms == pytest.approx(0.0, abs=1e-9)
    assert fit.held_runs == 4 and fit.fit_runs == 2


def test_run_record_round_trips_through_json() -> None:
    rec = _record("disk", 0, 5.0, 7.0, 3.0, delays={1: 60.0})
    text = json.dumps(record_to_json(rec))
    back = record_from_json(json.loads(text))
    assert json.dumps(record_to_json(back)) == text   # unmeasured fields are NaN, which equals nothing: compare as JSON
    assert set(back.layers) == {1, 3} and isinstance(back.layers[1], LayerStats) and back.layers[1].read_ms == 5.0
    assert back.delays_ms == {1: 60.0} and back.step_reads_ms == [{1: 5.0, 3: 7.0}]


def test_placement_rows_put_the_dram_table_first_and_spread_overheads() -> None:
    paired = [_record("disk", r, 5.0, 7.0, slow) for r, slow in enumerate((2.0, 4.0))]
    alone = [RunRecord("agent", 8, "dram-table", -1, 0, rss_peak_gib=1.5)]
    rows = placement_rows(paired, alone)
    assert [r.placement for r in rows] == ["dram-table", "disk"]
    assert rows[0].rss_gib == 1.5 and rows[0].base_ms == 100.0
    assert rows[1].overhead_pct == (3.0, 2.0, 4.0) and rows[1].layers[1].read_ms == 5.0
    assert math.isnan(rows[1].rss_gib)
    table = format_placement_table(rows, (1, 3)).splitlines()
    assert len(table) == 3 and "hit L1" in table[0] and table[2].split()[:3] == ["agent", "disk", "+3.0%"]


def test_jobs_come_from_typed_placements() -> None:
    cfg = E2EConfig(rig=RigConfig(max_batch=16, devices=4), runs=2, workloads=("agent", "chat"))
    places = placements(cfg, 1, 14)
    jobs = plan_jobs(cfg, places)
    t2 = [p for p in places.values() if p.experiment is Experiment.TABLE2 and not p.placement.stock]
    assert len(t2) == 6
    paired_t2 = [j for j in jobs if j.paired and places[j.placement].experiment is Experiment.TABLE2
                 and j.batch == cfg.table2_batch]
    assert len(paired_t2) == 2 * 6 * 2
    memory = sorted(j.placement for j in jobs if not j.paired)
    assert memory == sorted(["dram-table", "l1-dram-l14-disk", "disk"])
    split = sorted(p.split_f for p in places.values() if p.split_f is not None)
    assert split == [0.0, 0.25, 0.5, 0.75, 1.0]
    delays = [j for j in jobs if places[j.placement].experiment is Experiment.DELAY]
    assert len(delays) == len(cfg.delays_ms)
    fig5 = sorted({j.placement for j in jobs if j.batch != cfg.table2_batch})
    assert fig5 == sorted(["l1-dram-l14-disk", "disk-cache-l14", "disk-split"])
    assert jobs == plan_jobs(cfg, places)   # seeded shuffle


def test_write_section_replaces_only_its_own_section(tmp_path) -> None:
    md = tmp_path / "B.md"
    md.write_text("# Bench\n\n## Tables\nkeep me\n\n" + SECTION + "\nold numbers\n\n## Engine\nkeep me too\n")
    results = Results(E2EConfig(rig=RigConfig(cache_rows=10, decode_tokens=4, max_batch=16)), (1, 3),
                      {"layers": 8, "hidden_size": 64, "hc_mult": 4, "dtype": "float32", "engram_layer_ids": [1, 3]},
                      (100, 200), 1.0)
    write_section(md, results, "NEW TABLE", [], "benchmarks/bench_e2e_table2.py")
    text = md.read_text()
    assert "keep me\n" in text and "keep me too" in text and "NEW TABLE" in text and "old numbers" not in text
    assert text.count(SECTION) == 1
    # results.json round trip
    results.runs.append(E2ERun(Experiment.FIGURE3, 0.25, _record("disk-split-f0.25", 0, 1.0, 2.0, 3.0)))
    text = json.dumps(results.to_json())
    back = Results.from_json(json.loads(text))
    assert json.dumps(back.to_json()) == text and back.config == results.config
    assert back.runs[0].experiment is Experiment.FIGURE3 and back.runs[0].record.layers[3].read_ms == 2.0


def test_the_demo_says_first_when_no_deadline_binds():
    from slacktier.serve.report import PlacementRow, deadline_caveat
    from slacktier.serve.runs import LayerStats

    def row(window_ms, read_ms):
        return PlacementRow("agent", "disk", 1, 10.0, 10.0, (0.0, 0.0, 0.0),
                            layers={1: LayerStats(window_ms=window_ms, read_ms=read_ms)})

    assert deadline_caveat([row(23.0, 4.0)]).startswith("NO DEADLINE BINDS HERE: the shortest window is 23.0 ms")
    assert "a read can outlast its window" in deadline_caveat([row(0.27, 4.0)])
    assert deadline_caveat([]) == "Deadlines: not measured in this run."
