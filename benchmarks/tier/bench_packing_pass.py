"""What context packing costs begin_step: a packed and a plain TP4 rank-3 table, stepped in turn, on the DRAM tier.

The DRAM tier keeps the disk's noise out of begin_step, so the paired difference (packed minus plain, step by
step, on the same ids) is the pass's own cost of looking up each token's context. Traffic and pack list as in
bench_packing.py: real source text split by file, the list chosen on the fit half (contexts seen twice or
more), steps from the held-out half. Prints medians over the steps after --warmup; run it a few times, as
begin_step moves between processes on a shared machine.

    .venv/bin/python benchmarks/tier/bench_packing_pass.py --batch 128 --steps 400
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # the repo root: benchmarks.* imports
from benchmarks._harness import command_line, machine, utc_stamp  # noqa: E402
from benchmarks.tier import bench_packing as bp  # noqa: E402
from slacktier.engine.step import StepEngine  # noqa: E402
from slacktier.tables.packing import PackRequest, read_pack_list  # noqa: E402
from slacktier.tables.stage import stage_synthetic  # noqa: E402
from slacktier.testing.engine import real_token_ids  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    bp.add_pass_args(ap)
    args = ap.parse_args()
    layout, steps = bp.pass_steps(args, f"{utc_stamp()}; `{command_line(__file__)}`; {machine()}")
    layers = layout.layer_ids
    fit = real_token_ids(120_000, layout, start_file=0)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        d = Path(tmp)
        bp.pack_list(d / "list.npz", fit, layers, {"workload": "real-text", "seed": 0, "batch": args.batch,
                                                   "cache_rows": args.cache_rows, "ranks": 4,
                                                   "partition": "columns", "tokens": int(fit.shape[0])})
        request = PackRequest(read_pack_list(d / "list.npz"), int(0.25e9), int(16e6))
        plain = stage_synthetic([d / "plain.bin"], layout, 4, 0, progress=False).path
        packed = stage_synthetic([d / "packed.bin"], layout, 4, 0, progress=False, pack=request).path
        engines = {name: StepEngine.from_control(bp.control(d, f"{name}.toml", m, layers, 3, args.cache_rows,
                                                            args.batch, source="dram"))
                   for name, m in (("plain", plain), ("packed", packed))}
        out = bp.run_paired(engines, steps, args.warmup, args.checked)
    p, k = np.array(out["plain"]["begin_us"]), np.array(out["packed"]["begin_us"])
    pages = {name: out[name]["pages"] for name in out}
    print(f"B={args.batch}, {p.size} steps: begin_step median plain {np.median(p):.0f} us, packed {np.median(k):.0f} "
          f"us; packed - plain, step by step: median {np.median(k - p):.1f} us; pages per step "
          f"{np.median(pages['plain']):.0f} -> {np.median(pages['packed']):.0f}")


if __name__ == "__main__":
    main()
