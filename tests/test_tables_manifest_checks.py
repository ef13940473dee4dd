"""Issue 34: a manifest's own digest, its fields checked at load, `verify --redigest`, a layer id of 10**30.

Every case asserts the exact refusal: the ErrorKind and the key it names. A manifest is edited as text (JSON
cannot write 1e400 or NaN) and loaded; nothing may raise anything but a SlackTierError.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from slacktier import cli
from slacktier.errors import ErrorKind, SlackTierError
from slacktier.tables.checkpoint_source import CheckpointSource
from slacktier.tables.manifest import Manifest, StagedLayout, manifest_digest
from slacktier.tables.stage import stage_synthetic


@pytest.fixture()
def staged(tmp_path: Path) -> Manifest:
    return stage_synthetic([tmp_path / "t.bin"], {1: 300, 14: 450}, 2, 7, progress=False)


def _doc(m: Manifest) -> dict:
    return json.loads(Path(m.path).read_text())


def _write(m: Manifest, doc: dict, *, redigest: bool = False) -> None:
    if redigest:
        doc["manifest_digest"] = manifest_digest(doc)
    Path(m.path).write_text(json.dumps(doc, indent=1))


def _refused(path: str) -> SlackTierError:
    with pytest.raises(SlackTierError) as exc:
        Manifest.load(path)
    return exc.value


def test_a_manifest_records_the_digest_of_its_own_content(staged) -> None:
    doc = _doc(staged)
    assert doc["manifest_digest"] == manifest_digest(doc) and doc["manifest_digest"].startswith("sha256:")
    assert Manifest.load(staged.path).regions == staged.regions


@pytest.mark.parametrize("edit", [
    lambda d: d["regions"][0].update(offset_bytes=d["regions"][1]["offset_bytes"]) or
    d["regions"][1].update(offset_bytes=4096),   # two ranks' regions swapped: each would serve the other's rows
    lambda d: d["source"].update(seed=8),
    lambda d: d["targets"][0].update(path=d["targets"][0]["path"] + ".old") or
    [r.update(path=d["targets"][0]["path"]) for r in d["regions"]],
    lambda d: d.update(stage_id=""),
])
def test_an_edited_manifest_is_refused_by_its_digest(staged, edit) -> None:
    doc = _doc(staged)
    edit(doc)
    _write(staged, doc)
    exc = _refused(staged.path)
    assert exc.kind is ErrorKind.CHECKSUM
    assert exc.message.startswith(f"manifest {staged.path} was edited since it was written: its content is sha256:")
    assert f"`slacktier verify {staged.path} --redigest`" in exc.fix


def test_a_manifest_without_a_digest_is_refused_naming_the_fix(staged) -> None:
    doc = _doc(staged)
    del doc["manifest_digest"]
    _write(staged, doc)
    exc = _refused(staged.path)
    assert exc.kind is ErrorKind.BAD_INPUT and "records no manifest_digest" in exc.message
    assert "slacktier stage" in exc.fix and f"`slacktier verify {staged.path} --redigest`" in exc.fix


def test_redigest_records_the_digest_only_of_a_table_that_verifies(staged, capsys) -> None:
    doc = _doc(staged)
    del doc["manifest_digest"]
    _write(staged, doc)
    assert cli.main(["verify", staged.path, "--redigest", "--no-progress"]) == 0
    assert "recorded the digest of manifest" in capsys.readouterr().out
    assert Manifest.load(staged.path).regions == staged.regions
    # the same table's rank regions swapped in the manifest: the pages fail their checksums, nothing is recorded
    doc = _doc(staged)
    r0, r1 = doc["regions"][2], doc["regions"][3]
    r0["offset_bytes"], r1["offset_bytes"] = r1["offset_bytes"], r0["offset_bytes"]
    _write(staged, doc)
    before = Path(staged.path).read_bytes()
    assert cli.main(["verify", staged.path, "--redigest", "--no-progress"]) == 1
    assert "left as it was" in capsys.readouterr().out
    assert Path(staged.path).read_bytes() == before
    assert _refused(staged.path).kind is ErrorKind.CHECKSUM
    assert cli.main(["verify", staged.path, "--redigest", "--no-pages", "--no-progress"]) == 2
    assert "--redigest records a digest only after every page" in capsys.readouterr().err


def _text_edit(m: Manifest, old: str, new: str) -> None:
    text = Path(m.path).read_text()
    assert old in text
    Path(m.path).write_text(text.replace(old, new, 1))


# (edit of the document, or (old text, new text); the key the refusal names)
CASES = [
    (('"offset_bytes": 4096', '"offset_bytes": 1e400'), "$.regions[0].offset_bytes"),
    (('"ranks": 2', '"ranks": 1e400'), "$.ranks"),
    (('"pages": 10', '"pages": NaN'), "$.regions[0].pages"),
    (('"offset_bytes": 4096', '"offset_bytes": true'), "$.regions[0].offset_bytes"),
    (('"offset_bytes": 4096', '"offset_bytes": 4096.0'), "$.regions[0].offset_bytes"),
    (lambda d: d["regions"][1].update(device=3), "$.regions[1].device"),
    (lambda d: d.update(targets=[]), "$.targets"),
    (lambda d: d["regions"][0].update(crc_first_page=-1), "$.regions[0].crc_first_page"),
    (lambda d: d["regions"][1].update(crc_first_page=3), "$.regions[1].crc_first_page"),
    (lambda d: d["regions"][1].update(crc_first_page="10"), "$.regions[1].crc_first_page"),
    (lambda d: d["checksums"].update(pages=10**6), "$.checksums.pages"),
    (lambda d: d["source"].pop("kind"), "$.source.kind"),
    (lambda d: d["source"].pop("seed"), "$.source.seed"),
    (lambda d: d["source"].update(seed=True), "$.source.seed"),
    (lambda d: d["source"].update(kind="pickle"), "$.source.kind"),
    (lambda d: d["regions"][0].update(rank=5), "$.regions[0].rank"),
    (lambda d: d["regions"][0].update(path="/elsewhere"), "$.regions[0].path"),
    (lambda d: d["regions"][0].update(offset_bytes=4096 + 100), "$.regions[0].offset_bytes"),
    (lambda d: d["regions"][1].update(offset_bytes=4096), "$.regions[1].offset_bytes"),   # overlaps region 0
    (lambda d: d["regions"][0].update(rows=151), "$.regions[0].rows"),
    (lambda d: d["regions"][0].update(row_start=1), "$.regions[0].row_start"),
    (lambda d: d["layout"]["rows"].update({str(10**30): 30}), "$.layout.rows.10000000000000000000"),
    (lambda d: d["regions"].append(dict(d["regions"][0])), "$.regions[4].rank"),
    (lambda d: d.update(extra=1), "$.extra"),
]


@pytest.mark.parametrize("edit,key", CASES, ids=[c[1] + f"#{i}" for i, c in enumerate(CASES)])
def test_a_malformed_manifest_is_refused_naming_the_key(staged, edit, key) -> None:
    if isinstance(edit, tuple):
        _text_edit(staged, *edit)
    else:
        doc = _doc(staged)
        edit(doc)
        _write(staged, doc, redigest=True)   # past the digest: the fields themselves are checked too
    exc = _refused(staged.path)
    assert exc.kind is ErrorKind.BAD_INPUT
    assert exc.message.startswith(f"manifest {staged.path}: {key} "), exc.message
    assert "stage the table again" in exc.fix


def test_a_malformed_manifest_on_the_command_line_is_one_line_and_rc_2(staged) -> None:
    _text_edit(staged, '"offset_bytes": 4096', '"offset_bytes": 1e400')
    res = subprocess.run([sys.executable, "-m", "slacktier.cli", "verify", staged.path, "--no-progress"],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 2 and res.stdout == ""
    assert res.stderr.count("\n") == 1 and "Traceback" not in res.stderr
    assert res.stderr.startswith(f"slacktier verify: error: [bad_input] manifest {staged.path}: "
                                 "$.regions[0].offset_bytes is inf, want an integer")


def test_a_safetensors_layer_id_of_10_to_the_30_is_refused(tmp_path) -> None:
    raw = torch.zeros((30, 264), dtype=torch.uint8)
    name = f"layers.{10**30}.engram.embed"
    save_file({f"{name}.weight": raw[:, :256].contiguous().view(torch.float8_e4m3fn),
               f"{name}.scale": raw[:, 256:].contiguous().view(torch.float8_e8m0fnu)}, str(tmp_path / "c.safetensors"))
    with pytest.raises(SlackTierError) as exc:
        CheckpointSource(str(tmp_path / "c.safetensors"))
    assert exc.value.kind is ErrorKind.CHECKPOINT
    assert exc.value.message == (f"tensor {name}.weight names layer {str(10**30)}, outside 0..2147483647")
    with pytest.raises(SlackTierError) as exc:
        StagedLayout.from_rows({10**30: 30})
    assert exc.value.kind is ErrorKind.BAD_INPUT and exc.value.message.startswith(f"layer id {10**30} is outside")
    res = subprocess.run([sys.executable, "-m", "slacktier.cli", "stage", "--checkpoint", str(tmp_path / "c.safetensors"),
                          "--target", str(tmp_path / "t.bin"), "--no-progress"], capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 2 and res.stderr.count("\n") == 1 and "Traceback" not in res.stderr
    assert res.stderr.startswith("slacktier stage: error: [checkpoint] tensor layers.1000")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.safetensors"]


def test_a_checker_engine_opens_only_manifests_with_a_whole_source(staged) -> None:
    """check = true used to crash at open (KeyError 'seed') on a manifest missing source.seed."""
    from slacktier.config import ControlFile, EngineConfig, TableConfig
    from slacktier.engine import StepEngine

    doc = _doc(staged)
    doc["source"].pop("seed")
    _write(staged, doc, redigest=True)
    cfg = ControlFile(engine=EngineConfig(cache_rows=100, check=True),
                      tables=(TableConfig(layer=1, manifest=staged.path, source="disk", cache_share=1.0),))
    with pytest.raises(SlackTierError) as exc:
        StepEngine.from_config(cfg)
    assert exc.value.kind is ErrorKind.BAD_INPUT and f"manifest {staged.path}: $.source.seed is missing" == \
        exc.value.message
