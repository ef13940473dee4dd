"""Where begin_step's time goes outside the compiled pass: one V4.1 rank, engines with and without an admission rule.

`bench_host_pass.py`'s rank engine (rank 3 of TP4, both V4.1 layers' shards as
sparse files read through io_uring, a 1M-row cache split 0.5/0.5, evict-ahead),
one engine per rule in `--rules` beside a plain one ("off"), all in one process,
replaying the built-in agent traffic at B = `--batch`: prefill chunks and part-batch
steps warm each cache untimed, and each full decode step is timed on every engine
in turn (engines interleaved step by step, each timed step after a 96 MiB cache
flush, as after the model's forward). Every step passes its decode flags, as the
SGLang and vLLM plug-ins do.

begin_step is timed in parts by a copy of its body with clock readings between
them (`split_step`, which must follow `StepEngine.begin_step`; it also knows the
form before the pass made the heat codes, to time an earlier tree). The parts:
- `ids`: the ids' check (`_step_ids`);
- `flags`: the decode flags as the pass takes them (`configure.step_flags`; before
  the pass made the heat codes itself, `configure.step_heat`, which made them in numpy);
- `start`: the plan's staleness test and `CompiledPass.start`;
- `locks`: taking the lanes' locks and arming them;
- `to pass`: from the compiled call to its first layer's clock reading (the call's
  checks and numba's dispatch);
- `pass`: the compiled passes' own clock readings (resolve + submit of each layer);
- `return`: from the last layer's reading back to Python, and releasing the locks.
Printed per engine: the median of each part over the timed steps, and the total.

    PYTHONPATH=src .venv/bin/python benchmarks/engine/bench_begin_split.py [--rules counters,counters+sketch]
        [--batch 128] [--steps 150]

Run it with another checkout's `src/` first on PYTHONPATH to time that tree's begin_step (a worktree of an
earlier commit).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_host_pass as H  # noqa: E402

from slacktier.engine import configure as C  # noqa: E402
from slacktier.engine import step as S  # noqa: E402
from slacktier.tables.engram_hash import EngramLayout  # noqa: E402

ns = time.perf_counter_ns
PARTS = ("ids", "flags", "start", "locks", "to pass", "pass", "return", "total")


def split_step(engine: S.StepEngine, ids: np.ndarray, decode: np.ndarray) -> list[float]:
    """begin_step(ids, decode) with a clock reading between its parts: each part's us (PARTS, less the total)."""
    t = [ns()]
    ids = engine._step_ids(ids)
    t.append(ns())
    if hasattr(C, "step_flags"):   # the pass makes the rule's heat codes from the flags
        heat = C.step_flags(engine._admission, decode, ids.shape[0])
    else:                          # the earlier form: numpy made the codes
        heat = C.step_heat(engine.admission, decode, ids.shape[0])
    t.append(ns())
    engine._in_step = True
    engine._step += 1
    engine._tokens = ids.shape[0]
    if hasattr(engine, "_heat"):
        engine._heat = heat
    plan = engine._plan
    if plan is None or plan.cp.stale() or plan.pool is not engine._pool:
        plan = engine._plan = S._build_plan(engine)
    plan.cp.start(ids.shape[0])
    engine._taken = engine._unread = 0
    t.append(ns())
    plan.lanes.__enter__()
    t.append(ns())
    stop, _ = plan.cp.run(ids, 0, heat)
    t_ret = ns()
    plan.lanes.__exit__(None, None, None)
    t_end = ns()
    if stop != len(plan.runs):
        raise SystemExit("a layer stopped the compiled call (Python submits): not the step this bench times")
    engine._unread = stop
    engine._take_results()
    clocks = [run.clock for run in plan.runs]
    first, last = clocks[0][0], max(c[2] for c in clocks)
    counted = sum(c[2] - c[0] for c in clocks)
    return [(t[1] - t[0]) / 1e3, (t[2] - t[1]) / 1e3, (t[3] - t[2]) / 1e3, (t[4] - t[3]) / 1e3,
            (first - t[4]) / 1e3, counted / 1e3, ((t_ret - last) + (t_end - t_ret)) / 1e3, (t_end - t[0]) / 1e3]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rules", default="counters,counters+sketch", help="admission rules beside the plain engine")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--steps", type=int, default=150, help="timed decode steps per engine")
    ap.add_argument("--dir", default="runs", help="where the sparse shard files go")
    args = ap.parse_args()
    layout = EngramLayout.v41()
    names = ["off"] + [r for r in args.rules.split(",") if r and r != "off"]
    Path(args.dir).mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        engines = {}
        for name in names:
            (Path(d) / name).mkdir()
            engines[name] = H.build_rank_engine(layout, Path(d) / name, 1_000_000, 3, 4096, evict_ahead=True,
                                                admission=name)[0]
        replays = {name: H.agent_steps(layout, args.batch, 0) for name in names}
        got: dict[str, list[list[float]]] = {name: [] for name in names}
        while min(len(g) for g in got.values()) < args.steps + 10:   # the first 10 warm the interpreter
            for name in names:
                engine = engines[name]
                while True:
                    st = next(replays[name])
                    ids = np.ascontiguousarray(st.ids)
                    if st.kind == "decode" and st.num_tokens == args.batch:
                        break
                    H.warm(engine, ids, st.is_decode)
                H.flush_caches()
                got[name].append(split_step(engine, ids, st.is_decode))
                for layer in engine.layers:
                    engine.gather(layer)
                engine.end_step()
        for engine in engines.values():
            engine.close()
    when = time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())
    print(f"begin_step in parts, agent traffic, rank 3 of TP4 (V4.1), B={args.batch}, evict-ahead, {args.steps} "
          f"cold steps per engine, engines interleaved step by step; {when}; package: {Path(S.__file__).parents[2]}")
    print("| engine | " + " | ".join(PARTS) + " |")
    print("|---|" + "---:|" * len(PARTS))
    for name in names:
        med = np.median(np.array(got[name][10:]), axis=0)
        print(f"| {name} | " + " | ".join(f"{v:.1f}" for v in med) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
