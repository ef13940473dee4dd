"""Rank partitions side by side: every rank's pages under columns and balanced, per-rank cache sizing, and the
timeline stall of each partition's slowest rank on this disk.

    # counts (no disk): per-rank miss curves on one trace, the slowest rank, even vs per-rank cache sizing
    .venv/bin/python benchmarks/bench_rank_partition.py curves --workload agent --batch 128
    # the slowest rank of each partition served on the step timeline (disk-split placement, one disk per rank:
    # one rank's process on this VM's disk), the partitions interleaved in shuffled order, 3 runs each
    .venv/bin/python benchmarks/bench_rank_partition.py stall --workload agent --batch 128 --runs 3 --log

`--log` appends the table to docs/bench-log/rank-partition.md. Each rank's shard is
staged once per partition under --workdir (about 3.3 GB each at --engram-vocab
1000000) and deleted at the end unless --keep.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
from _common import ROOT, command_line, machine, utc_stamp  # noqa: E402

from slacktier.plan.curves import MissCurve  # noqa: E402
from slacktier.plan.ranks import rank_cache_rows  # noqa: E402
from slacktier.serve.full_rank import FullRankConfig, rank_page_counts, run_full_rank  # noqa: E402
from slacktier.workloads.rank_pages import slowest_rank  # noqa: E402

LOG = ROOT / "docs" / "bench-log" / "rank-partition.md"
CAPACITIES = (0, 25_000, 50_000, 100_000, 200_000, 500_000, 1_000_000)


def _log(title: str, regime: str, wall: float, table: str) -> None:
    if not LOG.exists():
        LOG.write_text("# Rank partitions: dated runs\n\nWritten by benchmarks/bench_rank_partition.py.\n")
    with LOG.open("a") as f:
        f.write("\n".join(["", f"## {utc_stamp()}: {title}", "", regime, "",
                           f"`{command_line(__file__)}` ({wall:.0f} s; {machine()}; machine shared with other "
                           "engineers' jobs)", "", "```", table, "```", ""]))


def _curves(results, partition: str, ranks: int) -> list[MissCurve]:
    """Per rank: pages per step over both layers behind c rows per layer."""
    out = []
    for k in range(ranks):
        rs = [r for r in results if r.partition == partition and r.rank == k]
        caps = sorted({r.capacity_rows for r in rs})
        out.append(MissCurve(tuple(float(c) for c in caps),
                             tuple(sum(r.pages_mean for r in rs if r.capacity_rows == c) for c in caps)))
    return out


def curves(args: argparse.Namespace) -> int:
    """Per-rank pages at each cache size under each partition; even vs per-rank (plan.ranks) cache sizing."""
    t0 = time.perf_counter()
    parts = tuple(args.partitions.split(","))
    cfg = FullRankConfig(workload=args.workload, batches=(args.batch,), engram_vocab=args.engram_vocab)
    res = rank_page_counts(cfg, args.batch, capacities=CAPACITIES, partitions=parts)
    lines = [f"{args.workload} B={args.batch}: pages per step of each rank (layer 1 + layer 14), c rows of cache "
             "per layer and rank",
             f"{'partition':9} {'c/layer':>9} " + " ".join(f"{f'rank {k}':>7}" for k in range(cfg.ranks))
             + f" {'slowest':>7}"]
    for part in parts:
        for cap in CAPACITIES:
            rs = [r for r in res if r.partition == part and r.capacity_rows == cap]
            per = [sum(r.pages_mean for r in rs if r.rank == k) for k in range(cfg.ranks)]
            lines.append(f"{part:9} {cap:>9,} " + " ".join(f"{p:7.0f}" for p in per)
                         + f" {per[slowest_rank(rs, cap)]:7.0f}")
    lines += ["", "the same total cache, even or split by the ranks' curves (plan.ranks.rank_cache_rows): "
              "rows per layer of each rank -> the slowest rank's pages",
              f"{'partition':9} {'total/layer':>11} {'even':>6} {'per-rank rows':>40} {'per-rank':>8}"]
    for part in parts:
        cv = _curves(res, part, cfg.ranks)
        for per_rank in (25_000, 50_000, 100_000, 500_000):
            total = per_rank * cfg.ranks
            even = max(c.pages_at(float(per_rank)) for c in cv)
            split = rank_cache_rows(cv, total, unit_rows=5_000)
            rows = "/".join(f"{r // 1000}k" for r in split.cache_rows)
            lines.append(f"{part:9} {total:>11,} {even:6.0f} {rows:>40} {split.slowest_pages:8.0f}")
    table = "\n".join(lines)
    print(table)
    if args.log:
        regime = ("Regime: counts, not timings (bench_full_rank.py pages' replay: the served CLOCK over each TP4 "
                  "rank's own lookups, full-batch decode steps, first B sessions' starts spread over 32 steps); "
                  + (f"tables scaled to engram_vocab {args.engram_vocab:,}" if args.engram_vocab else
                     "full V4.1 tables") + ". Per-rank sizing splits the same total cache by the ranks' curves "
                  "(linear between the measured capacities) to minimize the slowest rank's pages.")
        _log(f"per-rank pages and cache sizing ({args.workload}, B={args.batch})", regime,
             time.perf_counter() - t0, table)
    return 0


def stall(args: argparse.Namespace) -> int:
    """Each partition's slowest rank on the timeline, disk-split, interleaved in shuffled order."""
    t0 = time.perf_counter()
    parts = tuple(args.partitions.split(","))
    base = dict(workload=args.workload, batches=(args.batch,), engram_vocab=args.engram_vocab, runs=1,
                decode_steps=args.decode_steps, warmup_steps=args.warmup_steps, placements=("disk-split",),
                workdir=args.workdir, profile=args.profile, cache_rows=args.cache_rows)
    res = rank_page_counts(FullRankConfig(**base), args.batch, capacities=(args.cache_rows // 2,), partitions=parts)
    slow = {p: slowest_rank([r for r in res if r.partition == p], args.cache_rows // 2) for p in parts}
    counted = {p: {r.layer: r.pages_mean for r in res if r.partition == p and r.rank == slow[p]} for p in parts}
    print(f"slowest ranks by the page count: {slow}", flush=True)
    rng = np.random.default_rng(args.seed)
    runs: dict[str, list] = {p: [] for p in parts}
    manifests = {}
    for rep in range(args.runs):
        for i in rng.permutation(len(parts)):
            p = parts[i]
            cfg = FullRankConfig(**base, rank=slow[p], partition=p, seed=0)
            _, manifests[p], out = run_full_rank(cfg, progress=True)
            runs[p] += out
    lines = [f"{args.workload} B={args.batch}, disk-split ({args.cache_rows // 2:,} rows per layer), profile "
             f"{args.profile}, each partition's slowest rank by the page count; {args.runs} runs each, interleaved",
             f"{'partition':9} {'rank':>4} {'counted pg L1/L14':>17} {'served pg L1/L14':>16} {'stall ms':>8} "
             f"{'min..max':>13} {'step ms':>7} {'overhead':>8} {'checked':>7}"]
    mean_stall = {}
    for p in parts:
        rs = runs[p]
        stalls = [r.summary.stall_ms for r in rs]
        layers = sorted(counted[p])
        served = "/".join(f"{np.mean([r.summary.pages[l] for r in rs]):.0f}" for l in layers)
        mean_stall[p] = float(np.mean(stalls))
        lines.append(f"{p:9} {slow[p]:>4} {'/'.join(f'{counted[p][l]:.0f}' for l in layers):>17} {served:>16} "
                     f"{mean_stall[p]:8.2f} {min(stalls):6.2f}..{max(stalls):<6.2f} {rs[0].step_ms:7.2f} "
                     f"{100 * mean_stall[p] / rs[0].step_ms:+7.1f}% "
                     f"{sum(r.checked_steps for r in rs):>3}/{sum(r.mismatches for r in rs)}")
    if "columns" in mean_stall and "balanced" in mean_stall:
        lines.append(f"balanced / columns stall: {mean_stall['balanced'] / mean_stall['columns']:.2f}")
    table = "\n".join(lines)
    print(table)
    if args.log:
        regime = ("Regime: device compute from a profile, host, cache and I/O real (serve.full_rank): each "
                  "partition's slowest TP4 rank's shard of both Engram layers (" +
                  (f"tables scaled to engram_vocab {args.engram_vocab:,}" if args.engram_vocab else "full size")
                  + ", synthetic rows) staged in a file on this VM's shared virtio disk, O_DIRECT, served by one "
                  "process as that rank's (owned_only): the paper's \"4 disks\" arrangement, one disk per rank; "
                  "the split cache (half per layer); the partitions' runs interleaved in shuffled order. The stall "
                  "is the rank's own; the TP step waits for the slowest rank, which is the one measured. "
                  "'checked' = decode steps checked row by row / mismatching rows.")
        _log(f"slowest rank's stall, columns vs balanced ({args.workload}, B={args.batch})", regime,
             time.perf_counter() - t0, table)
    if not args.keep:
        for m in manifests.values():
            for t in m.targets:
                Path(t).unlink(missing_ok=True)
            m.crc_path().unlink(missing_ok=True)
            Path(m.path).unlink(missing_ok=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="part", required=True)
    for name in ("curves", "stall"):
        p = sub.add_parser(name)
        p.add_argument("--workload", default="agent")
        p.add_argument("--batch", type=int, default=128)
        p.add_argument("--partitions", default="columns,balanced")
        p.add_argument("--engram-vocab", type=int, default=1_000_000 if name == "stall" else 0,
                       help="0: full V4.1 tables; N: the same hash over scaled tables")
        p.add_argument("--log", action="store_true", help=f"append the table to {LOG.relative_to(ROOT)}")
        if name == "stall":
            p.add_argument("--runs", type=int, default=3)
            p.add_argument("--decode-steps", type=int, default=64)
            p.add_argument("--warmup-steps", type=int, default=8)
            p.add_argument("--cache-rows", type=int, default=1_000_000, help="split cache rows per rank (both layers)")
            p.add_argument("--profile", default="v41_paper")
            p.add_argument("--workdir", default="runs/rank_partition")
            p.add_argument("--seed", type=int, default=0)
            p.add_argument("--keep", action="store_true", help="keep the staged shards")
    args = ap.parse_args(argv)
    return curves(args) if args.part == "curves" else stall(args)


if __name__ == "__main__":
    sys.exit(main())
