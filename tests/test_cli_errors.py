"""Bad input on the command line: one "error:" line with a fix, exit code 2, no traceback, nothing written."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from slacktier import cli

SRC = Path(__file__).resolve().parents[1] / "src"


def _refused(capsys, argv: list[str], *expect: str) -> str:
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"slacktier {argv[0]}: error: ") and "Traceback" not in err, err
    assert "Fix:" in err, err
    for text in expect:
        assert text in err, err
    return err


def _stage(tmp_path: Path, *args: str) -> list[str]:
    return ["stage", *args, "--target", str(tmp_path / "t.bin"), "--no-progress"]


@pytest.mark.parametrize("args,expect", [
    (["--synthetic", "1=100,1=200"], "layer 1 is listed twice"),
    (["--synthetic", "1=100,14"], "LAYER=ROWS"),
    (["--synthetic", "1=1.5"], "not a whole number"),
    (["--synthetic", "1=nan"], "not a whole number"),
    (["--synthetic", "1=1e400"], "not a whole number"),
    (["--synthetic", "1=0"], "rows >= 1"),
    (["--synthetic=-1=10"], "layer ids are >= 0"),
    (["--engram", "0"], "at least 2"),
    (["--engram=-3"], "at least 2"),
    (["--engram", "inf"], "--engram"),
    (["--engram", "many"], "--engram"),
    (["--synthetic", "1=100", "--layers", "1"], "--layers picks checkpoint layers"),
    (["--synthetic", "1=100", "--ranks", "0"], "--ranks '0' is not a whole number in 1..65536"),
    (["--synthetic", "1=100", "--chunk-mib", "0"], "--chunk-mib '0' is not a whole number in 1..1024"),
])
def test_bad_stage_arguments_are_refused_before_writing(tmp_path, capsys, args, expect):
    _refused(capsys, _stage(tmp_path, *args), expect)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("layers", ["a,b", "1,1", "1,,14", "-1"])
def test_bad_checkpoint_layers_are_refused(tmp_path, capsys, layers):
    _refused(capsys, _stage(tmp_path, "--checkpoint", str(tmp_path / "c.safetensors"), f"--layers={layers}"),
             "--layers")
    assert list(tmp_path.iterdir()) == []


def test_a_manifest_in_a_missing_directory_is_refused_before_the_table_is_written(tmp_path, capsys):
    _refused(capsys, _stage(tmp_path, "--synthetic", "1=3000", "--manifest", str(tmp_path / "no" / "m.json")),
             "does not exist", str(tmp_path / "no"))
    assert list(tmp_path.iterdir()) == []


def test_verify_a_directory_or_a_file_that_is_not_a_manifest(tmp_path, capsys):
    _refused(capsys, ["verify", str(tmp_path), "--no-progress"], "is not a file", str(tmp_path))
    binary = tmp_path / "table.bin"
    binary.write_bytes(bytes(range(256)) * 64)
    _refused(capsys, ["verify", str(binary), "--no-progress"], "is not JSON", str(binary))
    text = tmp_path / "other.json"
    text.write_text('{"hello": 1}')
    _refused(capsys, ["verify", str(text), "--no-progress"], "is not a slacktier-table")
    _refused(capsys, ["verify", str(tmp_path / "missing.json"), "--no-progress"], "does not exist")


def test_verify_refuses_a_table_restaged_since_its_manifest(tmp_path, capsys):
    target = tmp_path / "t.bin"
    assert cli.main(_stage(tmp_path, "--synthetic", "1=300", "--seed", "1")) == 0
    first = str(target) + ".manifest.json"
    shutil.copy(first, tmp_path / "first.json")
    shutil.copy(str(target) + ".manifest.crc", tmp_path / "first.crc")
    assert cli.main(_stage(tmp_path, "--synthetic", "1=300", "--seed", "2", "--overwrite")) == 0
    capsys.readouterr()
    assert cli.main(["verify", str(tmp_path / "first.json"), "--rows", "0", "--no-pages", "--no-progress"]) == 1
    assert "holds another table" in capsys.readouterr().out
    assert cli.main(["verify", first, "--no-progress"]) == 0


def test_a_subprocess_prints_one_line_and_exits_2(tmp_path):
    res = subprocess.run([sys.executable, "-m", "slacktier.cli", "verify", str(tmp_path)], capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 2, res.stderr
    assert "Traceback" not in res.stderr and res.stderr.count("\n") == 1, res.stderr
    assert res.stderr.startswith("slacktier verify: error: [bad_input] manifest ")


@pytest.mark.slow
def test_numba_cache_falls_back_to_a_temp_dir_without_a_writable_home(tmp_path):
    # A read-only install and no writable HOME: every __pycache__ of the package copy is a plain file (so not
    # even root can make it a directory) and HOME is a file. Unfixed, importing a kernel module raised numba's
    # "cannot cache function ...: no locator available".
    pkg = tmp_path / "site"
    shutil.copytree(SRC / "slacktier", pkg / "slacktier", ignore=shutil.ignore_patterns("__pycache__"))
    for d in [pkg / "slacktier", *(p for p in (pkg / "slacktier").rglob("*") if p.is_dir())]:
        (d / "__pycache__").write_bytes(b"")
    home = tmp_path / "home"
    home.write_bytes(b"")
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("NUMBA_CACHE_DIR", "XDG_CACHE_HOME", "PYTHONPATH")}
    env.update(HOME=str(home), TMPDIR=str(tmp), PYTHONPATH=str(pkg), PYTHONDONTWRITEBYTECODE="1")
    target = tmp_path / "t.bin"
    res = subprocess.run([sys.executable, "-m", "slacktier.cli", "stage", "--synthetic", "1=100", "--target",
                          str(target), "--no-progress"], capture_output=True, text=True, env=env, timeout=600,
                         cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert "numba's cache places" in res.stderr and "not writable" in res.stderr, res.stderr
    cache = tmp / f"slacktier-numba-{os.getuid()}"
    assert str(cache) in res.stderr and str(pkg / "slacktier") in res.stderr, "the read-only copy was imported"
    assert any(cache.rglob("*.nbi")), "the kernels were cached in the fallback directory"
    assert "staged 1 regions" in res.stdout
