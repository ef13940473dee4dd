"""begin_step of two checkouts side by side: the same cold step loop on each tree's package, in alternating rounds.

A change to the host pass is judged against the commit before it on the same
machine in the same minutes (this VM is shared, and its speed drifts by tens of
percent within an hour). Each round runs one fresh process per tree, in turn
(the order alternates between rounds): the uncached rank engine of
`bench_host_pass.py` (rank 3 of TP4, both V4.1 layers' shards as sparse files
read through io_uring, a 1M-row cache split 0.5/0.5 and filled), then
`--steps` decode steps of `--batch` fresh tokens, each begin_step timed after a
96 MiB cache flush, as after the model's forward. With `--traffic agent` the
steps are the built-in agent traffic's instead (`bench_host_pass.agent_steps`,
the same sessions for both trees): prefill chunks and part-batch steps fill
the cache untimed, and only full decode steps of `--batch` tokens are timed, so
begin_step runs at that traffic's hit rate. Printed: each round's median
begin_step per tree and the ratio after / before of that round; the summary is
the median and range of those ratios. Each process's directories get
transparent huge pages or not as the kernel has them free, which moves its
begin_step by tens of percent; the share is printed beside each round.

`--admission RULE` serves that rule, and `--flags` passes each step's decode flags
to begin_step (prefill chunks flagged as prefill), as the plug-ins do.

    .venv/bin/python benchmarks/engine/bench_begin_step_trees.py --before /path/to/worktree [--rounds 4]
        [--traffic agent] [--evict-ahead] [--admission counters+sketch] [--flags]

Make the "before" tree with `git worktree add /tmp/before <commit>`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


def _timed(engine, ids, decode=None) -> float:
    """One step with its begin_step timed after a cache flush (us); `decode`: its tokens' flags, when given."""
    import bench_host_pass as H

    H.flush_caches()
    t0 = time.perf_counter_ns()
    if decode is None:
        engine.begin_step(ids)
    else:
        engine.begin_step(ids, decode)
    t1 = time.perf_counter_ns()
    for layer in engine.layers:
        engine.gather(layer)
    engine.end_step()
    return (t1 - t0) / 1e3


def loop(batch: int, steps: int, evict_ahead: bool, traffic: str, admission: str, flags: bool) -> None:
    """The child: build and fill the rank engine, time `steps` cold begin_steps, print them as JSON."""
    import numpy as np

    import bench_host_pass as H
    from slacktier.cache.rowcache import huge_page_share
    from slacktier.tables.engram_hash import EngramLayout

    layout = EngramLayout.v41()
    rng = np.random.default_rng(0)
    (ROOT / "runs").mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory(dir=ROOT / "runs") as tmp:
        engine, shards = H.build_rank_engine(layout, Path(tmp), 1_000_000, 3, 4096, evict_ahead=evict_ahead,
                                             admission=admission)
        times = []
        if traffic == "uncached":
            for _ in range(25):   # fill the cache
                H.warm(engine, H.random_ids(layout, shards, 3, 4096, rng))
            for k in range(steps + 10):   # the first 10 warm the interpreter and the rings
                t = _timed(engine, H.random_ids(layout, shards, 3, batch, rng),
                           np.ones(batch, dtype=bool) if flags else None)
                if k >= 10:
                    times.append(t)
        else:
            decode = 0
            for st in H.agent_steps(layout, batch, 0):
                ids = np.ascontiguousarray(st.ids)
                if st.kind != "decode" or st.num_tokens != batch:
                    H.warm(engine, ids, st.is_decode if flags else None)   # they fill the cache, untimed
                    continue
                t = _timed(engine, ids, st.is_decode if flags else None)
                decode += 1
                if decode > 10:   # the first 10 warm the interpreter and the rings
                    times.append(t)
                if len(times) == steps:
                    break
        huge = [huge_page_share(engine.cache.layer(layer).directory) for layer in engine.layers]
        engine.close()
    print(json.dumps({"times": times, "huge": huge}))


def run_tree(tree: Path, args: argparse.Namespace) -> dict:
    env = dict(os.environ, PYTHONPATH=f"{tree / 'src'}{os.pathsep}{HERE}")
    cmd = [sys.executable, __file__, "--child", "--batch", str(args.batch), "--steps", str(args.steps),
           "--traffic", args.traffic, "--admission", args.admission]
    if args.evict_ahead:
        cmd.append("--evict-ahead")
    if args.flags:
        cmd.append("--flags")
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def commit_of(tree: Path) -> str:
    head = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                          check=False).stdout.strip()
    dirty = subprocess.run(["git", "-C", str(tree), "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True, check=False).stdout.strip()
    return head + (" + working tree" if dirty else "")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", type=Path, help="the other checkout (a worktree of the earlier commit)")
    ap.add_argument("--after", type=Path, default=ROOT, help="default: this checkout")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--steps", type=int, default=60, help="timed steps per process")
    ap.add_argument("--evict-ahead", action="store_true")
    ap.add_argument("--traffic", choices=("uncached", "agent"), default="uncached",
                    help="random ids on a filled cache, or the built-in agent traffic's decode steps")
    ap.add_argument("--admission", default="off", help="the engine's admission rule (cache.ADMISSIONS)")
    ap.add_argument("--flags", action="store_true",
                    help="pass every step's decode flags to begin_step, as the SGLang and vLLM plug-ins do")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        loop(args.batch, args.steps, args.evict_ahead, args.traffic, args.admission, args.flags)
        return 0
    if args.before is None or not (args.before / "src" / "slacktier").is_dir():
        print("--before must name a checkout of this repository (git worktree add DIR COMMIT)", file=sys.stderr)
        return 2
    trees = {"before": args.before.resolve(), "after": args.after.resolve()}
    print(f"begin_step, {args.traffic} rank 3 of TP4 (V4.1), B={args.batch}, {args.steps} cold steps per process, "
          f"evict_ahead {'on' if args.evict_ahead else 'off'}, admission {args.admission}, decode flags "
          f"{'passed' if args.flags else 'not passed'}; before = {commit_of(trees['before'])}, after = "
          f"{commit_of(trees['after'])}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}", flush=True)
    ratios = []
    for r in range(args.rounds):
        order = ["before", "after"] if r % 2 == 0 else ["after", "before"]
        got = {name: run_tree(trees[name], args) for name in order}
        med = {name: statistics.median(g["times"]) for name, g in got.items()}
        huge = {name: "/".join("-" if h is None else f"{h:.0%}" for h in g["huge"]) for name, g in got.items()}
        ratios.append(med["after"] / med["before"])
        print(f"round {r + 1}: before {med['before']:.0f} us, after {med['after']:.0f} us (median); "
              f"after / before {ratios[-1]:.2f}x; directories in huge pages: before {huge['before']}, after "
              f"{huge['after']}", flush=True)
    print(f"after / before: median {statistics.median(ratios):.2f}x, range {min(ratios):.2f}-{max(ratios):.2f}x "
          f"over {args.rounds} rounds")
    return 0


if __name__ == "__main__":
    sys.exit(main())
