"""begin_step's one compiled entry against the per-layer path on one engine: where each path's time goes.

One engine (one TP4 rank of the V4.1 tables, owned_only, B = 128, 2M cache
rows, sparse disk regions: `_ab_worker.py begin_step`'s setting) runs every
step through one path or the other, chosen at random per step
(`StepEngine._one_entry`). Both paths leave the same cache state
(tests/test_engine_one_entry.py), so the two see the same memory, cache and
machine phase, which engines of their own (`bench_pass_anatomy.py`) and
processes of their own (`bench_hot_path.py`) cannot promise. Per step, thread
CPU time of:
- begin_step;
- the compiled code in it: `steppass.run_layers` (entry) or the two
  `directory.resolve_layer` calls with their numba dispatch (per-layer);
- the rest, the Python around that code;
and, between steps, the directory floor (`_ab_worker._directory_floor`).
Warm: the last 30 positions of the warm-up looked up again, `--rounds` times.
Fresh: `--rounds` x 30 steps of new tokens.

    .venv/bin/python benchmarks/bench_entry_ab.py [--rounds 10] [--append]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
from pathlib import Path

import numpy as np

from _common import command_line, count_main, machine, thread_timed, utc_stamp

sys.path.insert(0, str(Path(__file__).parent))
import _ab_worker as W  # noqa: E402

import slacktier.cache.rowcache as RC  # noqa: E402
import slacktier.engine.steppass as SP  # noqa: E402
from slacktier.tables.engram_hash import EngramLayout  # noqa: E402

SECTION = "## The tier: page sources, cache and step engine"
SUBSECTION = "### Hot path against issue 14's targets"
WARM_STEPS, SPAN = 64, 30
PATHS = {True: "one compiled entry", False: "per layer"}


def measure(rounds: int) -> dict:
    layout = EngramLayout.v41()
    ids = W._ids(layout, 128, WARM_STEPS + rounds * SPAN)
    inside: list[int] = []   # ns of compiled code in the current begin_step
    real_entry, real_pass = SP.run_layers, RC.resolve_layer
    out = {(kind, path, what): [] for kind in ("warm", "fresh") for path in PATHS
           for what in ("begin", "compiled", "python")} | {("warm", "floor"): [], ("fresh", "floor"): []}
    rng = np.random.default_rng(7)
    with tempfile.TemporaryDirectory() as tmp:
        engine = W.rank_engine(layout, Path(tmp))
        try:
            for t in range(WARM_STEPS):
                W.timed_step(engine, ids[t])
            for path in PATHS:   # each path's compiled code loaded (or compiled) outside the timed steps
                engine._one_entry = path
                W.timed_step(engine, ids[WARM_STEPS - 1])
            SP.run_layers, RC.resolve_layer = thread_timed(real_entry, inside), thread_timed(real_pass, inside)
            steps = [("warm", t) for _ in range(rounds) for t in range(WARM_STEPS - SPAN, WARM_STEPS)]
            steps += [("fresh", t) for t in range(WARM_STEPS, WARM_STEPS + rounds * SPAN)]
            for kind, t in steps:
                out[(kind, "floor")].append(W._directory_floor(engine, ids[t], rng))
                path = random.random() < 0.5
                engine._one_entry = path
                inside.clear()
                begin, _, _ = W.timed_step(engine, ids[t])
                compiled = sum(inside) / 1e3
                out[(kind, path, "begin")].append(begin)
                out[(kind, path, "compiled")].append(compiled)
                out[(kind, path, "python")].append(begin - compiled)
        finally:
            SP.run_layers, RC.resolve_layer = real_entry, real_pass
            engine.close()
    return out


def report(out: dict, args: argparse.Namespace) -> str:
    def mmm(v: list[float]) -> str:
        return f"{min(v):.1f} / {statistics.median(v):.1f} / {max(v):.1f}"

    rows = []
    for kind in ("warm", "fresh"):
        floor = statistics.median(out[(kind, "floor")])
        base = statistics.median(out[(kind, False, "begin")])
        for path, name in PATHS.items():
            b, c, p = (out[(kind, path, w)] for w in ("begin", "compiled", "python"))
            rows.append(f"| {kind} | {name} ({len(b)} steps) | {mmm(b)} | {statistics.median(b) / base:.2f} | "
                        f"{mmm(c)} | {statistics.median(c) / floor:.2f} | {mmm(p)} |")
        rows.append(f"| {kind} | directory floor | {mmm(out[(kind, 'floor')])} | | | | |")
    return "\n".join([
        f"#### The compiled entry and the per-layer path on one engine, {utc_stamp()}",
        "",
        f"`{command_line(__file__, sys.argv[1:])}`; {machine()}; each step through one path chosen at random, "
        "the floor measured before each step; thread CPU (us, min / median / max). \"compiled\": "
        "`run_layers` (entry) or the two `resolve_layer` calls with their dispatch (per layer); \"Python\": "
        "begin_step minus that (each timed call adds two clock reads to its side).",
        "",
        "| steps | path | begin_step | vs per layer (median) | compiled | compiled / floor (median) | Python |",
        "|---|---|---|---|---|---|---|",
        *rows,
    ])


def main() -> int:
    return count_main(__doc__, "rounds", 10, SECTION, SUBSECTION, measure, report)


if __name__ == "__main__":
    raise SystemExit(main())
