"""What an admission rule costs begin_step: one TP4 rank-3 table served by two engines, without and with the rule.

Both engines serve the same staged table on the DRAM tier (the disk's noise kept out of begin_step) with the
same cache; one runs plain CLOCK (`admission = "off"`), the other `--admission` (default "counters": each hit
raises its slot's count with a read-modify-write instead of a store, and the pass takes the step's heat codes).
They are stepped in turn on the same decode steps of real source text (which goes first alternates), so the
paired difference, step by step, is the rule's own cost. Every token is a decode token (begin_step's decode
flags left out), as in a decode step. Prints medians over the steps after --warmup, and pages per step: the
rule changes which rows stay cached, so pages differ too. Run it a few times, as begin_step moves
between processes on a shared machine.

    .venv/bin/python benchmarks/tier/bench_admission_pass.py --batch 128 --steps 400
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
from slacktier.cache import ADMISSIONS  # noqa: E402
from slacktier.engine.step import StepEngine  # noqa: E402
from slacktier.tables.stage import stage_synthetic  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--admission", default="counters", choices=[a for a in ADMISSIONS if a != "off"])
    bp.add_pass_args(ap)
    args = ap.parse_args()
    layout, steps = bp.pass_steps(args, f"{utc_stamp()}; `{command_line(__file__)}`; {machine()}")
    layers = layout.layer_ids
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        d = Path(tmp)
        table = stage_synthetic([d / "table.bin"], layout, 4, 0, progress=False).path
        engines = {}
        for name in ("off", args.admission):
            e = StepEngine.from_control(bp.control(d, f"{name}.toml", table, layers, 3, args.cache_rows, args.batch,
                                                   source="dram"))
            e.apply(e.config.replace(admission=name))
            engines[name] = e
        out = bp.run_paired(engines, steps, args.warmup, args.checked)
    p, k = np.array(out["off"]["begin_us"]), np.array(out[args.admission]["begin_us"])
    pages = {name: out[name]["pages"] for name in out}
    print(f"B={args.batch}, {p.size} steps: begin_step median off {np.median(p):.0f} us, {args.admission} "
          f"{np.median(k):.0f} us; {args.admission} - off, step by step: median {np.median(k - p):.1f} us "
          f"(quartiles {np.percentile(k - p, 25):.1f} / {np.percentile(k - p, 75):.1f}); pages per step "
          f"{np.median(pages['off']):.0f} -> {np.median(pages[args.admission]):.0f}")


if __name__ == "__main__":
    main()
