"""Rank partitions side by side: every rank's pages under columns and balanced, per-rank cache sizing, and the
timeline stall of each partition's slowest rank on this disk.

    # counts (no disk): per-rank miss curves on one trace, the slowest rank, even vs per-rank cache sizing
    .venv/bin/python benchmarks/paper/bench_rank_partition.py curves --workload agent --batch 128
    # the slowest rank of each partition served on the step timeline (disk-split placement, one disk per rank:
    # one rank's process on this VM's disk), the partitions interleaved in shuffled order, 3 runs each
    .venv/bin/python benchmarks/paper/bench_rank_partition.py stall --workload agent --batch 128 --runs 3 --log
    # what mapping the ids to stored rows adds to begin_step (warm steps, one process, both partitions)
    .venv/bin/python benchmarks/paper/bench_rank_partition.py cost --batch 128 --log

`--log` appends the table to docs/bench-log/rank-partition.md. Each rank's shard is
staged once per partition under --workdir (about 3.3 GB each at --engram-vocab
1000000) and deleted at the end unless --keep.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # the repo root: benchmarks.* imports

import numpy as np  # noqa: E402

from benchmarks._harness import ROOT, command_line, machine, utc_stamp  # noqa: E402

from slacktier.plan.curves import MissCurve  # noqa: E402
from slacktier.plan.ranks import rank_cache_rows  # noqa: E402
from benchmarks.paper.full_rank import FullRankConfig, rank_page_counts, run_full_rank  # noqa: E402
from benchmarks.paper.rank_pages import slowest_rank  # noqa: E402

LOG = ROOT / "docs" / "bench-log" / "rank-partition.md"
CAPACITIES = (0, 25_000, 50_000, 100_000, 200_000, 500_000, 1_000_000)


def _log(title: str, regime: str, wall: float, table: str) -> None:
    if not LOG.exists():
        LOG.write_text("# Rank partitions: dated runs\n\nWritten by benchmarks/paper/bench_rank_partition.py.\n")
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
    # each (partition, rank)'s curves in the planner's format: `slacktier plan --curves FILE` for that rank's process
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for part in parts:
        for k in range(cfg.ranks):
            doc = {"workload": args.workload, "batch": args.batch, "partition": part, "rank": k, "layers": {
                str(layer): {"capacity_rows": list(CAPACITIES), "pages_per_step": [
                    next(r.pages_mean for r in res if (r.partition, r.rank, r.layer, r.capacity_rows) ==
                         (part, k, layer, c)) for c in CAPACITIES]}
                for layer in sorted({r.layer for r in res})}}
            (out / f"curves-{args.workload}-b{args.batch}-{part}-rank{k}.json").write_text(json.dumps(doc, indent=1))
    lines.append(f"\nper-rank miss curves for `slacktier plan --curves`: {out}/curves-{args.workload}-b{args.batch}-"
                 "PARTITION-rankK.json")
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
        regime = ("Regime: device compute from a profile, host, cache and I/O real (benchmarks/paper/full_rank.py): each "
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


def cost(args: argparse.Namespace) -> int:
    """begin_step on warm steps (every lookup a hit) of one process serving a whole table staged
    under each partition, interleaved: what mapping the ids to stored rows costs (balanced) against none."""
    import tempfile

    from slacktier.config import ControlFile, EngineConfig, TableConfig
    from slacktier.engine.step import StepEngine
    from slacktier.tables.engram_hash import EngramLayout
    from slacktier.tables.stage import stage_synthetic

    t0 = time.perf_counter()
    layout = EngramLayout.scaled(args.engram_vocab)
    parts = tuple(args.partitions.split(","))
    rng = np.random.default_rng(0)
    ids = np.stack([np.asarray(layout.layer_column_bounds(l)[:-1]) + rng.integers(
        0, np.diff(layout.layer_column_bounds(l)), size=(args.batch, 24)) for l in layout.layer_ids], axis=1)
    with tempfile.TemporaryDirectory(dir=args.workdir_parent) as tmp:
        engines = {}
        for p in parts:
            m = stage_synthetic([Path(tmp) / f"{p}.bin"], layout, 4, 1, progress=False, partition=p)
            tables = tuple(TableConfig(layer=l, manifest=m.path, partition=p, cache_share=0.5, order=i)
                           for i, l in enumerate(layout.layer_ids))
            engines[p] = StepEngine.from_config(ControlFile(engine=EngineConfig(cache_rows=4 * ids.size),
                                                            tables=tables))
        times: dict[str, list[float]] = {p: [] for p in parts}
        try:
            for rep in range(args.rounds):
                for i in rng.permutation(len(parts)):
                    e = engines[parts[i]]
                    spent = 0
                    for step in range(args.steps + (2 if rep == 0 else 0)):   # 2 first steps fill the cache
                        t = time.perf_counter_ns()
                        e.begin_step(ids)
                        if step >= (2 if rep == 0 else 0):
                            spent += time.perf_counter_ns() - t
                        for layer in e.layers:   # untimed; a layer never gathered would leave its rows uncached
                            e.gather(layer)
                        e.end_step()
                    times[parts[i]].append(spent / args.steps / 1e3)
            mapping_us = None
            if "balanced" in engines:   # the mapping alone, the least disturbed of many repeats
                import timeit

                e = engines["balanced"]
                mapping_us = min(timeit.repeat(lambda: e._stored_ids(ids), number=200, repeat=30)) / 200 * 1e6
        finally:
            for e in engines.values():
                e.close()
    lines = [f"begin_step alone, warm (all hits; gather and end_step run untimed), B={args.batch}, 2 layers, one process serving the whole "
             f"table (engram_vocab {args.engram_vocab:,}); {args.rounds} rounds of {args.steps} steps, interleaved",
             f"{'partition':9} {'min us':>8} {'median us':>9} {'max us':>8}"]
    for p in parts:
        lines.append(f"{p:9} {min(times[p]):8.1f} {float(np.median(times[p])):9.1f} {max(times[p]):8.1f}")
    if "columns" in times and "balanced" in times:
        lines.append(f"balanced / columns, median: "
                     f"{float(np.median(times['balanced'])) / float(np.median(times['columns'])):.2f}")
    if mapping_us is not None:
        lines.append(f"the mapping alone (StepEngine._stored_ids, min of 30 x 200 calls): {mapping_us:.1f} us per step")
    table = "\n".join(lines)
    print(table)
    if args.log:
        _log(f"the id mapping's cost on warm steps (B={args.batch})", "Regime: host CPU only, no reads (every "
             "lookup hits); the two engines' rounds interleaved in shuffled order.", time.perf_counter() - t0, table)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="part", required=True)
    for name in ("curves", "stall", "cost"):
        p = sub.add_parser(name)
        p.add_argument("--workload", default="agent")
        p.add_argument("--batch", type=int, default=128)
        p.add_argument("--partitions", default="columns,balanced")
        p.add_argument("--engram-vocab", type=int, default={"stall": 1_000_000, "cost": 20_000}.get(name, 0),
                       help="0: full V4.1 tables; N: the same hash over scaled tables")
        p.add_argument("--log", action="store_true", help=f"append the table to {LOG.relative_to(ROOT)}")
        if name == "curves":
            p.add_argument("--out", default="runs/rank_partition", help="where the per-rank curve files go")
        if name == "cost":
            p.add_argument("--rounds", type=int, default=15)
            p.add_argument("--steps", type=int, default=50)
            p.add_argument("--workdir-parent", default=None, help="where the small tables are staged (a temp dir)")
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
    return {"curves": curves, "stall": stall, "cost": cost}[args.part](args)


if __name__ == "__main__":
    sys.exit(main())
