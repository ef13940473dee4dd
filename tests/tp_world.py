"""TP worlds for tests/test_tp_ranks.py: the engine's modules imported once, then one forked process per rank.

    python tp_world.py WORKER.py --world N [the worker's own flags, without --rank] [--next --world N ...]

A rank worker spends most of its time here importing its engine (SGLang's or
vLLM's model modules). This process imports them once (the worker's
`preload()`), then forks N children, as a DataLoader forks its workers after
torch is imported. Each child is a rank of its own: its own pid, its own
process group on gloo, its output in <out>/rank<r>.log; it runs the worker's
`main()` with `--rank r` and exits with its code. This process waits for all of
them and writes <out>/exits.json: each rank's exit status as subprocess reports
it (negative: the signal that ended it, -9 for a rank killed mid-step).

`--next` starts another world's flags (its own --world, --init and --out): the
worlds run one after another from the same import, each only once the one
before it has ended.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import traceback
from pathlib import Path


def worlds(args: list[str]) -> list[list[str]]:
    """Each world's flags: `args` split at every --next."""
    out = [[]]
    for a in args:
        if a == "--next":
            out.append([])
        else:
            out[-1].append(a)
    return out


def main() -> int:
    worker_path = Path(sys.argv[1])
    spec = importlib.util.spec_from_file_location("tp_rank_worker_module", worker_path)
    worker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(worker)
    worker.preload()
    for rest in worlds(sys.argv[2:]):
        run_world(worker, worker_path, rest)
    return 0


def run_world(worker, worker_path: Path, rest: list[str]) -> None:
    """Fork the world's ranks, wait for every one, and write their exit statuses to <out>/exits.json."""
    world = int(rest[rest.index("--world") + 1])
    out = Path(rest[rest.index("--out") + 1])
    out.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    children = {}
    for rank in range(world):
        pid = os.fork()
        if pid == 0:   # the rank: its output to its own log, then the worker as if started with --rank
            code = 1
            try:
                log = os.open(out / f"rank{rank}.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                os.dup2(log, 1)
                os.dup2(log, 2)
                sys.argv = [str(worker_path), "--rank", str(rank), *rest]
                code = worker.main()
            except BaseException:   # the rank's log says why; the test reads its missing report and exit
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        children[pid] = rank
    exits = {}
    while children:
        pid, status = os.wait()
        if pid in children:
            exits[children.pop(pid)] = os.waitstatus_to_exitcode(status)
    (out / "exits.json").write_text(json.dumps({str(r): exits[r] for r in sorted(exits)}))


if __name__ == "__main__":
    sys.exit(main())
