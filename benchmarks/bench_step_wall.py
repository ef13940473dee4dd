"""begin_step's wall time beside its CPU time, and each layer's submission, on decode steps of new tokens.

The hot-path targets count begin_step's CPU time. Eq. 1's s is wall time: the
step's first read cannot start before the pass that finds it, and a thread that
is descheduled inside begin_step delays every read after that point. This
prints both per step, and per layer the time from the end of its pass to its
batch being queued on its disk source's C engine (`LayerCounters.submit_us`,
wall), then to its reads being done (`read_us`: the gathers follow begin_step
at once, so this is the reads' own time, including the worker's start), as
percentiles, so a tail shows where a median hides it.

Setting: `_ab_worker.py begin_step`'s (one TP4 rank of the V4.1 tables,
owned_only, B = 128, 2M cache rows, sparse disk regions, one io_uring disk
source and C engine per layer), through begin_step's compiled entry, 64 warm-up
steps, then `--steps` steps of new tokens.

The C engines' worker threads (named `st-uring`) run in the batch scheduling
class, so that one waking for a batch does not preempt the caller
(csrc/uring_read.c). Before each step this script puts them, at random, in the
batch class or back in the normal one (`os.sched_setscheduler` on their thread
ids), so both are measured side by side on one engine.

    .venv/bin/python benchmarks/bench_step_wall.py [--steps 300] [--append]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from _common import command_line, count_main, machine, utc_stamp

sys.path.insert(0, str(Path(__file__).parent))
import _ab_worker as W  # noqa: E402

from slacktier.tables.engram_hash import EngramLayout  # noqa: E402

SECTION = "## The tier: page sources, cache and step engine"
SUBSECTION = "### Hot path against issue 14's targets"
LATE_US = 50.0   # a step whose wall time exceeds its CPU time by more than this was descheduled inside begin_step
CLASSES = {"batch (as built)": os.SCHED_BATCH, "normal (before)": os.SCHED_OTHER}


def set_workers(policy: int) -> int:
    """Put this process's C engine worker threads (`st-uring`) in scheduling class `policy`; how many."""
    n = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if f.read().strip() != "st-uring":
                    continue
            os.sched_setscheduler(int(tid), policy, os.sched_param(0))
            n += 1
        except (FileNotFoundError, ProcessLookupError):
            continue   # a thread that ended meanwhile
    return n


def measure(steps: int, warm_steps: int = 64) -> dict[str, list[float]]:
    layout = EngramLayout.v41()
    ids = W._ids(layout, 128, warm_steps + steps)
    out: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        engine = W.rank_engine(layout, Path(tmp))
        try:
            for t in range(warm_steps):
                W.timed_step(engine, ids[t])
            for t in range(warm_steps, warm_steps + steps):
                cls = random.choice(list(CLASSES))
                if set_workers(CLASSES[cls]) != len(engine.layers):
                    raise SystemExit("expected one st-uring worker per layer: is the io_uring engine in use?")
                c0, w0 = time.thread_time_ns(), time.perf_counter_ns()
                engine.begin_step(ids[t])
                w1, c1 = time.perf_counter_ns(), time.thread_time_ns()
                for layer in engine.layers:
                    engine.gather(layer)
                counters = engine.end_step()
                out.setdefault(f"{cls}|begin_step CPU", []).append((c1 - c0) / 1e3)
                out.setdefault(f"{cls}|begin_step wall", []).append((w1 - w0) / 1e3)
                for layer, c in sorted(counters.layers.items()):
                    out.setdefault(f"{cls}|layer {layer}: pass (wall)", []).append(c.resolve_us)
                    out.setdefault(f"{cls}|layer {layer}: end of pass -> batch queued (wall)", []).append(c.submit_us)
                    out.setdefault(f"{cls}|layer {layer}: batch queued -> its reads done (wall)", []).append(c.read_us)
                    out.setdefault(f"{cls}|layer {layer}: pages", []).append(c.pages_read)
        finally:
            engine.close()
    return out


def report(out: dict[str, list[float]], args: argparse.Namespace) -> str:
    lines = [
        f"#### begin_step's wall time and CPU time, {utc_stamp()}",
        "",
        f"`{command_line(__file__, sys.argv[1:])}`; {machine()}; one TP4 rank of the V4.1 tables, B = 128, "
        f"compiled entry, one io_uring disk source per layer; {args.steps} decode steps of new tokens after 64 "
        f"warm-up steps, the C engines' worker threads put in the batch or the normal scheduling class at random "
        f"before each step (us).",
        "",
        "| figure | workers | p50 | p90 | p99 | max |",
        "|---|---|---|---|---|---|",
    ]
    figures = list(dict.fromkeys(k.split("|", 1)[1] for k in out))
    for fig in figures:
        for cls in CLASSES:
            v = out.get(f"{cls}|{fig}")
            if not v:
                continue
            p50, p90, p99 = np.percentile(v, [50, 90, 99])
            lines.append(f"| {fig} | {cls} | {p50:.1f} | {p90:.1f} | {p99:.1f} | {max(v):.1f} |")
    lines.append("")
    for cls in CLASSES:
        cpu, wall = np.array(out[f"{cls}|begin_step CPU"]), np.array(out[f"{cls}|begin_step wall"])
        late = int(np.count_nonzero(wall - cpu > LATE_US))
        lines.append(f"- workers {cls}: {late} of {len(cpu)} steps ran more than {LATE_US:.0f} us longer in wall "
                     f"time than in CPU time (median excess {statistics.median(wall - cpu):.1f} us).")
    return "\n".join(lines)


def main() -> int:
    return count_main(__doc__, "steps", 300, SECTION, SUBSECTION, measure, report)


if __name__ == "__main__":
    raise SystemExit(main())
