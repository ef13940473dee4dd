"""What Prometheus metrics cost per step: begin_step + gather + end_step with metrics on and off, side by side.

Two engines serve the same two V4.1-shaped table layers (EngramLayout.scaled,
24 hash columns each) from in-memory page sources (`engine.testing.ArraySource`)
through equal row caches (by default as large as the tables: after the warm-up pass
over the same ids a step is mostly cache hits, the decode case); one has `metrics=EngineMetrics(registry=...)` (its own
CollectorRegistry), the other none (the default). Both run the same steps of real-token
ids (B tokens per step, a stretch of real Python source hashed with the
DeepSeek-V4 tokenizer), interleaved step by step in alternating order so drift
and cache warmth hit both alike, for `--rounds` rounds of `--steps` steps.
Reported per step, median over the rounds' medians (min and max beside): wall
time of begin_step, of the two gathers, of end_step, and of the whole step, and the calling
thread's CPU time of the whole step. Metrics work happens in end_step only (one
update per layer per step), so begin_step and gather must come out equal.

    .venv/bin/python benchmarks/bench_engine_metrics.py [--tokens 128] [--rounds 5] [--steps 200] [--append]
        [--png runs/engine_metrics.png]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # the repo root: benchmarks.* imports
from benchmarks._harness import append_to_section, command_line, machine, pyplot, save_figure, utc_stamp  # noqa: E402

from prometheus_client import CollectorRegistry  # noqa: E402

from slacktier.cache import RowCache  # noqa: E402
from slacktier.engine.metrics import EngineMetrics  # noqa: E402
from slacktier.engine.step import StepEngine  # noqa: E402
from slacktier.testing.engine import array_tables, real_token_ids  # noqa: E402
from slacktier.tables.engram_hash import EngramLayout  # noqa: E402

SECTION = "## The tier: page sources, cache and step engine"
SUBSECTION = "### Metrics: cost per step, on and off"
PARTS = ("begin_step", "gather", "end_step", "step", "step_cpu")


def build(layout: EngramLayout, cache_rows: int, tokens: int, metrics: bool) -> StepEngine:
    """An engine over in-memory pages of `layout`'s two layers, with or without metrics."""
    rows = {layer: layout.rows(i) for i, layer in enumerate(layout.layer_ids)}
    tables, _, _ = array_tables(rows, ranks=4)
    for t in tables:
        t.reference = None
    cache_rows = cache_rows or sum(rows.values())
    return StepEngine(tables, RowCache(cache_rows), max_tokens=tokens,
                      metrics=EngineMetrics(registry=CollectorRegistry()) if metrics else None)


def one_step(eng: StepEngine, ids: np.ndarray) -> dict[str, float]:
    """Times (us) of one step's parts."""
    c0 = time.thread_time_ns()
    t0 = time.perf_counter_ns()
    eng.begin_step(ids)
    t1 = time.perf_counter_ns()
    for layer in eng.layers:
        eng.gather(layer)
    t2 = time.perf_counter_ns()
    eng.end_step()
    t3 = time.perf_counter_ns()
    c1 = time.thread_time_ns()
    return {"begin_step": (t1 - t0) / 1e3, "gather": (t2 - t1) / 1e3, "end_step": (t3 - t2) / 1e3,
            "step": (t3 - t0) / 1e3, "step_cpu": (c1 - c0) / 1e3}


def run(args: argparse.Namespace) -> dict[str, dict[str, list[float]]]:
    """Per mode ("off", "on"), per part: the median of each round."""
    layout = EngramLayout.scaled(args.vocab)
    ids = real_token_ids(args.tokens * (args.steps + 1), layout)   # [N, 2, 24]
    engines = {"off": build(layout, args.cache_rows, args.tokens, False),
               "on": build(layout, args.cache_rows, args.tokens, True)}
    for eng in engines.values():   # warm: compile, fill the cache with the first stretch
        for a in range(0, args.tokens * args.steps, args.tokens):
            one_step(eng, ids[a:a + args.tokens])
    medians = {mode: {p: [] for p in PARTS} for mode in engines}
    for r in range(args.rounds):
        times = {mode: {p: [] for p in PARTS} for mode in engines}
        for s in range(args.steps):
            a = args.tokens * ((s + r * 7) % args.steps)
            order = ("off", "on") if (s + r) % 2 == 0 else ("on", "off")
            for mode in order:
                for p, v in one_step(engines[mode], ids[a:a + args.tokens]).items():
                    times[mode][p].append(v)
        for mode in engines:
            for p in PARTS:
                medians[mode][p].append(statistics.median(times[mode][p]))
    for eng in engines.values():
        eng.close()
    return medians


def table(medians: dict[str, dict[str, list[float]]], args: argparse.Namespace) -> str:
    """Markdown: one row per part, off and on side by side (median [min, max] over rounds, us)."""
    out = [f"B = {args.tokens} tokens per step, 2 layers x 24 lookups per token, {args.rounds} rounds x "
           f"{args.steps} steps, interleaved; us per step, median of the rounds' medians [min, max]", "",
           "| part | metrics off | metrics on | on - off |", "|---|---|---|---|"]
    for p in PARTS:
        off, on = medians["off"][p], medians["on"][p]
        mo, mn = statistics.median(off), statistics.median(on)
        out.append(f"| {p} | {mo:.1f} [{min(off):.1f}, {max(off):.1f}] | {mn:.1f} [{min(on):.1f}, {max(on):.1f}] "
                   f"| {mn - mo:+.1f} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    """Run, print the table, optionally append it to docs/bench-log/tier.md and plot it."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=128, help="tokens per step (default 128)")
    ap.add_argument("--rounds", type=int, default=5, help="rounds (default 5)")
    ap.add_argument("--steps", type=int, default=200, help="steps per round (default 200)")
    ap.add_argument("--vocab", type=int, default=20_000, help="EngramLayout.scaled vocabulary (default 20000)")
    ap.add_argument("--cache-rows", type=int, default=0,
                    help="row cache slots (default 0: the whole table, so a warmed step reads little)")
    ap.add_argument("--append", action="store_true", help="append the table to its docs/bench-log/ file")
    ap.add_argument("--png", help="write a bar plot here")
    args = ap.parse_args(argv)
    medians = run(args)
    text = table(medians, args)
    print(text)
    if args.png:
        plt = pyplot()
        fig, ax = plt.subplots(figsize=(7, 3.5))
        x = np.arange(len(PARTS))
        for k, mode in enumerate(("off", "on")):
            ax.bar(x + (k - 0.5) * 0.38, [statistics.median(medians[mode][p]) for p in PARTS], 0.38,
                   label=f"metrics {mode}")
        ax.set_xticks(x, PARTS)
        ax.set_ylabel("us per step (median)")
        ax.legend()
        save_figure(fig, args.png)
    if args.append:
        block = (f"#### {utc_stamp()}\n\n`{command_line(__file__, argv)}` on {machine()}\n\n{text}")
        append_to_section(block, SECTION, SUBSECTION)
    return 0


if __name__ == "__main__":
    sys.exit(main())
