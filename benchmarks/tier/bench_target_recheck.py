"""What the disk tier's restage check costs: one buffered header-page pread per target after each batch lands.

`DiskSource.wait` re-reads each target's header page once a batch has landed (issue 33: a target staged
again under a running engine is refused instead of having its rows served). This runs batches of 1 and of
100 random pages through one DiskSource over a staged file, A/B interleaved in one process: the source as
it is, and the same source with the re-read switched off, and prints each batch's wait (median of its
rounds), and the re-read alone. A shared machine disturbs absolute times: read the ratios.

    .venv/bin/python benchmarks/tier/bench_target_recheck.py --dir /var/tmp --rounds 5
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from slacktier.store.base import PageBufferPool, PageReads
from slacktier.store.disk import DiskSource
from slacktier.tables.stage import stage_synthetic


def _waits_us(src: DiskSource, pages: int, batches: int, rng: np.random.Generator, pool: PageBufferPool) -> float:
    """Median submit-to-return time of `batches` batches of `pages` random pages (us)."""
    out = []
    n = src.regions[0].pages
    for _ in range(batches):
        reads = PageReads(np.zeros(pages, np.int32), rng.integers(0, n, pages).astype(np.int64),
                          np.arange(pages, dtype=np.int32))
        t0 = time.perf_counter_ns()
        src.wait(src.submit(reads, pool), timeout_s=10.0)
        out.append((time.perf_counter_ns() - t0) / 1e3)
    return statistics.median(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default="/var/tmp", help="a directory on a disk that takes O_DIRECT")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--batches", type=int, default=400)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        m = stage_synthetic([Path(d) / "t.bin"], {1: 1_500_000}, 1, 0, progress=False)   # 100k pages, 400 MB
        src = DiskSource(m.runtime_regions(), identity=m.identity)
        pool = PageBufferPool(128)
        rng = np.random.default_rng(0)
        rows: dict[tuple[str, int], list[float]] = {}
        for _ in range(args.rounds):
            for pages in (1, 100):
                for variant in ("as is", "no re-read"):
                    if variant == "no re-read":
                        src._restaged = lambda: None   # the A/B's other arm only
                    else:
                        src.__dict__.pop("_restaged", None)
                    rows.setdefault((variant, pages), []).append(_waits_us(src, pages, args.batches, rng, pool))
        src.__dict__.pop("_restaged", None)
        t0 = time.perf_counter_ns()
        for _ in range(20_000):
            src._restaged()
        reread_us = (time.perf_counter_ns() - t0) / 1e3 / 20_000
        src.close()
    print(f"re-read alone: {reread_us:.2f} us per batch (1 target)")
    print(f"{'pages':>6} {'as is us':>10} {'no re-read us':>14} {'ratio':>7}   (median of {args.rounds} rounds' "
          "medians; min..max ratio)")
    for pages in (1, 100):
        a, b = rows[("as is", pages)], rows[("no re-read", pages)]
        ratios = [x / y for x, y in zip(a, b)]
        print(f"{pages:>6} {statistics.median(a):>10.1f} {statistics.median(b):>14.1f} "
              f"{statistics.median(ratios):>7.3f}   ({min(ratios):.3f}..{max(ratios):.3f})")


if __name__ == "__main__":
    main()
