"""The GPU check scripts' CPU rehearsal: benchmarks/engine/gpu_check_sglang.py and gpu_check_vllm.py with --cpu.

Each script runs in its own process, as on the device machine (one engine per
process), with the engines' folder appended to its path and its output in a file
(nothing waits on a pipe). Everything but the device calls runs: the tiny
checkpoint it makes and stages, the engine's own tables and lookup against the
plug-in loaded through the engine's own loader (rows bit for bit, the plug-in
active, a table of another checkpoint mismatching), the breakable capture and
its replays (recorded segments in place of CUDA graphs), the timing loop. A
part's line says PASS only when its own checks held, its negative control
included; the lines are checked here too.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from engines import ENGINES_DIR, SGLANG_VERSION, VLLM_VERSION, skip_reason

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.parametrize("engine, dist, version, parts", [
    ("sglang", "sglang", SGLANG_VERSION, ("rows", "bcg", "time", "ple")),
    ("vllm", "vllm", VLLM_VERSION, ("rows", "bcg", "time", "ple")),
])
def test_cpu_rehearsal_passes_every_part(engine, dist, version, parts, tmp_path):
    reason = skip_reason(dist, version)
    if reason:
        pytest.skip(reason)
    log = tmp_path / "log.txt"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    env.pop("OUT", None)
    with open(log, "w") as out:
        rc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "engine" / f"gpu_check_{engine}.py"), "--cpu",
                             "--engines", str(ENGINES_DIR), "--out", str(tmp_path / "out")], stdout=out,
                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, timeout=600).returncode
    text = log.read_text()
    found = dict(re.findall(r"^PART (\w+) (\w+) ", text, flags=re.M))
    assert rc == 0 and found == {part: "PASS" for part in parts}, text[-6000:]
    assert re.search(rf"^SUMMARY {len(parts)} parts, 0 failed$", text, flags=re.M)
    rows = re.search(r"^PART rows PASS .*mismatches 0;.*negative control \(other checkpoint\) mismatches (\d+)",
                     text, flags=re.M)
    assert rows and int(rows.group(1)) > 0
    bcg = re.search(r"^PART bcg PASS .*replayed rows (\d+) mismatches 0; rows changed between replays (\d+)", text,
                    flags=re.M)
    assert bcg and int(bcg.group(1)) > 0 and int(bcg.group(2)) > 0
    assert (tmp_path / "out" / "summary.txt").read_text().splitlines()[-1] == f"SUMMARY {len(parts)} parts, 0 failed"


def test_entry_point_is_written_where_the_package_is_not_installed(tmp_path):
    """On the device machine the package travels as src/ with no dist-info: the scripts write the entry point the
    engine's loader looks for (here a group of its own, so the installed package's entry points do not answer)."""
    from importlib import metadata

    sys.path.insert(0, str(ROOT / "benchmarks" / "engine"))
    try:
        import gpu_check_common as common

        group = "slacktier.gpu_check_test"
        assert not [ep for ep in metadata.entry_points(group=group)]   # nothing there before
        note = common.ensure_entry_point(group, "slacktier.adapters.vllm:register", tmp_path)
        found = [ep for ep in metadata.entry_points(group=group) if ep.name == "slacktier"]
        from slacktier.adapters import vllm

        assert note and len(found) == 1 and found[0].load() is vllm.register
        assert common.ensure_entry_point(group, "slacktier.adapters.vllm:register", tmp_path) is None
    finally:
        sys.path.remove(str(ROOT / "benchmarks" / "engine"))
        if str(tmp_path) in sys.path:
            sys.path.remove(str(tmp_path))
