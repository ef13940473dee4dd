"""`slacktier demo`: the main job on an embedded default.

1. Stage a small synthetic table (2 layers) into a local file with O_DIRECT,
   verify every page and random rows.
2. Replay built-in agent traffic (sessions built from real tool output on this
   machine) through a V4.1-shaped model whose Engram tables are served by the
   tier under three placements, each side by side with the DRAM table, and
   print the report.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

HELP = "run the demo: stage and verify a small table, replay built-in agent traffic under three placements, print a report"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default="runs/demo", help="working directory (default runs/demo)")
    p.add_argument("--rows", type=int, default=300_000, help="rows per layer (default 300000)")
    p.add_argument("--layers", default="1,14", help="layer ids (default 1,14)")
    p.add_argument("--ranks", type=int, default=2, help="ranks per layer (default 2)")
    p.add_argument("--seed", type=int, default=0, help="synthetic table seed (default 0)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--skip-replay", action="store_true", help="stage and verify only; skip the traffic replay")


def run(args: argparse.Namespace) -> int:
    import numpy as np
    import torch

    from slacktier.tables.codec import dequantize
    from slacktier.tables.stage import stage_synthetic
    from slacktier.tables.verify import verify_table

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    target = out / "table.bin"
    layers = {int(x): args.rows for x in args.layers.split(",")}
    progress = not args.no_progress

    t0 = time.perf_counter()
    m = stage_synthetic([target], layers, args.ranks, args.seed, overwrite=True, progress=progress)
    stage_s = time.perf_counter() - t0
    report = verify_table(m, rows_per_region=200, progress=progress)

    # One row read back through plain pread, dequantized, as a reader of the tier would see it.
    r = m.region(min(layers), 0)
    with open(target, "rb") as f:
        page = np.frombuffer(os.pread(f.fileno(), 4096, r.offset_bytes), dtype=np.uint8)
    row = dequantize(torch.from_numpy(page[:264].copy()))
    nbytes = m.total_pages * 4096
    print("SlackTier demo")
    print(f"  table      {len(layers)} layers x {args.rows:,} rows, {args.ranks} ranks -> {len(m.regions)} regions")
    print(f"  staged     {nbytes / 1e6:.1f} MB into {target} in {stage_s:.2f} s ({nbytes / stage_s / 1e6:.0f} MB/s, "
          f"O_DIRECT; a first run also compiles the kernels)")
    print(f"  manifest   {m.path}")
    print(f"  layer {r.layer} rank 0 row 0 (bf16, first 4): {[round(float(v), 6) for v in row[:4]]}")
    for line in report.lines():
        print(f"  {line}")
    if not report.ok:
        return 1
    if args.skip_replay:
        return 0

    from slacktier.serve.bench import run_short_demo

    print("\nReplaying built-in agent traffic through the tier (a first run builds the sessions and compiles "
          "kernels) ...", flush=True)
    t0 = time.perf_counter()
    print(run_short_demo(out, progress=progress))
    print(f"\n  replay took {time.perf_counter() - t0:.0f} s")
    return 0
