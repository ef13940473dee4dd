"""One separator for layer maps: LAYER=VALUE in every verb (`stage --synthetic 1=8000,14=8000`, `plan --table
1=MANIFEST`, as `--window 1=0.27` and `whatif --table 1=nvme-paper` already were). The older LAYER:VALUE of
`stage` and `plan` is read with one deprecation line naming the new form."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from slacktier.commands._args import layer_item
from slacktier.commands.plan import _parse_tables
from slacktier.commands.stage import parse_layer_rows
from slacktier.errors import ErrorKind, SlackTierError
from slacktier.tables.manifest import Manifest

SRC = Path(__file__).resolve().parents[1] / "src"


def _stage(tmp_path: Path, name: str, synthetic: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(SRC))
    return subprocess.run([sys.executable, "-m", "slacktier", "stage", "--synthetic", synthetic, "--seed", "3",
                           "--target", str(tmp_path / f"{name}.bin"), "--no-progress"],
                          capture_output=True, text=True, env=env, timeout=600)


def test_stage_reads_layer_equals_rows_and_the_old_colon_form_with_one_deprecation_line(tmp_path):
    new = _stage(tmp_path, "new", "1=300,14=450")
    assert new.returncode == 0 and "deprecated" not in new.stderr, new.stderr
    old = _stage(tmp_path, "old", "1:300,14:450")
    assert old.returncode == 0, old.stderr
    warnings = [line for line in old.stderr.splitlines() if "deprecated" in line]
    assert len(warnings) == 1 and "write 1=300" in warnings[0], old.stderr
    a, b = Manifest.load(tmp_path / "new.bin.manifest.json"), Manifest.load(tmp_path / "old.bin.manifest.json")
    assert dict(a.layout.rows) == dict(b.layout.rows) == {1: 300, 14: 450}
    assert (tmp_path / "new.bin").read_bytes()[4096:] == (tmp_path / "old.bin").read_bytes()[4096:]


def test_plan_tables_take_layer_equals_manifest_with_optional_rows():
    assert _parse_tables(["1=runs/t.json", "14=runs/t.json:9000"]) == [(1, "runs/t.json", None),
                                                                      (14, "runs/t.json", 9000)]
    # a path may hold ':' itself; only a trailing :digits is ROWS
    assert _parse_tables(["1=runs/a:b/t.json"]) == [(1, "runs/a:b/t.json", None)]
    assert _parse_tables(["1:runs/t.json:1000"]) == [(1, "runs/t.json", 1000)]   # the old form, deprecated


@pytest.mark.parametrize("item", ["x=runs/t.json", "runs/t.json", "=runs/t.json", "1.5=a"])
def test_a_layer_item_without_a_whole_layer_is_refused_naming_the_form(item):
    with pytest.raises(SlackTierError) as err:
        layer_item(item, "--table", "LAYER=MANIFEST[:ROWS]")
    assert err.value.kind is ErrorKind.BAD_INPUT and "LAYER=MANIFEST[:ROWS]" in str(err.value)


def test_synthetic_rows_refuse_what_they_refused_before():
    assert parse_layer_rows("1=10, 14=20") == {1: 10, 14: 20}
    for bad, said in [("1=10,1=20", "listed twice"), ("1=0", "rows >= 1"), ("-1=10", "layer ids are >= 0"),
                      ("1=1.5", "not a whole number"), ("1", "LAYER=ROWS")]:
        with pytest.raises(SlackTierError, match=said.replace(".", r"\.")):
            parse_layer_rows(bad)
