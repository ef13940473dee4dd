"""Resident memory of one process serving two tables of >= 16M rows each: from disk vs from DRAM.

Stages a synthetic table with two layers of the V4.1 Engram hash scaled to
>= 16.7M rows each (EngramLayout.scaled(700_000): ~9 GB of pages) with the
staging code, then runs one child process per configuration, one at a time:

- disk: both layers on the staged file (O_DIRECT, io_uring), 1M-row cache;
- dram: the same control file with source = "dram" (pages loaded into host memory);
- none: the same imports and hashing, no engine (the process's own baseline).

Each child builds its engine from a control file, runs `--steps` real-token
decode steps of B = 128 sessions (checker off: its memory-mapped reference
reads would add file pages to the resident set), and reports VmRSS and
VmHWM from /proc/self/status. The expectation for disk: baseline + directories
(4 B per row) + cache (264 B per slot + bookkeeping) + page buffers, nothing
proportional to the table. The staged files are deleted at the end unless --keep.

    .venv/bin/python benchmarks/bench_engine_rss.py [--append] [--dir runs/engine_rss]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # the repo root: benchmarks.* imports
from benchmarks._harness import append_to_section, command_line, machine, utc_stamp  # noqa: E402

VOCAB = 700_000
BATCH = 128


def proc_status() -> dict[str, int]:
    """VmRSS and VmHWM of this process in bytes."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(value.split()[0]) * 1024
    return out


def write_control(path: Path, manifest: str, source: str, cache_rows: int) -> None:
    path.write_text(f"""
[engine]
cache_rows = {cache_rows}
max_tokens = {BATCH}
[[table]]
layer = 1
source = "{source}"
manifest = "{manifest}"
cache_share = 0.5
order = 0
[[table]]
layer = 14
source = "{source}"
manifest = "{manifest}"
cache_share = 0.5
order = 1
""")


def child(kind: str, control: str, steps: int) -> None:
    """Run in a fresh process: build, step, report JSON on stdout."""
    from benchmarks.engine.bench_engine_begin_step import sessions_ids

    from slacktier.engine.step import StepEngine
    from slacktier.tables.engram_hash import EngramLayout
    layout = EngramLayout.scaled(VOCAB)
    ids = sessions_ids(layout, BATCH, steps)              # [B, steps, 2, 24]
    report: dict[str, object] = {"kind": kind}
    if kind == "none":
        report |= {"after_build": proc_status(), "after_steps": proc_status()}
    else:
        t0 = time.perf_counter()
        engine = StepEngine.from_control(control)
        report["build_s"] = time.perf_counter() - t0
        report["after_build"] = proc_status()
        for k in range(steps):
            engine.begin_step(ids[:, k])
            for layer in engine.layers:
                engine.gather(layer)
            engine.end_step()
        report["after_steps"] = proc_status()
        cache = engine.cache
        report["directory_bytes"] = sum(cache.layer(l).directory.nbytes for l in cache.layers)
        report["cache_bytes"] = (cache.weight.nbytes + cache.scale.nbytes + cache.slot_layer.nbytes
                                 + cache.slot_row.nbytes + cache.state.nbytes + cache.fill_miss.nbytes
                                 + cache.owner.nbytes)
        report["pool_bytes"] = engine._pool.pages.nbytes
        report["lookups"] = sum(c.lookups for c in engine.totals.values())
        report["pages_read"] = sum(c.pages_read for c in engine.totals.values())
        report["hits"] = sum(c.hits for c in engine.totals.values())
        engine.close()
    print("RESULT " + json.dumps(report), flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default="runs/engine_rss")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--cache-rows", type=int, default=1_000_000)
    ap.add_argument("--keep", action="store_true", help="keep the staged table")
    ap.add_argument("--append", action="store_true")
    ap.add_argument("--child", default="")
    ap.add_argument("--control", default="")
    args = ap.parse_args()
    if args.child:
        child(args.child, args.control, args.steps)
        return 0

    from benchmarks.engine.bench_engine_begin_step import SECTION, SUBSECTION

    from slacktier.tables.engram_hash import EngramLayout
    from slacktier.tables.manifest import Manifest
    from slacktier.tables.stage import stage_synthetic
    d = Path(args.dir)
    d.mkdir(parents=True, exist_ok=True)
    layout = EngramLayout.scaled(VOCAB)
    rows = [layout.rows(i) for i in range(layout.n_layers)]
    manifest_path = d / "table.bin.manifest.json"
    if manifest_path.exists():
        manifest = Manifest.load(manifest_path)
        print(f"reusing {manifest_path}")
    else:
        t0 = time.perf_counter()
        manifest = stage_synthetic([d / "table.bin"], layout, 1, 5, overwrite=True, progress=False)
        print(f"staged {sum(rows):,} rows in {time.perf_counter() - t0:.0f} s", flush=True)
    table_bytes = sum(r.nbytes for r in manifest.regions)
    results = {}
    try:
        for kind in ("none", "disk", "dram"):
            control = d / f"{kind}.toml"
            write_control(control, manifest.path, "dram" if kind == "dram" else "disk", args.cache_rows)
            proc = subprocess.run([sys.executable, __file__, "--child", kind, "--control", str(control),
                                   "--steps", str(args.steps)], capture_output=True, text=True)
            line = next((l for l in proc.stdout.splitlines() if l.startswith("RESULT ")), None)
            if proc.returncode != 0 or line is None:
                print(proc.stdout[-2000:], proc.stderr[-4000:])
                raise SystemExit(f"child {kind} failed with {proc.returncode}")
            results[kind] = json.loads(line[len("RESULT "):])
            print(kind, results[kind], flush=True)
    finally:
        if not args.keep:
            for p in d.glob("table.bin*"):
                p.unlink()
            shutil.rmtree(d, ignore_errors=True)

    gib = 2**30
    base = results["none"]["after_steps"]["VmRSS"]
    lines = ["| process | VmRSS after steps GiB | VmHWM GiB | above baseline GiB | expected above baseline GiB "
             "| lookups | hits | pages read |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for kind in ("none", "disk", "dram"):
        r = results[kind]
        rss = r["after_steps"]["VmRSS"]
        hwm = r["after_steps"]["VmHWM"]
        expected = ""
        if kind != "none":
            exp = r["directory_bytes"] + r["cache_bytes"] + r["pool_bytes"] + (table_bytes if kind == "dram" else 0)
            expected = f"{exp / gib:.2f}"
        lines.append(f"| {kind} | {rss / gib:.2f} | {hwm / gib:.2f} | {(rss - base) / gib:.2f} | {expected} | "
                     f"{r.get('lookups', '')} | {r.get('hits', '')} | {r.get('pages_read', '')} |")
    disk = results["disk"]
    table_md = "\n".join(lines)
    parts = (f"directories {disk['directory_bytes'] / 2**20:.0f} MiB (4 B x {sum(rows):,} rows), cache "
             f"{disk['cache_bytes'] / 2**20:.0f} MiB ({args.cache_rows:,} slots), page buffers "
             f"{disk['pool_bytes'] / 2**20:.0f} MiB; the table's pages: {table_bytes / gib:.2f} GiB")
    ratio = (results["dram"]["after_steps"]["VmRSS"] - base) / max(1, disk["after_steps"]["VmRSS"] - base)
    print(table_md)
    print(parts)
    print(f"DRAM / disk, above baseline: {ratio:.1f}x")
    if args.append:
        text = (f"**Resident memory, two tables of {rows[0]:,} and {rows[1]:,} rows, disk vs DRAM** - {utc_stamp()}, "
                f"{machine()}. Command: `{command_line(__file__)}`. One child process per row, run one "
                f"after another; each builds its engine from a control file and runs {args.steps} real-token "
                f"decode steps (B = {BATCH}). 'none' is the same process without an engine "
                f"(imports, tokenizer, hasher). Expected above baseline: {parts}.\n\n"
                + table_md + f"\n\nDRAM holds {ratio:.1f}x the disk process's memory above the baseline.")
        append_to_section(text, SECTION, SUBSECTION)
    return 0


if __name__ == "__main__":
    np.seterr(all="ignore")
    raise SystemExit(main())
