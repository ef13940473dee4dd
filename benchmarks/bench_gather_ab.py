"""The CPU gather pass of an earlier commit beside the current one, in one process, from a cold cache.

Both `engine/gather.py` versions (the earlier one loaded from git as a module
of its own) run `gather_cpu` on the same descriptors, pool and cache arrays,
alternately; before each call a 64 MiB sweep pushes the pool and the cache
rows out of the CPU caches, as another step's work would. Three cases of
B = 128 x 24 = 3,072 lookups, with the codec's synthetic rows:
- hits: every lookup a distinct random slot of a 1M-slot cache (256 MB);
- misses, no slots: 2,600 missed rows from 3,072 page buffers (4 KiB pages, 12 MiB), some lookups reusing a read,
  nothing cached (every slot pinned, or a cache of 0 rows: `_ab_worker.py gather`'s page pass);
- misses filling slots: the same, each miss also written to a random slot of the cache.
Outputs (and the cache after the fills) are compared between the two versions before timing.

    .venv/bin/python benchmarks/bench_gather_ab.py --against a00b770 [--repeats 30] [--append]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
import types

import numpy as np

from _common import ROOT, command_line, machine, publish, utc_stamp

from slacktier.engine import gather as G  # noqa: E402
from slacktier.tables.codec import synthetic_rows  # noqa: E402
from slacktier.tables.layout import PAGE_BYTES, ROW_BYTES, ROWS_PER_PAGE  # noqa: E402

SECTION = "## The tier: page sources, cache and step engine"
SUBSECTION = "### Hot path against issue 14's targets"
LOOKUPS, PAGES, MISSES, SLOTS = 128 * 24, 3072, 2600, 1_000_000


def old_gather(commit: str):
    proc = subprocess.run(["git", "-C", str(ROOT), "show", f"{commit}:src/slacktier/engine/gather.py"],
                          capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"cannot read engine/gather.py at {commit}: {proc.stderr.strip()}")
    mod = types.ModuleType(f"gather_{commit}")
    mod.__file__ = f"gather_{commit}.py"
    sys.modules[mod.__name__] = mod
    exec(compile(proc.stdout.replace("cache=True", "cache=False"), mod.__file__, "exec"), mod.__dict__)
    return mod.gather_cpu


def cases(rng: np.random.Generator) -> dict[str, tuple]:
    """name -> (desc_kind, desc_idx, miss_buf, miss_inpage, miss_slot)."""
    miss_buf = np.sort(rng.integers(0, PAGES, MISSES)).astype(np.int32)   # buffers in first-seen order
    miss_inpage = rng.integers(0, ROWS_PER_PAGE, MISSES).astype(np.int32)
    # Miss m is first asked for before miss m + 1 (the pass numbers them in lookup order); the other
    # lookups reuse a read already asked for.
    idx = np.empty(LOOKUPS, dtype=np.int64)
    at = np.concatenate([[0], np.sort(rng.choice(np.arange(1, LOOKUPS), MISSES - 1, replace=False))])
    idx[at] = np.arange(MISSES)
    created = np.cumsum(np.isin(np.arange(LOOKUPS), at))
    rest = np.setdiff1d(np.arange(LOOKUPS), at)
    idx[rest] = [rng.integers(0, created[i]) for i in rest]   # lookup 0 is a miss: created[i] >= 1
    misses = np.ones(LOOKUPS, dtype=np.int8)
    hits = np.zeros(LOOKUPS, dtype=np.int8)
    return {
        "hits (3,072 random slots of a 1M-slot cache)": (hits, rng.choice(SLOTS, LOOKUPS, replace=False).astype(
            np.int64), miss_buf[:0], miss_inpage[:0], np.zeros(0, dtype=np.int32)),
        "misses from page buffers, no slots": (misses, idx, miss_buf, miss_inpage, np.full(MISSES, -1, np.int32)),
        "misses from page buffers, each filling a slot": (misses, idx, miss_buf, miss_inpage, rng.choice(
            SLOTS, MISSES, replace=False).astype(np.int32)),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--against", required=True, help="the earlier commit whose engine/gather.py runs beside")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--append", action="store_true", help=f"append the table to BENCHMARKS.md ({SUBSECTION})")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    fns = {args.against: old_gather(args.against), "current": G.gather_cpu}
    pool = np.zeros((PAGES, PAGE_BYTES), dtype=np.uint8)
    raw = synthetic_rows(5, 0, PAGES * ROWS_PER_PAGE)
    pool[:, :ROWS_PER_PAGE * ROW_BYTES] = raw.reshape(PAGES, -1)
    weight = synthetic_rows(6, 0, SLOTS)
    scale = np.ascontiguousarray(weight[:, 256:])
    weight = np.ascontiguousarray(weight[:, :256])
    lut = G.lut_by_scale()
    sweep = np.ones(64 << 20, dtype=np.uint8)
    rows = []
    for name, (kind, idx, buf, inpage, slot) in cases(rng).items():
        outs = {}
        for key, fn in fns.items():
            w, s = weight.copy(), scale.copy()
            out = np.empty((LOOKUPS, 256), dtype=np.uint16)
            fn(kind, idx, LOOKUPS, buf, inpage, slot, buf.shape[0], pool, w, s, lut, out)
            outs[key] = (out, w, s)
        a, b = outs.values()
        if not all(np.array_equal(x, y) for x, y in zip(a, b)):
            raise SystemExit(f"{name}: the two versions disagree")
        times = {key: [] for key in fns}
        out = np.empty((LOOKUPS, 256), dtype=np.uint16)
        for _ in range(args.repeats):
            for key, fn in fns.items():
                sweep.sum()
                t0 = time.perf_counter_ns()
                fn(kind, idx, LOOKUPS, buf, inpage, slot, buf.shape[0], pool, weight, scale, lut, out)
                times[key].append((time.perf_counter_ns() - t0) / 1e3)
        old, new = times[args.against], times["current"]
        med = statistics.median
        rows.append(f"| {name} | {min(old):.0f} / {med(old):.0f} / {max(old):.0f} | {min(new):.0f} / {med(new):.0f} "
                    f"/ {max(new):.0f} | {med(old) / med(new):.2f} |")
        print(rows[-1], flush=True)
    block = "\n".join([
        f"#### The gather pass, {args.against} beside the current one in one process, {utc_stamp()}",
        "",
        f"`{command_line(__file__, sys.argv[1:])}`; {machine()}; {args.repeats} calls per version and case, "
        "alternating, each after a 64 MiB sweep; 3,072 lookups; us per call; outputs and filled slots identical.",
        "",
        f"| case | {args.against} (min / median / max) | current (min / median / max) | speed-up |",
        "|---|---|---|---|",
        *rows,
    ])
    return publish(block, args.append, SECTION, SUBSECTION)


if __name__ == "__main__":
    raise SystemExit(main())
