"""begin_step (s) on the emulated tier with its native lane against the Python submit it replaced (issue 31).

The what-if's four TP ranks at B = 128 on `nvme-paper` ("both 1 disk" and "both 4 disks" by default), each
placement run twice per round, interleaved and shuffled:

    lane     the emulated queue's native lane: the cache's compiled pass records each layer's pages in the
             queue's lane table (whatif.lane, `_lane_submit`), and begin_step is one compiled call
    python   every batch through `EmulatedSource.submit` (the thread queue's checks and copies, the device's
             timing record): the path before the lane, and the one a refused batch still takes. The benchmark
             turns the lane off by having `lane` answer None, as a source without one does.

Per variant: s per rank (begin_step, from the what-if's own timeline: mean over the run's steps, then the mean
and the slowest of the four ranks), the overhead it gives, and the checker's mismatching rows (0 expected).

    flock /tmp/slacktier-bench.lock .venv/bin/python benchmarks/engine/bench_emulated_lane.py --rounds 3
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # the repo root: benchmarks.* imports
from benchmarks._harness import (command_line, format_table, interleaved, machine, publish, utc_stamp,  # noqa: E402
                                 write_result)

from slacktier.whatif.run import WhatIfConfig, run_whatif, table2_placements  # noqa: E402
from slacktier.whatif.tier import EmulatedSource  # noqa: E402

VARIANTS = ("lane", "python")
SECTION = "## begin_step on the emulated tier: the native lane against Python's submit"


@contextlib.contextmanager
def variant(name: str):
    """Run with the native lane ("lane") or with every batch through Python's submit ("python")."""
    if name == "lane":
        yield
        return
    had = EmulatedSource.lane
    EmulatedSource.lane = lambda self: None
    try:
        yield
    finally:
        EmulatedSource.lane = had


def measure(args) -> dict[tuple[str, str], list[dict]]:
    cfg = WhatIfConfig(workdir=args.out, workload=args.workload, batch=args.batch, ranks=4,
                       engram_vocab=args.vocab, decode_steps=args.steps, warmup_steps=args.warmup, check_steps=1,
                       max_session_tokens=4096 if args.workload == "agent" else 1024)
    wanted = args.placements.split(",")
    placements = [p for p in table2_placements("nvme-paper") if p.name in wanted]
    got: dict[tuple[str, str], list[dict]] = {}
    for rnd, (v, p) in interleaved([(v, p) for v in VARIANTS for p in placements], args.rounds, seed=31):
        with variant(v):
            _, [run] = run_whatif(cfg, [p], runs=1)
        s = run.rank_mean(lambda st: st.s_ms)
        every = [r.s_ms for st in run.steps for r in st]   # each rank's begin_step of each TP step
        row = {"s_mean_ms": float(s.mean()), "s_max_ms": float(s.max()), "s_median_ms": float(np.median(every)),
               "overhead_pct": 100 * float(run.tp_stalls_ms().mean()) / run.step_ms, "mismatches": run.mismatches}
        got.setdefault((p.name, v), []).append(row)
        print(f"round {rnd} {v:6} {p.name:14} s {row['s_mean_ms']:.2f} ms (slowest rank {row['s_max_ms']:.2f}, "
              f"median of begin_steps {row['s_median_ms']:.2f}), "
              f"overhead {row['overhead_pct']:+.1f}%, {row['mismatches']} mismatching rows", flush=True)
    return got


def report(got: dict[tuple[str, str], list[dict]], args) -> str:
    rows = []
    figures = {}
    for (name, v), rs in got.items():
        s = [r["s_mean_ms"] for r in rs]
        smax = [r["s_max_ms"] for r in rs]
        smed = [r["s_median_ms"] for r in rs]
        ov = [r["overhead_pct"] for r in rs]
        rows.append((name, v, len(rs), f"{np.median(s):.2f} ({min(s):.2f}-{max(s):.2f})",
                     f"{np.median(smax):.2f}", f"{np.median(smed):.2f}",
                     f"{np.median(ov):+.1f}% ({min(ov):+.1f}..{max(ov):+.1f})", sum(r["mismatches"] for r in rs)))
        figures[f"{name}/{v}/s_ms"] = float(np.median(s))
        figures[f"{name}/{v}/s_median_ms"] = float(np.median(smed))
    ratios = []
    for name in dict.fromkeys(n for n, _ in got):
        lane, py = got.get((name, "lane")), got.get((name, "python"))
        if lane and py:
            r = np.median([a["s_mean_ms"] / b["s_mean_ms"] for a, b in zip(lane, py)])
            rm = np.median([a["s_median_ms"] / b["s_median_ms"] for a, b in zip(lane, py)])
            ratios.append(f"{name}: lane/python s = {r:.2f}x on the mean per rank, {rm:.2f}x on the median "
                          "begin_step (median of rounds)")
            figures[f"{name}/s_ratio"] = float(r)
    write_result("bench_emulated_lane", figures)
    return "\n".join([
        f"### {utc_stamp()}", "", f"`{command_line(__file__)}`; {machine()}; the machine is shared (load on its "
        "2 cores from other engineers' work: compare the variants side by side, not with other days).", "",
        f"{args.workload}, B={args.batch}, 4 TP ranks, nvme-paper, table of {args.vocab:,} rows per head, "
        f"{args.warmup} warm-up + {args.steps} timed TP steps per run, {args.rounds} rounds, variants interleaved.",
        "", format_table(["placement", "variant", "runs", "s per rank, ms: median of runs (range)",
                          "slowest rank s", "median begin_step ms", "overhead", "mismatching rows"], rows), "",
        *ratios, "", "(s per rank: each rank's mean over the run's TP steps, then the mean of the four ranks, as the "
        "what-if report's s; the median over every rank's begin_step shows the same without the steps a busy "
        "machine preempted.)", ""])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--workload", default="chat", choices=("agent", "chat"))
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=250_000)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--placements", default="both 1 disk,both 4 disks")
    ap.add_argument("--out", default="runs/whatif")
    ap.add_argument("--append", action="store_true", help="append the table to docs/bench-log/whatif.md")
    args = ap.parse_args()
    return publish(report(measure(args), args), args.append, SECTION)


if __name__ == "__main__":
    raise SystemExit(main())
