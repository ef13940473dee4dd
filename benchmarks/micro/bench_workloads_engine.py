"""Lookups per second of the compiled policy kernels on a real replay trace, against the pure-Python reference.

Replays the agent holdout sessions (B=64, N=128) through the V4.1 Engram hash,
takes layer 14's lookups and times each policy at two capacities (CLOCK: the
served cache's own directory pass, step by step, pins included), interleaved in
a shuffled order, `--repeats` times; the pure-Python reference runs once on a
prefix of the same trace. Prints a table and optionally appends it to
docs/bench-log/traffic.md under "## Traffic: access characterization".

    .venv/bin/python benchmarks/bench_workloads_engine.py [--append]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from slacktier.workloads import policies as P
from slacktier.workloads.characterize import prepare_workload, step_starts
from slacktier.workloads.corpus import CorpusConfig
from slacktier.workloads.hashing import EngramLookupHasher
from slacktier.workloads.replay import ReplayConfig

SECTION = "## Traffic: access characterization"

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # the repo root: benchmarks.* imports
from benchmarks._harness import append_to_section, command_line, machine, utc_stamp  # noqa: E402
from benchmarks.micro import policy_reference as R  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--reference-lookups", type=int, default=200_000)
    ap.add_argument("--append", action="store_true", help="append the table to its docs/bench-log/ file")
    args = ap.parse_args()

    pw = prepare_workload("agent", CorpusConfig(), ReplayConfig(batch=64, decode_tokens=128), EngramLookupHasher(),
                          [14])
    prep = pw.preps[0]
    ids, n, dec, ranks = prep.ids, prep.n_items, prep.decode, prep.ranks
    m = ids.shape[0]
    starts = step_starts(pw.trace)   # CLOCK is the served cache's directory pass, replayed step by step
    caps = [1_000_000, max(1, prep.n_items // 4)]
    kernels = {
        "lru": lambda c: P.lru(ids, n, c),
        "clock": lambda c: P.clock(ids, n, c, starts),
        "s3fifo": lambda c: P.s3fifo(ids, n, c),
        "static_lru": lambda c: P.static_lru(ids, ranks, n, c, c // 2),
        "belady": lambda c: P.belady(ids, dec, n, c),
    }
    for f in kernels.values():  # compile
        f(10)
    runs = [(k, c) for k in kernels for c in caps for _ in range(args.repeats)]
    random.Random(0).shuffle(runs)
    times: dict[tuple[str, int], list[float]] = {}
    for k, c in runs:
        t0 = time.perf_counter()
        kernels[k](c)
        times.setdefault((k, c), []).append(time.perf_counter() - t0)

    # the pure-Python reference and the compiled kernel on the same prefix, at a capacity that evicts
    k_ref = min(args.reference_lookups, m)
    pre_ids, pre_n = P.densify(ids[:k_ref])
    seq = pre_ids.tolist()
    ref_cap = max(1, pre_n // 4)
    refs = {"lru": (lambda: R.ref_lru(seq, ref_cap), lambda: P.lru(pre_ids, pre_n, ref_cap)),
            "s3fifo": (lambda: R.ref_s3fifo(seq, ref_cap, P.s3fifo_small_capacity(ref_cap)),
                       lambda: P.s3fifo(pre_ids, pre_n, ref_cap))}
    ref_lines = []
    for k, (slow, fast) in refs.items():
        t0 = time.perf_counter()
        ref_hits = slow()
        t_slow = time.perf_counter() - t0
        t_fast = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            hits = fast()
            t_fast.append(time.perf_counter() - t0)
        assert hits.tolist() == ref_hits, k
        med = statistics.median(t_fast)
        ref_lines.append(f"- {k} on the first {k_ref:,} lookups ({pre_n:,} distinct rows), capacity {ref_cap:,}: "
                         f"pure-Python reference {k_ref / t_slow / 1e6:.2f} Mlookups/s, compiled median "
                         f"{k_ref / med / 1e6:.1f} Mlookups/s ({t_slow / med:,.0f}x); hit masks identical.")
    t0 = time.perf_counter()
    P.densify(prep.rows)
    t_dense = time.perf_counter() - t0

    lines = [f"Trace: agent holdout, layer 14, {m:,} lookups ({pw.trace.num_tokens:,} tokens, "
             f"{prep.n_items:,} distinct rows), B=64, N=128. {args.repeats} runs per cell, shuffled.", "",
             "| policy | capacity (rows) | Mlookups/s min | median | max |", "|---|---:|---:|---:|---:|"]
    for k in kernels:
        for c in caps:
            rates = sorted(m / t / 1e6 for t in times[(k, c)])
            lines.append(f"| {k} | {c:,} | {rates[0]:.1f} | {statistics.median(rates):.1f} | {rates[-1]:.1f} |")
    lines.append("")
    lines += ref_lines
    lines.append(f"- one-time preparation of the layer (np.unique to dense ids): {t_dense:.2f} s "
                 f"({m / t_dense / 1e6:.1f} Mlookups/s).")
    text = "\n".join(lines)
    print(text)
    if args.append:
        block = (f"### Characterization engine throughput ({utc_stamp()})\n\n"
                 f"Command: `{command_line(__file__)}`; machine: "
                 f"{machine()} (shared with other jobs), one thread.\n\n{text}\n")
        append_to_section(block, SECTION)


if __name__ == "__main__":
    np.seterr(all="ignore")
    main()
