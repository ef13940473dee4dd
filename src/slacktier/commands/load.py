"""`slacktier load`: put a staged table into a Redis Cluster (resumable; a second run of the same table is a no-op)."""

from __future__ import annotations

import argparse

from slacktier.commands._args import whole

HELP = "load a staged table into a Redis Cluster for the redis-cluster tier (resumable, verified page by page)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("manifest", help="the table's manifest (.manifest.json)")
    p.add_argument("--url", required=True, help="one node of the cluster, redis://host:port (rediss:// for TLS)")
    p.add_argument("--user", default="", help="the ACL user that may write (the loading user)")
    secret = p.add_mutually_exclusive_group()
    secret.add_argument("--password-env", default="", metavar="VAR", help="environment variable with its password")
    secret.add_argument("--password-file", default="", metavar="PATH", help="file whose first line is its password")
    p.add_argument("--tls-ca-file", default="", help="CA bundle for TLS")
    p.add_argument("--prefix", default="", help="key prefix (default: st-<stage id>, what the tier looks for)")
    p.add_argument("--tag-buckets", type=whole("--tag-buckets", 1, 16384), default=None,
                   help="hash-tag groups per region (default: slacktier.store.redis_cluster.DEFAULT_TAG_BUCKETS; "
                        "at most the smallest region's pages)")
    p.add_argument("--workers", type=whole("--workers", 1, 256), default=4,
                   help="page groups written at once (default 4)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    from slacktier.config import RedisClusterOptions
    from slacktier.store.redis_cluster import DEFAULT_TAG_BUCKETS, default_prefix, load_manifest
    from slacktier.tables.manifest import Manifest

    manifest = Manifest.load(args.manifest)
    options = RedisClusterOptions(url=args.url, username=args.user, password_env=args.password_env,
                                  password_file=args.password_file, tls_ca_file=args.tls_ca_file)
    report = load_manifest(options, manifest, prefix=args.prefix or None,
                           tag_buckets=DEFAULT_TAG_BUCKETS if args.tag_buckets is None else args.tag_buckets, workers=args.workers,
                           progress=not args.no_progress)
    prefix = args.prefix or default_prefix(manifest.identity)
    if report.written == 0:
        print(f"table {manifest.identity.source_digest} is already complete under {prefix!r} "
              f"(generation {report.generation}): nothing written")
    else:
        print(f"loaded {report.written} of {report.groups} page groups ({report.tag_buckets} per region, "
              f"{report.pages} pages) of table "
              f"{manifest.identity.source_digest} under {prefix!r} in {report.seconds:.1f} s, generation "
              f"{report.generation}")
    print(f'serve it with: source = "redis-cluster", [table.redis-cluster] url = "{args.url}"'
          + (f', prefix = "{args.prefix}"' if args.prefix else "") + ", and the serving (read-only) user")
    return 0
