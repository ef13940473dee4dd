"""Disk tier: random 4 KiB O_DIRECT page reads, io_uring vs the threads engine vs fio, same file.

io_uring and fio run at the same queue depth; the threads engine (pread on the C
queue's threads: io_uring is needed here anyway, so the helper builds) runs
min(depth, MAX_ENGINE_THREADS) threads (store/uring_queue.py), one read in flight each.

For each batch size (700 and 3,000 pages, the paper's per-step page counts)
the DiskSource submits batches of uniformly random pages of one large file
back to back for `--seconds`, and fio runs `--rw=randread --bs=4k --direct=1
--ioengine=io_uring` at the same queue depth on the same file. In each of
`--repeats` rounds every configuration runs `--pairs` times in shuffled
order, each run paired back to back (in random order) with its own short fio
run; the IOPS ratio is taken within each pair, because a shared disk's rate
drifts by 2-3x over seconds.

CPU per page is the whole process's user + system time (getrusage
RUSAGE_SELF: every thread, including the kernel's io_uring workers) divided
by pages read; fio's is its own usr + sys over its I/Os.

    .venv/bin/python benchmarks/bench_store_disk.py --file-gib 4 --append-md

The file goes under runs/ (git-ignored) and is deleted at the end unless --keep-file.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from slacktier.config import DiskOptions
from slacktier.store import PageBufferPool, PageReads
from slacktier.store.disk import DiskSource
from slacktier.store._native import MAX_ENGINE_THREADS
from slacktier.tables.layout import PAGE_BYTES
from slacktier.tables.regions import Region

REPO = Path(__file__).resolve().parents[2]
SECTION = "## The tier: page sources, cache and step engine"
SUBSECTION = "### Page sources"
TARGET_IOPS_RATIO = 0.9

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # the repo root: benchmarks.* imports
from benchmarks._harness import (bench_log, append_to_section, command_line, machine, pyplot, save_figure,  # noqa: E402
                     utc_stamp)
TARGET_CPU_US = 3.0


@dataclass
class Run:
    """One measured run: a configuration, its rate and its CPU cost."""

    name: str
    batch: int       # pages per batch (0 for fio's steady stream)
    repeat: int
    pages: int
    wall_s: float
    cpu_s: float
    fio_iops: float = 0.0  # the IOPS of the fio run paired with this one

    @property
    def iops(self) -> float:
        return self.pages / self.wall_s

    @property
    def cpu_us_per_page(self) -> float:
        return self.cpu_s * 1e6 / self.pages


def make_file(path: Path, gib: float) -> int:
    """Write a file of `gib` GiB of non-zero bytes with O_DIRECT (real extents, not holes); return its pages."""
    chunk_bytes = 64 << 20
    total = int(gib * (1 << 30)) // chunk_bytes * chunk_bytes
    if path.exists() and path.stat().st_size == total:
        return total // PAGE_BYTES
    import mmap
    buf = mmap.mmap(-1, chunk_bytes)
    pattern = np.frombuffer(buf, dtype=np.uint8)
    pattern[:] = np.random.default_rng(0).integers(1, 256, chunk_bytes, dtype=np.uint8)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
    try:
        for off in range(0, total, chunk_bytes):
            pattern[:8] = np.frombuffer(np.int64(off).tobytes(), dtype=np.uint8)
            if os.pwrite(fd, buf, off) != chunk_bytes:
                raise OSError(f"short write at {off}")
        os.fsync(fd)
    finally:
        os.close(fd)
    return total // PAGE_BYTES


def cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def run_source(src: DiskSource, file_pages: int, batch: int, seconds: float, rng: np.random.Generator,
               pool: PageBufferPool, name: str, repeat: int) -> Run:
    """Back-to-back batches of `batch` random pages for `seconds`; batches are drawn before timing."""
    batches = [PageReads(np.zeros(batch, np.int32), rng.integers(0, file_pages, batch, dtype=np.int64),
                         np.arange(batch, dtype=np.int32)) for _ in range(16)]
    src.wait(src.submit(batches[0], pool))  # warm the worker and the ring
    pages = 0
    c0, t0 = cpu_s(), time.perf_counter()
    i = 0
    while True:
        src.wait(src.submit(batches[i % len(batches)], pool))
        pages += batch
        i += 1
        if time.perf_counter() - t0 >= seconds:
            break
    return Run(name, batch, repeat, pages, time.perf_counter() - t0, cpu_s() - c0)


def run_fio(path: Path, depth: int, seconds: float, repeat: int) -> Run:
    """fio randread 4k O_DIRECT io_uring at `depth` on the same file; its own I/O count and CPU."""
    cmd = ["fio", "--name=randread", f"--filename={path}", "--direct=1", "--rw=randread", "--bs=4k",
           f"--iodepth={depth}", "--ioengine=io_uring", "--numjobs=1", f"--runtime={int(seconds * 1000)}ms",
           "--time_based",
           "--norandommap", "--randrepeat=0", "--output-format=json", "--invalidate=0"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    job = json.loads(out[out.index("{"):])["jobs"][0]
    ios = int(job["read"]["total_ios"])
    runtime_s = job["read"]["runtime"] / 1e3
    cpu = (job["usr_cpu"] + job["sys_cpu"]) / 100.0 * job["job_runtime"] / 1e3
    return Run(f"fio io_uring qd{depth}", 0, repeat, ios, runtime_s, cpu)


def fmt3(values: list[float], spec: str) -> str:
    return "/".join(format(v, spec) for v in (min(values), statistics.median(values), max(values)))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--file", type=Path, default=REPO / "runs" / "bench_store_disk.bin")
    ap.add_argument("--file-gib", type=float, default=4.0)
    ap.add_argument("--depth", type=int, default=128, help="queue depth: io_uring entries, fio iodepth")
    ap.add_argument("--extra-threads", type=int, nargs="*", default=[],
                    help="also run the threads engine at these queue depths (its threads: at most "
                         f"{MAX_ENGINE_THREADS})")
    ap.add_argument("--batches", type=int, nargs="+", default=[700, 3000])
    ap.add_argument("--seconds", type=float, default=0.5, help="per run (fio adds ~0.7 s of start and stop)")
    ap.add_argument("--pairs", type=int, default=3, help="(engine, fio) pairs per configuration per round")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--png", type=Path, default=REPO / "runs" / "bench_store_disk.png")
    ap.add_argument("--append-md", action="store_true", help="append the table to its docs/bench-log/ file")
    ap.add_argument("--keep-file", action="store_true")
    args = ap.parse_args()

    args.file.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    file_pages = make_file(args.file, args.file_gib)
    print(f"file {args.file}: {file_pages * PAGE_BYTES / 2**30:.1f} GiB, {file_pages} pages "
          f"(written in {time.perf_counter() - t0:.0f} s)")
    region = [Region(layer=0, rank=0, path=str(args.file), offset_bytes=0, pages=file_pages)]
    sources = {f"io_uring qd{args.depth}": DiskSource(region, DiskOptions(engine="io_uring", queue_depth=args.depth))}
    # The threads engine runs min(queue_depth, MAX_ENGINE_THREADS) threads.
    thread_counts = {min(t, MAX_ENGINE_THREADS) for t in [args.depth, *args.extra_threads]}
    for threads in sorted(thread_counts):
        sources[f"threads x{threads}"] = DiskSource(region, DiskOptions(engine="threads", queue_depth=threads))
    pool = PageBufferPool(max(args.batches))
    rng = np.random.default_rng(1)
    runs: list[Run] = []
    try:
        for repeat in range(args.repeats):
            plan = [(e, b) for e in sources for b in args.batches]
            shuffler = random.Random(repeat)
            shuffler.shuffle(plan)
            for engine, batch in plan:
                # Each configuration is paired with its own fio run, back to back in random order: the
                # shared disk's rate drifts by 2x over seconds, so only adjacent runs compare fairly.
                for _ in range(args.pairs):
                    pair: dict[str, Run] = {}
                    for who in shuffler.sample(["fio", "engine"], 2):
                        if who == "fio":
                            pair[who] = run_fio(args.file, args.depth, args.seconds, repeat)
                        else:
                            pair[who] = run_source(sources[engine], file_pages, batch, args.seconds, rng, pool,
                                                   engine, repeat)
                    mine, fio_run = pair["engine"], pair["fio"]
                    mine.fio_iops = fio_run.iops
                    runs += [fio_run, mine]
                    print(f"  round {repeat}: {engine:16s} batch {batch:>5}  {mine.iops:8.0f} IOPS "
                          f"{mine.cpu_us_per_page:6.2f} us CPU/page | fio beside it {fio_run.iops:8.0f} IOPS "
                          f"{fio_run.cpu_us_per_page:6.2f} us CPU/page | ratio {mine.iops / fio_run.iops:.2f}",
                          flush=True)
    finally:
        for src in sources.values():
            src.close()
        if not args.keep_file:
            args.file.unlink(missing_ok=True)

    header = (f"| engine | batch (pages) | IOPS min/med/max | x fio IOPS min/med/max (target >= {TARGET_IOPS_RATIO}) "
              f"| CPU us/page min/med/max (target <= {TARGET_CPU_US:g}) |")
    lines = [header, "|---|---|---|---|---|"]
    fio_runs = [r for r in runs if r.batch == 0]
    lines.append(f"| fio io_uring qd{args.depth} | steady stream | {fmt3([r.iops for r in fio_runs], '.0f')} | 1 | "
                 f"{fmt3([r.cpu_us_per_page for r in fio_runs], '.2f')} |")
    verdicts = []
    for engine in sources:
        for batch in args.batches:
            mine = [r for r in runs if r.name == engine and r.batch == batch]
            ratios = [r.iops / r.fio_iops for r in mine]
            cpu = [r.cpu_us_per_page for r in mine]
            lines.append(f"| {engine} | {batch} | {fmt3([r.iops for r in mine], '.0f')} | "
                         f"{fmt3(ratios, '.2f')} | {fmt3(cpu, '.2f')} |")
            verdicts.append(f"{engine} batch {batch}: median {statistics.median(ratios):.2f}x fio IOPS "
                            f"({'meets' if statistics.median(ratios) >= TARGET_IOPS_RATIO else 'misses'} "
                            f">= {TARGET_IOPS_RATIO}), median {statistics.median(cpu):.2f} us CPU/page "
                            f"({'meets' if statistics.median(cpu) <= TARGET_CPU_US else 'misses'} "
                            f"<= {TARGET_CPU_US:g})")
    table = "\n".join(lines)
    print()
    print(table)
    print()
    print("\n".join(verdicts))

    if args.png:
        write_png(args.png, runs, list(sources), args.batches)
        print(f"plot: {args.png}")
    if args.append_md:
        append_md(args, table, verdicts, file_pages)
    return 0


def write_png(path: Path, runs: list[Run], engines: list[str], batches: list[int]) -> None:
    fig, (a1, a2) = pyplot().subplots(1, 2, figsize=(13, 4.5))
    labels = ["fio"] + [e.replace(" ", "\n") + f"\n{b} pages" for e in engines for b in batches]
    groups = [[r for r in runs if r.batch == 0]] + [[r for r in runs if r.name == e and r.batch == b]
                                                   for e in engines for b in batches]
    for ax, key, title in ((a1, "iops", "IOPS (random 4 KiB, O_DIRECT)"), (a2, "cpu_us_per_page", "CPU us per page")):
        for x, group in enumerate(groups):
            ys = [getattr(r, key) for r in group]
            ax.scatter([x] * len(ys), ys, color="k", s=12)
            ax.bar(x, statistics.median(ys), alpha=0.4)
        ax.set_xticks(range(len(labels)), labels, fontsize=7)
        ax.set_title(title)
    a2.axhline(TARGET_CPU_US, color="r", ls="--", lw=1)
    fig.tight_layout()
    save_figure(fig, path, dpi=100)


def describe_disk(directory: Path) -> str:
    """'vda (virtio_blk, 256G, scheduler mq-deadline)' for the block device holding `directory`."""
    source = subprocess.run(["findmnt", "-no", "SOURCE", "-T", str(directory)], capture_output=True,
                            text=True).stdout.strip()
    name = Path(source).name
    sys_dir = Path("/sys/block") / name
    if not sys_dir.exists():
        return source or "unknown"
    driver = Path(os.path.realpath(sys_dir / "device" / "driver")).name
    size_gib = int((sys_dir / "size").read_text()) * 512 / 2**30
    sched = (sys_dir / "queue" / "scheduler").read_text().strip()
    active = sched[sched.index("[") + 1:sched.index("]")] if "[" in sched else sched
    return f"{name} ({driver}, {size_gib:.0f} GiB, scheduler {active})"


def append_md(args: argparse.Namespace, table: str, verdicts: list[str], file_pages: int) -> None:
    """Append this run under '### Page sources' inside the tier section (creating the subsection once)."""
    disk = describe_disk(args.file.parent)
    block = (f"#### Disk engine: random 4 KiB reads vs fio ({utc_stamp()})\n\n"
             f"`{command_line(__file__)}`\n\nMachine: {machine()}, "
             f"disk {disk}, shared with other jobs; file {file_pages * PAGE_BYTES / 2**30:.1f} GiB read with O_DIRECT, "
             f"queue depth {args.depth} for io_uring and fio (the thread engine: as many reads in flight as "
             f"threads), {args.seconds:g} s per run, {args.repeats} "
             f"shuffled rounds of {args.pairs} runs per configuration, each run paired back to back with its "
             f"own fio run (ratios are per pair). CPU per page: this process's user+sys (getrusage, all threads) over pages read; fio's: its "
             f"usr+sys over its I/Os. fio runs a steady stream; the engines run back-to-back batches "
             f"(submit, wait), so each batch's ramp-up and drain are included.\n\n"
             f"{table}\n\n" + "\n".join(f"- {v}" for v in verdicts) + "\n")
    append_to_section(block, SECTION, SUBSECTION)
    print(f"appended to {bench_log(SECTION, SUBSECTION)}")


if __name__ == "__main__":
    raise SystemExit(main())
