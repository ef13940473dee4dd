"""The paper's "1 disk" rows of Table 2: four TP rank processes reading their shards from one disk at once.

The paper's "1 disk" configuration is four TP ranks whose processes share one
NVMe; its "4 disks" rows give each rank its own (`bench_full_rank.py`, one
rank process on its full-size shard, is that configuration on this VM's disk).
Here four processes, one per rank of TP4, each serve their own rank's shard
(`owned_only`, their regions) from one file per rank on this VM's one disk, on
the step timeline (device compute from a profile). They step together: every
timed step starts at a barrier all four meet, as ranks of one tensor-parallel
forward do, and the TP step's stall is the slowest rank's stall of that step.

Four full-size shards (209 GB) do not fit this disk, so each rank's shard is
staged at a quarter of its rows (`--engram-vocab 4000000`: the V4.1 hash over
tables of ~96M rows per layer, 13 GB per rank, 52 GB in all). Pages per step
depend on the lookups, not on the table's size, while the table is far larger
than the cache: `bench_full_rank.py pages` with and without `--engram-vocab`
checks that on the same traffic.

What the two cores cost: four processes run their begin_steps at the same
moment on 2 cores, so each rank's `s` (step start to begin_step returned)
includes waiting for a core; the table prints s per rank.

An I/O priority class for the short-window layer's reads was measured with
this benchmark (docs/bench-log/table2.md, 2026-12-03 09:03 UTC: no gain) and
then removed from the product, so the option is gone here too.

    .venv/bin/python benchmarks/paper/bench_one_disk.py --workload agent --batches 128 --runs 3 \\
        --log docs/bench-log/table2.md
    # whole sessions, the window timed after 1,000 decode steps run untimed (as bench_full_rank.py timeline),
    # each rank's measured window hit rates beside the characterizer's on the same replay
    .venv/bin/python benchmarks/paper/bench_one_disk.py --workload agent --batches 128 --runs 3 \\
        --whole-sessions --start-decode-steps 1000 --log docs/bench-log/table2.md

Every round replays the same traffic (the config's `seed`; bench_full_rank.py's runs do too) and shuffles the
placements' order with its own `order_seed`, the same order on every rank. A round is one call of
`run_ranks` (fresh processes), so the untimed steps before the window run again in every round: a cached
placement's cache is built by the engine itself, never restored.

Shards go under runs/one_disk (git-ignored); --delete removes them at the end.
"""

from __future__ import annotations

import argparse
import dataclasses
import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # the repo root: benchmarks.* imports
from benchmarks._harness import command_line, machine, utc_stamp  # noqa: E402

from benchmarks.paper.bench_full_rank import add_session_arguments  # noqa: E402
from benchmarks.paper.full_rank import (FullRankConfig, peak_rss_gib, run_full_rank, stage_rank_shard,  # noqa: E402
                                          window_hit_rates, window_table)

REPO = Path(__file__).resolve().parents[2]


def _rank_main(cfg: FullRankConfig, barrier, results) -> None:
    """One rank's process: its placements' runs, meeting the other ranks before every step."""
    try:
        def meet() -> None:
            barrier.wait(timeout=900)

        _, _, runs = run_full_rank(cfg, progress=cfg.rank == 0, before_step=meet)
        results.put((cfg.rank, runs, peak_rss_gib(), None))
    except BaseException as exc:   # reported to the parent, which prints it and fails the run
        barrier.abort()
        results.put((cfg.rank, [], 0.0, f"{type(exc).__name__}: {exc}"))


def run_ranks(base: FullRankConfig, ranks: int) -> tuple[dict, dict]:
    """All ranks of `base` at once, one process each; (rank -> its runs, rank -> peak RSS GiB)."""
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(ranks)
    results = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(dataclasses.replace(base, rank=r), barrier, results),
                         name=f"rank{r}") for r in range(ranks)]
    for p in procs:
        p.start()
    out, rss, errors = {}, {}, []
    for _ in procs:
        rank, runs, peak, error = results.get()
        out[rank], rss[rank] = runs, peak
        if error:
            errors.append(f"rank {rank}: {error}")
    for p in procs:
        p.join()
    if errors:
        raise SystemExit("a rank process failed:\n" + "\n".join(errors))
    return out, rss


def table(per_rank: dict[int, list], ranks: int) -> str:
    """Per placement: the TP step's stall (the slowest rank per step), and each rank's figures."""
    lines = []
    head = (f"{'B':>4} {'placement':16} {'runs':>4} {'profile':>7} {'TP stall':>9} {'%':>6} "
            f"{'min..max':>12} {'p99 stall':>9} | per rank: stall ms, pages L1/L14, read ms L1/L14, s ms")
    lines.append(head)
    keys = sorted({(r.batch, r.placement) for r in per_rank[0]})
    per_round: dict[str, list[float]] = {}
    for batch, placement in keys:
        runs = {k: [r for r in per_rank[k] if (r.batch, r.placement) == (batch, placement)] for k in range(ranks)}
        tp_means, all_steps = [], []
        for i in range(len(runs[0])):
            per_step = np.max([runs[k][i].step_stalls_ms for k in range(ranks)], axis=0)
            tp_means.append(float(per_step.mean()))
            all_steps.extend(per_step.tolist())
        step_ms = runs[0][0].step_ms
        m = statistics.mean(tp_means)
        per_round[f"B={batch} {placement}"] = tp_means
        cells = []
        for k in range(ranks):
            rs = runs[k]
            s = [r.summary for r in rs]
            layers = rs[0].served
            pages = "/".join(f"{statistics.mean(x.pages[l] for x in s):.0f}" for l in layers)
            reads = "/".join(f"{statistics.mean(x.read_ms[l] for x in s):.1f}" for l in layers)
            cells.append(f"r{k} {statistics.mean(x.stall_ms for x in s):.1f}, {pages}, {reads}, "
                         f"{statistics.mean(x.s_ms for x in s):.2f}")
        lines.append(f"{batch:>4} {placement:16} {len(tp_means):>4} {step_ms:7.2f} "
                     f"{m:6.2f} ms {100 * m / step_ms:+5.1f}% {min(tp_means):5.2f}..{max(tp_means):<5.2f} "
                     f"{float(np.percentile(all_steps, 99)):9.2f} | " + "; ".join(cells))
    checked = sum(r.checked_steps for rs in per_rank.values() for r in rs)
    bad = sum(r.mismatches for rs in per_rank.values() for r in rs)
    lines.append("per round, in order (TP stall, ms): " + "; ".join(
        f"{p} " + ", ".join(f"{x:.2f}" for x in v) for p, v in sorted(per_round.items())))
    lines.append(f"checker: {checked} decode steps after the timed ones (all ranks, all runs), every row against "
                 f"the table's source: {bad} mismatching rows")
    lines.append("TP stall: per timed step, the largest of the four ranks' stalls (each rank's step starts at a "
                 "barrier all four meet); mean over steps, then over runs (min..max over runs); a DRAM layer is the "
                 "profile itself (0 stall).")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workload", default="agent")
    ap.add_argument("--batches", default="128")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--engram-vocab", type=int, default=4_000_000, help="0: full-size shards (209 GB: too big here)")
    ap.add_argument("--decode-steps", type=int, default=64)
    ap.add_argument("--warmup-steps", type=int, default=8)
    ap.add_argument("--check-steps", type=int, default=4)
    ap.add_argument("--placements", default="", help="comma-separated placement names (default: all)")
    add_session_arguments(ap)
    ap.add_argument("--no-window-hits", action="store_true",
                    help="skip the characterizer's hit rates on the same replay (printed per rank beside the "
                         "measured ones)")
    ap.add_argument("--workdir", default="runs/one_disk")
    ap.add_argument("--delete", action="store_true", help="delete the staged shards at the end")
    ap.add_argument("--log", type=Path, help="append the dated block to this bench-log file")
    args = ap.parse_args(argv)
    base = FullRankConfig(workdir=args.workdir, ranks=args.ranks, workload=args.workload,
                          batches=tuple(int(b) for b in args.batches.split(",")), runs=args.runs,
                          decode_steps=args.decode_steps, warmup_steps=args.warmup_steps,
                          check_steps=args.check_steps, engram_vocab=args.engram_vocab,
                          placements=tuple(p for p in args.placements.split(",") if p),
                          whole_sessions=args.whole_sessions, start_decode_steps=args.start_decode_steps)
    t0 = time.perf_counter()
    manifests = []
    for r in range(args.ranks):   # staged one after another, before any rank starts stepping
        manifests.append(stage_rank_shard(dataclasses.replace(base, rank=r), progress=True))
    staged_gb = sum(m.total_pages for m in manifests) * 4096 / 1e9
    per_rank: dict[int, list] = {k: [] for k in range(args.ranks)}
    peaks: dict[int, float] = {}
    try:
        for rep in range(args.runs):
            cfg = dataclasses.replace(base, runs=1, order_seed=base.seed + rep)
            t_round = time.perf_counter()
            out, rss = run_ranks(cfg, args.ranks)
            print(f"round {rep + 1}/{args.runs}: {time.perf_counter() - t_round:.0f} s", flush=True)
            for k, runs in out.items():
                per_rank[k].extend(dataclasses.replace(r, rep=rep) for r in runs)
                peaks[k] = max(peaks.get(k, 0.0), rss[k])
    finally:
        if args.delete:   # the targets and their manifests (a manifest left behind would name a missing file)
            for r, m in enumerate(manifests):
                for t in {x.path for x in m.regions}:
                    Path(t).unlink(missing_ok=True)
                manifest = dataclasses.replace(base, rank=r).manifest_path
                manifest.unlink(missing_ok=True)
                manifest.with_suffix(".crc").unlink(missing_ok=True)
    wall = time.perf_counter() - t0
    timed = table(per_rank, args.ranks)
    print(timed, flush=True)   # before the characterizer's replay (minutes on agent): a failure there keeps it
    hits_text = ""
    if not args.no_window_hits:   # after the timed runs: counts, no timing
        t1 = time.perf_counter()
        for b in base.batches:
            for k in range(args.ranks):
                cfg = dataclasses.replace(base, rank=k)
                hits_text += (f"\nrank {k}: " if hits_text else f"rank {k}: ") + window_table(
                    window_hit_rates(cfg, manifests[k], b, per_rank[k]), per_rank[k]) + "\n"
        foot = "over the rank's own decode lookups"   # window_table's footnote: kept once, at the end
        tables = hits_text.split("\n")
        last = max(i for i, x in enumerate(tables) if x.startswith(foot))
        hits_text = "\n".join(x for i, x in enumerate(tables) if i == last or not x.startswith(foot))
        hits_text += f"\n(the characterizer's replay and CLOCK: {time.perf_counter() - t1:.0f} s)"
    rows = manifests[0].layout.rows
    block = "\n".join([
        f"#### \"1 disk\": {args.ranks} rank processes on one disk, {args.workload}, B={args.batches}, {utc_stamp()}",
        "",
        f"`{command_line(__file__, argv)}` ({wall:.0f} s; {machine()})",
        "",
        f"Regime: device compute from profile {base.profile}; host, cache and I/O real. {args.ranks} processes, one "
        f"per TP{args.ranks} rank, each serving its own shard (owned_only) of both Engram layers, staged at "
        f"{'full size' if not args.engram_vocab else f'engram_vocab {args.engram_vocab:,}'} "
        f"({', '.join(f'layer {l}: {n:,} rows' for l, n in rows.items())}; {staged_gb:.1f} GB in all) in one file "
        f"per rank on this VM's one virtio disk, O_DIRECT; the ranks step together (a barrier before every step). "
        f"Traffic: {base.sessions_text}"
        + (f", timed after {base.start_decode_steps} untimed decode steps" if base.start_decode_steps else "")
        + f"; {args.runs} rounds, placements shuffled within a round (the same order on every rank). "
        "Peak RSS per rank: "
        + ", ".join(f"{peaks[k]:.2f}" for k in sorted(peaks)) + " GiB.",
        "",
        "```",
        timed,
        "```",
    ] + (["", "Each rank's timed window beside the characterizer's CLOCK on the same replay:", "", "```", hits_text,
          "```"] if hits_text else []))
    print(block)
    if args.log:
        args.log.parent.mkdir(parents=True, exist_ok=True)
        with args.log.open("a") as f:
            f.write("\n" + block + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
