"""begin_step and end_step of an earlier commit's StepEngine beside the current one, in one process.

The earlier commit's `engine/step.py` (and its `engine/steppass.py`, the compiled
entry whose plan it fills, where it has one) is loaded from git as a module of its own
and runs on this tree's cache, directory pass and sources (its `resolve` call
with flat ids still works: the pass takes them as one row). Each class drives
its own engine (one TP4 rank of the V4.1 tables, owned_only, B = 128, 2M cache
rows, sparse disk regions: `_ab_worker.py begin_step`'s setting), and every
step runs once on each engine in shuffled order, so the machine's drift
between fast and slow phases falls on both alike, which separate processes
(`bench_hot_path.py`) cannot promise. What differs is only the engine's own
Python around the pass: where each step's work is done, not the pass itself.

Warm: the last 30 positions of the warm-up looked up again, `--rounds` times
(all hits). Fresh: 60 decode steps of new tokens (misses, pages submitted).
Thread CPU time of begin_step and of end_step (us).

    .venv/bin/python benchmarks/bench_step_ab.py --against dc3681f [--rounds 4] [--append]
"""

from __future__ import annotations

import argparse
import importlib.util
import random
import statistics
import sys
import tempfile
import types
from pathlib import Path

from _common import against_main, command_line, git_show, machine, utc_stamp

sys.path.insert(0, str(Path(__file__).parent))
import _ab_worker as W  # noqa: E402

import slacktier.engine.step as S  # noqa: E402
from slacktier.tables.engram_hash import EngramLayout  # noqa: E402

SECTION = "## The tier: page sources, cache and step engine"
SUBSECTION = "### Hot path against issue 14's targets"
WARM_STEPS, FRESH_STEPS, SPAN = 64, 60, 30


def old_engine_class(commit: str, tmp: Path) -> tuple[type, types.ModuleType | None]:
    """StepEngine as `commit` wrote it (module `step_<commit>`), with that commit's compiled entry where it has
    one (`engine/steppass.py` as module `steppass_<commit>`, compiled afresh in `tmp`, uncached): the plan's
    layout goes with the engine code that fills it. Commits before the entry run on this tree's modules."""
    sp = None
    text = git_show(commit, "src/slacktier/engine/steppass.py", missing_ok=True)
    if text is not None:
        path = tmp / f"steppass_{commit}.py"   # numba compiles from a file; uncached, so nothing stale is loaded
        path.write_text(text.replace("cache=True", "cache=False"))
        spec = importlib.util.spec_from_file_location(path.stem, path)
        sp = importlib.util.module_from_spec(spec)
        sys.modules[path.stem] = sp
        spec.loader.exec_module(sp)
    name = f"step_{commit}"
    mod = types.ModuleType(name)
    mod.__file__ = f"{name}.py"
    sys.modules[name] = mod   # its dataclasses look themselves up there
    exec(compile(git_show(commit, "src/slacktier/engine/step.py"), mod.__file__, "exec"), mod.__dict__)
    if sp is not None:
        mod.SP = sp   # its begin_step calls its own compiled entry
    return mod.StepEngine, sp


def measure(commit: str, rounds: int) -> dict[str, dict[str, list[float]]]:
    layout = EngramLayout.v41()
    ids = W._ids(layout, 128, WARM_STEPS + FRESH_STEPS)
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        classes = {commit: old_engine_class(commit, tmp)[0], "current": S.StepEngine}
        out = {name: {k: [] for k in ("warm", "warm_end", "fresh", "fresh_end")} for name in classes}
        engines = {name: W.rank_engine(layout, tmp, tag=f"-{k}", engine_cls=cls)
                   for k, (name, cls) in enumerate(classes.items())}

        def step(name: str, t: int, kind: str | None) -> None:
            begin, end, _ = W.timed_step(engines[name], ids[t])
            if kind:
                out[name][kind].append(begin)
                out[name][f"{kind}_end"].append(end)

        order = list(engines)
        try:
            for t in range(WARM_STEPS):
                for name in order:
                    step(name, t, None)
            for _ in range(rounds):
                for t in range(WARM_STEPS - SPAN, WARM_STEPS):
                    random.shuffle(order)
                    for name in order:
                        step(name, t, "warm")
            for t in range(WARM_STEPS, WARM_STEPS + FRESH_STEPS):
                random.shuffle(order)
                for name in order:
                    step(name, t, "fresh")
        finally:
            for e in engines.values():
                e.close()
    return out


def report(out: dict, commit: str, args: argparse.Namespace) -> str:
    med = statistics.median
    rows = []
    for kind, label in (("warm", "begin_step, warm cache"), ("warm_end", "end_step after the warm steps"),
                        ("fresh", "begin_step, fresh tokens"), ("fresh_end", "end_step after the fresh steps")):
        a, b = out[commit][kind], out["current"][kind]
        rows.append(f"| {label} | {min(a):.1f} / {med(a):.1f} / {max(a):.1f} | {min(b):.1f} / {med(b):.1f} / "
                    f"{max(b):.1f} | {med(b) / med(a):.2f} | {med(b) - med(a):+.1f} |")
    return "\n".join([
        f"#### begin_step's Python, {commit} beside the current engine in one process, {utc_stamp()}",
        "",
        f"`{command_line(__file__, sys.argv[1:])}`; {machine()}; {args.rounds} rounds x {SPAN} warm steps and "
        f"{FRESH_STEPS} fresh steps per engine, the two engines' steps in shuffled order; thread CPU (us).",
        "",
        f"| what ran | {commit} (min / median / max) | current (min / median / max) | current / {commit} | "
        "difference (us, median) |",
        "|---|---|---|---|---|",
        *rows,
    ])


def main() -> int:
    return against_main(__doc__, "engine/step.py", 4, SECTION, SUBSECTION, measure, report)


if __name__ == "__main__":
    raise SystemExit(main())
