"""What sets the directory floor: random 4 B reads from arrays of growing size, on this machine.

begin_step's floor (`engine/hot_path_tasks._directory_floor`) is one numpy gather of as
many random directory entries as a step has owned lookups (~1,536 for one TP4
rank of the V4.1 tables at B = 128) from a directory of 4 B per row, 1.5 GB a
layer. This script takes the same gather from int32 arrays of 16 MiB up to
that size, so the cost per entry can be read against the array's size:
- "independent": numpy `take` of 1,536 random entries (the floor's own
  operation; the core overlaps the loads);
- "dependent": 1,536 loads where each address depends on the value before
  (one at a time: the latency of a random read).
Each array is filled as the cache fills a directory (np.full, which numpy
backs with transparent huge pages where the kernel allows it); with
`--no-thp` one more array of the largest size is allocated after turning
numpy's huge-page advice off, so the guest's 4 KiB pages can be compared.
Reported per size: ns per entry, min / median / max over `--rounds` rounds
of fresh random rows, and the array's share in huge pages.

    .venv/bin/python benchmarks/bench_directory_floor.py [--rounds 200] [--no-thp] [--append]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
from numba import njit

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # the repo root: benchmarks.* imports
from benchmarks._harness import command_line, machine, publish, utc_stamp  # noqa: E402

from slacktier.cache.rowcache import huge_page_share  # noqa: E402

SECTION = "## The tier: page sources, cache and step engine"
SUBSECTION = "### Hot path against issue 14's targets"
LOOKUPS = 1536
SIZES_MIB = (16, 64, 256, 366, 1024, 1536)   # 366 MiB: one TP4 rank's directory of a V4.1 layer


@njit(cache=False)
def _chase(a, start, n):
    """n reads of a, each at an address computed from the value read before: one random read at a time."""
    x = np.int64(start)
    m = a.shape[0]
    total = np.int64(0)
    for _ in range(n):
        v = a[x]
        total += v
        x = (x * np.int64(6364136223846793005) + np.int64(1442695040888963407) + v) & np.int64(0x7FFFFFFFFFFFFFFF)
        x = x % m
    return total


def measure(rounds: int, no_thp: bool) -> list[dict]:
    rng = np.random.default_rng(1)
    arrays = [(f"{mib} MiB", np.full(mib * 2**20 // 4, -1, dtype=np.int32)) for mib in SIZES_MIB]
    if no_thp:
        from numpy._core import multiarray
        was = multiarray._get_madvise_hugepage()
        multiarray._set_madvise_hugepage(False)
        try:
            arrays.append((f"{SIZES_MIB[-1]} MiB, 4 KiB pages", np.full(SIZES_MIB[-1] * 2**20 // 4, -1,
                                                                        dtype=np.int32)))
        finally:
            multiarray._set_madvise_hugepage(was)
    _chase(arrays[0][1], 0, 10)   # compiled outside the timed rounds
    out = [{"name": name, "huge": huge_page_share(a) or 0.0, "independent": [], "dependent": []}
           for name, a in arrays]
    for _ in range(rounds):
        for k in rng.permutation(len(arrays)):   # sizes in a new order each round: drift falls on all alike
            a = arrays[k][1]
            rows = rng.integers(0, a.shape[0], LOOKUPS)
            t0 = time.perf_counter_ns()
            a.take(rows).sum()
            t1 = time.perf_counter_ns()
            _chase(a, int(rows[0]), LOOKUPS)
            t2 = time.perf_counter_ns()
            out[k]["independent"].append((t1 - t0) / LOOKUPS)
            out[k]["dependent"].append((t2 - t1) / LOOKUPS)
    return out


def report(out: list[dict], args: argparse.Namespace) -> str:
    def mmm(v: list[float]) -> str:
        return f"{min(v):.1f} / {statistics.median(v):.1f} / {max(v):.1f}"

    base = statistics.median(out[0]["independent"])
    rows = [f"| {o['name']} | {o['huge']:.0%} | {mmm(o['independent'])} | "
            f"{statistics.median(o['independent']) / base:.1f}x | {mmm(o['dependent'])} | "
            f"{statistics.median(o['independent']) * LOOKUPS / 1e3:.1f} |" for o in out]
    return "\n".join([
        f"#### Random directory reads against the directory's size, {utc_stamp()}",
        "",
        f"`{command_line(__file__, sys.argv[1:])}`; {machine()}; {args.rounds} rounds of {LOOKUPS} fresh random "
        "rows per size, the sizes in shuffled order each round; wall time per entry (ns).",
        "",
        "| int32 array | in huge pages | independent (numpy take), min / median / max | vs 16 MiB (median) | "
        f"dependent (one at a time), min / median / max | {LOOKUPS} independent reads (us, median) |",
        "|---|---|---|---|---|---|",
        *rows,
    ])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--no-thp", action="store_true", help="also a largest-size array in the guest's 4 KiB pages")
    ap.add_argument("--append", action="store_true", help=f"append the table to BENCHMARKS.md ({SUBSECTION})")
    args = ap.parse_args()
    block = report(measure(args.rounds, args.no_thp), args)
    return publish(block, args.append, SECTION, SUBSECTION)


if __name__ == "__main__":
    raise SystemExit(main())
