"""Where measured - Eq. 1 comes from in the Table 3 analog: each layer's host time around its gather, timed.

A diagnostic, not a benchmark (it wraps the clock, the engine and LayerReads.wait to time each piece; nothing
goes into BENCHMARKS.md from here). Per delay pair (argv, "4/6,6/10"), B=8, both layers in DRAM, medians over
16 decode steps (ms): excess = measured - Eq. 1; rover = the runner's wake past a layer's start; dover = the
hold's wake past t0 + D; pre = gather call -> read wait; wait = the engine's wait on reads that landed long
before; post = the rest of the call outside the counted dequant pass; pass; stall.

    .venv/bin/python benchmarks/timeline_delay_breakdown.py 4/6,4/10,6/10,6/14,8/14,8/18
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np

from slacktier.engine.reads import LayerReads
from slacktier.serve.predict import DelayedEngine, delay_prediction, run_delayed_replay
from slacktier.serve.runs import clip_sessions
from slacktier.serve.tiers import Placement, TierSet
from slacktier.serve.timeline import SweepConfig, TimelineRunner, load_profile, sleep_then_spin
from slacktier.tables.engram_hash import EngramLayout
from slacktier.workloads.corpus import CorpusConfig, load_workload
from slacktier.workloads.hashing import EngramLookupHasher
from slacktier.workloads.replay import ReplayConfig, replay_steps

LOG: list[tuple] = []   # (what, deadline or layer, start s, end s) of the step being run
KEYS = ("excess", "s", "rover1", "dover1", "pre1", "wait1", "post1", "pass1", "stall1",
        "rover14", "dover14", "pre14", "wait14", "post14", "pass14", "stall14")


class TimedClock:
    """perf_counter; every wait_until logged with its deadline."""

    def __init__(self, tag: str) -> None:
        self.tag = tag

    def now(self) -> float:
        return time.perf_counter()

    def wait_until(self, deadline: float) -> None:
        a = time.perf_counter()
        sleep_then_spin(deadline)
        LOG.append((self.tag, deadline, a, time.perf_counter()))


class TimedEngine:
    """The engine with each gather call logged."""

    def __init__(self, inner) -> None:
        self.inner = inner

    def begin_step(self, ids) -> None:
        self.inner.begin_step(ids)

    def gather(self, layer: int):
        a = time.perf_counter()
        out = self.inner.gather(layer)
        LOG.append(("gather", layer, a, time.perf_counter()))
        return out

    def end_step(self):
        return self.inner.end_step()


def timed_wait(self, layer, _wait=LayerReads.wait):
    a = time.perf_counter()
    out = _wait(self, layer)
    LOG.append(("rwait", layer, a, time.perf_counter()))
    return out


def pieces(st, log, t0: float, layers: tuple[int, int]) -> dict[str, float]:
    """One step's pieces per layer (ms)."""
    r: dict[str, float] = {"s": st.s_ms}
    runner = [e for e in log if e[0] == "runner"]
    delay = [e for e in log if e[0] == "delay"]
    for i, layer in enumerate(layers):
        rw, dw = runner[i], delay[i]
        g = next(e for e in log if e[0] == "gather" and e[1] == layer)
        w = next(e for e in log if e[0] == "rwait" and e[1] == layer and g[2] <= e[2] <= g[3])
        r[f"rover{layer}"] = (rw[3] - max(rw[1], rw[2])) * 1e3
        r[f"dover{layer}"] = (dw[3] - max(dw[1], dw[2])) * 1e3
        r[f"pre{layer}"] = (w[2] - g[2]) * 1e3
        r[f"wait{layer}"] = (w[3] - w[2]) * 1e3
        r[f"post{layer}"] = (g[3] - w[3]) * 1e3 - st.gather_ms[layer]
        r[f"pass{layer}"] = st.gather_ms[layer]
        r[f"stall{layer}"] = st.stall_ms[layer]
    return r


def main(argv: list[str]) -> int:
    spec = argv[0] if argv else "4/6,4/10,6/10,6/14,8/14,8/18"
    pairs = [tuple(float(x) for x in p.split("/")) for p in spec.split(",")]
    cfg = SweepConfig(workdir="runs/timeline_delay_breakdown", decode_steps=16)
    layout = EngramLayout.scaled(cfg.engram_vocab, (1, 14))
    first, second = layout.layer_ids[:2]
    hasher = EngramLookupHasher(layout)
    split = load_workload(cfg.workload, CorpusConfig(seed=cfg.seed, agent_sessions_per_source=1))
    pool = clip_sessions(split.holdout, cfg.max_session_tokens, cfg.max_turns) + \
        clip_sessions(split.fit, cfg.max_session_tokens, cfg.max_turns)
    batch = 8
    times = load_profile(cfg.profile).times(batch, cfg.workload, layout.layer_ids)
    tiers = TierSet(Path(cfg.workdir) / "tables", layout, seed=cfg.seed + 1, max_cache_rows=cfg.cache_rows,
                    max_tokens=cfg.prefill_chunk_tokens, devices=1)
    tiers.stage(device_counts=(1,))
    rows = []
    LayerReads.wait = timed_wait
    try:
        for d1, d14 in pairs:
            tiers.provider(Placement("dram", ((first, "dram"), (second, "dram"))))
            engine = DelayedEngine(TimedEngine(tiers.engine), {first: d1, second: d14}, clock=TimedClock("delay"))
            runner = TimelineRunner(engine, times, clock=TimedClock("runner"))
            step, out = runner.step, []

            def logged_step(ids, t0=None, _step=step, _out=out):
                LOG.clear()
                st = _step(ids, t0=t0)
                _out.append((st, list(LOG), t0))
                return st

            runner.step = logged_step
            rc = ReplayConfig(batch=batch, decode_tokens=cfg.decode_tokens,
                              prefill_chunk_tokens=cfg.prefill_chunk_tokens)
            run_delayed_replay(runner, engine, iter(replay_steps(pool, hasher, rc)), batch, cfg.decode_steps)
            eq1 = delay_prediction(times, {first: d1, second: d14})
            for st, log, t0 in out:
                rows.append({"pair": f"{d1:g}/{d14:g}", "excess": st.stall_total_ms - eq1,
                             **pieces(st, log, t0, (first, second))})
    finally:
        LayerReads.wait = timed_wait.__defaults__[0]
        tiers.close()
    Path(cfg.workdir, "rows.json").write_text(json.dumps(rows))
    print(f"{'pair':>6} " + " ".join(f"{k:>7}" for k in KEYS) + "   (medians over steps, ms)")
    for pair in dict.fromkeys(r["pair"] for r in rows):
        rs = [r for r in rows if r["pair"] == pair]
        print(f"{pair:>6} " + " ".join(f"{np.median([r[k] for r in rs]):7.3f}" for k in KEYS))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
