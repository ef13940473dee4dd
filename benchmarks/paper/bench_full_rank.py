"""One TP rank's full-size V4.1 shard on the step timeline: every rank's pages, then Table 2's rows for one rank.

    # every rank's missed pages per full-batch decode step (no staging, no timing)
    .venv/bin/python benchmarks/bench_full_rank.py pages --workload agent --batches 128 [--append]
    # stage rank R's shard (52 GB, refused before writing if the disk lacks space) and time Table 2's rows on it
    flock /tmp/slacktier-bench.lock nice -n -5 .venv/bin/python benchmarks/bench_full_rank.py timeline \\
        --rank 3 --workload agent --batches 128 --runs 3 [--append]
    # whole sessions, the window timed after 1,000 decode steps run untimed (cached placements read them: ~3 min a
    # cached run), the measured hit rates beside the characterizer's, the planner's stalls from a read model
    .venv/bin/python benchmarks/paper/bench_full_rank.py timeline --rank 3 --workload agent --batches 128 \
        --engram-vocab 4000000 --whole-sessions --start-decode-steps 1000 --read-model 3.229,0.01344,0.01402,0

Device compute comes from a compute profile (default v41_paper); hashing,
begin_step, the cache and every page read are real, on this machine's disk.
`benchmarks/bench_timeline.py --full-rank R` runs the `timeline` part.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # the repo root: benchmarks.* imports
from benchmarks._harness import bench_log, append_to_section, command_line, machine, utc_stamp  # noqa: E402

from benchmarks.paper.full_rank import (FullRankConfig, full_rank_table, peak_rss_gib, rank_page_counts,  # noqa: E402
                                          planner_stalls, rank_pages_table, run_full_rank, window_hit_rates,
                                          window_table)
from slacktier.plan.readmodel import DeviceReadModel  # noqa: E402

SECTION = "## Step timeline"


def _append(title: str, regime: str, wall: float, table: str) -> None:
    block = "\n".join([f"### {utc_stamp()}: {title}", "", regime, "",
                       f"`{command_line(__file__)}` ({wall:.0f} s; {machine()})", "", "```", table, "```"])
    append_to_section(block, SECTION)


def add_session_arguments(ap: argparse.ArgumentParser) -> None:
    """--whole-sessions and --start-decode-steps (FullRankConfig's fields; also bench_one_disk.py's)."""
    ap.add_argument("--whole-sessions", action="store_true",
                    help="every turn of every session, no token cap (prefills chunked at 4096 tokens)")
    ap.add_argument("--start-decode-steps", type=int, default=0,
                    help="decode steps run untimed before the timed window (cached placements on the engine, "
                         "so the cache holds the sessions' earlier turns)")


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """The options of the `timeline` part (also `bench_timeline.py --full-rank R`)."""
    ap.add_argument("--rank", type=int, default=3)
    ap.add_argument("--workload", default="agent")
    ap.add_argument("--batches", default="128")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--decode-steps", type=int, default=64, help="full-batch decode steps timed per run")
    ap.add_argument("--warmup-steps", type=int, default=8, help="full-batch decode steps run first, not timed")
    ap.add_argument("--start-spread-steps", type=int, default=32,
                    help="the first B sessions start over this many decode steps (not in lockstep)")
    ap.add_argument("--check-steps", type=int, default=4, help="checked decode steps after the timed ones")
    ap.add_argument("--max-session-tokens", type=int, default=0, help="0: 4096 for agent, 1024 for chat")
    add_session_arguments(ap)
    ap.add_argument("--no-window-hits", action="store_true",
                    help="skip the characterizer's hit rates on the same replay (printed beside the measured ones)")
    ap.add_argument("--read-model", default="",
                    help="a,b,c,c_behind (ms): the disk's read-time model fitted before the runs "
                         "(bench_probe_readfit.py); prints the planner's stall per placement from the "
                         "characterizer's pages beside the measured one")
    ap.add_argument("--placements", default="", help="comma-separated placement names (default: all)")
    ap.add_argument("--profile", default="v41_paper")
    ap.add_argument("--workdir", default="runs/full_rank")
    ap.add_argument("--engram-vocab", type=int, default=0,
                    help="0: the full-size shard; > 0: the V4.1 hash over tables scaled to this vocabulary "
                         "(4,000,000: a quarter of the rows, 13 GB for rank 3)")
    ap.add_argument("--append", action="store_true", help=f"append the table to {bench_log(SECTION).name} ({SECTION})")


def config(args: argparse.Namespace) -> FullRankConfig:
    """The FullRankConfig of parsed arguments."""
    return FullRankConfig(workdir=args.workdir, rank=args.rank, profile=args.profile, workload=args.workload,
                          batches=tuple(int(b) for b in args.batches.split(",")), runs=args.runs,
                          decode_steps=args.decode_steps, warmup_steps=args.warmup_steps,
                          start_spread_steps=args.start_spread_steps,
                          check_steps=args.check_steps,
                          max_session_tokens=args.max_session_tokens, engram_vocab=args.engram_vocab,
                          placements=tuple(p for p in args.placements.split(",") if p),
                          whole_sessions=args.whole_sessions, start_decode_steps=args.start_decode_steps)


def timeline(args: argparse.Namespace) -> int:
    """Stage (or reuse) the rank's shard and run Table 2's placements on it."""
    cfg = config(args)
    t0 = time.perf_counter()
    profile, manifest, runs = run_full_rank(cfg, progress=True)
    table = full_rank_table(profile, cfg, manifest, runs)
    in_order = sorted(runs, key=lambda r: (r.rep, r.order))
    table += ("\nwall time per run (s, the untimed steps before the window included): "
              + ", ".join(f"{r.placement} B={r.batch} {r.wall_s:.0f}" for r in in_order))
    if not args.no_window_hits:
        t1 = time.perf_counter()
        model = DeviceReadModel(*(float(x) for x in args.read_model.split(","))) if args.read_model else None
        for b in cfg.batches:
            hits = window_hit_rates(cfg, manifest, b, runs)
            planned = planner_stalls(profile, cfg, hits, runs, model) if model else None
            table += "\n\n" + window_table(hits, runs, planned)
        table += f"\n(the characterizer's replay and CLOCK: {time.perf_counter() - t1:.0f} s)"
    wall = time.perf_counter() - t0
    table += f"\npeak RSS of this process: {peak_rss_gib():.2f} GiB; the whole command: {wall:.0f} s"
    print(table)
    steps = sorted({r.summary.steps for r in runs})
    regime = (f"Regime: device compute from profile {profile.name} (the paper's V4.1 numbers, origin in the "
              f"table's first line); host, cache and I/O real: rank {cfg.rank}'s "
              + ("full-size" if not cfg.engram_vocab else f"scaled (engram_vocab {cfg.engram_vocab:,}: its pages "
                 "per step are the full size's, its directories the cache's, so s and reads are too; its rows "
                 "fewer)") + f" TP{cfg.ranks} shard of "
              f"both Engram layers ({manifest.total_pages * 4096 / 1e9:.1f} GB, synthetic rows, V4.1 hash and "
              f"layout) in one file on this VM's shared virtio disk (fio at QD 128: 29k-94k IOPS, median ~45k, "
              "docs/bench-log/tier.md; vs the paper's NVMe), O_DIRECT, "
              f"served by one process as that rank's (owned_only, its regions): the paper's \"4 disks\" "
              "arrangement, one disk per rank (its \"1 disk\" rows, four ranks on one disk, are "
              "bench_one_disk.py's); all tables of the process share the disk's one device queue; "
              f"{cfg.workload} traffic "
              f"({cfg.sessions_text}), {cfg.decode_tokens} "
              f"decode tokens per turn, {'/'.join(map(str, steps))} full-batch decode steps timed per run after "
              + (f"{cfg.start_decode_steps} decode steps off the timeline (cached placements: run on the engine "
                 "untimed; uncached: skipped) and " if cfg.start_decode_steps else "")
              + f"{cfg.warmup_steps} untimed ones (first sessions' starts spread over {cfg.start_spread_steps} "
              "steps), "
              f"{cfg.runs} shuffled runs. A DRAM layer is the profile itself (stock path, not on the host's "
              "begin_step path); its host memory is computed. This cannot show the device's gather, PCIe, "
              "or the other three ranks' processes running beside this one (their pages are counted in the "
              "`pages` table); the step is this rank's.")
    if args.append:
        size = "full-size" if not cfg.engram_vocab else f"scaled (engram_vocab {cfg.engram_vocab:,})"
        _append(f"{size} rank {cfg.rank} shard, {cfg.workload}, B={args.batches}", regime, wall, table)
    return 0


def pages(args: argparse.Namespace) -> int:
    """Every rank's pages per full-batch decode step, uncached and at the split cache's share."""
    t0 = time.perf_counter()
    out = []
    for wl in args.workload.split(","):
        for b in (int(x) for x in args.batches.split(",")):
            cfg = FullRankConfig(workload=wl, batches=(b,), max_session_tokens=args.max_session_tokens,
                                 start_spread_steps=args.start_spread_steps, engram_vocab=args.engram_vocab)
            out += rank_page_counts(cfg, b, capacities=tuple(int(c) for c in args.capacities.split(",")),
                                    progress=False, partitions=tuple(args.partitions.split(",")))
    wall = time.perf_counter() - t0
    table = rank_pages_table(out)
    print(table)
    regime = ("Regime: counts, not timings. The served CLOCK (pins per step) replayed over each TP4 rank's own "
              f"lookups under rank partition(s) {args.partitions} (columns: rank k owns hash columns 6k..6k+5, "
              "the engines' sharding; balanced: heads 2k, 2k+1 of every order) of the "
              + ("full V4.1 hash" if not args.engram_vocab else f"V4.1 hash over tables scaled to engram_vocab "
                 f"{args.engram_vocab:,}") + ", on the "
              "whole replay of the traffic (agent sessions within 4096 tokens, chat within 1024, 2 turns, "
              f"128 decode tokens per turn, the first B sessions' starts spread over {args.start_spread_steps} "
              "decode steps); pages = distinct 4 KiB pages of the rank's region missed per "
              "full-batch decode step; cache rows are per layer and rank (500,000 = half of the 1M-row split "
              "cache, and the layer-14-only cache).")
    if args.append:
        _append(f"every rank's pages per step ({args.workload}, B={args.batches})", regime, wall, table)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="part", required=True)
    p = sub.add_parser("pages", help="every rank's missed pages per decode step")
    p.add_argument("--workload", default="agent,chat")
    p.add_argument("--batches", default="128")
    p.add_argument("--max-session-tokens", type=int, default=0)
    p.add_argument("--start-spread-steps", type=int, default=32)
    p.add_argument("--engram-vocab", type=int, default=0,
                   help="0: the full V4.1 tables; N: the same hash over scaled tables (bench_one_disk's quarter "
                        "size is 4000000): pages per step should not change while the table dwarfs the cache")
    p.add_argument("--capacities", default="0,500000", help="cache rows per layer and rank (0: uncached)")
    p.add_argument("--partitions", default="columns", help="rank partitions, side by side on one trace "
                   "(tables.partition: columns, balanced)")
    p.add_argument("--append", action="store_true")
    add_arguments(sub.add_parser("timeline", help="Table 2's rows on one rank's full-size shard"))
    args = ap.parse_args(argv)
    return pages(args) if args.part == "pages" else timeline(args)


if __name__ == "__main__":
    sys.exit(main())
