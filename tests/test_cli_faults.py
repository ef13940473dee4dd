"""Issue 33's command-line inputs: each is refused in its own process with exit code 2, exactly one line on
stderr naming the flag, key or file and the fix (no traceback), nothing on stdout, and nothing written."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from slacktier.tables.stage import stage_synthetic

SRC = Path(__file__).resolve().parents[1] / "src"
TIERS = '[[tier]]\nname = "dram"\nintercept_ms = 0.01\npage_ms = 0.00001\n'
CURVES = {"layers": {"1": {"capacity_rows": [0, 1000], "pages_per_step": [30, 3]},
                     "14": {"capacity_rows": [0, 1000], "pages_per_step": [30, 3]}}}


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> Path:
    """A staged table, its control file, and the bad files the cases point at (in `inputs`, never written to)."""
    d = tmp_path_factory.mktemp("inputs")
    m = stage_synthetic([d / "t.bin"], {1: 300, 14: 300}, 1, 0, progress=False, buffered=True)
    (d / "control.toml").write_text(f'[engine]\ncache_rows = 100\n[[table]]\nlayer = 1\nmanifest = "{m.path}"\n'
                                    f'cache_share = 0.5\n[[table]]\nlayer = 14\nmanifest = "{m.path}"\n'
                                    'cache_share = 0.5\n')
    (d / "binary.toml").write_bytes(bytes(range(256)) * 4)
    (d / "binary.json").write_bytes(bytes(range(256)) * 4)
    (d / "tiers.toml").write_text(TIERS)
    (d / "curves.json").write_text(json.dumps(CURVES))
    (d / "list.json").write_text("[1, 2]")
    for name, layers in (("layers-list", [1]), ("layers-str", "1")):
        (d / f"{name}.json").write_text(json.dumps({"layers": layers}))
    (d / "capacity-nan.json").write_text('{"layers": {"1": {"capacity_rows": [0, NaN], "pages_per_step": [3, 1]}}}')
    for name, tiers in (("tier-nan", "nan"), ("tier-inf", "inf"), ("tier-bool", "true"), ("tier-huge", "1e300")):
        (d / f"{name}.toml").write_text(f'[[tier]]\nname = "dram"\nintercept_ms = 0.01\npage_ms = {tiers}\n')
    raw = torch.from_numpy(np.random.default_rng(0).integers(0, 256, (30, 264), dtype=np.uint8))
    tensors = {"layers.1.engram.embed.weight": raw[:, :256].contiguous().view(torch.float8_e4m3fn),
               "layers.1.engram.embed.scale": raw[:, 256:].contiguous().view(torch.float8_e8m0fnu)}
    save_file(tensors, str(d / "list-metadata.safetensors"))
    _set_metadata(d / "list-metadata.safetensors", ["not", "a", "map"])
    big = {f"layers.{10**20}.engram.embed.{k.split('.')[-1]}": v for k, v in tensors.items()}
    save_file(big, str(d / "huge-layer.safetensors"))
    return d


def _set_metadata(path: Path, metadata: object) -> None:
    """Rewrite a safetensors file's __metadata__ (the header keeps its tensors' offsets)."""
    blob = path.read_bytes()
    n = int.from_bytes(blob[:8], "little")
    header = json.loads(blob[8:8 + n])
    header["__metadata__"] = metadata
    text = json.dumps(header).encode()
    text += b" " * ((8 - len(text) % 8) % 8)
    path.write_bytes(len(text).to_bytes(8, "little") + text + blob[8 + n:])


M, C, T = "{d}/t.bin.manifest.json", "{d}/control.toml", "{out}/new.bin"
PREDICT = ["--window", "1=0.5", "--window", "14=5"]
PLAN = ["plan", "--table", f"1={M}", "--table", f"14={M}", "--cache-rows", "100", "--target-ms", "1",
        "--window", "1=0.5", "--window", "14=5", "--out", "{out}/control.toml"]
CASES = [
    # stage
    (["stage", "--synthetic", "", "--target", T], "--synthetic is empty"),
    (["stage", "--synthetic", f"{10**20}=100", "--target", T], "layer id 100000000000000000000 is outside"),
    (["stage", "--synthetic", "1=100", "--ranks", "100000", "--target", T], "--ranks '100000'"),
    (["stage", "--synthetic", "1=100", "--ranks", "200", "--target", T], "layer 1 has 100 rows, fewer than its 200"),
    (["stage", "--synthetic", "1=100", "--chunk-mib", "99999999999999", "--target", T], "--chunk-mib"),
    (["stage", "--synthetic", "1=100", "--seed", str(2**70), "--target", T], "--seed '1180591620717411303424'"),
    (["stage", "--synthetic", "1=100", "--seed", "-5", "--target", T], "--seed '-5'"),
    (["stage", "--synthetic", "1=100", "--writers", "0", "--target", T], "--writers '0'"),
    (["stage", "--checkpoint", "{d}/list-metadata.safetensors", "--target", T], "its __metadata__ is list"),
    (["stage", "--checkpoint", "{d}/huge-layer.safetensors", "--target", T], "outside 0..2147483647"),
    # verify
    (["verify", M, "--rows", "-1"], "--rows '-1'"),
    (["verify", M, "--rows", str(10**12)], "--rows '1000000000000'"),
    (["verify", M, "--seed", "-1"], "--seed '-1'"),
    (["verify", M, "--checkpoint", "{d}/gone.safetensors"], "--checkpoint {d}/gone.safetensors does not exist"),
    # inspect
    (["inspect", "{d}/binary.toml"], "{d}/binary.toml"),
    (["inspect", "{d}/binary.json"], "{d}/binary.json is not JSON"),
    (["inspect", M, "--tp", "0"], "--tp '0'"),
    (["inspect", C, "--tiers", "{d}/tiers.toml", "--curves", "{d}/curves.json", "--window", "1=nan"],
     "--window 1=MS 'nan'"),
    (["inspect", C, "--tiers", "{d}/binary.toml", "--curves", "{d}/curves.json", *PREDICT],
     "tiers file {d}/binary.toml is not TOML"),
    (["inspect", C, "--tiers", "{d}/tiers.toml", "--curves", "{d}/binary.json", *PREDICT],
     "miss-curve file {d}/binary.json is not JSON"),
    (["inspect", C, "--tiers", "{d}/tiers.toml", "--curves", "{d}/curves.json", "--windows-json", "{d}/list.json"],
     "{d}/list.json is not a probe JSON"),
    (["inspect", C, "--tiers", "{d}/tiers.toml", "--curves", "{d}/curves.json", *PREDICT, "--kappa-ms", "nan"],
     "--kappa-ms 'nan'"),
    # plan
    ([*PLAN, "--tiers", "{d}/tiers.toml", "--curves", "{d}/curves.json", "--target-ms", "nan"], "--target-ms 'nan'"),
    ([*PLAN, "--tiers", "{d}/tiers.toml", "--curves", "{d}/curves.json", "--queue-depth", "0"], "--queue-depth '0'"),
    ([*PLAN, "--tiers", "{d}/tiers.toml", "--curves", "{d}/curves.json", "--queue-depth", "100000"],
     "--queue-depth '100000'"),
    ([*PLAN, "--tiers", "{d}/tiers.toml", "--curves", "{d}/curves.json", "--io-threads", "-1"], "--io-threads '-1'"),
    *[([*PLAN, "--tiers", f"{{d}}/tier-{k}.toml", "--curves", "{d}/curves.json"], f"tier 'dram': {said}")
      for k, said in (("nan", "read-time term page_ms = nan"), ("inf", "read-time term page_ms = inf"),
                      ("bool", "page_ms = True is not a number"), ("huge", "read-time term page_ms = 1e+300"))],
    ([*PLAN, "--tiers", "{d}/tiers.toml", "--curves", "{d}/layers-list.json"], "`layers` is list"),
    ([*PLAN, "--tiers", "{d}/tiers.toml", "--curves", "{d}/layers-str.json"], "`layers` is str"),
    ([*PLAN, "--tiers", "{d}/tiers.toml", "--curves", "{d}/capacity-nan.json"], "capacity_rows holds nan"),
    # whatif: binary input files
    (["whatif", "--model", "{d}/binary.toml", "--out", "{out}/w"],
     "device model {d}/binary.toml is not TOML text: a binary file"),
    (["whatif", "--table", "14={d}/binary.toml", "--out", "{out}/w"],
     "device model {d}/binary.toml is not TOML text: a binary file"),
    (["whatif", "--profile", "{d}/binary.json", "--out", "{out}/w"],
     "compute profile {d}/binary.json is not JSON text: a binary file"),
    (["whatif", "--model", "this-disk", "--this-disk", "{d}/binary.toml", "--out", "{out}/w"],
     "tiers file {d}/binary.toml is not TOML text: a binary file"),
    # load, demo
    (["load", M, "--url", "redis://127.0.0.1:notaport"], "redis url 'redis://127.0.0.1:notaport'"),
    (["load", M, "--url", "redis://127.0.0.1:99999"], "Port out of range"),
    (["load", M, "--url", "redis://[::1"], "Invalid IPv6 URL"),
    (["load", M, "--url", "redis://127.0.0.1:7000", "--tag-buckets", "0"], "--tag-buckets '0'"),
    (["demo", "--metrics-port", "70000", "--out", "{out}/demo"], "--metrics-port '70000'"),
]


@pytest.mark.parametrize("argv,said", CASES, ids=[f"{a[0]}-{s[:36]}" for a, s in CASES])
def test_bad_input_is_one_line_exit_2_and_nothing_written(inputs, tmp_path, argv, said) -> None:
    out = tmp_path / "out"
    out.mkdir()
    fill = {"d": str(inputs), "out": str(out)}
    args = [a.format(**fill) for a in argv]
    if args[0] in ("stage", "verify", "load"):
        args.append("--no-progress")
    before = sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in inputs.iterdir())
    res = subprocess.run([sys.executable, "-m", "slacktier.cli", *args], capture_output=True, text=True,
                         timeout=300, cwd=tmp_path, env=dict(os.environ, PYTHONPATH=str(SRC)))
    assert res.returncode == 2, res.stderr[-3000:]
    assert res.stdout == "" and "Traceback" not in res.stderr and res.stderr.count("\n") == 1, res.stderr[-3000:]
    assert res.stderr.startswith(f"slacktier {args[0]}: error: ") and "Fix: " in res.stderr, res.stderr
    assert said.format(**fill) in res.stderr, res.stderr
    assert list(out.iterdir()) == []
    assert sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in inputs.iterdir()) == before
