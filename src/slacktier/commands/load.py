"""`slacktier load`: put a staged table into Redis, a standalone server or a cluster (resumable; a second run of
the same table is a no-op)."""

from __future__ import annotations

import argparse

from slacktier.commands._args import whole

HELP = "load a staged table into Redis (standalone or cluster) for the redis tier (resumable, verified page by page)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("manifest", help="the table's manifest (.manifest.json)")
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


def run(args: argparse.Namespace) -> int:
    from slacktier.config import RedisOptions
    from slacktier.store.redis.keys import DEFAULT_TAG_BUCKETS
    from slacktier.store.redis.loader import load_manifest
    from slacktier.tables.manifest import Manifest

    manifest = Manifest.load(args.manifest)
    options = RedisOptions(mode=args.mode, url=args.url, username=args.user, password_env=args.password_env,
                           password_file=args.password_file, tls_ca_file=args.tls_ca_file)
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
    print(f'serve it with: source = "redis", [table.redis] mode = "{args.mode}", url = "{args.url}"'
          + (f', prefix = "{args.prefix}"' if args.prefix else "") + ", and the serving (read-only) user")
    return 0
