"""begin_step's Python: an earlier commit's engine code beside the current one, on one engine, step by step.

The earlier commit's `engine/step.py` and `engine/steppass.py` are loaded from
git as modules of their own (`bench_step_ab.old_engine_class`: its compiled
entry compiled afresh, uncached; the directory pass is this tree's). One engine (one TP4 rank of the V4.1 tables,
owned_only, B = 128, 2M cache rows, sparse disk regions: `_ab_worker.py
begin_step`'s setting) runs each step as one commit's StepEngine or the other,
chosen at random per step: the instance's class is switched between steps and
each class keeps its own StepPlan over the same cache, scratch and pool. So the
two sides see the same memory, cache state and machine phase, which engines of
their own (`bench_step_ab.py`) cannot promise: there the two engines' passes
differ by more than the Python under test.

Per step, thread CPU of begin_step, of the compiled entry inside it
(`steppass.run_layers`, each side's own) and the rest, the Python around it;
and, before each step, the directory floor (`_ab_worker._directory_floor`).
Warm: the last 30 positions of the warm-up looked up again, `--rounds` times
(all hits). Fresh: `--rounds` x 30 steps of new tokens (misses, pages
submitted).

    .venv/bin/python benchmarks/bench_begin_ab.py --against cae9ba9 [--rounds 8] [--append]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
from pathlib import Path

import numpy as np

from _common import against_main, command_line, machine, thread_timed, utc_stamp

sys.path.insert(0, str(Path(__file__).parent))
import _ab_worker as W  # noqa: E402
from bench_step_ab import old_engine_class  # noqa: E402

import slacktier.engine.step as S  # noqa: E402
import slacktier.engine.steppass as SP  # noqa: E402
from slacktier.tables.engram_hash import EngramLayout  # noqa: E402

SECTION = "## The tier: page sources, cache and step engine"
SUBSECTION = "### Hot path against issue 14's targets"
WARM_STEPS, SPAN = 64, 30


def measure(commit: str, rounds: int) -> dict:
    layout = EngramLayout.v41()
    ids = W._ids(layout, 128, WARM_STEPS + rounds * SPAN)
    inside: list[int] = []   # ns of compiled entry in the current begin_step
    out = {(kind, name, what): [] for kind in ("warm", "fresh") for name in (commit, "current")
           for what in ("begin", "compiled", "python")} | {("warm", "floor"): [], ("fresh", "floor"): []}
    rng = random.Random(7)
    floor_rng = np.random.default_rng(7)
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        old_cls, old_sp = old_engine_class(commit, tmp)
        if old_sp is None:
            raise SystemExit(f"{commit} has no compiled entry (engine/steppass.py) to time: use bench_step_ab.py")
        classes = {commit: old_cls, "current": S.StepEngine}
        entries = {commit: old_sp, "current": SP}
        engine = W.rank_engine(layout, tmp)
        plans = {name: None for name in classes}

        def step(name: str, t: int) -> float:
            """One whole step as `name`'s class; begin_step's thread CPU (us)."""
            engine.__class__ = classes[name]
            engine._plan = plans[name]
            for run in engine._layers.values():   # the earlier code clears these in begin_step, ours in end_step
                run.resolved = run.gathered = False
            begin, _, _ = W.timed_step(engine, ids[t])
            plans[name] = engine._plan
            return begin

        real = {name: sp.run_layers for name, sp in entries.items()}
        try:
            for t in range(WARM_STEPS):
                step("current", t)
            for name in classes:   # each side's compiled entry compiled (or loaded) outside the timed steps
                step(name, WARM_STEPS - 1)
            for name, sp in entries.items():
                sp.run_layers = thread_timed(real[name], inside)
            steps = [("warm", t) for _ in range(rounds) for t in range(WARM_STEPS - SPAN, WARM_STEPS)]
            steps += [("fresh", t) for t in range(WARM_STEPS, WARM_STEPS + rounds * SPAN)]
            for kind, t in steps:
                out[(kind, "floor")].append(W._directory_floor(engine, ids[t], floor_rng))
                name = rng.choice(list(classes))
                inside.clear()
                begin = step(name, t)
                compiled = sum(inside) / 1e3
                out[(kind, name, "begin")].append(begin)
                out[(kind, name, "compiled")].append(compiled)
                out[(kind, name, "python")].append(begin - compiled)
        finally:
            for name, sp in entries.items():
                sp.run_layers = real[name]
            engine.__class__ = S.StepEngine
            engine.close()
    return out


def report(out: dict, commit: str, args: argparse.Namespace) -> str:
    med = statistics.median

    def mmm(v: list[float]) -> str:
        return f"{min(v):.1f} / {med(v):.1f} / {max(v):.1f}"

    rows = []
    for kind in ("warm", "fresh"):
        floor = med(out[(kind, "floor")])
        for what in ("begin", "compiled", "python"):
            a, b = out[(kind, commit, what)], out[(kind, "current", what)]
            over = f"{med(a) / floor:.2f} / {med(b) / floor:.2f}" if what != "python" else ""
            rows.append(f"| {kind} | {what} | {mmm(a)} | {mmm(b)} | {med(b) / med(a):.2f} | "
                        f"{med(b) - med(a):+.1f} | {over} |")
        rows.append(f"| {kind} | directory floor | {mmm(out[(kind, 'floor')])} | | | | |")
    n = {k: len(out[(k, "current", "begin")]) for k in ("warm", "fresh")}
    return "\n".join([
        f"#### begin_step, {commit}'s engine code beside the current code on one engine, {utc_stamp()}",
        "",
        f"`{command_line(__file__, sys.argv[1:])}`; {machine()}; each step as one side chosen at random "
        f"({n['warm']} warm and {n['fresh']} fresh steps for the current side of {2 * args.rounds * SPAN}), the "
        "floor measured before each step; thread CPU (us). \"compiled\": each side's `steppass.run_layers`; "
        "\"python\": begin_step minus that (each timed call adds two clock reads to it).",
        "",
        f"| steps | what | {commit} (min / median / max) | current (min / median / max) | current / {commit} "
        f"(median) | difference (us, median) | over the floor, {commit} / current (median) |",
        "|---|---|---|---|---|---|---|",
        *rows,
    ])


def main() -> int:
    return against_main(__doc__, "engine code", 8, SECTION, SUBSECTION, measure, report)


if __name__ == "__main__":
    raise SystemExit(main())
