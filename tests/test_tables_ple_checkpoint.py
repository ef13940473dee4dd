"""Staging a Qwen4Exp (Qwen3.8) checkpoint's PLE tables by their own names (tables.ple_checkpoint_source)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from ple_common import BASE, EOS, LAYERS, VOCAB, fp8_rows, qwen_checkpoint
from slacktier import cli
from slacktier.errors import ErrorKind, SlackTierError
from slacktier.tables.manifest import Manifest
from slacktier.tables.ple_checkpoint_source import PleCheckpointSource
from slacktier.tables.ple_hash import PleLayout
from slacktier.tables.stage import source_from_manifest, stage_checkpoint


@pytest.fixture(scope="module")
def world() -> SimpleNamespace:
    layouts = {layer: PleLayout.scaled(BASE, vocab_size=VOCAB, eos_token_id=EOS, ple_layer_index=i, layer_id=layer)
               for i, layer in enumerate(LAYERS)}
    return SimpleNamespace(layouts=layouts, tables={layer: fp8_rows(lay.rows, seed=layer)
                                                    for layer, lay in layouts.items()})


def test_stage_reads_the_shards_by_their_names_with_sglangs_padding(world, tmp_path):
    folder = qwen_checkpoint(tmp_path / "q", world, parts=4)
    m = stage_checkpoint(folder, [tmp_path / "q.bin"], 1, progress=False)
    for layer, lay in world.layouts.items():
        assert m.layout.rows[layer] == lay.rows < lay.padded_rows   # padding rows are not staged
        assert m.layout.column_bounds[layer] == lay.column_bounds()
        assert m.source["tensors"][str(layer)] == [f"model.language_model.layers.{layer}.ple.ple_embedding."
                                                   f"ngram_embedding.shard_{i}.weight" for i in range(4)]
        ident = m.source["identity"]["layers"][str(layer)]
        assert ident["scales"] is None and ident["tensor_rows"] == lay.padded_rows
    src = source_from_manifest(Manifest.load(m.path))
    assert isinstance(src, PleCheckpointSource)
    lay = world.layouts[1]
    size = -(-lay.padded_rows // 4)
    ids = np.array([0, size - 1, size, 2 * size + 5, lay.rows - 1])   # across the shard edges
    got = src.rows(1, ids)
    np.testing.assert_array_equal(got[:, :256], world.tables[1].view(torch.uint8).numpy()[ids])
    assert bool((got[:, 256:] == 0x7F).all())
    with pytest.raises(SlackTierError, match="rows outside"):
        src.rows(1, np.array([lay.rows]))   # a padding row


def test_cli_stage_then_verify_and_a_changed_checkpoint_fails_verify(world, tmp_path, capsys):
    folder = qwen_checkpoint(tmp_path / "q", world, parts=3)
    target = tmp_path / "q.bin"
    assert cli.main(["stage", "--checkpoint", str(folder), "--layers", "3", "--target", str(target),
                     "--no-progress"]) == 0
    manifest = f"{target}.manifest.json"
    assert Manifest.load(manifest).layout.layer_ids == (3,)
    assert cli.main(["verify", manifest, "--rows", "4000", "--no-progress"]) == 0
    capsys.readouterr()
    ckpt = folder / "model.safetensors"   # flip every value byte of the table's rows in the checkpoint
    m = Manifest.load(manifest)
    data = bytearray(ckpt.read_bytes())
    for entry in m.source["identity"]["layers"]["3"]["tensors"]["weight"]:
        lo = entry["offset_bytes"]
        data[lo:lo + entry["nbytes"]] = bytes(b ^ 0x01 for b in data[lo:lo + entry["nbytes"]])
    ckpt.write_bytes(bytes(data))
    assert cli.main(["verify", manifest, "--rows", "400", "--no-progress", "--no-pages"]) != 0


def _edit(folder: Path, **text: object) -> None:
    doc = json.loads((folder / "config.json").read_text())
    doc["text_config"].update(text)
    (folder / "config.json").write_text(json.dumps(doc))


def test_checkpoints_that_do_not_fit_the_config_are_refused(world, tmp_path):
    folder = qwen_checkpoint(tmp_path / "q", world, parts=4)
    _edit(folder, split_ngram_parts=5)   # SGLang would place the shards at other rows
    with pytest.raises(SlackTierError, match="shard") as err:
        stage_checkpoint(folder, [tmp_path / "a.bin"], 1, progress=False)
    assert err.value.kind is ErrorKind.CHECKPOINT
    _edit(folder, split_ngram_parts=4, ngram_vocab_size_base=BASE + 500)   # other head sizes: other padded rows
    with pytest.raises(SlackTierError, match="shape"):
        stage_checkpoint(folder, [tmp_path / "b.bin"], 1, progress=False)
    _edit(folder, ngram_vocab_size_base=BASE, ple_layer_ids=[2])   # layer 3 is not a PLE layer of this model
    with pytest.raises(SlackTierError, match="ple_layer_ids"):
        stage_checkpoint(folder, [tmp_path / "c.bin"], 1, progress=False)
    (folder / "config.json").unlink()
    with pytest.raises(SlackTierError, match="config.json") as err:
        stage_checkpoint(folder, [tmp_path / "d.bin"], 1, progress=False)
    assert err.value.kind is ErrorKind.MISSING


def test_a_bf16_table_is_refused(world, tmp_path):
    from safetensors.torch import save_file

    folder = qwen_checkpoint(tmp_path / "q", world, parts=1)
    lay = world.layouts[1]
    tensors = {f"model.language_model.layers.{layer}.ple.ple_embedding.ngram_embedding.shard_0.weight":
               torch.zeros(world.layouts[layer].padded_rows, 256, dtype=torch.bfloat16) for layer in LAYERS}
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(SlackTierError, match="BF16.*fp8") as err:
        stage_checkpoint(folder, [tmp_path / "a.bin"], 1, progress=False)
    assert err.value.kind is ErrorKind.CHECKPOINT and lay.rows
