"""The read-time model of paper section 4.1, fitted on this machine's disk: T_1 = a + b P_1 + c P_14.

    .venv/bin/python benchmarks/bench_probe_readfit.py --runs 90 --append

Two tables share one disk: layer 1's region and layer 14's region of one file,
each behind its own O_DIRECT page source (slacktier.store.disk), as the engine
opens them. Each run draws page counts (P_1, P_14), submits layer 1's pages
first and layer 14's right after, and times both to their last completion.
The fit uses the first two thirds of the runs (plan.fit.fit_read_time); the
rest are predicted and scored (held out). Prints the coefficients, R^2, RMSE
and b/c, and with --append adds them to BENCHMARKS.md under
"## Windows and placement".
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time
from pathlib import Path

import numpy as np

from slacktier.plan import fit_quality, fit_read_time
from slacktier.config import DiskOptions
from slacktier.store.base import PageBufferPool, PageReads
from slacktier.tables.regions import Region
from slacktier.store.disk import DiskSource
from slacktier.tables.layout import PAGE_BYTES

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import append_to_section  # noqa: E402
from bench_probe_windows import SECTION, machine  # noqa: E402


def make_file(path: Path, pages: int) -> None:
    if path.exists() and path.stat().st_size == pages * PAGE_BYTES:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    chunk = 4096  # pages per write
    with open(path, "wb") as f:
        for start in range(0, pages, chunk):
            n = min(chunk, pages - start)
            f.write(rng.integers(0, 256, n * PAGE_BYTES, dtype=np.uint8).tobytes())
        f.flush()
        os.fsync(f.fileno())


def reads_for(n: int, region_pages: int, rng: np.random.Generator) -> PageReads:
    pages = np.sort(rng.choice(region_pages, size=n, replace=False)).astype(np.int64)
    return PageReads(region=np.zeros(n, dtype=np.int32), page=pages, buffer=np.arange(n, dtype=np.int32))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=90)
    ap.add_argument("--region-pages", type=int, default=32768, help="pages per layer region (128 MiB)")
    ap.add_argument("--max-p1", type=int, default=1500)
    ap.add_argument("--max-p14", type=int, default=3000)
    ap.add_argument("--engine", default="auto", help="disk engine: auto | io_uring | threads")
    ap.add_argument("--queue-depth", type=int, default=128)
    ap.add_argument("--file", type=Path, default=ROOT / "data" / "probe_readfit" / "two_tables.bin")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--append", action="store_true")
    args = ap.parse_args()

    started = datetime.datetime.now(datetime.timezone.utc)
    host = machine()
    make_file(args.file, 2 * args.region_pages)
    r1 = Region(layer=1, rank=0, path=str(args.file), offset_bytes=0, pages=args.region_pages)
    r14 = Region(layer=14, rank=0, path=str(args.file), offset_bytes=args.region_pages * PAGE_BYTES,
                     pages=args.region_pages)
    options = DiskOptions(engine=args.engine, queue_depth=args.queue_depth)
    s1 = DiskSource([r1], options)
    s14 = DiskSource([r14], options)
    pool1, pool14 = PageBufferPool(args.max_p1), PageBufferPool(args.max_p14)
    rng = np.random.default_rng(args.seed)
    pages, t1, t14 = [], [], []
    try:
        for _ in range(3):  # warm-up
            a = s1.submit(reads_for(64, args.region_pages, rng), pool1)
            s1.wait(a)
        for _ in range(args.runs):
            p1 = int(rng.integers(1, args.max_p1 + 1))
            p14 = int(rng.integers(1, args.max_p14 + 1))
            q1, q14 = reads_for(p1, args.region_pages, rng), reads_for(p14, args.region_pages, rng)
            start = time.perf_counter()
            a = s1.submit(q1, pool1)
            b = s14.submit(q14, pool14)
            s1.wait(a)
            d1 = time.perf_counter() - start
            s14.wait(b)
            d14 = time.perf_counter() - start
            pages.append((p1, p14))
            t1.append(d1 * 1e3)
            t14.append(d14 * 1e3)
    finally:
        s1.close()
        s14.close()
    P = np.asarray(pages, dtype=np.float64)  # [runs, 2]
    T1, T14 = np.asarray(t1), np.asarray(t14)
    n_fit = (2 * args.runs) // 3
    out = []
    for name, T in (("T_1", T1), ("T_14", T14)):
        fit = fit_read_time([1, 14], P[:n_fit], T[:n_fit])
        pred = [fit.model.predict_ms({1: p1, 14: p14}) for p1, p14 in P[n_fit:]]
        held = fit_quality(pred, T[n_fit:])
        a, (b1, b14) = fit.model.intercept_ms, fit.model.per_page_ms
        out.append((name, a, b1, b14, fit.quality, held))
        print(f"{name} = {a:.3f} ms + {b1 * 1e3:.2f} us * P_1 + {b14 * 1e3:.2f} us * P_14   "
              f"(fit on {n_fit} runs: R^2 {fit.quality.r2:.3f}, RMSE {fit.quality.rmse_ms:.3f} ms; held-out "
              f"{held.runs} runs: R^2 {held.r2:.3f}, RMSE {held.rmse_ms:.3f} ms; b_1/b_14 = {b1 / b14:.1f})")
    print(f"T_1 range {T1.min():.2f}..{T1.max():.2f} ms, T_14 range {T14.min():.2f}..{T14.max():.2f} ms; "
          f"engine {args.engine}")
    if not args.append:
        return 0
    lines = [f"### Read-time model on this machine's disk ({started:%Y-%m-%d %H:%M} UTC)", "",
             "    .venv/bin/python benchmarks/bench_probe_readfit.py " + " ".join(sys.argv[1:]), "",
             f"Machine: {host}. Two 128 MiB regions of one file on the local disk, one O_DIRECT page source each "
             f"(slacktier.store.disk, engine `{args.engine}`, queue depth {args.queue_depth}); per run, random "
             f"P_1 in 1..{args.max_p1} and P_14 in 1..{args.max_p14} distinct pages, layer 1 submitted first; "
             f"wall time from the first submit to each layer's last completion. Fit on the first {n_fit} of "
             f"{args.runs} runs (least squares), scored on the other {args.runs - n_fit}. Paper (one NVMe shared "
             "by four ranks): T_1 = 0.30 ms + 3.05 us P_1 + 0.37 us P_14, R^2 0.997, b/c ~ 8.", "",
             "| model | a ms | b_1 us/page | b_14 us/page | b_1/b_14 | fit R^2 | fit RMSE ms | held-out R^2 | "
             "held-out RMSE ms |", "|---|---|---|---|---|---|---|---|---|"]
    for name, a, b1, b14, q, h in out:
        lines.append(f"| {name} | {a:.3f} | {b1 * 1e3:.2f} | {b14 * 1e3:.2f} | {b1 / b14:.1f} | {q.r2:.3f} | "
                     f"{q.rmse_ms:.3f} | {h.r2:.3f} | {h.rmse_ms:.3f} |")
    lines += ["", f"Measured T_1 {T1.min():.2f}..{T1.max():.2f} ms, T_14 {T14.min():.2f}..{T14.max():.2f} ms."]
    append_to_section("\n".join(lines), SECTION)
    print("appended to BENCHMARKS.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
