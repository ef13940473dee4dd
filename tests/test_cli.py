"""The `slacktier` command line: --help on every registered verb, stage/verify/demo end to end."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from slacktier import cli

ROOT = Path(__file__).resolve().parents[1]


def _registered_verbs() -> list[str]:
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if a.dest == "verb")
    return sorted(sub.choices)


def test_every_registered_verb_has_help(capsys):
    verbs = _registered_verbs()
    assert {"stage", "verify", "demo"} <= set(verbs)
    for verb in verbs:
        with pytest.raises(SystemExit) as e:
            cli.main([verb, "--help"])
        assert e.value.code == 0, verb
        out = capsys.readouterr().out
        assert f"slacktier {verb}" in out and "--help" in out


def test_top_level_help_and_no_verb(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--help"])
    assert e.value.code == 0
    assert cli.main([]) == 2


def test_installed_entry_point_runs():
    exe = Path(sys.executable).with_name("slacktier")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "slacktier.cli"]
    res = subprocess.run([*cmd, "stage", "--help"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and "--synthetic" in res.stdout


def test_stage_and_verify_synthetic(tmp_path, capsys):
    target = tmp_path / "t.bin"
    rc = cli.main(["stage", "--synthetic", "1=2000,14=1500", "--ranks", "2", "--seed", "4", "--target", str(target),
                   "--no-progress"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "staged 4 regions (3500 rows" in out
    manifest = str(target) + ".manifest.json"
    assert cli.main(["verify", manifest, "--rows", "20", "--no-progress"]) == 0
    assert ": OK;" in capsys.readouterr().out
    # another table onto the same target: refused with a fix message, exit code 2 (cli.py: a refused command)
    rc = cli.main(["stage", "--synthetic", "1=2000", "--seed", "5", "--target", str(target), "--no-progress"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "another table" in err and "--overwrite" in err


def test_stage_checkpoint_cli(tmp_path, capsys):
    import torch
    from safetensors.torch import save_file

    w = torch.randint(0, 256, (50, 256), dtype=torch.uint8)
    s = torch.randint(100, 150, (50, 8), dtype=torch.uint8)
    ckpt = tmp_path / "m.safetensors"
    save_file({"layers.3.engram.embed.weight": w.view(torch.float8_e4m3fn),
               "layers.3.engram.embed.scale": s.view(torch.float8_e8m0fnu)}, str(ckpt))
    target = tmp_path / "t.bin"
    assert cli.main(["stage", "--checkpoint", str(ckpt), "--target", str(target), "--no-progress"]) == 0
    assert cli.main(["verify", str(target) + ".manifest.json", "--no-progress"]) == 0
    assert "layer" not in capsys.readouterr().out.split("OK;")[1]


def test_stage_scaled_engram_layout(tmp_path, capsys):
    pytest.importorskip("slacktier.tables.engram_hash")
    target = tmp_path / "t.bin"
    assert cli.main(["stage", "--engram", "500", "--ranks", "4", "--target", str(target), "--no-progress"]) == 0
    from slacktier.tables.manifest import Manifest
    m = Manifest.load(str(target) + ".manifest.json")
    assert m.layout.layer_ids == (1, 14) and all(len(b) == 25 for b in m.layout.column_bounds.values())
    assert cli.main(["verify", m.path, "--rows", "10", "--no-progress"]) == 0


def test_bad_layer_spec_is_a_clean_error(tmp_path, capsys):
    assert cli.main(["stage", "--synthetic", "1-20", "--target", str(tmp_path / "t.bin")]) == 2
    assert "LAYER=ROWS" in capsys.readouterr().err


@pytest.mark.slow
def test_demo_runs_with_its_defaults(tmp_path, capsys):
    """README's `make demo` is `slacktier demo` with its defaults: this is where it runs (the docs test skips it)."""
    import socket
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    recipe = re.search(r"^demo:.*\n\t(.*)$", (ROOT / "Makefile").read_text(), flags=re.M)
    assert recipe and recipe.group(1) == "$(BIN)/slacktier demo", recipe   # the target runs the verb, no flags
    rc = cli.main(["demo", "--out", str(tmp_path / "demo"), "--metrics-port", str(port)])
    assert rc == 0
    out = capsys.readouterr().out
    assert "SlackTier demo" in out and ": OK;" in out
    assert (tmp_path / "demo" / "table.bin.manifest.json").exists()
    assert os.path.getsize(tmp_path / "demo" / "table.bin") > 0
    assert "device compute from profile v41_paper; host, cache and I/O real" in out
    # a person reads it: lines fit a terminal, no tracker numbers or paper sections, a verdict per experiment
    lines = out.splitlines()
    assert max(len(l) for l in lines if str(tmp_path) not in l) <= 120, max(lines, key=len)
    assert not any(re.search(r"issue \d|section \d", l) for l in lines)
    assert sum(l.startswith("Verdict: ") for l in lines) == 2
    # --metrics-port: the demo's engines published into the endpoint it served (still up in this process)
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    lookups = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                  if line.startswith("slacktier_lookups_total{"))
    assert lookups > 0


def test_staging_and_verifying_a_table_import_no_torch():
    # stage and verify read and write bytes and checksums: torch's import would cost each command seconds
    code = ("import sys, slacktier.tables.stage, slacktier.tables.verify, slacktier.commands.plan; "
            "print('torch' in sys.modules)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "False"


def test_report_verbs_import_no_torch_and_keep_their_old_names():
    # the verbs only parse flags; their rooms (torch, numba) load when the verb runs, so --help stays fast
    code = ("import sys, slacktier.commands.characterize, slacktier.commands.probe, slacktier.commands.redknot; "
            "print(sorted(m for m in ('torch', 'numba', 'matplotlib') if m in sys.modules)); "
            "from slacktier.commands.probe import parse_layers; print(parse_layers('every:2', 5))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split("\n")[:2] == ["[]", "[0, 2, 4]"]
