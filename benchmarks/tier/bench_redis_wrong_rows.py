"""Issue cases for the Redis tier with every check off: how many wrong rows an engine serves.

An engine serves table A from a local redis-server with `verify_reads = false` and `check = false`, and every
gathered row is compared with the row regenerated from A's own source (tests/test_faults.py's `Run`, not read
back from Redis). Cases, in order: A served; table B (same shape, other rows) loaded into the prefix the engine
serves; A loaded again (nothing wrong may stay cached); B then A loaded live while the engine steps. Prints
wrong rows, lookups served and gathers refused per case; 0 wrong rows is the only acceptable count. Not a
timing: it runs in well under a minute.

    PYTHONPATH=src .venv/bin/python benchmarks/tier/bench_redis_wrong_rows.py
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))

import test_faults as F  # noqa: E402  (the fault suite's Run and control file: one definition of a wrong row)

from slacktier.config import RedisOptions  # noqa: E402
from slacktier.engine import StepEngine  # noqa: E402
from slacktier.store.redis.loader import load_manifest  # noqa: E402
from slacktier.tables.stage import stage_synthetic  # noqa: E402
from slacktier.testing.store import RedisServer  # noqa: E402


def main() -> None:
    """Run the cases and print one line each, then the total."""
    work = Path(tempfile.mkdtemp(prefix="bench-redis-wrong-"))
    server = None
    try:
        a = stage_synthetic([work / "a.bin"], F.ROWS, 2, 11, progress=False)
        b = stage_synthetic([work / "b.bin"], F.ROWS, 2, 12, progress=False)
        (work / "redis").mkdir()
        server = RedisServer(work / "redis")
        opts = RedisOptions(url=server.url, prefix="p")
        load_manifest(opts, a, tag_buckets=8)
        engine = StepEngine.from_config(F.control(a, "redis", opts, verify_reads=False, check=False,
                                                  wait_timeout_ms=5000.0))
        run = F.Run(engine, a, seed=1)

        def live(*manifests) -> None:
            for m in manifests:
                t = threading.Thread(target=load_manifest, args=(opts, m), kwargs={"tag_buckets": 8})
                t.start()
                while t.is_alive():
                    run.step()
                t.join()
            run.steps(10)

        cases = [("A served", lambda: run.steps(20)),
                 ("B loaded into the served prefix", lambda: (load_manifest(opts, b, tag_buckets=8), run.steps(20))),
                 ("A loaded again", lambda: (load_manifest(opts, a, tag_buckets=8), run.steps(20))),
                 ("B then A loaded live while stepping", lambda: live(b, a))]
        for name, act in cases:
            w, n, e = run.wrong, run.lookups, len(run.errors)
            act()
            first = str(run.errors[e]).split(". Fix:")[0] if len(run.errors) > e else "-"
            print(f"{name:38s} wrong rows {run.wrong - w:7d} of {run.lookups - n:7d} served, "
                  f"{len(run.errors) - e:3d} gathers refused; first: {first[:110]}")
        engine.close()
        print(f"total: {run.wrong} wrong rows of {run.lookups} lookups served (verify_reads = false, check = false)")
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
