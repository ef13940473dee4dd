"""`slacktier load`: put a staged table into Redis, a standalone server or a cluster (resumable; a second run of
the same table is a no-op); `--list` shows the loaded tables, `--remove PREFIX` deletes one, `--replace PREFIX`
deletes the table a load supersedes once the new one is complete."""

from __future__ import annotations

import argparse

from slacktier.commands._args import whole
from slacktier.tables.layout import binary_bytes

HELP = "load a staged table into Redis (standalone or cluster) for the redis tier (resumable, verified page by page)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("manifest", nargs="?", default="", help="the table's manifest (.manifest.json); none with "
                                                             "--list or --remove")
    p.add_argument("--list", action="store_true", help="list the tables loaded at --url (prefix, size, generation)")
    p.add_argument("--remove", default="", metavar="PREFIX", help="delete the table loaded under PREFIX")
    p.add_argument("--replace", default="", metavar="PREFIX",
                   help="after this load completes, delete the table under PREFIX (the version it supersedes: "
                        "both copies are held only while this one loads)")
    p.add_argument("--url", required=True, help="the server, or one node of the cluster: redis://host:port "
                                                "(rediss:// for TLS)")
    p.add_argument("--mode", choices=("standalone", "cluster"), default="standalone",
                   help="what --url is (default standalone; a mode the server does not match is refused)")
    p.add_argument("--user", default="", help="the ACL user that may write (the loading user)")
    secret = p.add_mutually_exclusive_group()
    secret.add_argument("--password-env", default="", metavar="VAR", help="environment variable with its password")
    secret.add_argument("--password-file", default="", metavar="PATH", help="file whose first line is its password")
    p.add_argument("--tls-ca-file", default="", help="CA bundle for TLS")
    p.add_argument("--prefix", default="", help="key prefix (default: st-<stage id>, what the tier looks for)")
    p.add_argument("--tag-buckets", type=whole("--tag-buckets", 1, 16384), default=None,
                   help="hash-tag groups per region (default: slacktier.store.redis.keys.DEFAULT_TAG_BUCKETS; "
                        "at most the smallest region's pages)")
    p.add_argument("--workers", type=whole("--workers", 1, 256), default=4,
                   help="page groups written at once (default 4)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _describe(t) -> str:
    """One loaded table in one line."""
    state = "" if t.state == "complete" else f", {t.state.upper()} (never served)"
    return (f"{t.prefix!r}: table {t.source_digest}, stage {t.stage_id or '-'}, generation {t.generation}, "
            f"{len(t.regions)} regions, {t.pages} pages, {binary_bytes(t.value_bytes)} of page values{state}")


def run(args: argparse.Namespace) -> int:
    from slacktier.config import RedisOptions
    from slacktier.errors import ErrorKind, SlackTierError
    from slacktier.store.redis.admin import find_table, list_tables, remove_table
    from slacktier.store.redis.keys import DEFAULT_TAG_BUCKETS
    from slacktier.store.redis.loader import load_manifest
    from slacktier.tables.manifest import Manifest

    options = RedisOptions(mode=args.mode, url=args.url, username=args.user, password_env=args.password_env,
                           password_file=args.password_file, tls_ca_file=args.tls_ca_file)
    asked = [f for f, on in (("a manifest", bool(args.manifest)), ("--list", args.list),
                             ("--remove", bool(args.remove))) if on]
    if len(asked) != 1:
        raise SlackTierError(ErrorKind.BAD_INPUT, f"load got {' and '.join(asked) or 'nothing to do'}",
                             fix="give a manifest to load, or --list, or --remove PREFIX (one of them)")
    if args.list:
        tables = list_tables(options)
        for t in tables:
            print(_describe(t))
        print(f"{len(tables)} tables, {binary_bytes(sum(t.value_bytes for t in tables))} of page values at {args.url}")
        return 0
    if args.remove:
        print(f"removed {_describe(remove_table(options, args.remove))}")
        return 0
    manifest = Manifest.load(args.manifest)
    if args.replace and find_table(options, args.replace) is None:   # refused before anything is written
        raise SlackTierError(ErrorKind.MISSING, f"--replace {args.replace!r}: no table is loaded under that prefix",
                             fix="list the loaded tables with `slacktier load --list --url ...`")
    report = load_manifest(options, manifest, prefix=args.prefix or None,
                           tag_buckets=DEFAULT_TAG_BUCKETS if args.tag_buckets is None else args.tag_buckets,
                           workers=args.workers, progress=not args.no_progress)
    if report.written == 0:
        print(f"table {manifest.identity.source_digest} is already complete under {report.prefix!r} "
              f"(generation {report.generation}): nothing written")
    else:
        print(f"loaded {report.written} of {report.groups} page groups ({report.tag_buckets} per region, "
              f"{report.pages} pages) of table {manifest.identity.source_digest} under {report.prefix!r} in "
              f"{report.seconds:.1f} s, generation {report.generation}")
    if report.replaced is not None:
        print(f"replaced in place: {_describe(report.replaced)}")
    if args.replace and args.replace != report.prefix:
        print(f"removed {_describe(remove_table(options, args.replace))}")
    try:
        loaded = list_tables(options)
    except SlackTierError as exc:   # a loading user without SCAN: the load stands, the listing is said to be missing
        loaded = []
        print(f"could not list the other loaded tables: {exc.message}")
    others = [t for t in loaded if t.prefix != report.prefix
              and sorted(t.regions) == sorted((r.layer, r.rank, r.pages) for r in manifest.runtime_regions())]
    for t in others:
        print(f"also loaded, with this table's regions: {_describe(t)}; remove it with `slacktier load --remove "
              f"{t.prefix} --url {args.url}` once no engine serves it")
    print(f'serve it with: source = "redis", [table.redis] mode = "{args.mode}", url = "{args.url}"'
          + (f', prefix = "{args.prefix}"' if args.prefix else "") + ", and the serving (read-only) user")
    return 0
