"""CPU time of `begin_step` at B = 8, 128, 256 decode sessions, V4.1 tables, warm cache.

Row ids are the real DeepSeek-V4.1 Engram hash (EngramLayout.v41(): 384,006,168
and 384,016,682 rows, both layers) of real text: B sessions, each a contiguous
stretch of Python source from the installed packages, tokenized with the
DeepSeek-V4 tokenizer. Every session is prefilled (its prefix's lookups warm the
cache), then decode steps look up one new token per session: ids [B, 2, 24].

The engine serves both full-size layers in one process, each split over 4 rank
regions (the TP4 shard bounds), with full directories (4 B per row: 3 GB) and a
cache of 1M rows per layer (CLOCK, pins). The regions are sparse files: their
pages read as zeros, which does not matter for the directory pass timed here.
Beside it, in the same process and interleaved step by step, a per-rank engine:
one rank of TP4 (`--rank`, default 0) as its own process would run it, a
directory for its shard of each table only (a quarter: 4 B per row of the
shard), the same cache size per layer, `owned_only=True`: ids outside the
shard come out as zeros without being resolved, as in SGLang's per-rank host
lookup before its all-reduce. Both see the same decode ids and are warmed by the
same prefill. B values run interleaved in shuffled order, `--repeats` rounds of
`--steps` steps each; each (round, B) decodes new tokens, unless
`--same-positions` (every B of a round decodes the same positions, so a B that
runs after another finds most rows cached: the pass on a warm cache).
Reported: begin_step wall time and the calling thread's CPU time per step
(min / median / max over the rounds' medians), the compiled pass alone
(resolve_us), the hit rate and the pages submitted, beside the paper's 80-160 us C pass and the
target of < 100 us at B = 128.

    .venv/bin/python benchmarks/bench_engine_begin_step.py [--same-positions] [--append] [--png runs/begin_step.png]
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # the repo root: benchmarks.* imports
from benchmarks._harness import timed_step  # noqa: E402
from benchmarks.engine.bench_host_pass import build_rank_engine as host_pass_rank_engine  # noqa: E402

from slacktier.cache import RowCache
from slacktier.engine.step import StepEngine
from slacktier.engine.tables import TableSpec, rank_regions_for
from slacktier.testing.engine import real_text
from slacktier.store.disk import DiskSource
from slacktier.tables.engram_hash import EngramHasher, EngramLayout
from slacktier.tables.layout import PAGE_BYTES, pages_for_rows, shard_bounds
from slacktier.tables.regions import Region
from slacktier.tables.tokenizer import encode

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # the repo root: benchmarks.* imports
from benchmarks._harness import append_to_section  # noqa: E402

SECTION = "## The tier: page sources, cache and step engine"
SUBSECTION = "### Cache and step engine"
RANKS = 4


def sessions_ids(layout: EngramLayout, sessions: int, tokens_each: int) -> np.ndarray:
    """Row ids [sessions, tokens_each, 2, 24] of `sessions` contiguous stretches of real text."""
    need = sessions * tokens_each
    text_bytes = need * 4
    tokens: list[int] = []
    while len(tokens) < need:
        tokens = encode(real_text(text_bytes))
        text_bytes *= 2
    hasher = EngramHasher(layout)
    toks = np.asarray(tokens[:need], dtype=np.int64).reshape(sessions, tokens_each)
    return np.stack([hasher.prefill(t) for t in toks])


def build_rank_engine(layout: EngramLayout, directory: Path, cache_rows_per_layer: int, max_tokens: int,
                      rank: int) -> StepEngine:
    """One rank of TP4: both layers' shards of `rank` only (one sparse file per layer), owned_only."""
    return host_pass_rank_engine(layout, directory, 2 * cache_rows_per_layer, rank, max_tokens)[0]


def build_engine(layout: EngramLayout, directory: Path, cache_rows_per_layer: int, max_tokens: int):
    """Both layers over 4 sparse rank regions each (one sparse file per layer)."""
    tables = []
    sources = []
    for i, layer in enumerate(layout.layer_ids):
        rows = layout.rows(i)
        bounds = layout.column_bounds(i)
        path = directory / f"layer{layer}.sparse"
        regions, offset = [], 0
        for rank in range(RANKS):
            lo, hi = shard_bounds(rows, bounds, rank, RANKS)
            regions.append(Region(layer=layer, rank=rank, path=str(path), offset_bytes=offset,
                                  pages=pages_for_rows(hi - lo)))
            offset += pages_for_rows(hi - lo) * PAGE_BYTES
        with open(path, "wb") as f:
            f.truncate(offset)                                 # sparse: no disk space used
        source = DiskSource(regions)
        sources.append(source)
        tables.append(TableSpec(layer=layer, row_start=0, rows=rows, source=source, cache_share=0.5,
                                regions=rank_regions_for(layer, rows, regions, column_bounds=bounds)))
    cache = RowCache(2 * cache_rows_per_layer)
    return StepEngine(tables, cache, max_tokens=max_tokens, owned_sources=sources)


def directory_floor_us(engine: StepEngine, lookups_per_layer: int, rng: np.random.Generator) -> float:
    """The memory floor of the pass: one vectorized numpy gather of as many random entries of each
    layer's directory as the step resolves (fresh random rows, so nothing is cached)."""
    t = 0
    for layer in engine.layers:
        directory = engine.cache.layer(layer).directory
        rows = rng.integers(0, directory.shape[0], lookups_per_layer)
        t0 = time.perf_counter_ns()
        np.take(directory, rows)
        t += time.perf_counter_ns() - t0
    return t / 1e3


def run_step(engine: StepEngine, ids: np.ndarray) -> tuple[float, float, float, float, int]:
    """One step; -> (begin_step wall us, begin_step thread CPU us, resolve us, hit rate, pages submitted)."""
    wall, cpu, counters = timed_step(engine, ids)
    resolve = sum(c.resolve_us for c in counters.layers.values())
    # Hit rate over the lookups this process resolves (a rank's foreign ids are counted as zero rows).
    hits = sum(c.hits for c in counters.layers.values()) / sum(c.lookups - c.zero_rows
                                                              for c in counters.layers.values())
    pages = sum(c.pages_read for c in counters.layers.values())
    return wall, cpu, resolve, hits, pages


def _mmm(values: list[float]) -> tuple[float, float, float]:
    """(min, median, max) of a list (the middle element of the sorted list, as the earlier runs quoted)."""
    v = sorted(values)
    return v[0], v[len(v) // 2], v[-1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="8,128,256")
    ap.add_argument("--prefill", type=int, default=256, help="prefill tokens per session (warms the cache)")
    ap.add_argument("--steps", type=int, default=40, help="decode steps per B per round")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cache-rows", type=int, default=1_000_000, help="cache rows per layer (per process)")
    ap.add_argument("--rank", type=int, default=0, help="the TP4 rank the per-rank engine serves")
    ap.add_argument("--same-positions", action="store_true",
                    help="every B of a round decodes the same token positions (the earlier protocol): a B that "
                         "runs after another finds most rows already cached, so hit rates are high; default: "
                         "each (round, B) decodes new tokens")
    ap.add_argument("--dir", default="", help="where the sparse region files go (default: a temp dir)")
    ap.add_argument("--append", action="store_true")
    ap.add_argument("--png", default="")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    sessions = max(batches)
    layout = EngramLayout.v41()
    decode_tokens = args.steps * args.repeats * (1 if args.same_positions else len(batches)) + 4
    t = time.perf_counter()
    ids = sessions_ids(layout, sessions, args.prefill + decode_tokens)   # [S, tokens, 2, 24]
    print(f"hashed {ids.shape[0]} sessions x {ids.shape[1]} tokens in {time.perf_counter() - t:.1f} s", flush=True)
    ways = ("all", "rank")
    with tempfile.TemporaryDirectory(dir=args.dir or None) as d:
        engines = {"all": build_engine(layout, Path(d), args.cache_rows, max_tokens=max(512, sessions)),
                   "rank": build_rank_engine(layout, Path(d), args.cache_rows, max(512, sessions), args.rank)}
        dir_mb = {w: sum(e.cache.layer(l).directory.nbytes for l in e.layers) / 2**20 for w, e in engines.items()}
        # Prefill: each session's prefix, 512 tokens per step, then 4 warm-up decode steps.
        for s in range(sessions):
            for a in range(0, args.prefill, 512):
                for e in engines.values():
                    run_step(e, ids[s, a:min(a + 512, args.prefill)])
        pos = args.prefill
        for _ in range(4):
            for e in engines.values():
                run_step(e, ids[:, pos])
            pos += 1
        print("caches warm; measuring", flush=True)
        results = {(w, b): [] for w in ways for b in batches}
        medians = {(w, b): [] for w in ways for b in batches}
        floors = {(w, b): [] for w in ways for b in batches}
        nrng = np.random.default_rng(1)
        rng = random.Random(0)
        for _ in range(args.repeats):
            order = batches[:]
            rng.shuffle(order)
            for b in order:
                rows = {w: [] for w in ways}
                fl = {w: [] for w in ways}
                for k in range(args.steps):
                    for w in (ways if k % 2 == 0 else ways[::-1]):   # alternate which engine goes first
                        rows[w].append(run_step(engines[w], ids[:b, pos + k]))
                        # the rank resolves its own columns' lookups only: a quarter of each layer's
                        fl[w].append(directory_floor_us(engines[w], b * 24 // (RANKS if w == "rank" else 1), nrng))
                for w in ways:
                    results[w, b] += rows[w]
                    floors[w, b].append(statistics.median(fl[w]))
                    medians[w, b].append(tuple(statistics.median(r[i] for r in rows[w]) for i in range(3)))
                # Next (round, B) decodes the sessions' next tokens: a B that runs after another in a
                # round would otherwise find the first one's rows already read (its misses become hits).
                if not args.same_positions:
                    pos += args.steps
            if args.same_positions:
                pos += args.steps
        for e in engines.values():
            e.close()
    label = {"all": "all 4 ranks, 1 process", "rank": f"rank {args.rank} of TP4 (owned_only)"}
    lines = ["| B | process | directories MiB | lookups resolved per step | begin_step CPU us (min / med / max "
             "of round medians) | compiled pass us | begin_step wall us | p90 wall us | hit rate "
             "| pages submitted per step (median) | directory floor us | median CPU / floor | CPU vs 1 process "
             "| target |",
             "|---:|---|---:|---:|---|---|---|---:|---:|---:|---:|---:|---:|---|"]
    summary = {}
    for b in batches:
        for w in ways:
            wall = _mmm([m[0] for m in medians[w, b]])
            cpu = _mmm([m[1] for m in medians[w, b]])
            res = _mmm([m[2] for m in medians[w, b]])
            p90 = float(np.percentile([r[0] for r in results[w, b]], 90))
            hit = statistics.mean(r[3] for r in results[w, b])
            pages = statistics.median(r[4] for r in results[w, b])
            floor = statistics.median(floors[w, b])
            summary[w, b] = cpu[1]
            resolved = b * 2 * 24 // (RANKS if w == "rank" else 1)
            target = "< 100 us" if b == 128 else ""
            lines.append(f"| {b} | {label[w]} | {dir_mb[w]:,.0f} | {resolved:,} | "
                         f"{cpu[0]:.0f} / {cpu[1]:.0f} / {cpu[2]:.0f} | {res[0]:.0f} / {res[1]:.0f} / {res[2]:.0f} | "
                         f"{wall[0]:.0f} / {wall[1]:.0f} / {wall[2]:.0f} | {p90:.0f} | {hit:.3f} | {pages:.0f} | "
                         f"{floor:.0f} | "
                         f"{cpu[1] / floor:.1f}x | {cpu[1] / summary['all', b]:.2f}x | {target} |")
    table = "\n".join(lines)
    print(table)
    if args.png:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(7, 4))
        data, ticks = [], []
        for b in batches:
            for w in ways:
                data.append([r[1] for r in results[w, b]])
                ticks.append(f"B={b}\n{'1 proc' if w == 'all' else 'rank'}")
        ax.boxplot(data, tick_labels=ticks)
        ax.axhspan(80, 160, color="tab:orange", alpha=0.2, label="paper C pass (80-160 us, B=128)")
        ax.axhline(100, color="tab:red", ls="--", label="target at B=128")
        ax.set_yscale("log")
        ax.set_ylabel("begin_step CPU time per step (us)")
        ax.legend()
        Path(args.png).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(args.png, dpi=120, bbox_inches="tight")
    if args.append:
        cmd = " ".join(["`.venv/bin/python benchmarks/bench_engine_begin_step.py", *sys.argv[1:]]) + "`"
        now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        text = (f"**begin_step CPU time, one process for all ranks vs one rank of TP4, V4.1 tables (2 x 384M rows), "
                f"real-token decode steps, warm cache ({args.cache_rows:,} rows per layer per process)** - {now}, "
                f"{platform.node()}, {os.cpu_count()} CPUs (shared with other jobs). Command: {cmd}. Each step is "
                f"a decode step of B sessions, ids [B, 2, 24], given to both engines in the same process, "
                f"alternating which goes first; B values interleaved in shuffled order, {args.repeats} rounds x "
                f"{args.steps} steps"
                + ("; every B of a round decodes the same positions, so a B that runs after another finds most "
                   "of its rows cached (high hit rates: the pass on a warm cache, few pages to submit). "
                   if args.same_positions else "; every (round, B) decodes new tokens (real decode hit rates). ")
                + f"'1 process' serves all 4 rank regions of both tables with full directories; "
                f"'rank {args.rank}' is what one TP rank's process holds: directories of its shard only, "
                f"owned_only=True (it resolves its 6 of the 24 hash columns; the other ids come out as zeros "
                f"for the all-reduce). CPU time is the calling thread's (thread_time), the figure to quote on "
                f"this shared machine; 'compiled pass' is the numba directory pass alone (both layers, wall "
                f"time); 'directory floor' is the same run's time for one numpy gather of as many random "
                f"entries of that engine's directories as it resolves, measured after each step.\n\n"
                + table)
        append_to_section(text, SECTION, SUBSECTION)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
