"""`slacktier characterize`: replay agent and chat sessions and characterize their table accesses."""

from __future__ import annotations

import argparse
import csv
import logging
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np

from slacktier.errors import ErrorKind, SlackTierError

HELP = "replay agent/chat sessions through the Engram hash; hit rates per policy, batch reuse, miss-page curves"

log = logging.getLogger(__name__)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of the characterize verb."""
    p.add_argument("--workloads", default="agent,chat", help="comma list of agent, chat")
    p.add_argument("--batch", type=int, default=64, help="interleaved sessions (8..256)")
    p.add_argument("--decode-tokens", type=int, default=128, help="tokens regenerated per assistant turn")
    p.add_argument("--pause-steps-mean", type=float, default=0.0, help="mean decode steps between turns (tool time)")
    p.add_argument("--start-spread-steps", type=int, default=0,
                   help="first B sessions start at uniform random delays in [0, this) decode steps")
    p.add_argument("--policies", default="lru,clock,s3fifo,static,static_lru,belady,belady_warm",
                   help="comma list of lru, clock, s3fifo, static, static_lru, belady (cold), belady_warm "
                        "(the fit's top rows preloaded: the ceiling of the static policies too)")
    p.add_argument("--layers", default="1,14", help="comma list of Engram layers")
    p.add_argument("--capacities", default="",
                   help="comma list of capacities in rows per layer (default: 1M, 5M, 0.2/1/5%% of the table "
                        "and 5/10/25/50%% of the trace's unique rows)")
    p.add_argument("--static-head-share", type=float, default=0.5, help="share of capacity pinned by static_lru")
    p.add_argument("--miss-policy", default="clock", help="policy behind the miss-page curve (the engine uses CLOCK)")
    p.add_argument("--miss-points", type=int, default=12, help="capacities on the miss-page curve")
    p.add_argument("--agent-per-source", type=int, default=5, help="agent sessions per source repository")
    p.add_argument("--agent-sources", default="", help="comma list of source trees (default: all installed)")
    p.add_argument("--chat-sessions", type=int, default=192, help="ShareGPT conversation records")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cache-dir", type=Path, default=Path("data/workloads"), help="agent session cache")
    p.add_argument("--out", type=Path, default=Path("runs/characterize"), help="output directory")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")


def _csv(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if not rows:
        path.write_text("")
        return
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


def _flat(result) -> dict:
    d = asdict(result)
    orders = d.pop("order_hit_rate", {})
    for k, v in orders.items():
        d[f"order{k}_decode_hit_rate"] = v
    return d


def run(args: argparse.Namespace) -> int:
    """Build the workloads, replay them, characterize, write CSV/JSON/PNG under --out."""
    from slacktier.workloads.characterize import (Capacity, batch_reuse, capacities_for, hit_table,
                                                  miss_page_curve, prepare_workload, trace_summary, write_json)
    from slacktier.workloads.corpus import CorpusConfig
    from slacktier.workloads.hashing import EngramLookupHasher
    from slacktier.workloads.policies import POLICIES
    from slacktier.workloads.replay import ReplayConfig

    progress = not args.no_progress
    workloads = [w for w in args.workloads.split(",") if w]
    policies = [p for p in args.policies.split(",") if p]
    for p in policies:
        if p not in POLICIES:
            raise SlackTierError(ErrorKind.BAD_INPUT, f"unknown policy {p}", fix=f"use {','.join(POLICIES)}")
    layers = [int(x) for x in args.layers.split(",") if x]
    sources = tuple(s for s in args.agent_sources.split(",") if s) or None
    corpus = CorpusConfig(agent_sources=sources, agent_sessions_per_source=args.agent_per_source,
                          chat_sessions=args.chat_sessions, seed=args.seed, cache_dir=args.cache_dir)
    replay = ReplayConfig(batch=args.batch, decode_tokens=args.decode_tokens,
                          pause_steps_mean=args.pause_steps_mean, start_spread_steps=args.start_spread_steps,
                          seed=args.seed)
    hasher = EngramLookupHasher()
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    all_hits, reuse_rows, summary = [], [], {}
    for wl in workloads:
        pw = prepare_workload(wl, corpus, replay, hasher, layers, progress)
        if len(pw.split.holdout) < args.batch:
            log.warning("%s: only %d holdout sessions for batch %d", wl, len(pw.split.holdout), args.batch)
        trace, preps, caps = pw.trace, pw.preps, {}
        for prep in preps:
            if args.capacities:
                caps[prep.layer_id] = [Capacity(int(float(c)), f"{int(float(c))} rows")
                                       for c in args.capacities.split(",")]
            else:
                caps[prep.layer_id] = capacities_for(trace, prep.layer_id)
        t1 = time.perf_counter()
        results = hit_table(preps, policies, caps, args.static_head_share, progress)
        all_hits += results
        for prep in preps:
            reuse_rows.append(asdict(batch_reuse(prep, seed=args.seed)))
        # miss-page curve on one grid for all layers: 0, then geometric up to the most unique rows of a layer
        top = max(p.n_items for p in preps)
        grid = sorted({0, *[int(round(top * f)) for f in np.geomspace(1e-3, 1.0, max(args.miss_points - 1, 1))]})
        curve = miss_page_curve(preps, grid, args.miss_policy, progress)
        curve_path = out / f"miss_curve_{wl}_B{args.batch}.json"
        write_json(curve_path, curve)
        lru_runs = [r for r in results if r.policy == "lru"]
        summary[wl] = trace_summary(pw) | {
            "characterize_s": time.perf_counter() - t1,
            "lru_lookups_per_s": (sum(r.all_lookups for r in lru_runs) / sum(r.seconds for r in lru_runs))
            if lru_runs else None,
            "miss_curve": str(curve_path),
        }
    rows = [_flat(r) for r in all_hits]
    _csv(out / "hit_rates.csv", rows)
    write_json(out / "hit_rates.json", [asdict(r) for r in all_hits])
    _csv(out / "batch_reuse.csv", reuse_rows)
    write_json(out / "batch_reuse.json", reuse_rows)
    write_json(out / "summary.json", summary)
    if not args.no_plots:
        plot_hit_rates(all_hits, out)
        plot_miss_curves([out / f"miss_curve_{wl}_B{args.batch}.json" for wl in workloads], out)
    print_table(all_hits, reuse_rows, summary)
    print(f"wrote {out}/hit_rates.csv, hit_rates.json, batch_reuse.csv, summary.json, miss_curve_*.json")
    return 0


def print_table(results, reuse_rows, summary) -> None:
    """A readable decode-hit-rate table: one line per (workload, layer, capacity), one column per policy."""
    from slacktier.workloads.policies import POLICIES

    policies = sorted({r.policy for r in results}, key=POLICIES.index)
    keyed = {(r.workload, r.layer, r.capacity_rows, r.capacity_label, r.policy): r for r in results}
    lines = sorted({k[:4] for k in keyed}, key=lambda k: (k[0], k[1], k[2]))
    head = f"{'workload':8} {'layer':>5} {'capacity':>22} {'rows':>11} " + " ".join(f"{p:>10}" for p in policies)
    print(head)
    print("-" * len(head))
    for wl, layer, rows, label in lines:
        vals = []
        for p in policies:
            r = keyed.get((wl, layer, rows, label, p))
            vals.append(f"{100 * r.decode_hit_rate:9.1f}%" if r else f"{'-':>10}")
        print(f"{wl:8} {layer:>5} {label:>22} {rows:>11,} " + " ".join(vals))
    print()
    for r in reuse_rows:
        print(f"batch reuse {r['workload']:6} layer {r['layer']:>2}: distinct among {r['sample_tokens']} sampled "
              f"decode tokens {100 * r['sampled_distinct']:.1f}%, consecutive {100 * r['consecutive_distinct']:.1f}%, "
              f"in {r['window_tokens']}-token windows {100 * r['window_distinct']:.1f}%")
    for wl, s in summary.items():
        print(f"{wl}: {s['holdout_sessions']} holdout sessions ({s['holdout_sources']} sources), fit "
              f"{s['fit_sessions']} ({s['fit_sources']} sources), {s['trace_tokens']:,} trace tokens, "
              f"{s['decode_tokens']:,} decode tokens, LRU {s['lru_lookups_per_s'] or 0:,.0f} lookups/s")


def plot_hit_rates(results, out: Path) -> None:
    """hit_rate_<workload>_L<layer>.png: decode hit rate against capacity, one line per policy."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    for wl in sorted({r.workload for r in results}):
        for layer in sorted({r.layer for r in results if r.workload == wl}):
            fig, ax = plt.subplots(figsize=(6, 4))
            for policy in sorted({r.policy for r in results}):
                pts = sorted({(r.capacity_rows, r.decode_hit_rate) for r in results
                              if r.workload == wl and r.layer == layer and r.policy == policy and r.capacity_rows > 0})
                if pts:
                    ax.plot([p[0] for p in pts], [100 * p[1] for p in pts], marker="o", label=policy)
            ax.set_xscale("log")
            ax.set_xlabel("cache capacity (rows per layer)")
            ax.set_ylabel("decode hit rate (%)")
            ax.set_title(f"{wl}, Engram layer {layer}")
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=8)
            fig.tight_layout()
            fig.savefig(out / f"hit_rate_{wl}_L{layer}.png", dpi=120)
            plt.close(fig)


def plot_miss_curves(paths: list[Path], out: Path) -> None:
    """miss_pages.png: P_l(c), pages read per decode step against capacity, per workload and layer."""
    import json

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for path in paths:
        curve = json.loads(path.read_text())
        for layer, d in curve["layers"].items():
            xs = [max(c, 1) for c in d["capacity_rows"]]
            ax.plot(xs, d["pages_per_step"], marker=".", label=f"{curve['workload']} L{layer} (B={curve['batch']})")
    ax.set_xscale("log")
    ax.set_xlabel("cache capacity (rows per layer)")
    ax.set_ylabel("pages read per decode step")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "miss_pages.png", dpi=120)
    plt.close(fig)
