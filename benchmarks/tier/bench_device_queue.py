"""The short-window layer first (issue 27): layer 1's read time beside layer 14 on one disk, over its time alone.

Two tables (layer 1 and layer 14) live in two halves of one large file on this
disk, each read by its own DiskSource, as the engine opens them. Each run
draws new uniformly random pages (P1 for layer 1, P14 for layer 14), submits
layer 1's batch, then layer 14's at once (as begin_step does, without the
pass between them), and waits for both. A layer's read time is the source's
own `ReadStats.read_us`: its batch's submit to its last page landing.

Configurations, interleaved in shuffled order within each round:

- ``alone``: layer 1's batch only (layer 14 in DRAM, say);
- ``shared``: both, through the one device queue they share, in its default
  strict window order: layer 14's first read waits until none of layer 1's is
  in flight;
- ``shared-fill``: the same queue with strict order off: layer 14's reads fill
  the depth layer 1's tail leaves (the device then serves both at once);
- ``per-table``: both, each table with a queue of its own at full depth on
  the same disk: the design before issue 27, reproduced with today's code by
  giving layer 14's file a device queue of its own.

The goal: median shared / alone <= 1.15 at 768 + 768 pages.

    .venv/bin/python benchmarks/bench_device_queue.py --rounds 20 --log docs/bench-log/device-queue.md

The file goes under runs/ (git-ignored) and is deleted at the end unless --keep-file.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from pathlib import Path
from unittest import mock

import numpy as np

from slacktier.config import DiskOptions
from slacktier.store import PageBufferPool, PageReads
from slacktier.store import disk as disk_tier
from slacktier.store.devqueue import Device, open_queues
from slacktier.store.disk import DiskSource
from slacktier.tables.layout import PAGE_BYTES
from slacktier.tables.regions import Region

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # the repo root: benchmarks.* imports
from benchmarks._harness import command_line, machine, pyplot, save_figure, utc_stamp  # noqa: E402
from benchmarks.tier.bench_store_disk import make_file  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
GOAL = 1.15
CONFIGS = ("alone", "shared", "shared-fill", "per-table")


def _sources(path: Path, pages_each: int, opts: DiskOptions, separate: bool) -> tuple[DiskSource, DiskSource]:
    regions = [Region(layer=layer, rank=0, path=str(path), offset_bytes=k * pages_each * PAGE_BYTES,
                      pages=pages_each, row_start=0, rows=pages_each * 15) for k, layer in enumerate((1, 14))]
    one = DiskSource([regions[0]], opts)
    if not separate:
        return one, DiskSource([regions[1]], opts)
    real = disk_tier.physical_device

    def own_device(fd: int) -> Device:   # layer 14's file gets a device queue of its own: the old design
        d = real(fd)
        return Device(d.number + (1 << 40), d.name + "-layer14")

    with mock.patch.object(disk_tier, "physical_device", own_device):
        return one, DiskSource([regions[1]], opts)


def _batch(rng: np.random.Generator, pages_each: int, n: int) -> PageReads:
    page = np.sort(rng.choice(pages_each, size=n, replace=False)).astype(np.int64)
    return PageReads(np.zeros(n, np.int32), page, np.arange(n, dtype=np.int32))


def measure(path: Path, pages_each: int, sizes: list[tuple[int, int]], rounds: int, opts: DiskOptions,
            seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    order = random.Random(seed)
    sets = {"joint": _sources(path, pages_each, opts, separate=False),
            "separate": _sources(path, pages_each, opts, separate=True)}
    cap = max(max(p) for p in sizes)
    pools = [PageBufferPool(cap), PageBufferPool(cap)]
    rows = []
    try:
        for r in range(rounds):
            cells = [(p1, p14, c) for p1, p14 in sizes for c in CONFIGS]
            order.shuffle(cells)
            for p1, p14, config in cells:
                one, fourteen = sets["separate" if config == "per-table" else "joint"]
                if config != "per-table":
                    for q in open_queues():
                        if hasattr(q, "strict_order"):
                            q.strict_order(config != "shared-fill")
                t1 = one.submit(_batch(rng, pages_each, p1), pools[0])
                t14 = fourteen.submit(_batch(rng, pages_each, p14), pools[1]) if config != "alone" else None
                s1 = one.wait(t1)
                s14 = fourteen.wait(t14) if t14 is not None else None
                rows.append({"round": r, "p1": p1, "p14": p14, "config": config, "t1_ms": s1.read_us / 1e3,
                             "t14_ms": s14.read_us / 1e3 if s14 else None})
            print(f"round {r + 1}/{rounds} done", file=sys.stderr)
    finally:
        for pair in sets.values():
            for s in pair:
                s.close()
    return rows


def summarize(rows: list[dict], sizes: list[tuple[int, int]]) -> str:
    def mmm(xs: list[float]) -> str:
        return f"{min(xs):.2f} / {statistics.median(xs):.2f} / {max(xs):.2f}"

    out = ["| P1 + P14 | configuration | layer 1 read, ms (min / median / max) | layer 14 read, ms | "
           "layer 1 over alone (median of per-round ratios) |", "|---|---|---|---|---|"]
    verdicts = []
    for p1, p14 in sizes:
        at = [x for x in rows if (x["p1"], x["p14"]) == (p1, p14)]
        alone = {x["round"]: x["t1_ms"] for x in at if x["config"] == "alone"}
        for config in CONFIGS:
            sel = [x for x in at if x["config"] == config]
            t1 = [x["t1_ms"] for x in sel]
            t14 = [x["t14_ms"] for x in sel if x["t14_ms"] is not None]
            ratio = statistics.median(x["t1_ms"] / alone[x["round"]] for x in sel)
            out.append(f"| {p1} + {p14} | {config} | {mmm(t1)} | {mmm(t14) if t14 else '-'} | {ratio:.2f}x |")
            if config.startswith("shared"):
                verdicts.append(f"{p1} + {p14}: {config} / alone = {ratio:.2f}x (goal <= {GOAL}x: "
                                f"{'met' if ratio <= GOAL else 'not met'})")
    return "\n".join(out + [""] + verdicts)


def write_png(path: Path, rows: list[dict], sizes: list[tuple[int, int]]) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, len(sizes), figsize=(5 * len(sizes), 4), squeeze=False)
    for ax, (p1, p14) in zip(axes[0], sizes, strict=True):
        at = [x for x in rows if (x["p1"], x["p14"]) == (p1, p14)]
        data = [[x["t1_ms"] for x in at if x["config"] == c] for c in CONFIGS]
        data14 = [[x["t14_ms"] for x in at if x["config"] == c and x["t14_ms"] is not None] for c in CONFIGS[1:]]
        ax.boxplot(data + data14, tick_labels=[f"L1 {c}" for c in CONFIGS] + [f"L14 {c}" for c in CONFIGS[1:]])
        ax.set_title(f"{p1} + {p14} pages, one disk")
        ax.set_ylabel("read time, ms (submit to last page)")
        ax.tick_params(axis="x", rotation=30)
    fig.tight_layout()
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--file", type=Path, default=REPO / "runs" / "device-queue.bin")
    ap.add_argument("--file-gib", type=float, default=8.0)
    ap.add_argument("--keep-file", action="store_true")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--sizes", default="768+768,3000+3000", help="P1+P14 pairs, comma-separated")
    ap.add_argument("--queue-depth", type=int, default=128)
    ap.add_argument("--engine", default="auto", choices=("auto", "io_uring", "threads"))
    ap.add_argument("--seed", type=int, default=27)
    ap.add_argument("--json", type=Path, help="write every run here")
    ap.add_argument("--png", type=Path, default=REPO / "runs" / "device-queue.png")
    ap.add_argument("--log", type=Path, help="append the dated block to this bench-log file")
    args = ap.parse_args(argv)
    sizes = [tuple(int(v) for v in s.split("+")) for s in args.sizes.split(",")]
    if args.rounds < 1 or any(p <= 0 for s in sizes for p in s):
        ap.error("--rounds and every page count must be positive")
    args.file.parent.mkdir(parents=True, exist_ok=True)
    if not args.file.exists() or args.file.stat().st_size < args.file_gib * 2**30:
        make_file(args.file, args.file_gib)
    pages_each = args.file.stat().st_size // PAGE_BYTES // 2
    opts = DiskOptions(engine=args.engine, queue_depth=args.queue_depth)
    try:
        rows = measure(args.file, pages_each, sizes, args.rounds, opts, args.seed)
    finally:
        if not args.keep_file:
            args.file.unlink(missing_ok=True)
    if args.json:
        args.json.write_text(json.dumps(rows))
    write_png(args.png, rows, sizes)
    block = (f"#### Layer 1 beside layer 14 on one disk, {utc_stamp()}\n\n"
             f"`{command_line(__file__, argv)}`, {machine()}; {args.file_gib:g} GiB file, "
             f"queue depth {args.queue_depth}, {args.rounds} rounds, configurations shuffled per round.\n\n"
             + summarize(rows, sizes) + f"\n\nPlot: `{args.png.relative_to(REPO) if args.png.is_relative_to(REPO) else args.png}`.\n")
    print(block)
    if args.log:
        args.log.parent.mkdir(parents=True, exist_ok=True)
        with args.log.open("a") as f:
            f.write("\n" + block)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
