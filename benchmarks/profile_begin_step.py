"""Where `begin_step`'s time goes: py-spy samples of a step loop, summarized per function, for one or two trees.

The loop is `_ab_worker.py`'s begin_step setting (one TP4 rank of the V4.1
tables, owned_only, B = 128, 1M cache rows per layer, sparse disk regions):
after a warm-up it alternates decode steps of new tokens (misses, pages
submitted) for `--seconds`. py-spy (pip's `py-spy`, in the bench extra) samples
it with native frames; only samples inside `StepEngine.begin_step` count.
Printed per tree: the share of those samples in each function (inclusive and
self), numba-compiled code shown as `[compiled]`.

    .venv/bin/pip install -e ".[bench]"     # py-spy
    .venv/bin/python benchmarks/profile_begin_step.py [--before /tmp/hot_before] [--seconds 20] [--append]
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

sys.path.insert(0, str(Path(__file__).resolve().parent))

SECTION = "## The tier: page sources, cache and step engine"
SUBSECTION = "### Hot path against issue 14's targets"


def loop(seconds: float) -> None:
    """The profiled process: build the rank engine, warm it, then decode new tokens for `seconds`."""
    import _ab_worker as W
    from slacktier.tables.engram_hash import EngramLayout

    batch, warm_steps, steps = 128, 64, 200
    layout = EngramLayout.v41()
    ids = W._ids(layout, batch, warm_steps + steps)
    with tempfile.TemporaryDirectory(dir=os.environ.get("AB_DIR") or None) as tmp:
        engine = W.rank_engine(layout, Path(tmp), batch)

        def step(t: int) -> None:
            engine.begin_step(ids[t])
            for layer in engine.layers:
                engine.gather(layer)
            engine.end_step()

        for t in range(warm_steps):
            step(t)
        print("READY", flush=True)   # the parent starts sampling here
        end = time.monotonic() + seconds
        k = 0
        while time.monotonic() < end:
            step(warm_steps + k % steps)
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
        return "[compiled]"   # numba's JIT code has no symbols
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
    rows = [(name, 100 * v / total, 100 * own[name] / total) for name, v in incl.most_common(top)]
    return total, rows


def profile(tree: Path, seconds: float, out: Path) -> tuple[int, list[tuple[str, float, float]]]:
    """Run the loop under `tree`'s package with py-spy attached once it is warm."""
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    env = dict(os.environ, PYTHONPATH=f"{tree / 'src'}{os.pathsep}{Path(__file__).resolve().parent}")
    child = subprocess.Popen([sys.executable, __file__, "--loop", str(seconds)], env=env, stdout=subprocess.PIPE,
                             text=True)
    assert child.stdout is not None
    for line in child.stdout:
        if line.startswith("READY"):
            break
    subprocess.run([spy, "record", "--native", "-r", "1000", "-f", "raw", "-o", str(out), "--pid",
                    str(child.pid), "--duration", str(int(seconds))], check=True, capture_output=True)
    child.wait()
    return summarize(out, 14)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", type=Path, help="also profile this earlier tree")
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--loop", type=float, help=argparse.SUPPRESS)
    ap.add_argument("--append", action="store_true")
    args = ap.parse_args()
    if args.loop is not None:
        loop(args.loop)
        return 0
    root = Path(__file__).resolve().parents[1]
    trees = ([("before", args.before.resolve())] if args.before else []) + [("after", root)]
    blocks = []
    for name, tree in trees:
        commit = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, check=False).stdout.strip()
        label = f"{name} ({'working tree of ' if name == 'after' else ''}commit {commit})"
        total, rows = profile(tree, args.seconds, root / "runs" / f"profile_begin_step_{name}.txt")
        text = [f"{label}: {total} samples inside begin_step (py-spy --native, 1000 Hz, {args.seconds:.0f} s)",
                f"{'incl %':>7} {'self %':>7}  function"]
        text += [f"{i:7.1f} {s:7.1f}  {fn}" for fn, i, s in rows]
        blocks.append("\n".join(text))
        print(blocks[-1], flush=True)
    if args.append:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from _common import append_to_section, command_line, machine, utc_stamp
        block = (f"#### Profile of begin_step, {utc_stamp()}\n\n`{command_line(__file__)}`; {machine()}. Decode "
                 "steps of new tokens, one TP4 rank, B = 128.\n\n```\n" + "\n\n".join(blocks) + "\n```\n")
        append_to_section(block, SECTION, SUBSECTION)
    return 0


if __name__ == "__main__":
    sys.exit(main())
