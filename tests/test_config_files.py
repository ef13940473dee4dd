"""Control files as files: relative paths from the file's folder, `plan` writing what the engine opens, errors
naming the file and line with the nearest key, documented defaults equal to the code's, one open-time check."""

from __future__ import annotations

import json
import os
import re
import tomllib
from pathlib import Path

import msgspec
import numpy as np
import pytest
import torch

from slacktier import cli, config
from slacktier.config import (ControlFile, DiskOptions, EngineConfig, RedisOptions, TableConfig, load_control,
                              parse_control, write_control)
from slacktier.engine.step import StepEngine
from slacktier.errors import ErrorKind, SlackTierError
from slacktier.tables.engram_hash import EngramLayout
from slacktier.tables.stage import stage_synthetic

TIERS = ('[[tier]]\nname = "dram"\nintercept_ms = 0.01\npage_ms = 0.00001\nholds_table = true\n'
         '[[tier]]\nname = "disk"\nintercept_ms = 0.30\npage_ms = 0.00305\ncontention_page_ms = 0.00037\n')
CURVES = {"workload": "agent", "batch": 8, "layers": {
    "1": {"capacity_rows": [0, 1000], "pages_per_step": [100, 50]},
    "14": {"capacity_rows": [0, 1000], "pages_per_step": [100, 50]}}}
LAYOUT = EngramLayout.scaled(200)   # layers 1 and 14, 24 hash columns each


@pytest.fixture(scope="module")
def staged(o_direct_module_dir: Path) -> dict[str, Path]:
    """A table staged under the columns and under the balanced rank partition (2 ranks), by absolute path."""
    return {kind: Path(stage_synthetic([o_direct_module_dir / f"{kind}.bin"], LAYOUT, 2, 3, progress=False,
                                       partition=kind).path)
            for kind in ("columns", "balanced")}


def _plan_inputs(folder: Path) -> None:
    (folder / "tiers.toml").write_text(TIERS)
    (folder / "curves.json").write_text(json.dumps(CURVES))


def _plan(manifest: str, out: str, *extra: str) -> int:
    return cli.main(["plan", "--tiers", "tiers.toml", "--curves", "curves.json", "--table", f"1:{manifest}",
                     "--table", f"14:{manifest}", "--window", "1=0.27", "--window", "14=9.35", "--cache-rows", "1000",
                     "--target-ms", "0.5", "--out", out, *extra])


def _one_step(engine: StepEngine) -> None:
    ids = np.zeros((4, 2, 24), dtype=np.int64)
    ids[:, :, :] = np.arange(24) * 7
    engine.begin_step(ids)
    for layer in engine.ids_layers:
        assert engine.gather(layer).shape == (4, 24, 256)
    engine.end_step()


# ---- paths: relative to the control file ---------------------------------------------------------------------

def test_plan_writes_paths_the_engine_and_inspect_read_from_anywhere(staged, tmp_path, monkeypatch, capsys) -> None:
    """The README's sequence with relative paths: plan in one folder, inspect there, the engine from another."""
    work = staged["columns"].parent
    monkeypatch.chdir(work)
    _plan_inputs(work)
    assert _plan(staged["columns"].name, "runs/plan/control.toml") == 0
    text = (work / "runs/plan/control.toml").read_text()
    assert 'manifest = "../../columns.bin.manifest.json"' in text   # relative to the control file's folder
    assert cli.main(["inspect", "runs/plan/control.toml"]) == 0
    assert "layer 14 (order 1): tier" in capsys.readouterr().out
    monkeypatch.chdir(tmp_path)   # elsewhere: the same file names the same table
    cfg = load_control(work / "runs/plan/control.toml")
    assert {t.manifest for t in cfg.tables} == {str(staged["columns"])}
    with StepEngine.from_control(work / "runs/plan/control.toml") as engine:
        _one_step(engine)


def test_write_control_writes_relative_paths_relative_to_the_file(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    cfg = ControlFile(tables=(
        TableConfig(layer=1, manifest="tables/t.json", seen="tables/seen.npy", targets=("moved.bin", "")),
        TableConfig(layer=2, manifest="/abs/t.json", source="redis", targets=("st-prefix",),
                    options=RedisOptions(password_file="secret.txt"))))
    path = write_control(cfg, tmp_path / "deploy" / "rank0.toml")
    doc = tomllib.loads(path.read_text())
    one, two = doc["table"]
    assert (one["manifest"], one["seen"], one["targets"]) == ("../tables/t.json", "../tables/seen.npy",
                                                               ["../moved.bin", ""])
    # an absolute path stays; a Redis target is a key prefix, not a path; the password file is a path
    assert (two["manifest"], two["targets"], two["redis"]["password_file"]) == ("/abs/t.json", ["st-prefix"],
                                                                              "../secret.txt")
    back = load_control(path)   # read back from the file's folder: the files cfg named, made absolute
    assert back.table(1).manifest == str(tmp_path / "tables/t.json")
    assert back.table(1).targets == (str(tmp_path / "moved.bin"), "")
    assert back.table(2).options.password_file == str(tmp_path / "secret.txt")
    assert back.table(2).targets == ("st-prefix",)


def test_a_missing_manifest_is_named_as_resolved_with_the_file_that_named_it(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs" / "plan").mkdir(parents=True)
    (tmp_path / "runs/plan/control.toml").write_text('[[table]]\nlayer = 1\nmanifest = "runs/t.json"\n')
    with pytest.raises(SlackTierError) as err:
        StepEngine.from_control("runs/plan/control.toml")
    said = str(err.value)
    assert err.value.kind is ErrorKind.MISSING and err.value.layer == 1
    assert said.startswith("[missing] control file runs/plan/control.toml: manifest "
                           f"{tmp_path}/runs/plan/runs/t.json does not exist"), said
    assert "relative path is read from the file's folder" in said


def test_a_missing_target_is_named_with_the_manifest_that_named_it(o_direct_dir, capsys) -> None:
    m = stage_synthetic([o_direct_dir / "gone.bin"], {1: 150}, 1, 0, progress=False)
    control = write_control(ControlFile(tables=(TableConfig(layer=1, manifest=m.path),)), o_direct_dir / "c.toml")
    assert cli.main(["inspect", str(control)]) == 0
    os.remove(o_direct_dir / "gone.bin")
    for source in ("disk", "dram"):
        control.write_text(f'[[table]]\nlayer = 1\nmanifest = "{m.path}"\nsource = "{source}"\n')
        with pytest.raises(SlackTierError) as err:
            StepEngine.from_control(control)
        assert err.value.kind is ErrorKind.MISSING and (err.value.layer, err.value.rank) == (1, 0)
        assert str(err.value).startswith(f"[missing] control file {control}: target {o_direct_dir}/gone.bin (named "
                                         f"by manifest {m.path}) does not exist"), str(err.value)
        assert cli.main(["inspect", str(control)]) == 2   # inspect runs the same check
        assert f"target {o_direct_dir}/gone.bin (named by manifest" in capsys.readouterr().err


# ---- plan writes what the engine opens -----------------------------------------------------------------------

def test_plan_refuses_queue_settings_the_engine_refuses(staged, monkeypatch, capsys) -> None:
    monkeypatch.chdir(staged["columns"].parent)
    _plan_inputs(staged["columns"].parent)
    for flag, value, bounds in (("--queue-depth", "4097", "1..4096"), ("--io-threads", "65", "1..64")):
        assert _plan(staged["columns"].name, "bad/control.toml", flag, value) == 2
        assert f"{flag} '{value}' is not a whole number in {bounds}" in capsys.readouterr().err
    assert not Path("bad").exists()
    # the largest values the schema takes are written, and the engine opens the file
    assert _plan(staged["columns"].name, "ok/control.toml", "--queue-depth", "4096", "--io-threads", "64") == 0
    assert load_control("ok/control.toml").table(14).options == DiskOptions(queue_depth=4096, io_threads=64)


def test_write_control_checks_what_it_writes_with_the_schema(tmp_path) -> None:
    """A struct built in code skips the schema's ranges; the file it would write is refused, nothing written."""
    cfg = ControlFile(tables=(TableConfig(layer=1, manifest="/t.json", options=DiskOptions(queue_depth=5000)),))
    with pytest.raises(SlackTierError) as err:
        write_control(cfg, tmp_path / "c.toml")
    assert err.value.kind is ErrorKind.BAD_INPUT and "<= 4096 - at `$.queue_depth`" in str(err.value)
    assert "not written" in str(err.value) and not (tmp_path / "c.toml").exists()


def test_plan_serves_a_balanced_table_with_its_partition(staged, monkeypatch) -> None:
    work = staged["balanced"].parent
    monkeypatch.chdir(work)
    _plan_inputs(work)
    assert _plan(staged["balanced"].name, "bal/control.toml") == 0
    assert {t.partition for t in load_control("bal/control.toml").tables} == {"balanced"}
    with StepEngine.from_control("bal/control.toml") as engine:
        _one_step(engine)


# ---- inspect runs the engine's open-time checks --------------------------------------------------------------

def test_inspect_refuses_what_the_engine_refuses_at_open(staged, tmp_path, capsys) -> None:
    control = tmp_path / "wrong.toml"
    control.write_text(f'[[table]]\nlayer = 1\nmanifest = "{staged["columns"]}"\npartition = "balanced"\n')
    with pytest.raises(SlackTierError) as engine_err:
        StepEngine.from_control(control)
    assert engine_err.value.kind is ErrorKind.BAD_INPUT and "rank partition" in engine_err.value.message
    assert cli.main(["inspect", str(control)]) == 2
    assert f"slacktier inspect: error: {engine_err.value}" in capsys.readouterr().err
    control.write_text(f'[[table]]\nlayer = 7\nmanifest = "{staged["columns"]}"\n')   # a layer it does not hold
    assert cli.main(["inspect", str(control)]) == 2
    assert "has no layer 7" in capsys.readouterr().err
    control.write_text(f'[[table]]\nlayer = 1\nmanifest = "{staged["columns"]}"\n')   # the control: it passes
    assert cli.main(["inspect", str(control)]) == 0


# ---- errors name the file, the line and the nearest key ------------------------------------------------------

@pytest.mark.parametrize("text, line, says", [
    ('[engine]\ncache_row = 200000\n[[table]]\nlayer = 1\nmanifest = "m"\n', 2,
     ", [engine]: unknown key `cache_row`. Fix: did you mean `cache_rows`?"),
    ('[[table]]\nlayer = 1\nmanifest = "m"\n[[table]]\nlayer = 14\nmanifest = "m"\ncache_shar = 0.5\n', 7,
     ", [[table]] #2: unknown key `cache_shar`. Fix: did you mean `cache_share`?"),
    ('[[table]]\nlayer = 1\nmanifest = "m"\n[table.disk]\nqueue_dept = 5\n', 5,
     ", [[table]] #1 [table.disk]: unknown key `queue_dept`. Fix: did you mean `queue_depth`?"),
    ('[engine]\nmax_tokens = 1\n\nlossy = "false"\n[[table]]\nlayer = 1\nmanifest = "m"\n', 4,
     ", [engine]: Expected `bool`, got `str` - at `$.lossy`"),
    ('[engine]\ncache_rows = 5\ndevice = "tpu"\n[[table]]\nlayer = 1\nmanifest = "m"\ncache_share = 1.0\n', 3,
     ", [engine]: device 'tpu'"),
    ('[[table]]\nlayer = 1\nmanifest = "m"\n[table.disk]\nio_threads = 65\n', 5,
     ", [[table]] #1 [table.disk]: Expected `int` <= 64 - at `$.io_threads`"),
    ('[engin]\ncache_rows = 1\n', 1, ": unknown section `engin`. Fix: did you mean `engine`?"),
])
def test_errors_name_the_file_the_line_and_the_nearest_key(tmp_path, text, line, says) -> None:
    path = tmp_path / "rank3.toml"
    path.write_text(text)
    with pytest.raises(SlackTierError) as err:
        load_control(path)
    assert err.value.kind is ErrorKind.BAD_INPUT
    assert str(err.value).startswith(f"[bad_input] control file {path}, line {line}{says}"), str(err.value)


def test_an_unknown_key_far_from_every_key_is_told_to_go() -> None:
    with pytest.raises(SlackTierError) as err:
        parse_control('[engine]\nzzz = 1\n[[table]]\nlayer = 1\nmanifest = "m"\n')
    assert "Fix: remove it ([engine] keys: device, cache_rows," in str(err.value)


# ---- documented defaults -------------------------------------------------------------------------------------

def _documented_schema() -> dict[str, dict[str, object]]:
    """Section -> key -> value, from the schema in slacktier.config's docstring (what README points to)."""
    doc = config.__doc__
    block = doc[doc.index("Schema (every key"):doc.index("Worked example:")]
    out: dict[str, dict[str, object]] = {}
    section = ""
    for line in block.splitlines():
        header = re.match(r"^    (\[\[?[\w.]+\]\]?)", line)
        if header:
            section = header.group(1)
            out[section] = {}
            continue
        key = re.match(r"^    (\w+) = (.+?)\s*(#.*)?$", line)
        if key and section:
            out[section][key.group(1)] = tomllib.loads(f"v = {key.group(2)}")["v"]
    return out


def test_documented_defaults_are_the_codes() -> None:
    documented = _documented_schema()
    structs = {"[engine]": EngineConfig, "[[table]]": TableConfig, "[table.disk]": DiskOptions,
               "[table.redis]": RedisOptions}
    assert set(documented) == set(structs)
    for section, kind in structs.items():
        fields = {f.encode_name: f for f in msgspec.structs.fields(kind) if f.encode_name != "options"}
        assert set(documented[section]) == set(fields), section   # every key documented, none made up
        for name, field in fields.items():
            if field.required:
                continue   # layer and manifest: the docs show an example
            want = msgspec.json.decode(msgspec.json.encode(field.default))   # as TOML writes it: () -> []
            assert documented[section][name] == want, f"{section} {name}"
    # the negative control: a default the docs once stated wrongly
    assert documented["[[table]]"]["cache_share"] == 0.0 != 0.5


# ---- a device this process cannot allocate on ----------------------------------------------------------------

@pytest.mark.skipif(torch.cuda.is_available(), reason="this torch has a CUDA device")
def test_cuda_without_a_cuda_torch_is_one_line(staged, tmp_path) -> None:
    control = tmp_path / "gpu.toml"
    control.write_text(f'[engine]\ndevice = "cuda"\n[[table]]\nlayer = 1\nmanifest = "{staged["columns"]}"\n')
    with pytest.raises(SlackTierError) as err:
        StepEngine.from_control(control)
    assert err.value.kind is ErrorKind.UNAVAILABLE and "\n" not in str(err.value)
    assert str(err.value).startswith(f"[unavailable] control file {control}: device 'cuda': ")
    assert 'set device = "cpu"' in str(err.value)


# ---- a target in host memory ---------------------------------------------------------------------------------

@pytest.fixture
def shm_dir() -> Path:
    """A fresh folder on /dev/shm (tmpfs), removed after; skipped where there is none or it refuses O_DIRECT."""
    import shutil
    import tempfile

    from slacktier.tables.memfs import ram_backed
    from slacktier.testing.store import supports_o_direct

    if not os.path.isdir("/dev/shm") or ram_backed("/dev/shm") is None:
        pytest.skip("no tmpfs at /dev/shm")
    d = Path(tempfile.mkdtemp(prefix="slacktier-test-", dir="/dev/shm"))
    try:
        if not supports_o_direct(d):
            pytest.skip("this kernel's tmpfs refuses O_DIRECT (before Linux 6.6)")
        yield d
    finally:
        shutil.rmtree(d)


def test_a_target_in_ram_warns_at_staging_and_counts_as_host_memory(shm_dir, staged, tmp_path, monkeypatch,
                                                                     caplog, capsys) -> None:
    from slacktier.tables.memfs import ram_backed

    assert ram_backed(shm_dir / "not-yet.bin").startswith("tmpfs at ")
    assert ram_backed(staged["columns"]) is None or pytest.skip("the test's disk folder is itself in RAM")
    with caplog.at_level("WARNING", logger="slacktier.tables.page_writer"):
        m = stage_synthetic([shm_dir / "t.bin"], {1: 3000, 14: 3000}, 1, 0, progress=False)
    assert any("is in host memory (tmpfs at " in r.getMessage() for r in caplog.records)
    table_bytes = 200 * 4096   # 3000 rows = 200 pages per layer
    reports = {}
    for name, manifest in (("ram", m.path), ("disk", staged["columns"])):
        control = tmp_path / f"{name}.toml"
        control.write_text(f'[engine]\nmax_tokens = 1\n[[table]]\nlayer = 1\nmanifest = "{manifest}"\n')
        assert cli.main(["inspect", str(control), "--json"]) == 0
        reports[name] = json.loads(capsys.readouterr().out)["control_report"]["tables"][0]
    ram, disk = reports["ram"], reports["disk"]
    assert ram["tier"] == "disk" and ram["in_memory_bytes"] == table_bytes
    assert ram["host_bytes"] == table_bytes + ram["directory_bytes"]
    assert disk["in_memory_bytes"] == 0 and disk["host_bytes"] == disk["directory_bytes"]   # the control
    # plan counts them too, on the disk tier it picks
    monkeypatch.chdir(tmp_path)
    _plan_inputs(tmp_path)
    assert cli.main(["plan", "--tiers", "tiers.toml", "--curves", "curves.json", "--table", f"1:{m.path}",
                     "--window", "1=1000", "--cache-rows", "0", "--target-ms", "1", "--out", "p.toml",
                     "--json", "p.json"]) == 0
    assert "0.8 MiB of its staged files sit in host memory (tmpfs at" in capsys.readouterr().out
    planned = json.loads(Path("p.json").read_text())
    assert planned["tables"][0]["source"] == "disk"
    assert planned["tables"][0]["host_bytes"] >= table_bytes
