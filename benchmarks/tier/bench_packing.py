"""Context packing through the real engine: pages per step and begin_step time, held-out traffic, with and without.

A scaled Engram table (`--vocab`, 24 columns per layer, layers 1 and 14) is staged twice on one disk
directory, with and without a pack list, at TP1 (one process serves the table) and TP4 (one `owned_only`
process per rank, `columns` partition). Traffic is real source text tokenized with the DeepSeek-V4 tokenizer
and hashed by the Engram hasher: the fit half is the text of the installed packages' files from index 0, the
held-out half starts at file `--heldout-file` (no file on both sides). The pack list is chosen on the fit
half only: contexts seen at least twice, most frequent first (a frequency proxy for "page reads saved"; the
traffic side's `write_pack_list` ranks by simulated savings). Held-out steps: `--batch` streams, each a
contiguous piece of the held-out tokens, one token per stream per step; the first `--warmup` steps warm the
cache and are not counted. The plain and packed engines step in turn on the same ids (A/B interleaved), each
with the checker on for the first steps (0 mismatches required) and off for the timed ones.

    .venv/bin/python benchmarks/tier/bench_packing.py --dir /var/tmp --vocab 40000 --steps 200

`--plain-cost` instead times begin_step of a table without packing only (TP4 rank 3, random in-column ids, a
cache too small to hit: every lookup a miss, the path packing added a branch to), importing nothing that
packing added, so the same file runs against the source before packing (PYTHONPATH=<that tree>/src) and
after it, one process after the other, to show the unpacked path's cost is unchanged.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import numpy as np

from slacktier.config import from_dict, write_control
from slacktier.engine.step import StepEngine
from slacktier.tables.engram_hash import EngramLayout
from slacktier.tables.stage import stage_synthetic

PACK_LIST_FORMAT = "slacktier-pack-list"


def pack_list(path: Path, fit_ids: np.ndarray, layers: tuple[int, ...], meta: dict) -> dict[int, int]:
    """Write a pack list (the format: tables.packing) of the fit half's contexts seen twice or more, most frequent
    first."""
    arrays = {"layers": np.array(layers, dtype=np.int64),
              "meta": np.array(json.dumps({"format": PACK_LIST_FORMAT, "version": 1, "split": "fit", **meta}))}
    counts = {}
    for j, layer in enumerate(layers):
        seen = Counter(map(tuple, fit_ids[:, j, :].tolist()))
        ranked = [(n, ctx) for ctx, n in seen.items() if n >= 2 and min(ctx) >= 0]
        ranked.sort(key=lambda x: -x[0])
        arrays[f"ids_{layer}"] = np.array([c for _, c in ranked], dtype=np.int64).reshape(-1, fit_ids.shape[2])
        arrays[f"saved_{layer}"] = np.array([n - 1 for n, _ in ranked], dtype=np.float64)
        counts[layer] = len(ranked)
    np.savez(path, **arrays)
    return counts


def control(d: Path, name: str, manifest: str, layers: tuple[int, ...], rank: int, cache_rows: int,
            batch: int, source: str = "disk") -> str:
    tables = [{"layer": layer, "manifest": manifest, "cache_share": 1.0 / len(layers), "order": i, "rank": rank,
               "source": source} for i, layer in enumerate(layers)]
    doc = {"engine": {"cache_rows": cache_rows, "max_tokens": batch, "owned_only": rank >= 0, "check": False,
                      "verify_reads": False}, "table": tables}
    return str(write_control(from_dict(doc), d / name))


def add_pass_args(ap: argparse.ArgumentParser) -> None:
    """The flags of the paired begin_step benches (bench_packing_pass, bench_admission_pass)."""
    ap.add_argument("--dir", default="/var/tmp", help="where the tables are staged (deleted after)")
    ap.add_argument("--vocab", type=int, default=40_000, help="scaled Engram vocab (rows per layer ~24x)")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--cache-rows", type=int, default=5_000)
    ap.add_argument("--checked", type=int, default=5, help="first steps run with the bit-exact checker (untimed)")


def pass_steps(args: argparse.Namespace, header: str) -> tuple[EngramLayout, list[np.ndarray]]:
    """The paired benches' table layout and timed decode steps (held-out source text), after checking the flags
    and printing `header` (the run's date, command and machine)."""
    from slacktier.testing.engine import real_token_ids

    if args.checked > args.warmup:
        raise SystemExit("--checked must not exceed --warmup: checked steps are not timed")
    print(header, flush=True)
    layout = EngramLayout.scaled(args.vocab)
    held = real_token_ids(args.batch * (args.steps + 2), layout, start_file=1500)
    return layout, steps_of(held, args.batch, args.steps)


def run_paired(engines: dict[str, StepEngine], steps: list[np.ndarray], warmup: int, checked: int) -> dict[str, dict]:
    """`run` with the engines alternating which goes first, then closed; refused unless the checked steps were
    exact (`check_exact`)."""
    try:
        out = run(engines, steps, warmup, checked, alternate=True)
    finally:
        for e in engines.values():
            e.close()
    check_exact(out, checked)
    return out


def check_exact(out: dict[str, dict], checked: int) -> None:
    """Refuse a paired run whose checked steps found a mismatching row (or checked none); say what was checked."""
    bad = {name: r["mismatches"] for name, r in out.items() if r["mismatches"] or not r["checked"]}
    if bad:
        raise SystemExit(f"rows not bit-exact (or not checked) on the first {checked} steps: {bad}")
    print(f"checker: {checked} steps per engine, {sum(r['checked'] for r in out.values()):,} rows compared, "
          "0 mismatching")


def steps_of(held: np.ndarray, batch: int, steps: int) -> list[np.ndarray]:
    """Decode steps: `batch` streams, stream b the held-out tokens from b * len / batch on."""
    per = held.shape[0] // batch
    if per < steps:
        raise SystemExit(f"held-out half has {held.shape[0]} tokens: {batch} streams of {steps} steps need more")
    return [np.ascontiguousarray(held[np.arange(batch) * per + s]) for s in range(steps)]


def run(engines: dict[str, StepEngine], steps: list[np.ndarray], warmup: int, checked: int,
        alternate: bool = False) -> dict[str, dict]:
    """Step the engines in turn on each step's ids; per engine the counted steps' pages and begin_step times.
    `alternate`: which engine goes first alternates step by step (for paired begin_step differences)."""
    out = {name: {"pages": [], "packed": [], "begin_us": [], "mismatches": 0, "checked": 0} for name in engines}
    order = list(engines.items())
    for i, ids in enumerate(steps):
        for name, e in (order[::-1] if alternate and i % 2 else order):
            if i == 0:
                e.apply(e.config.replace(check=True))
            if i == checked:
                e.apply(e.config.replace(check=False))
            t0 = time.perf_counter_ns()
            e.begin_step(ids)
            t1 = time.perf_counter_ns()
            for layer in e.layers:
                e.gather(layer)
            c = e.end_step()
            rec = out[name]
            rec["mismatches"] += sum(x.mismatches for x in c.layers.values())
            rec["checked"] += sum(x.checked_rows for x in c.layers.values())
            if i >= warmup:
                rec["pages"].append(sum(x.pages_read for x in c.layers.values()))
                rec["packed"].append(sum(x.packed_pages for x in c.layers.values()))
                rec["begin_us"].append((t1 - t0) / 1e3)
    return out


def mmm(xs: list[float]) -> str:
    return f"{min(xs):,.0f} / {statistics.median(xs):,.0f} / {max(xs):,.0f}"


def plain_cost(args: argparse.Namespace) -> None:
    """begin_step of an unpacked TP4 rank-3 table, all misses: min / median / max over `--steps` steps."""
    layout = EngramLayout.scaled(args.vocab)
    layers = layout.layer_ids
    rng = np.random.default_rng(0)
    bounds = {layer: np.asarray(layout.layer_column_bounds(layer)) for layer in layers}
    steps = [np.ascontiguousarray(np.stack([b[:-1] + rng.integers(0, b[1:] - b[:-1], size=(args.batch, 24))
                                            for b in bounds.values()], axis=1)) for _ in range(args.steps)]
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        d = Path(tmp)
        m = stage_synthetic([d / "t.bin"], layout, 4, 0, progress=False)
        times = []
        with StepEngine.from_control(control(d, "c.toml", m.path, layers, 3, 1_000, args.batch)) as e:
            for ids in steps:
                t0 = time.perf_counter_ns()
                e.begin_step(ids)
                times.append((time.perf_counter_ns() - t0) / 1e3)
                for layer in e.layers:
                    e.gather(layer)
                c = e.end_step()
        hits = sum(x.hits for x in c.layers.values())
        print(f"plain begin_step us (min / median / max of {args.steps - 20} steps after 20): "
              f"{mmm(times[20:])}; last step's hits {hits}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default="/var/tmp", help="a directory on a disk that takes O_DIRECT")
    ap.add_argument("--vocab", type=int, default=40_000, help="scaled Engram vocab (rows per layer ~24x)")
    ap.add_argument("--fit-tokens", type=int, default=120_000)
    ap.add_argument("--heldout-file", type=int, default=1500,
                    help="first file of the held-out half (numpy's 487 files, then torch's: 1500 is torch's)")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--checked", type=int, default=20, help="first steps run with the bit-exact checker")
    ap.add_argument("--cache-rows", type=int, default=20_000, help="cache rows per process (split by layer)")
    ap.add_argument("--pack-disk-gb", type=float, default=0.25, help="extra disk per rank")
    ap.add_argument("--pack-index-mb", type=float, default=16.0, help="index host memory per rank")
    ap.add_argument("--plain-cost", action="store_true", help="time the unpacked path only (module doc)")
    args = ap.parse_args()
    sys.stdout.reconfigure(line_buffering=True)
    if args.plain_cost:
        plain_cost(args)
        return
    from slacktier.tables.packing import PackRequest, read_pack_list
    from slacktier.testing.engine import real_token_ids

    layout = EngramLayout.scaled(args.vocab)
    layers = layout.layer_ids
    t0 = time.perf_counter()
    fit = real_token_ids(args.fit_tokens, layout, start_file=0)
    held = real_token_ids(args.batch * (args.warmup + args.steps + 1), layout, start_file=args.heldout_file)
    print(f"traffic: fit {fit.shape[0]:,} tokens (files from 0), held-out {held.shape[0]:,} tokens (files from "
          f"{args.heldout_file}), hashed in {time.perf_counter() - t0:.0f} s")
    steps = steps_of(held, args.batch, args.warmup + args.steps)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        d = Path(tmp)
        found = pack_list(d / "list.npz", fit, layers, {"workload": "real-text", "seed": 0, "batch": args.batch,
                                                        "cache_rows": args.cache_rows, "ranks": 4,
                                                        "partition": "columns", "tokens": int(fit.shape[0])})
        print(f"pack list: contexts seen twice or more in the fit half: {found}", flush=True)
        request = PackRequest(read_pack_list(d / "list.npz"), int(args.pack_disk_gb * 1e9),
                              int(args.pack_index_mb * 1e6))
        rows = []
        for ranks in (1, 4):
            manifests = {}
            for name in ("plain", "packed"):
                m = stage_synthetic([d / f"{name}{ranks}.bin"], layout, ranks, 0, progress=False,
                                    pack=request if name == "packed" else None)
                manifests[name] = m.path
                if m.packing is not None:
                    pk = m.packing
                    print(f"TP{ranks}: packed {pk.contexts} contexts, per rank {pk.disk_bytes_per_rank / 2**20:,.1f} "
                          f"MiB extra disk, {pk.index_bytes_per_rank / 2**20:,.2f} MiB index")
            for rank in ([-1] if ranks == 1 else range(ranks)):
                cache = args.cache_rows if ranks == 1 else args.cache_rows // ranks
                engines = {name: StepEngine.from_control(control(d, f"{name}{ranks}-{rank}.toml", path, layers, rank,
                                                                 cache, args.batch))
                           for name, path in manifests.items()}
                try:
                    got = run(engines, steps, args.warmup, args.checked)
                finally:
                    for e in engines.values():
                        e.close()
                for name, rec in got.items():
                    if rec["mismatches"] or not rec["checked"]:
                        raise SystemExit(f"TP{ranks} rank {rank} {name}: {rec['mismatches']} mismatches of "
                                         f"{rec['checked']} checked rows")
                rows.append((f"TP{ranks}" + (f" rank {rank}" if rank >= 0 else ""), got, cache))
    print(f"\nheld-out steps {args.steps} (after {args.warmup} warm-up), batch {args.batch}, checker: 0 mismatches "
          f"on the first {args.checked} steps of every engine")
    print("| process | cache rows | pages/step plain (min/med/max) | pages/step packed | change (median) "
          "| packed pages/step (median) | begin_step us plain | begin_step us packed |")
    print("|---|---|---|---|---|---|---|---|", flush=True)
    for what, got, cache in rows:
        p, q = got["plain"], got["packed"]
        change = statistics.median(q["pages"]) / max(statistics.median(p["pages"]), 1) - 1
        print(f"| {what} | {cache:,} | {mmm(p['pages'])} | {mmm(q['pages'])} | {change:+.1%} | "
              f"{statistics.median(q['packed']):,.0f} | {mmm(p['begin_us'])} | {mmm(q['begin_us'])} |")


if __name__ == "__main__":
    main()
