"""Our io_uring rate against fio's, reading the same pages every run or new ones: is the comparison fair?

`bench_hot_path.py`'s disk task read the same 105,000 random pages of its
1 GiB file in every run (a fixed seed), while fio draws new offsets every run
(`randrepeat=0`). The host behind this VM's disk may still hold pages read in
the last run, so the fixed pattern can read faster than fresh pages do. Here
each round runs, back to back in shuffled order on the hot path's file:
- fio (randread 4 KiB, O_DIRECT, io_uring, depth 128, 2 s, new offsets);
- our engine on the fixed pattern (seed 1, what the disk task read up to
  commit 44b8be3);
- our engine on new pages (a new seed each run, what it reads now);
each engine run 150 batches of 700 pages (`_ab_worker.disk_run`). Reported:
kIOPS min / median / max, and each engine run over the fio run of its round.

    .venv/bin/python benchmarks/bench_disk_repeat.py [--rounds 8] [--append]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
from pathlib import Path

from _common import ROOT, command_line, count_main, machine, utc_stamp

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("AB_DIR", str(ROOT / "runs" / "bench_hot_path"))   # the hot path's file
import _ab_worker as W  # noqa: E402
from bench_hot_path import DEPTH, ensure_fio  # noqa: E402
from bench_store_disk import run_fio  # noqa: E402

SECTION = "## The tier: page sources, cache and step engine"
SUBSECTION = "### Hot path against issue 14's targets"
SIDES = ("fio", "same pages every run (seed 1)", "new pages every run")


def measure(rounds: int) -> dict[str, list[float]]:
    ensure_fio()
    Path(os.environ["AB_DIR"]).mkdir(parents=True, exist_ok=True)
    path = W.disk_file()
    out: dict[str, list[float]] = {k: [] for k in SIDES} | {f"{k} / fio": [] for k in SIDES[1:]}
    rng = random.Random(3)
    for r in range(rounds):
        order = list(SIDES)
        rng.shuffle(order)
        got = {}
        for side in order:
            if side == "fio":
                got[side] = run_fio(path, DEPTH, 2.0, r).iops / 1e3
            else:
                got[side] = W.disk_run(path, 150, 1 if side == SIDES[1] else None)["disk_kiops"]
        for side in SIDES:
            out[side].append(got[side])
        for side in SIDES[1:]:
            out[f"{side} / fio"].append(got[side] / got["fio"])
        print(f"round {r + 1}/{rounds}: " + ", ".join(f"{k} {v:.1f}" for k, v in got.items()), flush=True)
    return out


def report(out: dict[str, list[float]], args: argparse.Namespace) -> str:
    def mmm(v: list[float], spec: str) -> str:
        return " / ".join(format(x, spec) for x in (min(v), statistics.median(v), max(v)))

    rows = [f"| {side} | {mmm(out[side], '.1f')} | "
            f"{mmm(out[side + ' / fio'], '.2f') if side != 'fio' else '1'} |" for side in SIDES]
    return "\n".join([
        f"#### Our io_uring rate against fio's, the same pages every run or new ones, {utc_stamp()}",
        "",
        f"`{command_line(__file__, sys.argv[1:])}`; {machine()}; {args.rounds} rounds, each one fio run (2 s, "
        f"depth {DEPTH}, new offsets) and two engine runs (150 batches of 700 random 4 KiB O_DIRECT reads) back "
        "to back in shuffled order, on the hot path's 1 GiB file.",
        "",
        "| reads | kIOPS (min / median / max) | over the fio run of its round (min / median / max) |",
        "|---|---|---|",
        *rows,
    ])


def main() -> int:
    return count_main(__doc__, "rounds", 8, SECTION, SUBSECTION, measure, report)


if __name__ == "__main__":
    raise SystemExit(main())
