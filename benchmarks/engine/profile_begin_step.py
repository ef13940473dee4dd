"""Where begin_step's time goes: py-spy samples of one V4.1 rank's step loop, per function, for one or two trees.

The loop is `bench_host_pass.py`'s uncached engine: rank 3 of TP4, both layers' shards as sparse files read
through the io_uring device queue, a 1M-row cache split 0.5/0.5 and filled, then decode steps of 768 fresh
lookups per layer (B = 128) for `--seconds`. py-spy (pip's `py-spy`, the bench extra) samples it with
native frames once it is warm; only samples inside `StepEngine.begin_step` count. Printed per tree: the
share of those samples in each function (inclusive and self); numba's compiled code has no symbols and shows
as `[compiled]`, the C helper's functions by name.

    .venv/bin/python benchmarks/engine/profile_begin_step.py [--before /path/to/other/tree] [--seconds 20]

`--before` runs the same loop on another checkout's `src/` (a worktree of an earlier commit): the engine
builder works with both.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


def loop(seconds: float) -> None:
    """The profiled process: build and fill the rank engine, then step on fresh rows for `seconds`."""
    import numpy as np

    import bench_host_pass as H
    from slacktier.tables.engram_hash import EngramLayout

    layout = EngramLayout.v41()
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory(dir=ROOT / "runs") as tmp:
        engine, shards = H.build_rank_engine(layout, Path(tmp), 1_000_000, 3, 4096)
        for _ in range(25):
            H.warm(engine, H.random_ids(layout, shards, 3, 4096, rng))
        steps = [H.random_ids(layout, shards, 3, 128, rng) for _ in range(400)]
        for ids in steps[:50]:
            H.warm(engine, ids)
        print("READY", flush=True)   # the parent starts sampling here
        end = time.monotonic() + seconds
        k = 0
        while time.monotonic() < end:
            H.warm(engine, steps[50 + k % 350] + 0)
            k += 1
        print(f"steps {k}", flush=True)
        engine.close()


def _name(frame: str) -> str:
    """'StepEngine.begin_step (slacktier/engine/step.py:416)' -> 'StepEngine.begin_step (step.py)'."""
    m = re.match(r"(.*) \((.*?)(?::\d+)?\)$", frame)
    if not m:
        return frame
    fn, where = m.groups()
    if fn.startswith("0x") and where == "?":
        return "[compiled]"
    return f"{fn} ({Path(where).name})"


def summarize(raw: Path, top: int) -> tuple[int, list[tuple[str, float, float]]]:
    """Samples inside begin_step, and the top functions by inclusive share with their self share (%)."""
    incl: collections.Counter[str] = collections.Counter()
    own: collections.Counter[str] = collections.Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        frames = stack.split(";")
        at = next((i for i, f in enumerate(frames) if f.startswith("StepEngine.begin_step ")), None)
        if at is None:
            continue
        names = [_name(f) for f in frames[at:]]
        total += int(n)
        own[names[-1]] += int(n)
        for name in set(names):
            incl[name] += int(n)
    return total, [(name, 100 * v / total, 100 * own[name] / total) for name, v in incl.most_common(top)]


def profile(tree: Path, seconds: float, out: Path) -> tuple[int, int, list[tuple[str, float, float]]]:
    """(steps, samples inside begin_step, rows) of the loop on `tree`'s package."""
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    env = dict(os.environ, PYTHONPATH=f"{tree / 'src'}{os.pathsep}{HERE}")
    child = subprocess.Popen([sys.executable, __file__, "--loop", str(seconds)], env=env, stdout=subprocess.PIPE,
                             text=True)
    assert child.stdout is not None
    for line in child.stdout:
        if line.startswith("READY"):
            break
    subprocess.run([spy, "record", "--native", "-r", "1000", "-f", "raw", "-o", str(out), "--pid", str(child.pid),
                    "--duration", str(int(seconds))], check=True, capture_output=True)
    steps = next((int(line.split()[1]) for line in child.stdout if line.startswith("steps ")), 0)
    child.wait()
    return (steps, *summarize(out, 16))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", type=Path, help="also profile this checkout (an earlier commit's worktree)")
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--loop", type=float, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.loop is not None:
        loop(args.loop)
        return 0
    if not (shutil.which("py-spy") or Path(sys.executable).with_name("py-spy").exists()):
        print("py-spy not found: pip install -e '.[bench]'", file=sys.stderr)
        return 2
    trees = ([("before", args.before.resolve())] if args.before else []) + [("after", ROOT)]
    for name, tree in trees:
        commit = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, check=False).stdout.strip()
        (ROOT / "runs").mkdir(exist_ok=True)
        steps, total, rows = profile(tree, args.seconds, ROOT / "runs" / f"profile_begin_step_{name}.txt")
        print(f"{name} (commit {commit}{', working tree' if name == 'after' else ''}): {total} samples inside "
              f"begin_step over {steps} steps (py-spy --native, 1000 Hz, {args.seconds:.0f} s): "
              f"{1e3 * total / max(steps, 1):.0f} us of begin_step per step as sampled")
        print(f"{'incl %':>7} {'self %':>7}  function")
        for fn, i, s in rows:
            print(f"{i:7.1f} {s:7.1f}  {fn}")
        print(flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
