"""The benchmark's pieces: side-by-side replay catches a wrong row, sessions are clipped, the report section."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from slacktier.commands.bench import SECTION, write_section
from slacktier.models.deepseek_v41 import V41Config, V41Model
from slacktier.models.rows import DramRowProvider, DramTable
from slacktier.serve.bench import clip_sessions, exposure_fit
from slacktier.serve.loop import replay
from slacktier.serve.runners import V41Runner
from slacktier.tables.engram_hash import EngramLayout
from slacktier.workloads.hashing import EngramLookupHasher
from slacktier.workloads.replay import ReplayConfig, replay_steps
from slacktier.workloads.sessions import TokenSession


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
    assert sum(s.extra["mismatch"] for s in ok.steps) == 0
    assert all(s.extra["mismatch"] == 1 for s in bad.steps)
    assert all(len(s.extra["arm_ms"]) == 2 for s in ok.steps)
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


def test_exposure_fit_predicts_injected_delays_it_was_not_fitted_on() -> None:
    # Synthetic runs built from Eq. 1 itself plus a constant: the fit must recover kappa and predict exactly.
    from slacktier.plan.exposure import LayerRead, exposure

    runs = []
    for i, (t1, t2) in enumerate([(5, 10), (40, 10), (20, 90), (60, 120), (80, 150), (10, 200)]):
        windows = {"1": 20.0, "3": 70.0}
        slow = exposure([LayerRead(1, 20.0, t1), LayerRead(3, 70.0, t2)]).slowdown_ms + 1.5
        runs.append({"paired": True, "rep": i % 2, "placement": "disk" if i < 4 else "delay-x-y",
                     "batch": 8, "window_ms": windows, "step_reads": [{"1": t1, "3": t2}],
                     "base_ms": 100.0, "step_ms": 100.0 + slow, "delays_ms": {}})
    fit = exposure_fit({"layers": [1, 3], "runs": runs})
    assert fit["kappa_ms"] == pytest.approx(1.5)
    assert fit["held_rmse_ms"] == pytest.approx(0.0, abs=1e-9)


def test_write_section_replaces_only_its_own_section(tmp_path) -> None:
    md = tmp_path / "B.md"
    md.write_text("# Bench\n\n## Tables\nkeep me\n\n" + SECTION + "\nold numbers\n\n## Engine\nkeep me too\n")
    results = {"config": {"cache_rows": 10, "table2_batch": 8, "decode_tokens": 4},
               "model": {"layers": 8, "hidden_size": 64, "hc_mult": 4, "dtype": "float32", "engram_layer_ids": [1, 3]},
               "table_rows": [100, 200], "stage_s": 1.0}
    write_section(md, results, "NEW TABLE", [], "slacktier bench")
    text = md.read_text()
    assert "keep me\n" in text and "keep me too" in text and "NEW TABLE" in text and "old numbers" not in text
    assert text.count(SECTION) == 1
