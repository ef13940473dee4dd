"""Step timeline: placements at B = 32, 64, 128 on a scaled table, measured stall vs Eq. 1's prediction.

Device compute comes from a compute profile (default: the paper's V4.1 numbers,
src/slacktier/serve/profiles/v41_paper.json); hashing, begin_step, the cache
and every page read are real, on this machine's disk. Each (B, placement) runs
`--runs` times in shuffled order; a B the traffic cannot fill is refused.

    .venv/bin/python benchmarks/bench_timeline.py [--batches 32,64,128] [--runs 3] [--append] [--plot PATH]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # the repo root: benchmarks.* imports
from benchmarks._harness import (bench_log, append_to_section, command_line, machine, pyplot,  # noqa: E402
                     save_figure, utc_stamp)

from benchmarks.paper.timeline_sweep import run_sweep  # noqa: E402
from slacktier.serve.report import timeline_table  # noqa: E402
from slacktier.serve.timeline import SweepConfig  # noqa: E402

SECTION = "## Step timeline"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="32,64,128")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--decode-steps", type=int, default=32, help="full-batch decode steps timed per run")
    ap.add_argument("--profile", default="v41_paper", help="a shipped profile name or a JSON file")
    ap.add_argument("--workload", default="chat")
    ap.add_argument("--workdir", default="runs/bench_timeline")
    ap.add_argument("--remote-nodes", type=int, default=0,
                    help="also the remote placements, from a local Redis Cluster of this many masters")
    ap.add_argument("--append", action="store_true", help=f"append the table to {bench_log(SECTION).name} ({SECTION})")
    ap.add_argument("--plot", default="", help="write a PNG: measured vs predicted stall per step")
    ap.add_argument("--full-rank", type=int, default=None, metavar="R",
                    help="time rank R's full-size V4.1 shard (staged, ~52 GB) instead of the scaled table: "
                         "bench_full_rank.py timeline --rank R with these options")
    args = ap.parse_args(argv)
    if args.full_rank is not None:
        from benchmarks.paper import bench_full_rank

        return bench_full_rank.main(["timeline", "--rank", str(args.full_rank), "--workload", args.workload,
                                     "--batches", args.batches, "--runs", str(args.runs), "--decode-steps",
                                     str(args.decode_steps), "--profile", args.profile]
                                    + (["--append"] if args.append else []))
    cfg = SweepConfig(workdir=args.workdir, profile=args.profile, workload=args.workload,
                      batches=tuple(int(b) for b in args.batches.split(",")), runs=args.runs,
                      decode_steps=args.decode_steps, remote_nodes=args.remote_nodes)
    t0 = time.perf_counter()
    profile, runs = run_sweep(cfg, progress=True)
    wall = time.perf_counter() - t0
    table = timeline_table(profile, runs)
    print(table)
    regime = (f"Regime: scaled table (~{cfg.engram_vocab * 24:,} rows per layer, V4.1 hash, 1 file on this VM's "
              f"disk, O_DIRECT), {cfg.workload} traffic, {cfg.decode_steps} full-batch decode steps per run, "
              f"{cfg.runs} shuffled runs; device compute from profile {profile.name} (origin in the table's first "
              f"line); host, cache and I/O real; kappa = 0."
              + (f" Remote rows: a local Redis Cluster of {cfg.remote_nodes} masters on loopback (ACLs on, the "
                 "serving user), sharing this VM's two cores with the engine." if cfg.remote_nodes else ""))
    if args.plot:
        plt = pyplot()
        fig, ax = plt.subplots(figsize=(5, 4))
        for r in runs:
            ax.scatter(r.summary.predicted_ms, r.summary.stall_ms, s=12)
        top = max([max(r.summary.predicted_ms, r.summary.stall_ms) for r in runs] + [1.0])
        ax.plot([0, top], [0, top], lw=0.8, color="gray")
        ax.set_xlabel("Eq. 1 predicted stall per step (ms)")
        ax.set_ylabel("measured stall per step (ms)")
        ax.set_title(f"step timeline, profile {profile.name}")
        save_figure(fig, args.plot)
    if args.append:
        block = "\n".join([f"### {utc_stamp()}", "", regime, "", f"`{command_line(__file__)}` ({wall:.0f} s; "
                           f"{machine()})", "", "```", table, "```"])
        append_to_section(block, SECTION)
    return 0


if __name__ == "__main__":
    sys.exit(main())
