"""`slacktier demo`: stage and verify a small table, replay built-in agent traffic under three placements
(slacktier.serve.demo)."""

from __future__ import annotations

import argparse

HELP = "run the demo: stage and verify a small table, replay built-in agent traffic under three placements, print a report"


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of the demo verb."""
    p.add_argument("--out", default="runs/demo", help="working directory (default runs/demo)")
    p.add_argument("--rows", type=int, default=300_000, help="rows per layer (default 300000)")
    p.add_argument("--layers", default="1,14", help="layer ids (default 1,14)")
    p.add_argument("--ranks", type=int, default=2, help="ranks per layer (default 2)")
    p.add_argument("--seed", type=int, default=0, help="synthetic table seed (default 0)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--skip-replay", action="store_true", help="stage and verify only; skip the traffic replay")


def run(args: argparse.Namespace) -> int:
    """Run the demo."""
    from slacktier.serve.demo import DemoConfig, run_demo

    return run_demo(DemoConfig(out=args.out, rows=args.rows, layers=tuple(int(x) for x in args.layers.split(",")),
                               ranks=args.ranks, seed=args.seed, progress=not args.no_progress,
                               replay=not args.skip_replay))
