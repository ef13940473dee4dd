"""A DRAM-placed layer's read time per step, and what the placement costs begin_step.

The read: the pages a step misses, copied into the page pool by the DRAM tier.

One table (the V4.1 layout scaled to `--vocab` rows per head, staged as a file
and loaded into host memory), layer 1 on `source = "dram"`, layer 14 on disk,
a row cache of 1,000 rows (nearly every lookup misses), steps of `--batch`
tokens of real text (the built-in token ids). Per step the engine's counters give
layer 1's pages and its read time (submit to landed), and begin_step is timed
(wall and the calling thread's CPU). Between begin_step and the first gather the
caller either waits at once, sleeps 3 ms, or spins 3 ms in Python (as the
timeline's runner and a serving engine's Python thread keep the GIL and a core
busy), to show whether the copy depends on the caller leaving its core or the
interpreter. With `--disk-too` the same steps run with layer 1 on disk as well:
begin_step's reference when no layer is on DRAM. Printed: per placement and
mode, median and p90 read time, begin_step's median wall and CPU time, pages per
step and microseconds per page.

    PYTHONPATH=src .venv/bin/python benchmarks/tier/bench_dram_read.py [--vocab 200000] [--batch 32] [--steps 40]
        [--disk-too] [--dram-engine auto|io_uring|threads] [--disk-engine auto|io_uring|threads|threads-python]

Run it with another checkout's `src/` first on PYTHONPATH to time that tree's DRAM tier.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from slacktier.config import ControlFile, DiskOptions, DramOptions, EngineConfig, TableConfig, write_control
from slacktier.engine.step import StepEngine
from slacktier.tables.engram_hash import EngramLayout
from slacktier.tables.stage import stage_synthetic
from slacktier.testing.engine import real_token_ids


def control(folder: Path, manifest: Path, first: str = "dram", dram_engine: str = "auto",
            disk_engine: str = "auto") -> Path:
    """The control file: layer 1 on `first`, layer 14 on disk, a 1,000-row cache split half and half."""
    tables = tuple(TableConfig(layer=layer, manifest=str(manifest), source=source, cache_share=0.5, order=order,
                               options=DramOptions(engine=dram_engine) if source == "dram" else
                               DiskOptions(engine=disk_engine.removesuffix("-python")))
                   for order, (layer, source) in enumerate(((1, first), (14, "disk"))))
    return write_control(ControlFile(engine=EngineConfig(device="cpu", cache_rows=1000, max_tokens=256),
                                     tables=tables), folder / "control.toml")


def spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=200_000)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=40, help="steps per mode (the first 5 are not counted)")
    ap.add_argument("--dir", default="runs")
    ap.add_argument("--disk-too", action="store_true", help="also run the steps with layer 1 on disk")
    ap.add_argument("--dram-engine", default="auto", choices=("auto", "io_uring", "threads"),
                    help="[table.dram] engine: the C worker, or the copying thread of a machine without the helper")
    ap.add_argument("--disk-engine", default="auto", choices=("auto", "io_uring", "threads", "threads-python"),
                    help="[table.disk] engine (threads-python: the threads engine as it runs without the C helper)")
    args = ap.parse_args()
    if args.disk_engine == "threads-python":   # what a machine without a compiler gets
        import slacktier.store.disk
        slacktier.store.disk.helper_builds = lambda: False
    layout = EngramLayout.scaled(args.vocab)
    Path(args.dir).mkdir(parents=True, exist_ok=True)
    modes = ("wait", "sleep", "spin", "wait", "sleep", "spin")
    ids = real_token_ids(args.batch * args.steps, layout)
    got: dict[tuple[str, str], list[tuple[float, int, float, float]]] = {}
    placements = ("dram", "disk") if args.disk_too else ("dram",)
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        staged = stage_synthetic([Path(d) / "t.bin"], layout, 1, 5, progress=False)
        for first in placements:
            path = control(Path(d), Path(staged.path), first, args.dram_engine, args.disk_engine)
            with StepEngine.from_control(str(path)) as engine:
                for mode in modes:
                    for k in range(args.steps):
                        batch = np.ascontiguousarray(ids[k * args.batch:(k + 1) * args.batch])
                        t0, c0 = time.perf_counter(), time.thread_time()
                        engine.begin_step(batch)
                        begin_s, begin_cpu = time.perf_counter() - t0, time.thread_time() - c0
                        if mode == "sleep":
                            time.sleep(0.003)
                        elif mode == "spin":
                            spin(0.003)
                        for layer in engine.layers:
                            engine.gather(layer)
                        c = engine.end_step().layers[1]
                        if k >= 5:
                            got.setdefault((first, mode), []).append((c.read_us, c.pages_read, 1e6 * begin_s,
                                                                      1e6 * begin_cpu))
    package = Path(sys.modules[StepEngine.__module__].__file__).parents[2]
    print(f"layer 1 on {' / '.join(placements)}, disk engine {args.disk_engine}, B={args.batch}, vocab "
          f"{args.vocab:,}, {2 * (args.steps - 5)} steps "
          f"per mode; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; package: {package}")
    for (first, mode), rows in got.items():
        a = np.array(rows)
        med = float(np.median(a[:, 0]))
        print(f"{first:4s} {mode:5s} read {med:.0f} us median, {np.percentile(a[:, 0], 90):.0f} us p90; "
              f"begin_step {np.median(a[:, 2]):.0f} us ({np.median(a[:, 3]):.0f} us CPU); "
              f"{np.median(a[:, 1]):.0f} pages per step, {med / max(np.median(a[:, 1]), 1):.2f} us per page")
    return 0


if __name__ == "__main__":
    sys.exit(main())
