"""The characterizer's CLOCK hit rates on the Table 1 run's traffic, to compare two versions of the cache kernel.

The characterizer replays the served CLOCK itself (cache.simulate.replay_clock runs the directory pass), so a
change of the directory (issue 28: a hash table sized to the cache in place of an array of a row per table row)
must leave every outcome unchanged. This script prepares the Table 1 run's agent and chat traces once (layers
14 and 1, B = 64, N = 128 decode tokens per turn: `bench_workloads_traffic.py`'s defaults) and pickles them to
`--trace`; every run then evaluates CLOCK at 1M and 5M rows per layer, decode hit rates and a SHA-256 of each
hit mask, and writes them to `--out`. Run it once per version (PYTHONPATH selects the source) and compare:

    .venv/bin/python benchmarks/micro/bench_clock_same.py --out runs/clock_same/new.json
    PYTHONPATH=/path/to/old/src .venv/bin/python benchmarks/micro/bench_clock_same.py --out runs/clock_same/old.json
    .venv/bin/python benchmarks/micro/bench_clock_same.py --compare runs/clock_same/old.json runs/clock_same/new.json

`--no-evict-ahead` replays CLOCK alone (the policy before the engine's evict_ahead); comparing it with a
default run shows what evict_ahead changes in the hit rates (the masks then differ; the rates are the figure).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import pickle
import sys
import time
from pathlib import Path

import numpy as np


def prepare(trace: Path) -> dict:
    from slacktier.workloads.characterize import prepare_workload
    from slacktier.workloads.corpus import CorpusConfig
    from slacktier.workloads.hashing import EngramLookupHasher
    from slacktier.workloads.replay import ReplayConfig

    if trace.exists():
        return pickle.loads(trace.read_bytes())
    preps = {}
    for wl in ("agent", "chat"):
        t = time.perf_counter()
        pw = prepare_workload(wl, CorpusConfig(), ReplayConfig(batch=64, decode_tokens=128), EngramLookupHasher(),
                              [14, 1], progress=True)
        preps[wl] = pw.preps
        print(f"{wl}: prepared in {time.perf_counter() - t:.0f} s", flush=True)
    trace.parent.mkdir(parents=True, exist_ok=True)
    trace.write_bytes(pickle.dumps(preps))
    return preps


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", type=Path, default=Path("runs/clock_same/traces.pkl"))
    ap.add_argument("--out", type=Path, default=Path("runs/clock_same/result.json"))
    ap.add_argument("--compare", nargs=2, type=Path, metavar=("BEFORE", "AFTER"))
    ap.add_argument("--no-evict-ahead", action="store_true",
                    help="CLOCK alone, without the engine's evict_ahead between steps (its default since issue 28)")
    args = ap.parse_args()
    if args.compare:
        a, b = (json.loads(p.read_text()) for p in args.compare)
        same = a["cells"] == b["cells"]
        for key, cell in b["cells"].items():
            was = a["cells"].get(key, {}).get("decode_hit_rate", float("nan"))
            print(f"{key:24} decode hit {was:.4%} -> {cell['decode_hit_rate']:.4%} "
                  f"({100 * (cell['decode_hit_rate'] - was):+.3f} points) "
                  f"{'same mask' if a['cells'].get(key) == cell else 'DIFFERS'}")
        print("every hit mask identical" if same else "hit masks differ")
        return 0 if same else 1
    from slacktier.cache import simulate
    from slacktier.workloads.characterize import run_policy

    preps = prepare(args.trace)
    cells = {}
    for wl, layers in preps.items():
        for prep in layers:
            for cap in (1_000_000, 5_000_000):
                t = time.perf_counter()
                if args.no_evict_ahead:
                    from slacktier.workloads import policies
                    from slacktier.workloads.characterize import step_starts
                    hit = policies.clock(prep.ids, prep.n_items, cap, step_starts(prep.trace), evict_ahead=False)
                else:   # the served cache's hit mask over every lookup, as characterize replays it
                    hit = run_policy(prep, "clock", cap, 0.5)
                decode = float(hit[prep.decode].mean())
                cells[f"{wl}/L{prep.layer_id}/{cap // 1_000_000}M"] = {
                    "decode_hit_rate": decode, "hit_rate": float(hit.mean()),
                    "mask_sha256": hashlib.sha256(np.ascontiguousarray(hit).tobytes()).hexdigest()}
                print(wl, prep.layer_id, cap, f"{decode:.4%} ({time.perf_counter() - t:.0f} s)", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"kernel_source": simulate.__file__, "cells": cells}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
