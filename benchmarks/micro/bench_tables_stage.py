"""Staging throughput as a fraction of the disk's sequential O_DIRECT write bandwidth, measured in the same run.

Per repeat, in shuffled order, each writing the same bytes to a fresh file in
--dir (fsync at the end, file deleted right after):
  fio qdD C   fio --rw=write --direct=1 --bs=C --end_fsync=1, psync (queue depth 1) or libaio --iodepth=D
  zeros       our own O_DIRECT writer of zeros: --chunk-mib chunks, preallocated, one thread, fsync
  random qd1  the same writing one chunk of random bytes over and over (a host that detects zero
              writes would flatter `zeros`)
  stage wW fF C   slacktier stage_synthetic with W writer threads (W O_DIRECT writes in flight), F filler
              threads and C chunks: generate + CRC32C + O_DIRECT write + header + manifest
Each stage variant is compared within each repeat with fio qd1 at its chunk size, fio at its own queue
depth and chunk size (the fair baseline), and random qd1; we report min/median/max of those ratios.

Also, side by side: the row codec's CPU paths (dequantize via the exact lookup
table vs the torch reference; synthetic_rows now vs the skeleton's numpy+torch
version from git HEAD, when git has it).

  .venv/bin/python benchmarks/bench_tables_stage.py [--rows-per-layer 8000000] [--repeats 3] [--append-md]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import time
import types
from pathlib import Path

import numpy as np
import torch

from slacktier.tables import codec
from slacktier.tables.layout import PAGE_BYTES, ROW_BYTES, ROWS_PER_PAGE
from slacktier.tables.manifest import StagedLayout, plan_regions, target_bytes
from slacktier.tables.odirect import DirectFile, aligned_array
from slacktier.tables.stage import StageStats, SyntheticSource, stage_synthetic

ROOT = Path(__file__).resolve().parents[2]
PARENT_SECTION = "## Foundation: hashing and staging"
SECTION = "### Codec and staging"

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # the repo root: benchmarks.* imports
from benchmarks._harness import append_to_section, command_line, machine, pyplot, save_figure, utc_stamp  # noqa: E402

FILL_KEY = "stage fill: synthetic rows + page CRC32C, 4 MiB chunks (CPU time)"


def run_fio(path: Path, nbytes: int, chunk_bytes: int, iodepth: int = 1) -> float:
    """GB/s of fio's sequential O_DIRECT write, end fsync included: psync at queue depth 1, libaio at `iodepth`."""
    engine = ["--ioengine=psync"] if iodepth == 1 else ["--ioengine=libaio", f"--iodepth={iodepth}"]
    res = subprocess.run(["fio", "--name=seqw", f"--filename={path}", "--rw=write", f"--bs={chunk_bytes}",
                          f"--size={nbytes}", "--direct=1", *engine, "--end_fsync=1",
                          "--output-format=json"], capture_output=True, text=True, check=True)
    job = json.loads(res.stdout)["jobs"][0]["write"]
    return job["io_bytes"] / (job["runtime"] / 1e3) / 1e9 if job["runtime"] else float("nan")


def run_zeros(path: Path, nbytes: int, chunk_bytes: int, random_bytes: bool = False) -> float:
    """GB/s of our own O_DIRECT writer of zeros (or of one chunk of random bytes, written over and over), same
    chunk size, preallocated like staging, fsync included."""
    buf = aligned_array(chunk_bytes)
    if random_bytes:  # a host that detects zero writes would flatter the zeros baseline
        buf[:] = np.random.default_rng(0).integers(0, 256, chunk_bytes, dtype=np.uint8)
    t0 = time.perf_counter()
    with DirectFile(str(path), write=True, create=True) as f:
        os.ftruncate(f.fd, nbytes)
        os.posix_fallocate(f.fd, 0, nbytes)
        for off in range(0, nbytes, chunk_bytes):
            n = min(chunk_bytes, nbytes - off)
            f.pwrite(buf[:n], off)
        f.sync()
    return nbytes / (time.perf_counter() - t0) / 1e9


def run_stage(path: Path, layers: dict[int, int], ranks: int, chunk_bytes: int, seed: int, writers: int = 1,
              fillers: int = 2) -> tuple[float, float]:
    """(GB/s of staging a synthetic table, everything and manifest included; busiest writer's busy fraction)."""
    stats = StageStats()
    t0 = time.perf_counter()
    m = stage_synthetic([path], layers, ranks, seed, overwrite=True, chunk_bytes=chunk_bytes, progress=False,
                        writers=writers, fillers=fillers, stats=stats)
    dt_s = time.perf_counter() - t0
    for p in (Path(m.path), m.crc_path()):
        p.unlink()
    return (m.total_pages * PAGE_BYTES + PAGE_BYTES) / dt_s / 1e9, stats.writer_busy_fraction


def codec_rows(reps: int) -> list[tuple[str, list[float]]]:
    """Side-by-side CPU timings (us per row) of the codec paths."""
    raw = torch.from_numpy(codec.synthetic_rows(1, 0, 20_000))
    codec.dequantize(raw)
    old = None
    try:
        src = subprocess.run(["git", "show", "HEAD~0:src/slacktier/tables/codec.py"], cwd=ROOT, capture_output=True,
                             text=True, check=True).stdout
        if "def synthetic_rows" in src and "_synthetic_fill" not in src:
            old = types.ModuleType("codec_skeleton")
            exec(compile(src, "codec_skeleton", "exec"), old.__dict__)
    except (subprocess.CalledProcessError, FileNotFoundError):
        old = None
    source = SyntheticSource(StagedLayout.from_rows({1: 1 << 30}), seed=1)
    chunk = aligned_array(4 << 20).reshape(-1, PAGE_BYTES)
    crcs = np.empty(chunk.shape[0], dtype=np.uint32)
    rows_per_chunk = chunk.shape[0] * ROWS_PER_PAGE
    source.fill_pages(1, 0, rows_per_chunk, chunk, crcs)
    timers: dict[str, list[float]] = {"dequantize (lookup table), 20k rows": [],
                                      "reference_dequant (torch), 20k rows": [],
                                      "synthetic_rows (numba), 20k rows": []}
    if old is not None:
        timers["synthetic_rows (skeleton, numpy+torch), 20k rows"] = []
    timers[FILL_KEY] = []
    jobs = list(timers)
    for _ in range(reps):
        random.shuffle(jobs)
        for name in jobs:
            if name == FILL_KEY:  # CPU time, so other jobs on the machine do not count
                t0 = time.process_time()
                for i in range(8):
                    source.fill_pages(1, i * rows_per_chunk, rows_per_chunk, chunk, crcs)
                timers[name].append((time.process_time() - t0) / (8 * rows_per_chunk) * 1e6)
                continue
            t0 = time.perf_counter()
            if name.startswith("dequantize"):
                codec.dequantize(raw)
            elif name.startswith("reference"):
                codec.reference_dequant(*codec.split_raw(raw))
            elif "numba" in name:
                codec.synthetic_rows(2, 0, 20_000)
            else:
                old.synthetic_rows(2, 0, 20_000)
            timers[name].append((time.perf_counter() - t0) / 20_000 * 1e6)
    return list(timers.items())


def stats(xs: list[float]) -> str:
    return f"{min(xs):.3f} / {statistics.median(xs):.3f} / {max(xs):.3f}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows-per-layer", type=int, default=8_000_000)
    ap.add_argument("--layers", default="1,14")
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--chunk-mib", type=int, default=4)
    ap.add_argument("--big-chunk-mib", type=int, default=16, help="chunk size of the large-chunk staging variants")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", default=str(ROOT / "runs" / "bench_stage"))
    ap.add_argument("--png", default=str(ROOT / "runs" / "bench_stage" / "stage_ratio.png"))
    ap.add_argument("--append-md", action="store_true", help=f"append the results under '{SECTION}' in its docs/bench-log/ file")
    args = ap.parse_args()

    load0 = os.getloadavg()[0]
    work = Path(args.dir)
    work.mkdir(parents=True, exist_ok=True)
    layers = {int(x): args.rows_per_layer for x in args.layers.split(",")}
    chunk = args.chunk_mib << 20
    nbytes = target_bytes(plan_regions(StagedLayout.from_rows(layers), args.ranks, ["t"]), 1)[0]
    have_fio = shutil.which("fio") is not None

    # warm the compiled kernels so the first staging run is not charged for loading them
    stage_synthetic([work / "warm.bin"], {1: 30_000}, 1, 0, overwrite=True, progress=False)
    for p in work.glob("warm.bin*"):
        p.unlink()

    # Staging variants: (writer threads = O_DIRECT writes in flight, filler threads, chunk MiB).
    stage_variants = {f"stage w{w} f{f} {c}MiB": (w, f, c) for w, f, c in
                      [(1, 2, args.chunk_mib), (2, 2, args.chunk_mib), (4, 2, args.chunk_mib), (2, 1, args.chunk_mib),
                       (1, 2, args.big_chunk_mib)]}
    # fio baselines: (queue depth, chunk MiB); each stage variant is compared with fio qd1 at its chunk size and
    # with fio at its own queue depth and chunk size.
    fio_variants = {f"fio qd{d} {c}MiB": (d, c) for d, c in
                    sorted({(1, c) for _, _, c in stage_variants.values()}
                           | {(w, c) for w, _, c in stage_variants.values()})} if have_fio else {}
    results: dict[str, list[float]] = {k: [] for k in [*fio_variants, "zeros", "random qd1", *stage_variants]}
    ratios: dict[str, list[float]] = {}
    busy_fractions: dict[str, list[float]] = {k: [] for k in stage_variants}

    def fair(name: str) -> list[str]:
        w, _, c = stage_variants[name]
        base = [f"fio qd1 {c}MiB", f"fio qd{w} {c}MiB"] if have_fio else []
        return list(dict.fromkeys(base + ["random qd1"]))

    for name in stage_variants:
        for k in fair(name):
            ratios[f"{name} / {k}"] = []
    print(f"{len(layers)} layers x {args.rows_per_layer:,} rows, {args.ranks} ranks: {nbytes / 1e9:.2f} GB per run, "
          f"chunk {args.chunk_mib} MiB, {args.repeats} repeats, dir {work}")
    for rep in range(args.repeats):
        order = list(results)
        random.shuffle(order)
        got: dict[str, float] = {}
        for name in order:
            path = work / f"{name.replace('+', '_').replace(' ', '_')}.bin"
            try:
                if name in fio_variants:
                    d, c = fio_variants[name]
                    got[name] = run_fio(path, nbytes, c << 20, iodepth=d)
                elif name == "zeros":
                    got[name] = run_zeros(path, nbytes, chunk)
                elif name == "random qd1":
                    got[name] = run_zeros(path, nbytes, chunk, random_bytes=True)
                else:
                    w, f, c = stage_variants[name]
                    got[name], busy = run_stage(path, layers, args.ranks, c << 20, seed=rep, writers=w, fillers=f)
                    busy_fractions[name].append(busy)
            finally:
                path.unlink(missing_ok=True)
            results[name].append(got[name])
        for name in stage_variants:
            for k in fair(name):
                ratios[f"{name} / {k}"].append(got[name] / got[k])
        print(f"  repeat {rep}: " + ", ".join(f"{k} {got[k]:.2f}" for k in order) + " GB/s")

    codec_t = codec_rows(reps=5)

    lines = ["| run | GB/s min / median / max |", "|---|---|"]
    lines += [f"| {k} | {stats(v)} |" for k, v in results.items()]
    lines += ["", "| ratio (within each repeat) | min / median / max |", "|---|---|"]
    lines += [f"| {k} | {stats(v)} |" for k, v in ratios.items()]
    lines += ["", "Busiest staging writer thread's time inside pwrite, as a fraction of the staging wall time, per "
              "run: " + "; ".join(f"{k}: " + ", ".join(f"{b:.0%}" for b in v) for k, v in busy_fractions.items())
              + " (near 100%: disk-bound; lower: the fillers did not get the CPU to keep the disk busy)."]
    lines += ["", f"wN = N writer threads (N O_DIRECT writes in flight), fN = N filler threads. fio qd1 is psync, "
              f"fio qdN>1 is libaio at iodepth N; zeros / random qd1 are our own one-thread O_DIRECT "
              f"writer of zeros / of one {args.chunk_mib} MiB chunk of random bytes, preallocated like staging. "
              "Target: stage / disk above 0.8."]
    lines += ["", "| codec path (CPU, 5 runs, shuffled) | us per row min / median / max |", "|---|---|"]
    lines += [f"| {k} | {stats(v)} |" for k, v in codec_t]
    med = {k: statistics.median(v) for k, v in codec_t}
    deq_ratio = med["reference_dequant (torch), 20k rows"] / med["dequantize (lookup table), 20k rows"]
    lines += ["", f"dequantize is {deq_ratio:.1f}x faster than the torch reference (median)."]
    old_key = "synthetic_rows (skeleton, numpy+torch), 20k rows"
    if old_key in med:
        lines[-1] += f" synthetic_rows is {med[old_key] / med['synthetic_rows (numba), 20k rows']:.0f}x faster " \
                     "than the skeleton's."
    fill_us = statistics.median(dict(codec_t)[FILL_KEY])
    lines += [f"One filler thread produces {ROW_BYTES / fill_us / 1e3 * PAGE_BYTES / (ROWS_PER_PAGE * ROW_BYTES):.2f} "
              "GB/s of pages per CPU-second (median)."]
    print()
    print("\n".join(lines))

    try:
        fig, ax = pyplot().subplots(figsize=(7, 4))
        names = list(results)
        ax.boxplot([results[k] for k in names])
        ax.set_xticks(range(1, len(names) + 1), names, rotation=60, ha="right", fontsize=6)
        ax.set_ylabel("GB/s")
        ax.set_title(f"staging vs sequential O_DIRECT write ({nbytes / 1e9:.1f} GB)")
        fig.tight_layout()
        save_figure(fig, args.png)
        print(f"plot: {args.png}")
    except ImportError:
        print("matplotlib missing: no plot")

    if args.append_md:
        host = (f"{machine()}, shared with other jobs (1-min load average {load0:.1f} at start, "
                f"{os.getloadavg()[0]:.1f} at end), virtio disk under {work}")
        block = [f"Run {utc_stamp()}. Command: `{command_line(__file__)}`. Machine: {host}.",
                 f"Table: {len(layers)} layers x {args.rows_per_layer:,} rows, {args.ranks} ranks, "
                 f"{nbytes / 1e9:.2f} GB per run, {args.repeats} repeats interleaved "
                 "(shuffled).", ""] + lines + [""]
        append_to_section("\n".join(block), PARENT_SECTION, SECTION)
    return 0


if __name__ == "__main__":
    sys.exit(main())
