"""`slacktier demo`: stage and verify a small table, replay built-in traffic under a few placements, and time
them against a GPU step profile (slacktier.serve.demo)."""

from __future__ import annotations

import argparse

HELP = ("run the demo: stage and verify a small table, replay built-in traffic under a few placements (real model "
        "code, then the step timeline), print a report")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of the demo verb."""
    p.add_argument("--out", default="runs/demo", help="working directory (default runs/demo)")
    p.add_argument("--rows", type=int, default=300_000, help="rows per layer (default 300000)")
    p.add_argument("--layers", default="1,14", help="layer ids (default 1,14)")
    p.add_argument("--ranks", type=int, default=2, help="ranks per layer (default 2)")
    p.add_argument("--seed", type=int, default=0, help="synthetic table seed (default 0)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--skip-replay", action="store_true", help="stage and verify only; skip the traffic replay")
    p.add_argument("--skip-timeline", action="store_true", help="skip the step-timeline section")
    p.add_argument("--metrics-port", type=int, default=0,
                   help="serve the demo engines' Prometheus metrics on this port while it runs (0: off)")


def run(args: argparse.Namespace) -> int:
    """Run the demo."""
    from slacktier.serve.demo import DemoConfig, run_demo

    return run_demo(DemoConfig(out=args.out, rows=args.rows, layers=tuple(int(x) for x in args.layers.split(",")),
                               ranks=args.ranks, seed=args.seed, progress=not args.no_progress,
                               replay=not args.skip_replay, timeline=not args.skip_timeline,
                               metrics_port=args.metrics_port))
