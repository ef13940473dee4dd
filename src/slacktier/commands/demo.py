"""`slacktier demo`: stage and verify a small table, replay built-in traffic under a few placements, and time
them against a GPU step profile (slacktier.serve.demo)."""

from __future__ import annotations

import argparse

from slacktier.commands._args import whole
from slacktier.errors import ErrorKind, SlackTierError

HELP = ("run the demo: stage and verify a small table, replay built-in traffic under a few placements (real model "
        "code, then the step timeline), print a report")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of the demo verb."""
    p.add_argument("--out", default="runs/demo", help="working directory (default runs/demo)")
    p.add_argument("--rows", type=whole("--rows", 1), default=300_000, help="rows per layer (default 300000)")
    p.add_argument("--layers", default="1,14", help="layer ids (default 1,14)")
    p.add_argument("--ranks", type=whole("--ranks", 1, 1 << 16), default=2, help="ranks per layer (default 2)")
    p.add_argument("--seed", type=int, default=0, help="synthetic table seed (default 0)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--skip-replay", action="store_true", help="stage and verify only; skip the traffic replay")
    p.add_argument("--skip-timeline", action="store_true", help="skip the step-timeline section")
    p.add_argument("--metrics-port", type=whole("--metrics-port", 0, 65535), default=0,
                   help="serve the demo engines' Prometheus metrics on this port while it runs (0: off)")
    p.add_argument("--metrics-addr", default="127.0.0.1",
                   help="the address the metrics port binds (default 127.0.0.1, this host only; 0.0.0.0 serves "
                        "every interface)")


def parse_layer_ids(text: str) -> tuple[int, ...]:
    """'1,14' -> (1, 14); anything but distinct layer ids is refused naming --layers."""
    from slacktier.tables.manifest import MAX_LAYER_ID

    fix = "write layer ids separated by commas, e.g. --layers 1,14"
    try:
        layers = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise SlackTierError(ErrorKind.BAD_INPUT, f"cannot read --layers {text!r}: not whole numbers",
                             fix=fix) from None
    if len(set(layers)) != len(layers) or not all(0 <= x <= MAX_LAYER_ID for x in layers):
        raise SlackTierError(ErrorKind.BAD_INPUT, f"--layers {text!r} lists a layer twice or one outside "
                             f"0..{MAX_LAYER_ID}", fix=fix)
    return layers


def run(args: argparse.Namespace) -> int:
    """Run the demo (every argument is checked before anything is staged)."""
    from slacktier.serve.demo import DemoConfig, run_demo

    return run_demo(DemoConfig(out=args.out, rows=args.rows, layers=parse_layer_ids(args.layers),
                               ranks=args.ranks, seed=args.seed, progress=not args.no_progress,
                               replay=not args.skip_replay, timeline=not args.skip_timeline,
                               metrics_port=args.metrics_port, metrics_addr=args.metrics_addr))
