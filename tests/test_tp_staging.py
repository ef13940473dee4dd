"""`slacktier stage --checkpoint DIR --ranks N` cuts rank regions by the serving engines' hash-column shards, records
them in the manifest, and `inspect --tp N` says which engine's sharding a manifest fits; tables.tp_sharding's
start-up refusals name both sides and the command that fixes them.

The engines' own functions (SGLang's shard_range, vLLM's ParallelEngramEmbedding) are compared with
tables.tp_sharding's rules in tests/test_adapters_sglang.py and tests/test_adapters_vllm.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from slacktier import cli
from slacktier.errors import ErrorKind, SlackTierError
from slacktier.tables.engram_hash import EngramLayout
from slacktier.tables.manifest import Manifest, manifest_digest
from slacktier.tables.stage import layout_from_model_config, stage_synthetic
from slacktier.tables.tp_sharding import SGLANG, VLLM, check_rank_rows, check_staged_for, manifest_fits, \
    sglang_rank_rows, vllm_rank_rows

VOCAB = 200
LAYERS = (1, 14)


def _config(layout: EngramLayout, **change) -> dict:
    return {"engram_layer_ids": list(LAYERS), "engram_num_embeddings": list(layout.rows_per_layer),
            "engram_max_ngram_size": 4, "engram_n_heads": 8, "engram_vocab_size": VOCAB, "engram_head_dim": 256,
            "engram_pad_token_id": 2, "engram_compressed_vocab_size": 99_092} | change


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A scaled V4-shaped Engram checkpoint: model.safetensors and its config.json in one directory."""
    import torch
    from safetensors.torch import save_file

    layout = EngramLayout.scaled(VOCAB)
    d = tmp_path_factory.mktemp("ckpt") / "model"
    d.mkdir()
    rng = np.random.default_rng(5)
    save_file({f"layers.{layer}.engram.embed.{part}": torch.from_numpy(
        rng.integers(0, 120, size=(layout.layer_rows(layer), n), dtype=np.uint8)).view(dtype)
        for layer in LAYERS for part, n, dtype in (("weight", 256, torch.float8_e4m3fn),
                                                   ("scale", 8, torch.float8_e8m0fnu))},
        str(d / "model.safetensors"))
    (d / "config.json").write_text(json.dumps({"text_config": _config(layout)}))   # nested, as V4.1's may be
    return d


def _stage(o_direct_dir: Path, *args: str) -> int:
    return cli.main(["stage", *args, "--target", str(o_direct_dir / "t.bin"), "--overwrite", "--no-progress"])


def _manifest(o_direct_dir: Path) -> Manifest:
    return Manifest.load(str(o_direct_dir / "t.bin") + ".manifest.json")


@pytest.mark.parametrize("ranks", [2, 4])
def test_checkpoint_staged_for_n_ranks_holds_the_engines_shards(ckpt, o_direct_dir, ranks):
    assert _stage(o_direct_dir, "--checkpoint", str(ckpt), "--ranks", str(ranks)) == 0
    m = _manifest(o_direct_dir)
    layout = EngramLayout.scaled(VOCAB)
    assert m.sharding_rule == "hash-columns"
    for layer in LAYERS:
        bounds = layout.layer_column_bounds(layer)
        assert m.layout.column_bounds[layer] == bounds
        for rank in range(ranks):
            want = bounds[rank * 24 // ranks], bounds[(rank + 1) * 24 // ranks]
            r = m.region(layer, rank)
            assert (r.row_start, r.row_start + r.rows) == want
            assert want == sglang_rank_rows(bounds, ranks, rank) == vllm_rank_rows(bounds, ranks, rank)
        recorded = json.loads(Path(m.path).read_text())["sharding"]
        assert recorded["rule"] == "hash-columns" and recorded["ranks"] == ranks
        assert recorded["rank_rows"][str(layer)] == [[[bounds[k * 24 // ranks], bounds[(k + 1) * 24 // ranks]]]
                                                      for k in range(ranks)]
    assert all(f.fits for f in manifest_fits(m, ranks))


def test_balanced_partition_from_a_checkpoint(ckpt, o_direct_dir):
    assert _stage(o_direct_dir, "--checkpoint", str(ckpt), "--ranks", "2", "--partition", "balanced") == 0
    m = _manifest(o_direct_dir)
    assert m.partition_kind == "balanced" and m.sharding_rule == "balanced"
    bounds = m.layout.column_bounds[1]
    assert m.rank_rows(1)[1] == [(bounds[4], bounds[8]), (bounds[12], bounds[16]), (bounds[20], bounds[24])]
    fits = manifest_fits(m, 2)
    assert all(f.fits for f in fits) and "balanced partition" in fits[0].why


def test_without_the_models_layout_several_ranks_are_refused_before_writing(ckpt, o_direct_dir, tmp_path, capsys):
    import shutil

    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(ckpt / "model.safetensors", bare / "model.safetensors")
    for extra in ((), ("--partition", "balanced")):
        ranks = "2" if not extra else "1"
        assert _stage(tmp_path, "--checkpoint", str(bare), "--ranks", ranks, *extra) == 2
        err = capsys.readouterr().err
        assert "needs the model's hash-column bounds" in err and "--config MODEL/config.json" in err
        assert not (tmp_path / "t.bin").exists()
    # the fix, followed: --config names the model's config.json (or --engram its vocab size)
    assert _stage(tmp_path, "--checkpoint", str(bare), "--ranks", "2", "--config", str(ckpt / "config.json")) == 0
    assert _manifest(tmp_path).sharding_rule == "hash-columns"
    assert _stage(tmp_path, "--checkpoint", str(bare), "--ranks", "4", "--engram", str(VOCAB)) == 0
    assert _manifest(tmp_path).sharding_rule == "hash-columns"
    assert _stage(tmp_path, "--checkpoint", str(bare), "--ranks", "1") == 0   # one rank: the whole table
    assert _manifest(tmp_path).layout.column_bounds == {}


def test_a_config_of_another_layout_is_refused(ckpt, tmp_path, capsys):
    layout = EngramLayout.scaled(VOCAB)
    wrong = tmp_path / "wrong.json"
    wrong.write_text(json.dumps(_config(layout, engram_vocab_size=VOCAB + 50)))
    with pytest.raises(SlackTierError, match="are not the sums of its hash primes"):
        layout_from_model_config(wrong)
    other = EngramLayout.scaled(VOCAB + 50)
    wrong.write_text(json.dumps(_config(other, engram_vocab_size=VOCAB + 50)))
    assert _stage(tmp_path, "--checkpoint", str(ckpt), "--ranks", "2", "--config", str(wrong)) == 2
    assert "rows in the checkpoint, the layout expects" in capsys.readouterr().err
    wrong.write_text(json.dumps({"hidden_size": 64}))
    with pytest.raises(SlackTierError, match="has no engram_layer_ids"):
        layout_from_model_config(wrong)
    assert layout_from_model_config(ckpt / "config.json") == layout


def test_inspect_says_which_engines_sharding_fits(ckpt, o_direct_dir, tmp_path, capsys):
    assert _stage(o_direct_dir, "--checkpoint", str(ckpt), "--ranks", "4") == 0
    path = str(o_direct_dir / "t.bin") + ".manifest.json"
    assert cli.main(["inspect", path, "--tp", "4"]) == 0
    out = capsys.readouterr().out
    assert f"TP 4: fits {SGLANG}'s sharding: whole hash columns, 6 per rank" in out
    assert f"TP 4: fits {VLLM}'s sharding" in out
    assert cli.main(["inspect", path, "--tp", "2"]) == 2
    assert "staged with 4 ranks" in capsys.readouterr().err
    # a table cut by equal rows (no column bounds): no engine's TP 2 shards, each engine's reason named
    equal = stage_synthetic([tmp_path / "e.bin"], {1: 5_000, 14: 5_000}, 2, 0, progress=False)
    assert equal.sharding_rule == "equal-rows"
    fits = manifest_fits(equal, 2)
    assert [f.fits for f in fits] == [False, False] and "without hash-column bounds" in fits[1].why
    assert all(f.fits for f in manifest_fits(equal, 1))   # TP 1 serves every region


def test_sglang_and_vllm_shards_agree_for_v41_where_tp_divides_the_columns():
    layout = EngramLayout.v41()
    for layer in layout.layer_ids:
        bounds = layout.layer_column_bounds(layer)
        for tp in (1, 2, 3, 4, 6, 8, 12, 24):
            for rank in range(tp):
                assert sglang_rank_rows(bounds, tp, rank) == vllm_rank_rows(bounds, tp, rank)
        # TP 5: SGLang splits rows equally, vLLM gives 5, 5, 5, 5, 4 heads (both plug-ins refuse it)
        assert sglang_rank_rows(bounds, 5, 4) != vllm_rank_rows(bounds, 5, 4) == (bounds[20], bounds[24])
        assert vllm_rank_rows(bounds, 7, 0) is None   # 4 heads each would leave rank 6 none: vLLM asserts


def test_an_edited_sharding_record_is_refused(ckpt, o_direct_dir):
    assert _stage(o_direct_dir, "--checkpoint", str(ckpt), "--ranks", "2") == 0
    path = Path(str(o_direct_dir / "t.bin") + ".manifest.json")
    doc = json.loads(path.read_text())
    doc["sharding"]["rank_rows"]["1"][0][0][1] += 1
    doc["manifest_digest"] = manifest_digest(doc)   # even with its digest recomputed
    path.write_text(json.dumps(doc))
    with pytest.raises(SlackTierError, match=r"\$\.sharding"):
        Manifest.load(path)


def test_start_up_refusals_name_both_sides_and_the_fix(ckpt, o_direct_dir, tmp_path):
    assert _stage(o_direct_dir, "--checkpoint", str(ckpt), "--ranks", "4", "--only-ranks", "0,1") == 0
    m = _manifest(o_direct_dir)
    check_staged_for(m, "rank1.toml", SGLANG, 4, 1, 1)   # staged for this TP and rank
    with pytest.raises(SlackTierError) as err:   # another TP
        check_staged_for(m, "rank1.toml", VLLM, 2, 1, 1)
    assert "staged for 4 TP ranks; vLLM 0.33.0 runs TP 2" in err.value.message
    assert "--ranks 2 --partition columns" in err.value.fix and err.value.kind is ErrorKind.BAD_INPUT
    with pytest.raises(SlackTierError) as err:   # this rank's region is on another machine
        check_staged_for(m, "rank3.toml", SGLANG, 4, 3, 14)
    assert err.value.kind is ErrorKind.MISSING and "holds ranks [0, 1]" in err.value.message
    assert "--ranks 4 --partition columns --only-ranks 3" in err.value.fix
    equal = stage_synthetic([tmp_path / "e.bin"], {1: 5_000, 14: 5_000}, 2, 0, progress=False)
    with pytest.raises(SlackTierError) as err:   # no engine's sharding
        check_staged_for(equal, "rank0.toml", SGLANG, 2, 0, 1)
    assert "without the model's hash-column bounds" in err.value.message and "--config" in err.value.fix
    bounds = m.layout.column_bounds[1]
    with pytest.raises(SlackTierError) as err:   # a region that is not the engine's rank's rows
        check_rank_rows(m, "rank0.toml", SGLANG, 4, 0, 1, (0, bounds[6]), (0, bounds[6] - 1))
    assert f"owns rows [0, {bounds[6]}) (hash columns 0..5)" in err.value.message
    check_rank_rows(m, "rank0.toml", SGLANG, 4, 0, 1, (0, bounds[6]), (0, bounds[6]))
