"""What knowing which table each Redis value belongs to costs: the stored CRC32C against the manifest's.

With `verify_reads = false` the Redis tier still compares each value's stored CRC32C with the manifest's on
every read (store/redis/source.py, `_landed`), so another table loaded into the prefix an engine serves is
refused instead of served. This reads the same random batches through three RedisSources over one loaded
table, A/B interleaved in shuffled order in one process: no manifest CRC32Cs (what verify_reads = false did
before), the stored-CRC32C compare alone (verify_reads = false now), and the compare plus each page's own
CRC32C (verify_reads = true, the default). It prints each one's wall time per batch and the source's CPU per
page (min/median/max over rounds), and the compare alone (the numpy gather and compare `_landed` runs per
batch). A shared machine disturbs absolute times: read the ratios, and the compare alone. The host memory
the compare needs is the manifest's CRC32Cs: 4 bytes per page served.

    .venv/bin/python benchmarks/tier/bench_redis_stored_crc.py --rounds 7 --batches 30 --pages 700
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import timeit
from pathlib import Path

import numpy as np

from slacktier.config import RedisOptions
from slacktier.store.base import PageBufferPool, PageReads
from slacktier.store.redis.loader import load_manifest
from slacktier.store.redis.source import RedisSource
from slacktier.tables.stage import stage_synthetic
from slacktier.testing.store import RedisServer


def main() -> None:
    """Stage, load, read interleaved, print the table."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--batches", type=int, default=30, help="batches per source per round")
    ap.add_argument("--pages", type=int, default=700, help="pages per batch")
    ap.add_argument("--rows", type=int, default=60_000, help="rows per layer (2 layers, 2 ranks)")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-redis-crc-"))
    server = None
    try:
        m = stage_synthetic([work / "t.bin"], {1: args.rows, 14: args.rows}, 2, 3, progress=False)
        (work / "redis").mkdir()
        server = RedisServer(work / "redis")
        opts = RedisOptions(url=server.url, prefix="bench")
        load_manifest(opts, m, tag_buckets=64)
        specs, crcs = m.runtime_regions(), m.region_checksums()
        sources = {"no manifest CRC32Cs": RedisSource(specs, opts, identity=m.identity),
                   "stored CRC32C compared": RedisSource(specs, opts, page_crc32c=crcs, identity=m.identity,
                                                         verify_pages=False),
                   "compared + page CRC32C": RedisSource(specs, opts, page_crc32c=crcs, identity=m.identity)}
        rng = np.random.default_rng(0)
        pool = PageBufferPool(args.pages)
        pages = np.array([s.pages for s in specs])
        got: dict[str, list[tuple[float, float]]] = {k: [] for k in sources}
        for _ in range(args.rounds):
            for name in rng.permutation(list(sources)):
                src, wall_ms, cpu_us = sources[name], 0.0, 0.0
                for _ in range(args.batches):
                    region = rng.integers(0, len(specs), args.pages).astype(np.int32)
                    page = (rng.random(args.pages) * pages[region]).astype(np.int64)
                    st = src.wait(src.submit(PageReads(region, page, np.arange(args.pages, dtype=np.int32)), pool))
                    wall_ms += st.read_us / 1e3
                    cpu_us += st.cpu_us
                got[name].append((wall_ms / args.batches, cpu_us / args.batches / args.pages))
        for s in sources.values():
            s.close()
        expected = np.concatenate(crcs)
        base = np.concatenate([[0], np.cumsum(pages)[:-1]])
        region = rng.integers(0, len(specs), args.pages).astype(np.int32)
        page = (rng.random(args.pages) * pages[region]).astype(np.int64)
        stored = expected[base[region] + page].copy()
        n = 2000
        alone_us = min(timeit.repeat(lambda: np.flatnonzero(stored != expected[base[region] + page]),
                                     number=n, repeat=5)) / n * 1e6
        print(f"Redis tier, {args.pages}-page batches, {args.rounds} rounds x {args.batches} batches, local "
              f"redis-server {server.url}")
        print(f"{'source':26s} {'wall ms/batch min/med/max':>28s} {'source CPU us/page min/med/max':>32s}")
        for name, v in got.items():
            w = sorted(x[0] for x in v)
            c = sorted(x[1] for x in v)
            mid = len(v) // 2
            print(f"{name:26s} {w[0]:8.2f} {w[mid]:8.2f} {w[-1]:8.2f}   {c[0]:9.3f} {c[mid]:9.3f} {c[-1]:9.3f}")
        print(f"the compare alone: {alone_us:.1f} us per {args.pages}-page batch "
              f"({alone_us / args.pages * 1e3:.1f} ns per page); host memory: 4 B per page served")
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
