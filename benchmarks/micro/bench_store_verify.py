"""Disk tier: the CPU cost per page of checking every read page's CRC32C against the manifest (verify_reads).

One file of `--file-gib` GiB (random bytes, written with O_DIRECT under runs/)
is read as one region by two DiskSources, io_uring at queue depth 128: one
without checksums, one with the file's page CRC32Cs (as `verify_reads` gives
it). In each of `--rounds` rounds both run, in shuffled order, `--seconds` of
back-to-back batches of `--batch` uniformly random pages (submit, wait).

CPU per page is the whole process's user + system time (getrusage
RUSAGE_SELF: every thread, the kernel's io_uring work included) over pages
read; the verification cost is "on" minus "off" within each round. Because two
noisy figures are subtracted, the script also times the check alone: the
compiled CRC32C pass the source runs per batch (`store._common.pool_page_crcs`)
over a pool the reads just filled, and, for scale, the former per-page Python
call (`crc32c.crc32c`, one call per page).

The decision rule for `DiskSource.verify_by_default`: on when the median
added CPU per page is under `--budget-us` (0.5 us, against the ~2.3-3 us a
read costs; docs/bench-log/tier.md, "Page sources").

    .venv/bin/python benchmarks/bench_store_verify.py --append

The file is deleted at the end unless --keep-file.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path

import crc32c
import numpy as np

from slacktier.config import DiskOptions
from slacktier.store import PageBufferPool, PageReads
from slacktier.store._common import pool_page_crcs
from slacktier.store.disk import DiskSource
from slacktier.tables.layout import PAGE_BYTES
from slacktier.tables.pagecrc import HW_CRC32C, page_crcs
from slacktier.tables.regions import Region

REPO = Path(__file__).resolve().parents[2]
SECTION = "## The tier: page sources, cache and step engine"
SUBSECTION = "### Page sources"

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # the repo root: benchmarks.* imports
from benchmarks._harness import append_to_section, command_line, machine, pyplot, save_figure, utc_stamp  # noqa: E402
from benchmarks.tier.bench_store_disk import cpu_s, fmt3, make_file  # noqa: E402


def file_crcs(path: Path, pages: int, chunk_pages: int = 16384) -> np.ndarray:
    """[pages] uint32 CRC32C of every page of the file (buffered reads, compiled checksums)."""
    out = np.empty(pages, dtype=np.uint32)
    with open(path, "rb", buffering=0) as f:
        for lo in range(0, pages, chunk_pages):
            n = min(chunk_pages, pages - lo)
            data = np.frombuffer(f.read(n * PAGE_BYTES), dtype=np.uint8).reshape(n, PAGE_BYTES)
            page_crcs(data, out[lo:lo + n])
    return out


def run(src: DiskSource, batches: list[PageReads], pool: PageBufferPool, seconds: float) -> tuple[int, float]:
    """Back-to-back batches for `seconds`: (pages read, process CPU seconds)."""
    src.wait(src.submit(batches[0], pool))  # warm the worker and the ring
    pages, i = 0, 0
    c0, t0 = cpu_s(), time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        src.wait(src.submit(batches[i % len(batches)], pool))
        pages += batches[0].region.shape[0]
        i += 1
    return pages, cpu_s() - c0


def kernel_us_per_page(pool: PageBufferPool, batch: int, repeats: int = 50) -> tuple[float, float]:
    """Median us per page of the compiled pool check and of one crc32c.crc32c call per page, over `batch` buffers."""
    buffers = np.random.default_rng(1).permutation(batch).astype(np.int32)
    pool_page_crcs(pool.pages, buffers)  # compiled already (cache=True); warm the caches
    compiled, python = [], []
    for _ in range(repeats):
        t0 = time.perf_counter_ns()
        pool_page_crcs(pool.pages, buffers)
        compiled.append((time.perf_counter_ns() - t0) / 1e3 / batch)
        t0 = time.perf_counter_ns()
        for b in buffers:
            crc32c.crc32c(pool.pages[b])
        python.append((time.perf_counter_ns() - t0) / 1e3 / batch)
    return statistics.median(compiled), statistics.median(python)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--file-gib", type=float, default=1.0)
    p.add_argument("--batch", type=int, default=700, help="pages per batch")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--seconds", type=float, default=2.0, help="per configuration and round")
    p.add_argument("--budget-us", type=float, default=0.5, help="most added CPU us/page for verify on by default")
    p.add_argument("--append", action="store_true", help="write the table into its docs/bench-log/ file")
    p.add_argument("--plot", type=Path, help="write a PNG of CPU us/page per round")
    p.add_argument("--keep-file", action="store_true")
    args = p.parse_args(argv)

    (REPO / "runs").mkdir(exist_ok=True)
    path = REPO / "runs" / f"bench-verify-{args.file_gib:g}g.bin"
    t0 = time.perf_counter()
    file_pages = make_file(path, args.file_gib)
    sums = file_crcs(path, file_pages)
    print(f"file {path} ({file_pages} pages) written and checksummed in {time.perf_counter() - t0:.1f} s")
    region = [Region(layer=1, rank=0, path=str(path), offset_bytes=0, pages=file_pages)]
    options = DiskOptions(engine="io_uring", queue_depth=128)
    sources = {"off": DiskSource(region, options), "on": DiskSource(region, options, page_crc32c=[sums])}
    rng = np.random.default_rng(0)
    batches = [PageReads(np.zeros(args.batch, np.int32), rng.integers(0, file_pages, args.batch, dtype=np.int64),
                         np.arange(args.batch, dtype=np.int32)) for _ in range(16)]
    pool = PageBufferPool(args.batch)
    cpu_us: dict[str, list[float]] = {"off": [], "on": []}
    iops: dict[str, list[float]] = {"off": [], "on": []}
    order = random.Random(0)
    try:
        for r in range(args.rounds):
            names = ["off", "on"]
            order.shuffle(names)
            for name in names:
                pages, cpu = run(sources[name], batches, pool, args.seconds)
                cpu_us[name].append(cpu * 1e6 / pages)
                iops[name].append(pages / args.seconds)
            print(f"round {r}: off {cpu_us['off'][-1]:.2f} us/page, on {cpu_us['on'][-1]:.2f} us/page")
        compiled_us, python_us = kernel_us_per_page(pool, args.batch)
    finally:
        for src in sources.values():
            src.close()
        if not args.keep_file:
            path.unlink()

    added = [on - off for on, off in zip(cpu_us["on"], cpu_us["off"], strict=True)]
    decision = "on" if statistics.median(added) < args.budget_us else "off"
    rows = [
        "| verify_reads | CPU us/page min/med/max | IOPS min/med/max |",
        "|---|---|---|",
        f"| off | {fmt3(cpu_us['off'], '.2f')} | {fmt3(iops['off'], '.0f')} |",
        f"| on | {fmt3(cpu_us['on'], '.2f')} | {fmt3(iops['on'], '.0f')} |",
        f"| on - off, same round | {fmt3(added, '.2f')} | |",
    ]
    notes = [
        f"- the check alone, {args.batch} pages of the pool, warm in cache: compiled pass (pool_page_crcs, SSE4.2 "
        f"{'yes' if HW_CRC32C else 'no'}) {compiled_us:.3f} us/page; one crc32c.crc32c call per page "
        f"(before issue 11) {python_us:.3f} us/page",
        f"- decision: median added CPU {statistics.median(added):.2f} us/page (the check alone {compiled_us:.3f}) "
        f"{'<' if decision == 'on' else '>='} {args.budget_us} us budget -> DiskSource.verify_by_default "
        f"{decision == 'on'}",
    ]
    table = "\n".join(rows + [""] + notes)
    print()
    print(table)
    if args.plot:
        plt = pyplot()
        fig, ax = plt.subplots(figsize=(6, 3.5))
        for name in ("off", "on"):
            ax.plot(range(args.rounds), cpu_us[name], marker="o", label=f"verify {name}")
        ax.set_xlabel("round")
        ax.set_ylabel("CPU us per page")
        ax.set_title(f"Disk tier, io_uring qd128, {args.batch}-page batches")
        ax.legend()
        save_figure(fig, args.plot)
    if args.append:
        block = "\n".join([
            f"#### Read verification cost on the disk tier ({utc_stamp()})", "",
            f"`{command_line(__file__, argv)}`", "",
            f"Machine: {machine()}; file {args.file_gib:g} GiB read with O_DIRECT, io_uring queue depth 128, "
            f"{args.batch}-page random batches, {args.rounds} rounds of {args.seconds:g} s per setting, order "
            "shuffled per round. CPU per page: this process's user+sys (all threads) over pages read.", "",
            table,
        ])
        append_to_section(block, SECTION, SUBSECTION)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    main()
