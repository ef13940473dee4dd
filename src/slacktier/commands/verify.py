"""`slacktier verify`: check every page checksum and N random rows per region against the source."""

from __future__ import annotations

import argparse
from pathlib import Path

from slacktier.commands._args import whole

HELP = "verify a staged table: every page's CRC32C and N random rows per region against the source"


MAX_VERIFY_ROWS = 10**7   # random rows per region checked against the source (drawn with replacement)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("manifest", help="the table's manifest (.manifest.json)")
    p.add_argument("--rows", type=whole("--rows", 0, MAX_VERIFY_ROWS), default=200,
                   help="random rows per (layer, rank) region (default 200)")
    p.add_argument("--seed", type=whole("--seed", 0, 2**63 - 1), default=0,
                   help="seed for picking the rows (default 0)")
    p.add_argument("--checkpoint", nargs="+", metavar="PATH", help="checkpoint path(s), if moved since staging")
    p.add_argument("--no-pages", action="store_true", help="skip the page checksum pass")
    p.add_argument("--buffered", action="store_true", help="read through the page cache instead of O_DIRECT")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--redigest", action="store_true",
                   help="for a manifest without its own digest (or edited on purpose): verify the whole table, then, "
                        "only if it is intact, record the manifest's digest")


def run(args: argparse.Namespace) -> int:
    from slacktier.errors import ErrorKind, SlackTierError
    from slacktier.tables.manifest import Manifest
    from slacktier.tables.verify import verify_table

    manifest = args.manifest
    for path in args.checkpoint or ():
        if not Path(path).exists():
            raise SlackTierError(ErrorKind.MISSING, f"--checkpoint {path} does not exist",
                                 fix="pass the checkpoint's current path (a file or its directory)")
    if args.redigest:
        if args.no_pages or args.rows < 1:
            raise SlackTierError(ErrorKind.BAD_INPUT, "--redigest records a digest only after every page and rows "
                                 "against the source are checked", fix="drop --no-pages and keep --rows >= 1")
        manifest = Manifest.load(args.manifest, check_digest=False)
    report = verify_table(manifest, args.rows, seed=args.seed, checkpoint=args.checkpoint,
                          check_pages=not args.no_pages, buffered=args.buffered, progress=not args.no_progress)
    print("\n".join(report.lines()))
    if args.redigest and report.ok:
        manifest.save(manifest.path)
        print(f"recorded the digest of manifest {manifest.path}")
    elif args.redigest:
        print(f"manifest {manifest.path} left as it was: the table did not verify")
    return 0 if report.ok else 1
