"""Whole short replays: the stock DRAM table and every SlackTier placement give the same logits and tokens."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import slacktier
from benchmarks.rig.placements import DelayedRowProvider, replay_table2_placements
from slacktier.models.deepseek_v41 import V41Config, V41Model
from slacktier.models.qwen38 import (Q38Config, Q38Served, build_qwen38, load_ple_tables, ple_column_bounds,
                                     ple_table_rows, ple_tables_from)
from slacktier.models.rows import DramRowProvider
from slacktier.serve.loop import LoopConfig, replay
from slacktier.serve.runners import Q38Runner, V41Runner
from slacktier.plan.placement import Placement
from slacktier.serve.tiers import TierSet
from slacktier.tables.engram_hash import EngramLayout
from slacktier.tables.manifest import StagedLayout
from slacktier.tables.stage import SyntheticSource
from slacktier.workloads.hashing import EngramLookupHasher
from slacktier.workloads.replay import ReplayConfig, replay_steps
from slacktier.workloads.sessions import Session, Turn, render_session


pytestmark = pytest.mark.usefixtures("one_torch_thread")

SRC = Path(slacktier.__file__).parent


def _sessions(n: int, turns: int) -> list:
    """Real text: agent-like turns quoting this package's own source files."""
    files = sorted(SRC.glob("tables/*.py"))
    out = []
    for i in range(n):
        text = files[i % len(files)].read_text().splitlines()
        msgs = [Turn("system", "You are a coding agent.")]
        for k in range(turns):
            part = "\n".join(text[8 * k + 3 * i: 8 * k + 3 * i + 4])
            msgs += [Turn("user", f"Run: sed -n {k},{k + 4}p file\n{part}"),
                     Turn("assistant", f"THOUGHT: read the lines.\n```bash\ngrep -n def {files[i % len(files)].name}\n```")]
        out.append(render_session(Session(f"s{i}", "slacktier", "agent", tuple(msgs))))
    return out


def _run(runner, sessions, hasher, rc):
    r = replay(runner, sessions, replay_steps(sessions, hasher, rc), rc.decode_tokens, LoopConfig(record_digests=True))
    return [s.digest for s in r.steps], [t.tokens for t in r.turns], r


def test_v41_replay_is_bit_exact_on_every_placement(tmp_path) -> None:
    cfg = V41Config.preset("tiny")
    layout = EngramLayout.scaled(1000, cfg.engram_layer_ids)
    hasher = EngramLookupHasher(layout)
    sessions = _sessions(3, 2)
    rc = ReplayConfig(batch=2, decode_tokens=4, prefill_chunk_tokens=48)
    tiers = TierSet(tmp_path, layout, seed=9, max_cache_rows=2000, devices=2)
    tiers.stage()
    runner = V41Runner(V41Model(cfg))
    placements = replay_table2_placements(1, 3, cache_rows=2000, devices=2)
    try:
        runner.set_provider(tiers.provider(placements[0]))   # the stock DRAM table, reference gather
        ref_digests, ref_tokens, ref = _run(runner, sessions, hasher, rc)
        for p in placements[1:]:
            runner.set_provider(tiers.provider(p))
            before = {l: c.hits for l, c in tiers.engine.totals.items()}
            digests, tokens, got = _run(runner, sessions, hasher, rc)
            assert digests == ref_digests, p.name
            assert tokens == ref_tokens, p.name
            if p.cache_rows:
                assert sum(c.hits - before[l] for l, c in tiers.engine.totals.items()) > 0, p.name
        # an experiment's wrapper (injected hand-out delays) holds rows back and changes none of them
        delayed = tiers.provider(placements[2], wrap=lambda p: DelayedRowProvider(p, {1: 1.0, 3: 2.0}))
        assert isinstance(delayed, DelayedRowProvider) and delayed.layer_ids == (1, 3)
        runner.set_provider(delayed)
        digests, tokens, _ = _run(runner, sessions, hasher, rc)
        assert digests == ref_digests and tokens == ref_tokens
    finally:
        tiers.close()
    summary = ref.summary()
    assert summary["turns"] == 6 and summary["decode_steps"] > 0
    assert len(ref_tokens[0]) == 1 + rc.decode_tokens   # the prompt-end token, then one per decode step


def test_qwen_replay_is_bit_exact_through_the_engine(tmp_path) -> None:
    model = build_qwen38(Q38Config.preset("tiny"))
    layout = StagedLayout(ple_table_rows(model), ple_column_bounds(model))
    tables = ple_tables_from(SyntheticSource(layout, seed=4), model)
    load_ple_tables(model, tables)
    sessions = _sessions(2, 1)
    rc = ReplayConfig(batch=2, decode_tokens=3, prefill_chunk_tokens=64)
    hasher = EngramLookupHasher(EngramLayout.scaled(1000))  # schedules the steps; Qwen hashes on its own
    served = Q38Served(model, DramRowProvider(tables, tuple(sorted(tables))))
    runner = Q38Runner(served)
    ref_digests, ref_tokens, _ = _run(runner, sessions, hasher, rc)
    tiers = TierSet(tmp_path, layout, seed=4, columns=16, max_cache_rows=800, devices=1)
    tiers.stage((1,))
    try:
        runner.set_provider(tiers.provider(Placement("disk-split", ((0, "disk"), (1, "disk")), 800,
                                                     ((0, 0.5), (1, 0.5)))))
        digests, tokens, _ = _run(runner, sessions, hasher, rc)
    finally:
        tiers.close()
        served.restore()
    assert digests == ref_digests and tokens == ref_tokens
    assert len(tokens) == 2 and all(len(t) == 1 + rc.decode_tokens for t in tokens)


def test_replay_refuses_out_of_order_steps() -> None:
    from slacktier.errors import SlackTierError
    from slacktier.workloads.replay import Step

    cfg = V41Config.preset("tiny")
    layout = EngramLayout.scaled(1000, cfg.engram_layer_ids)
    sessions = _sessions(1, 1)
    runner = V41Runner(V41Model(cfg))
    ids = np.zeros((2, 2, 24), dtype=np.int64)
    bad = Step(0, "prefill", np.zeros(2, dtype=np.int32), np.array([5, 6]), np.array([3, 4]), ids,
               np.zeros(2, dtype=bool))
    with pytest.raises(SlackTierError):
        replay(runner, sessions, [bad], 4)
