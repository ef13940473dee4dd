"""The hot path before and after the architecture refactor (issue 10), side by side in one run.

`begin_step`, `gather` and the disk source are measured by `_ab_worker.py`,
run alternately under the tree before the refactor and the current tree, in
shuffled order, `--rounds` times; each run is a fresh process. Reported: each
figure's min / median / max over the rounds for both trees, and the ratio of
the medians (after / before; below 1 is faster for times, above 1 for IOPS).

    git worktree add /tmp/ab_before 97c974c        # the last commit before the refactor
    .venv/bin/python benchmarks/bench_refactor_ab.py --before /tmp/ab_before [--rounds 5] [--append]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
from pathlib import Path

from _common import ROOT, append_to_section, command_line, machine, utc_stamp

SECTION = "## The tier: page sources, cache and step engine"
SUBSECTION = "### Before and after the architecture refactor"
WORKER = Path(__file__).with_name("_ab_worker.py")

#: figure -> (task, what it is, higher is better)
FIGURES = {
    "warm_cpu_us": ("begin_step", "begin_step CPU, B=128, one TP4 rank of V4.1, warm cache (us)", False),
    "fresh_cpu_us": ("begin_step", "begin_step CPU, B=128, one TP4 rank, fresh tokens (us)", False),
    "gather_hit_us": ("gather", "gather B=128, every row a cache hit (us)", False),
    "gather_page_us": ("gather", "gather B=128, every row from page buffers (us)", False),
    "disk_cpu_us_per_page": ("disk", "disk io_uring, 700-page batches: CPU per page (us)", False),
    "disk_kiops": ("disk", "disk io_uring, 700-page batches: kIOPS", True),
}


def run(tree: Path, task: str, quick: bool) -> dict:
    """One worker run of `task` under `tree`'s package."""
    env = dict(os.environ, PYTHONPATH=str(tree / "src"))
    cmd = [sys.executable, str(WORKER), task] + (["--quick"] if quick else [])
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise SystemExit(f"{task} under {tree} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", type=Path, required=True, help="a checkout of the tree before the refactor")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tasks", default="begin_step,gather,disk")
    ap.add_argument("--quick", action="store_true", help="fewer steps per run (a smoke test)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--append", action="store_true", help="append the table to BENCHMARKS.md")
    args = ap.parse_args()
    trees = {"before": args.before.resolve(), "after": ROOT}
    for name, tree in trees.items():
        if not (tree / "src" / "slacktier").is_dir():
            raise SystemExit(f"{name}: {tree} has no src/slacktier")
    tasks = args.tasks.split(",")
    rng = random.Random(args.seed)
    values: dict[tuple[str, str], list[float]] = {}
    for r in range(args.rounds):
        jobs = [(name, task) for task in tasks for name in trees]
        rng.shuffle(jobs)
        for name, task in jobs:
            result = run(trees[name], task, args.quick)
            for key, value in result.items():
                if key in FIGURES:
                    values.setdefault((name, key), []).append(float(value))
            print(f"round {r + 1}/{args.rounds} {name:6s} {task}: "
                  + ", ".join(f"{k} {v:.2f}" for k, v in result.items() if k in FIGURES), flush=True)

    def mmm(v: list[float]) -> str:
        return f"{min(v):.2f} / {statistics.median(v):.2f} / {max(v):.2f}"

    lines = ["| figure | before (min / median / max) | after (min / median / max) | after / before |",
             "|---|---|---|---|"]
    for key, (task, label, _) in FIGURES.items():
        if task not in tasks:
            continue
        b, a = values[("before", key)], values[("after", key)]
        lines.append(f"| {label} | {mmm(b)} | {mmm(a)} | {statistics.median(a) / statistics.median(b):.3f} |")
    table = "\n".join(lines)
    print(table)
    if args.append:
        commit = subprocess.run(["git", "-C", str(trees["before"]), "rev-parse", "--short", "HEAD"],
                                capture_output=True, text=True, check=False).stdout.strip() or "unknown"
        block = (f"#### {utc_stamp()}\n\n`{command_line(__file__)}` with `--before` a worktree of commit "
                 f"{commit}; {machine()}. {args.rounds} rounds, each a fresh "
                 "process per tree and task, in shuffled order; both trees run the same worker "
                 "(`benchmarks/_ab_worker.py`).\n\n" + table + "\n")
        append_to_section(block, SECTION, SUBSECTION)
    return 0


if __name__ == "__main__":
    sys.exit(main())
