"""The disk tier where io_uring is refused: the threads engine on C threads against Python's, and io_uring.

A container started with Docker's default seccomp profile refuses io_uring_setup,
so `engine = "auto"` falls back to "threads". Where the C helper builds, that is
the C device queue without rings (store.uring_queue.PreadThreadsQueue: pread on
queue_depth C threads); without it, Python's thread queue (store.pread_queue).
This times one batch of P random pages, submit to wait, on one O_DIRECT file,
for each engine and P, the engines taking turns batch by batch (a shared disk's
rate drifts over seconds), with `--sleep-ms` between batches as between decode
steps. Prints the median (p10..p90) per engine and P, and each engine's median
over io_uring's.

    .venv/bin/python benchmarks/tier/bench_thread_engine.py [--pages 1,16,64,256,1024,3000] [--batches 40]

The file (256 MiB, under runs/) is kept between runs.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path
from unittest import mock

import numpy as np

from slacktier.config import DiskOptions
from slacktier.store.base import PageBufferPool, PageReads
from slacktier.store.disk import DiskSource
from slacktier.store.pread_queue import PreadQueue
from slacktier.store.uring_queue import PreadThreadsQueue, UringQueue
from slacktier.tables.layout import PAGE_BYTES
from slacktier.tables.regions import Region

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))   # the repo root: benchmarks.* imports
from benchmarks._harness import command_line, machine, utc_stamp  # noqa: E402



class PythonThreads(PreadQueue):
    """Python's thread queue under its own name, so that it and the C threads engine can both be open on one
    device (the process keeps one queue per engine name and device)."""

    engine_name = "threads-python"


ENGINES = {"io_uring": ("io_uring", UringQueue), "threads (C)": ("threads", PreadThreadsQueue),
           "threads (Python)": ("threads", PythonThreads)}


def make_file(path: Path, pages: int) -> None:
    """A file of `pages` pages of random bytes (written once)."""
    if path.exists() and path.stat().st_size == pages * PAGE_BYTES:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    with open(path, "wb") as f:
        for _ in range(pages // 4096):
            f.write(rng.integers(0, 256, 4096 * PAGE_BYTES, dtype=np.uint8).tobytes())


def open_engine(name: str, region: Region, depth: int) -> DiskSource:
    engine, cls = ENGINES[name]
    with mock.patch.object(DiskSource, "queue_engine", lambda self: cls):
        src = DiskSource([region], DiskOptions(engine=engine, queue_depth=depth))
    if src.lane() is None and cls is not PythonThreads:
        raise SystemExit(f"{name}: the source has no lane, so it is not the C device queue")
    return src


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pages", default="1,16,64,256,1024,3000", help="batch sizes P")
    ap.add_argument("--batches", type=int, default=40, help="batches per engine and P")
    ap.add_argument("--depth", type=int, default=128, help="queue_depth (the C threads engine: that many threads, "
                                                         "at most 64)")
    ap.add_argument("--sleep-ms", type=float, default=2.0, help="pause between batches")
    ap.add_argument("--file", type=Path, default=ROOT / "runs" / "bench_thread_engine.bin")
    args = ap.parse_args()
    sizes = [int(x) for x in args.pages.split(",") if x]
    region_pages = 65536
    make_file(args.file, region_pages)
    region = Region(layer=1, rank=0, path=str(args.file), offset_bytes=0, pages=region_pages)
    logging.getLogger("slacktier.store.devqueue").setLevel(logging.ERROR)   # three engines on one device, on purpose
    sources = {name: open_engine(name, region, args.depth) for name in ENGINES}
    started, host = utc_stamp(), machine()
    rng = np.random.default_rng(1)
    pool = PageBufferPool(max(sizes))
    pool.pages.fill(0)
    times = {(n, p): [] for n in ENGINES for p in sizes}
    for p in sizes:
        for _ in range(args.batches):
            for name in rng.permutation(list(ENGINES)):
                src = sources[str(name)]
                page = np.sort(rng.choice(region_pages, p, replace=False)).astype(np.int64)
                reads = PageReads(np.zeros(p, np.int32), page, np.arange(p, dtype=np.int32))
                t0 = time.perf_counter()
                src.wait(src.submit(reads, pool))
                times[str(name), p].append((time.perf_counter() - t0) * 1e3)
                time.sleep(args.sleep_ms / 1e3)
    for src in sources.values():
        src.close()
    print(f"{started}; `{command_line(__file__)}`; {host}; queue_depth {args.depth}, {args.batches} batches per "
          f"engine and P, {args.sleep_ms:g} ms between batches, engines in turn.\n")
    print("| P | " + " | ".join(f"{n}: median (p10..p90) ms" for n in ENGINES) + " | C / io_uring | Python / io_uring "
          "| Python / C |")
    print("|---:|" + "---|" * (len(ENGINES) + 3))
    for p in sizes:
        med = {n: float(np.median(times[n, p])) for n in ENGINES}
        cells = [f"{med[n]:.3f} ({np.percentile(times[n, p], 10):.3f}..{np.percentile(times[n, p], 90):.3f})"
                 for n in ENGINES]
        c, py, ur = med["threads (C)"], med["threads (Python)"], med["io_uring"]
        print(f"| {p} | " + " | ".join(cells) + f" | {c / ur:.2f}x | {py / ur:.2f}x | {py / c:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
