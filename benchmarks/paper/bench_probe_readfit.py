"""The planner's read-time model (plan.readmodel) fitted on this machine's disk: b, c and R^2, measured and held out.

    .venv/bin/python benchmarks/bench_probe_readfit.py --runs 90 --append
    .venv/bin/python benchmarks/bench_probe_readfit.py --from-csv docs/bench-log/probe_readfit_<date>.csv

Two tables share one disk: layer 1's region and layer 14's region of one file,
each behind its own O_DIRECT page source (slacktier.store.disk), as the engine
opens them; both sources read through the disk's one device queue (strict
window order, store/devqueue.py), so a run before 2026-12-03 08:28 UTC in
docs/bench-log/windows.md measured per-table queues and this one the shared queue. Each run draws page counts (P_1, P_14), submits layer 1's
pages first and layer 14's right after, and times both to their last
completion. The device model T_l = a + b P_l + c P_ahead + c_behind P_behind
is fitted on the first two thirds of the runs (plan.fit.fit_device_read_model,
every layer of a run one observation); the rest are predicted and scored (held
out). Beside it, on the same split: the planner's first tier form (c = b) and
the per-position models serve/predict.py kept before (T_first and T_second each
a + b_1 P_1 + b_14 P_14). The runs go to a CSV (docs/bench-log/ with --append),
and --from-csv refits a stored one without reading the disk.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

from slacktier.config import DiskOptions
from slacktier.plan import device_design, fit_device_read_model, fit_quality
from slacktier.store.base import PageBufferPool, PageReads
from slacktier.store.disk import DiskSource
from slacktier.tables.layout import PAGE_BYTES
from slacktier.tables.regions import Region

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # the repo root: benchmarks.* imports
from benchmarks._harness import append_to_section, command_line, machine, utc_stamp  # noqa: E402

SECTION = "## Windows and placement"


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


def measure(args) -> tuple[np.ndarray, np.ndarray]:
    """pages [runs, 2] and read_ms [runs, 2] (layer 1, layer 14), layer 1 submitted first."""
    make_file(args.file, 2 * args.region_pages)
    r1 = Region(layer=1, rank=0, path=str(args.file), offset_bytes=0, pages=args.region_pages)
    r14 = Region(layer=14, rank=0, path=str(args.file), offset_bytes=args.region_pages * PAGE_BYTES,
                 pages=args.region_pages)
    options = DiskOptions(engine=args.engine, queue_depth=args.queue_depth)
    s1, s14 = DiskSource([r1], options), DiskSource([r14], options)
    pool1, pool14 = PageBufferPool(args.max_p1), PageBufferPool(args.max_p14)
    rng = np.random.default_rng(args.seed)
    warm_rng = np.random.default_rng(args.seed + 1)   # layer 14's warm-up draws: the timed runs' draws stay the same
    pages, times = [], []
    try:
        for pool in (pool1, pool14):   # every buffer's first touch now, not in the timed run that first reaches it
            pool.pages.fill(0)
        for _ in range(3):  # warm-up: threads, rings, first reads, on both sources
            s1.wait(s1.submit(reads_for(64, args.region_pages, rng), pool1))
            s14.wait(s14.submit(reads_for(64, args.region_pages, warm_rng), pool14))
        for _ in range(args.runs):
            p1, p14 = int(rng.integers(1, args.max_p1 + 1)), int(rng.integers(1, args.max_p14 + 1))
            q1, q14 = reads_for(p1, args.region_pages, rng), reads_for(p14, args.region_pages, rng)
            start = time.perf_counter()
            a = s1.submit(q1, pool1)
            b = s14.submit(q14, pool14)
            s1.wait(a)
            d1 = time.perf_counter() - start
            s14.wait(b)
            d14 = time.perf_counter() - start
            pages.append((p1, p14))
            times.append((d1 * 1e3, d14 * 1e3))
    finally:
        s1.close()
        s14.close()
    return np.asarray(pages, dtype=np.float64), np.asarray(times, dtype=np.float64)


def write_csv(path: Path, P: np.ndarray, T: np.ndarray) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = ["run,pages_l1,pages_l14,read_ms_l1,read_ms_l14"]
    rows += [f"{i},{p[0]:.0f},{p[1]:.0f},{t[0]:.6f},{t[1]:.6f}" for i, (p, t) in enumerate(zip(P, T))]
    path.write_text("\n".join(rows) + "\n")


def read_csv(path: Path) -> tuple[np.ndarray, np.ndarray]:
    a = np.loadtxt(path, delimiter=",", skiprows=1, ndmin=2)   # [runs, 5]
    return a[:, 1:3], a[:, 3:5]


def others(P: np.ndarray, T: np.ndarray, n_fit: int) -> dict[str, tuple]:
    """Held-out scores, on the same split, of the first tier form and of the per-position models."""
    out = {}
    X = device_design(P)
    Xf = np.stack([X[:, 0], X[:, 1] + X[:, 2], X[:, 3]], axis=1)   # first form: a + b (own + ahead) + c behind
    k = 2 * n_fit
    w, *_ = np.linalg.lstsq(Xf[:k], T.reshape(-1)[:k], rcond=None)
    out["first form (c = b)"] = (fit_quality(Xf[:k] @ w, T.reshape(-1)[:k]),
                                 fit_quality(Xf[k:] @ w, T.reshape(-1)[k:]), "a {:.3f} ms, b {:.2f}, c_behind {:.2f}"
                                 .format(w[0], w[1] * 1e3, w[2] * 1e3))
    A = np.hstack([np.ones((P.shape[0], 1)), P])   # [runs, 3]: 1, P_1, P_14
    pred_in, pred_out, desc = np.zeros((n_fit, 2)), np.zeros((P.shape[0] - n_fit, 2)), []
    for j, name in enumerate(("T_1", "T_14")):
        wj, *_ = np.linalg.lstsq(A[:n_fit], T[:n_fit, j], rcond=None)
        pred_in[:, j], pred_out[:, j] = A[:n_fit] @ wj, A[n_fit:] @ wj
        desc.append(f"{name} = {wj[0]:.3f} + {wj[1] * 1e3:.2f} P_1 + {wj[2] * 1e3:.2f} P_14")
    out["per-position (6 terms)"] = (fit_quality(pred_in.reshape(-1), T[:n_fit].reshape(-1)),
                                     fit_quality(pred_out.reshape(-1), T[n_fit:].reshape(-1)), "; ".join(desc))
    return out


def _ratio(num: float, den: float) -> str:
    """num / den, or "inf (term held at 0)" when the fit held the denominator's term at 0."""
    return f"{num / den:.2f}" if den > 0 else "inf (term held at 0)"


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
    ap.add_argument("--from-csv", type=Path, default=None, help="refit these stored runs instead of measuring")
    ap.add_argument("--csv", type=Path, default=None,
                    help="where the runs go (default: docs/bench-log/probe_readfit_<date>.csv with --append, "
                         "else data/probe_readfit/runs.csv)")
    ap.add_argument("--append", action="store_true")
    args = ap.parse_args()

    started = utc_stamp()
    host = machine()
    load = os.getloadavg()[0]
    if args.from_csv:
        P, T = read_csv(args.from_csv)
        source = f"Runs stored in {args.from_csv}"
    else:
        P, T = measure(args)
        csv = args.csv or (ROOT / "docs" / "bench-log" / f"probe_readfit_{started[:16].replace(' ', '_').replace(':', '')}.csv"
                           if args.append else ROOT / "data" / "probe_readfit" / "runs.csv")
        write_csv(csv, P, T)
        source = f"Runs written to {csv.relative_to(ROOT) if csv.is_relative_to(ROOT) else csv}"
        print(source)
    fit = fit_device_read_model(P, T)
    m, q, h = fit.model, fit.quality, fit.held_out
    n_fit = fit.fit_runs
    print(f"device model: T_l = {m.intercept_ms:.3f} ms + {m.page_ms * 1e3:.2f} us P_l + {m.ahead_page_ms * 1e3:.2f} us "
          f"P_ahead + {m.behind_page_ms * 1e3:.2f} us P_behind; b/c = {_ratio(m.page_ms, m.ahead_page_ms)}, "
          f"b/c_behind = {_ratio(m.page_ms, m.behind_page_ms)}; fit {n_fit} runs: R^2 {q.r2:.3f}, RMSE "
          f"{q.rmse_ms:.3f} ms; held-out {P.shape[0] - n_fit} runs: R^2 {h.r2:.3f}, RMSE {h.rmse_ms:.3f} ms"
          + (f"; held at 0: {', '.join(fit.at_zero)}" if fit.at_zero else ""))
    rows = [("device model (a, b, c, c_behind)", q, h, "")]
    for name, (qi, ho, desc) in others(P, T, n_fit).items():
        print(f"{name}: fit R^2 {qi.r2:.3f}, RMSE {qi.rmse_ms:.3f}; held-out R^2 {ho.r2:.3f}, RMSE {ho.rmse_ms:.3f} "
              f"({desc})")
        rows.append((name, qi, ho, desc))
    print(f"T_1 {T[:, 0].min():.2f}..{T[:, 0].max():.2f} ms, T_14 {T[:, 1].min():.2f}..{T[:, 1].max():.2f} ms")
    if not args.append:
        return 0
    measured = ("" if args.from_csv else
                f" Two 128 MiB regions of one file on the local disk, one O_DIRECT page source each "
                f"(slacktier.store.disk, engine `{args.engine}`, queue depth {args.queue_depth}); per run, random "
                f"P_1 in 1..{args.max_p1} and P_14 in 1..{args.max_p14} distinct pages, layer 1 submitted first; "
                f"wall time from the first submit to each layer's last completion.")
    lines = [f"### The planner's read-time model on this disk ({started}"
             + (", stored runs refitted)" if args.from_csv else ")"), "",
             f"    {command_line(__file__)}", "",
             f"Machine: {host}; load average at start {load:.1f}.{measured} {source}. Fit on the first {n_fit} of "
             f"{P.shape[0]} runs (every layer of a run one observation), scored on the other {P.shape[0] - n_fit}. "
             "Paper (one NVMe shared by four ranks): T_1 = 0.30 ms + 3.05 us P_1 + 0.37 us P_14, R^2 0.997.", "",
             "| a ms | b us/page | c us/page (queued ahead) | c_behind us/page (queued behind) | b/c | fit R^2 | "
             "fit RMSE ms | held-out R^2 | held-out RMSE ms |", "|---|---|---|---|---|---|---|---|---|",
             f"| {m.intercept_ms:.3f} | {m.page_ms * 1e3:.2f} | {m.ahead_page_ms * 1e3:.2f} | "
             f"{m.behind_page_ms * 1e3:.2f} | {_ratio(m.page_ms, m.ahead_page_ms)} | {q.r2:.3f} | {q.rmse_ms:.3f} | "
             f"{h.r2:.3f} | {h.rmse_ms:.3f} |", "",
             "The same split with the other forms:", "", "| model | fit R^2 | fit RMSE ms | held-out R^2 | "
             "held-out RMSE ms | terms |", "|---|---|---|---|---|---|"]
    lines += [f"| {name} | {qi.r2:.3f} | {qi.rmse_ms:.3f} | {ho.r2:.3f} | {ho.rmse_ms:.3f} | {desc} |"
              for name, qi, ho, desc in rows]
    lines += ["", f"Measured T_1 {T[:, 0].min():.2f}..{T[:, 0].max():.2f} ms, T_14 {T[:, 1].min():.2f}.."
              f"{T[:, 1].max():.2f} ms."]
    append_to_section("\n".join(lines), SECTION)
    print("appended to its docs/bench-log/ file")
    return 0


if __name__ == "__main__":
    sys.exit(main())
