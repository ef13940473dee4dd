"""Issue 34 on the command line: each bad input is refused in a subprocess with exit code 2, exactly one line
on stderr naming what is wrong (no traceback, no usage block), nothing on stdout and nothing written."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

TIERS = ('[[tier]]\nname = "dram"\nintercept_ms = 0.01\npage_ms = 0.00001\n'
         '[[tier]]\nname = "disk"\nintercept_ms = 0.30\npage_ms = {page_ms}\ncontention_page_ms = 0.00037\n'
         'holds_table = {holds}\n')
CURVES = {"workload": "agent", "batch": 128, "layers": {"1": {"capacity_rows": [0, 1000], "pages_per_step": [30, 3]}}}


def _refused(argv: list[str], cwd: Path, starts: str) -> str:
    res = subprocess.run([sys.executable, "-m", "slacktier.cli", *argv], capture_output=True, text=True,
                         timeout=300, cwd=cwd)
    assert res.returncode == 2, res.stderr
    assert res.stdout == "" and "Traceback" not in res.stderr and res.stderr.count("\n") == 1, res.stderr
    assert res.stderr.startswith(starts), res.stderr
    assert "Fix: " in res.stderr
    return res.stderr


def _plan(tmp_path: Path, *extra: str, page_ms: str = "0.00305", holds: str = "false",
          curves: dict | None = None) -> list[str]:
    (tmp_path / "tiers.toml").write_text(TIERS.format(page_ms=page_ms, holds=holds))
    (tmp_path / "curves.json").write_text(json.dumps(curves or CURVES))
    return ["plan", "--table", "1=l1.json:1000", "--tiers", str(tmp_path / "tiers.toml"), "--curves",
            str(tmp_path / "curves.json"), "--out", str(tmp_path / "out" / "control.toml"), *extra]


PLAN_CASES = [
    (dict(extra=("--window", "1=0.5", "--cache-rows", "100", "--target-ms", "nan")),
     "[bad_input] --target-ms 'nan' is not a finite number in 0..1e+06"),
    (dict(extra=("--window", "1=0.5", "--cache-rows", "100", "--target-ms", "inf")),
     "[bad_input] --target-ms 'inf' is not a finite number"),
    (dict(extra=("--window", "1=0.5", "--cache-rows", "100", "--target-ms", "-1")),
     "[bad_input] --target-ms '-1' is not a finite number"),
    (dict(extra=("--window", "1=0.5", "--cache-rows", "1e400", "--target-ms", "1")),
     "[bad_input] --cache-rows '1e400' is not a whole number"),
    (dict(extra=("--window", "1=0.5", "--cache-rows", "100", "--target-ms", "1", "--kappa-ms", "nan")),
     "[bad_input] --kappa-ms 'nan' is not a finite number"),
    (dict(extra=("--window", "1=nan", "--cache-rows", "100", "--target-ms", "1")),
     "[bad_input] --window 1=MS 'nan' is not a finite number"),
    (dict(extra=("--window", "1=0.5", "--cache-rows", "100", "--target-ms", "1"), page_ms="nan"),
     "[bad_input] {tiers}: tier 'disk': read-time term page_ms = nan is not a finite number in 0..1e+06 ms"),
    (dict(extra=("--window", "1=0.5", "--cache-rows", "100", "--target-ms", "1"), page_ms="inf"),
     "[bad_input] {tiers}: tier 'disk': read-time term page_ms = inf"),
    (dict(extra=("--window", "1=0.5", "--cache-rows", "100", "--target-ms", "1"), page_ms="1e300"),
     "[bad_input] {tiers}: tier 'disk': read-time term page_ms = 1e+300"),
    (dict(extra=("--window", "1=0.5", "--cache-rows", "100", "--target-ms", "1"), page_ms="true"),
     "[bad_input] {tiers}: tiers document: tier 'disk': page_ms = True is not a number"),
    (dict(extra=("--window", "1=0.5", "--cache-rows", "100", "--target-ms", "1"), holds='"false"'),
     "[bad_input] {tiers}: tiers document: tier 'disk': holds_table = 'false', want true or false"),
    (dict(extra=("--window", "1=0.5", "--cache-rows", "100", "--target-ms", "1"),
          curves={"layers": {"1": {"capacity_rows": [0, 1000], "pages_per_step": [30, float("nan")]}}}),
     "[bad_input] miss curve layers.1.pages_per_step holds nan"),
    (dict(extra=("--window", "1=0.5", "--cache-rows", "100", "--target-ms", "1"),
          curves={"layers": {"1": {"capacity_rows": [0, True], "pages_per_step": [30, 3]}}}),
     "[bad_input] miss curve layers.1.capacity_rows holds True"),
]


@pytest.mark.parametrize("case,said", PLAN_CASES, ids=[s[:40] for _, s in PLAN_CASES])
def test_plan_refuses_non_finite_or_out_of_range_inputs(tmp_path, case, said) -> None:
    argv = _plan(tmp_path, *case["extra"], **{k: v for k, v in case.items() if k != "extra"})
    _refused(argv, tmp_path, "slacktier plan: error: " + said.replace("{tiers}", str(tmp_path / "tiers.toml")))
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("args,said", [
    (["--layers", "a"], "[bad_input] cannot read --layers 'a': not whole numbers"),
    (["--layers", "1,1"], "[bad_input] --layers '1,1' lists a layer twice"),
    (["--layers", str(10**30)], "[bad_input] --layers '1000000000000000000000000000000' lists a layer twice or one "
                                "outside 0..2147483647"),
    (["--metrics-port", "70000"], "[bad_input] --metrics-port '70000' is not a whole number in 0..65535"),
    (["--metrics-port", "x"], "[bad_input] --metrics-port 'x' is not a whole number"),
    (["--metrics-port", "9400", "--metrics-addr", "every-interface"],
     "[bad_input] metrics address 'every-interface' is not an IP address"),
    (["--rows", "0"], "[bad_input] --rows '0' is not a whole number in 1.."),
    (["--rows", "1.5"], "[bad_input] --rows '1.5' is not a whole number"),
])
def test_demo_refuses_bad_arguments_before_staging(tmp_path, args, said) -> None:
    _refused(["demo", "--out", str(tmp_path / "demo"), "--no-progress", *args], tmp_path,
             f"slacktier demo: error: {said}")
    assert not (tmp_path / "demo").exists()


def test_demo_refuses_a_metrics_port_in_use_before_staging(tmp_path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        _refused(["demo", "--out", str(tmp_path / "demo"), "--no-progress", "--metrics-port", str(port)], tmp_path,
                 f"slacktier demo: error: [unavailable] cannot serve metrics on 127.0.0.1 port {port}: ")
    assert not (tmp_path / "demo").exists()
