"""Measured prefetch windows of SmolLM2-135M on this CPU at two batch sizes, and the probe's own overhead.

    .venv/bin/python benchmarks/bench_probe_windows.py --batch 1 8 --layers every:3 --append

Prints a table per batch (window in ms and as a share of the step, next to k/L and
the paper's 0.85-0.92 k/L), the probe's overhead (hooks attached, no target, vs
hooks removed, A/B interleaved in shuffled order), writes JSON and a Figure-4-style
PNG under runs/probe/, and with --append adds the figures to docs/bench-log/windows.md under
"## Windows and placement".
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

from slacktier.commands.probe import parse_layers
from slacktier.probe import (NO_TARGET, SweepSettings, WindowProbe, format_table, measure_overhead, plot_windows,
                             sweep_windows, write_json, write_probe_config)
from slacktier.probe.hf import DecodeLoop, load_causal_lm
from slacktier.probe.report import PAPER_FRAC_HIGH, PAPER_FRAC_LOW, depth

ROOT = Path(__file__).resolve().parents[2]
SECTION = "## Windows and placement"

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # the repo root: benchmarks.* imports
from benchmarks._harness import append_to_section  # noqa: E402
from benchmarks._harness import machine as common_machine  # noqa: E402


def machine() -> str:
    """The shared machine line plus torch's version and threads and the load average now."""
    return (f"{common_machine()}, torch {torch.__version__}, {torch.get_num_threads()} torch thread(s); "
            f"load average at start {os.getloadavg()[0]:.1f}")


def slope_through_origin(sweep, attr: str = "window_ms") -> float:
    """Least-squares a in window/step = a * k/L over the probed layers with k > 0."""
    pts = [(depth(lw.layer, sweep.num_layers), getattr(lw, attr) / sweep.noise.baseline_ms) for lw in sweep.layers
           if getattr(lw, attr) is not None and lw.layer > 0]
    x = np.array([p[0] for p in pts])
    y = np.array([p[1] for p in pts])
    return float(x @ y / (x @ x)) if len(pts) else float("nan")


def summary_rows(sweep) -> list[str]:
    rows = []
    for lw in sweep.layers:
        d = depth(lw.layer, sweep.num_layers)
        if lw.window_ms is None:
            rows.append(f"| {sweep.batch} | {lw.layer} | {d:.3f} | - | - | - | - | - | {lw.arrival_ms:.2f} |")
            continue
        ratio = f"{lw.window_frac / d:.2f}" if d > 0 else "-"
        fit_frac = lw.window_fit_ms / sweep.noise.baseline_ms
        fit_ratio = f"{fit_frac / d:.2f}" if d > 0 else "-"
        rows.append(f"| {sweep.batch} | {lw.layer} | {d:.3f} | {lw.window_ms:.2f} | {lw.window_frac:.3f} | {ratio} | "
                    f"{lw.window_fit_ms:.2f} | {fit_ratio} | {lw.arrival_ms:.2f} |")
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--layers", default="every:3")
    ap.add_argument("--clock", choices=("wall", "thread_cpu"), default="thread_cpu")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--baseline-steps", type=int, default=40)
    ap.add_argument("--floor-ms", type=float, default=0.3)
    ap.add_argument("--points-per-step", type=int, default=10)
    ap.add_argument("--overhead-pairs", type=int, default=60)
    ap.add_argument("--overhead-clocks", default="thread_cpu,wall",
                    help="clocks to time the overhead A/B with (comma list)")
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "probe")
    ap.add_argument("--png", type=Path, default=None, help="plot path (default: <out>/windows_<clock>.png)")
    ap.add_argument("--append", action="store_true", help="append the figures to its docs/bench-log/ file")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    started = datetime.datetime.now(datetime.timezone.utc)
    host = machine()
    t_start = time.perf_counter()
    model, name = load_causal_lm("smollm2")
    args.out.mkdir(parents=True, exist_ok=True)
    cfg = args.out / "probe.json"
    settings = SweepSettings(baseline_steps=args.baseline_steps, repeats=args.repeats, floor_ms=args.floor_ms,
                             points_per_step=args.points_per_step)
    sweeps, overhead = [], []
    for batch in args.batch:
        loop = DecodeLoop(model, batch, clock=args.clock)
        write_probe_config(cfg, NO_TARGET)
        probe = WindowProbe(model, config_path=str(cfg), clock=args.clock)
        layers = parse_layers(args.layers, probe.num_layers)
        if probe.num_layers - 1 not in layers:
            layers.append(probe.num_layers - 1)
        with probe:
            sweeps.append(sweep_windows(loop.step, probe, layers, settings, batch=batch, model_name=name,
                                        progress=lambda m, b=batch: print(f"[B={b}] {m}", file=sys.stderr,
                                                                          flush=True)))
        for clock in [c for c in args.overhead_clocks.split(",") if c]:
            oloop = DecodeLoop(model, batch, clock=clock)
            oprobe = WindowProbe(model, config_path=str(cfg), clock=clock)
            hooked, bare = measure_overhead(oloop.step, oprobe, pairs=args.overhead_pairs, seed=batch)
            overhead.append((batch, clock, hooked, bare))
    elapsed = time.perf_counter() - t_start
    table = format_table(sweeps)
    print(table)
    ov_lines = []
    for batch, clock, hooked, bare in overhead:
        h, b = statistics.median(hooked), statistics.median(bare)
        ov_lines.append(f"| {batch} | {clock} | {len(hooked)} | {b:.2f} ({min(bare):.2f} / {max(bare):.2f}) | "
                        f"{h:.2f} ({min(hooked):.2f} / {max(hooked):.2f}) | {h - b:+.3f} | {h / b:.4f} |")
    print("\n".join(ov_lines))
    js = write_json(sweeps, args.out / f"windows_{args.clock}.json")
    png = plot_windows(sweeps, args.png or args.out / f"windows_{args.clock}.png",
                       title=f"{name}, CPU, clock={args.clock}")
    print(f"wrote {js} and {png}; {elapsed:.0f} s")
    if not args.append:
        return 0
    cmd = "    .venv/bin/python benchmarks/bench_probe_windows.py " + " ".join(sys.argv[1:])
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                             check=False).stdout.strip()
    except OSError:
        rev = "?"
    lines = [
        f"### Prefetch windows of SmolLM2-135M on the CPU ({started:%Y-%m-%d %H:%M} UTC, commit {rev} + working tree)",
        "",
        cmd,
        "",
        f"Machine: {host}. Model: {name}, float32, decode steps of B sequences (one token each, KV cache "
        f"holding 64-128 tokens). Clock: `{args.clock}`"
        + (" (the decode thread's CPU time: the machine is shared, so wall time mostly measures other "
           "processes; with one torch thread the step's compute and the probe's busy-wait both run on that "
           "thread)" if args.clock == "thread_cpu" else "") + ".",
        f"Sweep: {args.baseline_steps} baseline steps, X grid = step/{args.points_per_step}, {args.repeats} "
        f"(held, baseline) pairs per point in shuffled order, first point above threshold confirmed by a second "
        f"block; {elapsed:.0f} s in all.",
        "",
    ]
    for s in sweeps:
        n = s.noise
        lines.append(f"- B={s.batch}: step {n.baseline_ms:.2f} ms (median of {n.steps}), robust std {n.std_ms:.2f} ms "
                     f"-> noise threshold max({n.floor_ms} ms floor, 3 std, 1% of step) = **{n.threshold_ms:.2f} ms**; "
                     f"least-squares window/step = **{slope_through_origin(s):.2f} x k/L** by the paper's rule, "
                     f"{slope_through_origin(s, 'window_fit_ms'):.2f} x k/L by the fit, "
                     f"{slope_through_origin(s, 'arrival_ms'):.2f} x k/L by arrival (paper, Gemma 4 on GPUs: "
                     f"{PAPER_FRAC_LOW}-{PAPER_FRAC_HIGH} x k/L); {s.steps_run} steps.")
    lines += ["", "| B | layer k | k/L | window ms (first X) | window/step | (window/step)/(k/L) | fit ms | "
                  "fit: (window/step)/(k/L) | arrival ms (no hold) |",
              "|---|---|---|---|---|---|---|---|---|"]
    for s in sweeps:
        lines += summary_rows(s)
    lines += ["",
              f"Plot: `{png.relative_to(ROOT) if png.is_relative_to(ROOT) else png}` (git-ignored; window/step vs "
              "k/L with the paper's band). \"arrival\" is when the layer's pre-hook ran with nothing held, a direct "
              "reading the probe also takes; \"first X\" is the paper's estimate, X - delta at the first X whose "
              "delta passes the threshold (biased low on a noisy machine: that delta was selected for being "
              f"large); \"fit\" is the median of X - delta over the {settings.extra_points} next grid points, "
              "measured whatever their delta.",
              "",
              "Probe overhead, hooks attached with no target vs hooks removed, A/B interleaved, shuffled "
              "(ms, median (min / max)):",
              "",
              "| B | clock | pairs | hooks removed | hooks, no target | difference ms | ratio |",
              "|---|---|---|---|---|---|---|"]
    lines += ov_lines
    append_to_section("\n".join(lines), SECTION)
    print("appended to its docs/bench-log/ file")
    return 0


if __name__ == "__main__":
    sys.exit(main())
