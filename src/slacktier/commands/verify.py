"""`slacktier verify`: check every page checksum and N random rows per region against the source."""

from __future__ import annotations

import argparse

HELP = "verify a staged table: every page's CRC32C and N random rows per region against the source"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("manifest", help="the table's manifest (.manifest.json)")
    p.add_argument("--rows", type=int, default=200, help="random rows per (layer, rank) region (default 200)")
    p.add_argument("--seed", type=int, default=0, help="seed for picking the rows (default 0)")
    p.add_argument("--checkpoint", nargs="+", metavar="PATH", help="checkpoint path(s), if moved since staging")
    p.add_argument("--no-pages", action="store_true", help="skip the page checksum pass")
    p.add_argument("--buffered", action="store_true", help="read through the page cache instead of O_DIRECT")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")


def run(args: argparse.Namespace) -> int:
    from slacktier.tables.verify import verify_table

    report = verify_table(args.manifest, args.rows, seed=args.seed, checkpoint=args.checkpoint,
                          check_pages=not args.no_pages, buffered=args.buffered, progress=not args.no_progress)
    print("\n".join(report.lines()))
    return 0 if report.ok else 1
