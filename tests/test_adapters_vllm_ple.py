"""The vLLM plug-in's PLE backend against vLLM 0.33.0's own Qwen4Exp n-gram code, on this CPU.

What runs here: the plug-in loads through vLLM's load_general_plugins() and patches the
Qwen4Exp seams; vLLM's own `Qwen4ExpNGramEmbedding` builds the third backend
(`ServedPLEEmbedding`) in place of its storage classes; its CPU hash
(`compute_ngram_ids`, torch ops) equals SlackTier's PleHasher; and the rows, through
vLLM's prefetch interface (`start_prefetch`, `finalize_prefetch`) and its own
`dequantize`, equal vLLM's resident fp8 table's (`Qwen4ExpPLEDeviceEmbedding`: F.embedding,
then the same `dequantize`) bit for bit. vLLM's pinned-host backend (its Triton UVA
lookup) and its Triton hash need a GPU (benchmarks/engine/gpu_check_vllm.py, part
ple, not yet run on a GPU).

vLLM asks its process groups for TP and ETP sizes and ranks; a CPU process has none,
so the tests state them through those same getters (pytest's monkeypatch), as
tests/test_adapters_vllm.py does, and the vLLM config through get_current_vllm_config.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from engines import VLLM_VERSION, import_vllm
from ple_common import BASE, DIM, EOS, LAYERS, SCALE, VOCAB, assert_same_rows, padded, ple_control, ple_world, \
    qwen_checkpoint, same_rows, shard_stream
from slacktier.adapters import vllm as plug
from slacktier.adapters import vllm_ple as ple
from slacktier.errors import ErrorKind, SlackTierError
from slacktier.tables.ple_hash import PleHasher

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def vl() -> SimpleNamespace:
    return SimpleNamespace(ngram=import_vllm(ple.NGRAM_MODULE), common=import_vllm(
        "vllm.models.qwen4_exp.common.ngram_embedding"), parameter=import_vllm("vllm.model_executor.parameter"),
        config=import_vllm("vllm.config"), engram_config=import_vllm("vllm.config.engram"),
        distributed=import_vllm("vllm.distributed"), plugins=import_vllm("vllm.plugins"))


@pytest.fixture
def worker(vl: SimpleNamespace, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """One TP-1 worker's groups and config, stated through vLLM's own getters; `worker(tp=2)` another TP size."""
    def state(tp: int = 1, cpu_offload: bool = False) -> None:
        group = SimpleNamespace(world_size=tp, rank_in_group=0)
        for module in (vl.ngram, vl.common):
            monkeypatch.setattr(module, "get_etp_group", lambda: group)
            monkeypatch.setattr(module, "get_tp_group", lambda: group)
        monkeypatch.setattr(vl.parameter, "get_tensor_model_parallel_rank", lambda: 0)
        monkeypatch.setattr(vl.parameter, "get_tensor_model_parallel_world_size", lambda: tp)
        monkeypatch.setattr(vl.distributed, "get_tensor_model_parallel_rank", lambda: 0)
        config = SimpleNamespace(parallel_config=vl.config.ParallelConfig(tensor_parallel_size=tp),
                                 engram_config=vl.engram_config.EngramConfig(cpu_offload=cpu_offload),
                                 model_config=SimpleNamespace(enforce_eager=True), additional_config={},
                                 speculative_config=None)
        monkeypatch.setattr(vl.config, "get_current_vllm_config", lambda: config)
        monkeypatch.setattr(vl.ngram, "get_current_vllm_config", lambda: config)
    state()
    yield state
    plug.close()


@pytest.fixture(scope="module")
def world(vl: SimpleNamespace, o_direct_module_dir: Path) -> SimpleNamespace:
    return ple_world(o_direct_module_dir)


def _hf_config(dtype: str | None = "float8_e4m3fn", dim: int = DIM) -> Any:
    from transformers import Qwen4ExpTextConfig

    return Qwen4ExpTextConfig(ple_embed_dim=dim, ngram_vocab_size_base=BASE, vocab_size=VOCAB, eos_token_id=EOS,
                              ple_embedding_dtype=dtype)


def _ngram(vl: SimpleNamespace, layer: int, dtype: str | None = "float8_e4m3fn", dim: int = DIM) -> Any:
    return vl.ngram.Qwen4ExpNGramEmbedding(_hf_config(dtype, dim), dim, LAYERS.index(layer), 512,
                                           data_parallel_rank=0, prefix=f"model.layers.{layer}.ple.ple_embedding")


def _load(module: Any, rows: torch.Tensor | None) -> Any:
    """What vLLM's loader does: the checkpoint's (padded) rows, then its per-tensor scale."""
    emb = module.ngram_embedding
    if rows is not None:
        emb.weight.weight_loader(emb.weight, padded(rows, emb.org_vocab_size), checkpoint_start=0)
    emb.weight_scale.weight_loader(emb.weight_scale, torch.tensor([SCALE]))
    return module


def _steps(world: SimpleNamespace) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(input_ids, query_start_loc, ngram_context): a prefill of both requests, then one decode token each."""
    p0, p1 = world.prompts
    prefill = (torch.from_numpy(np.concatenate([p0, p1])), torch.tensor([0, len(p0), len(p0) + len(p1)]),
               torch.full((2, 2), EOS, dtype=torch.long))
    decode = (torch.from_numpy(world.next_tokens[:2]), torch.tensor([0, 1, 2]),
              torch.from_numpy(np.stack([p0[-2:], p1[-2:]])))
    return [prefill, decode]


def test_entry_point_loads_the_ple_backend(vl, monkeypatch):
    classes = [(getattr(import_vllm(m), c), method) for m, c, method in ple.PATCHED]
    monkeypatch.setenv("VLLM_PLUGINS", "slacktier")
    monkeypatch.setenv(plug.CONTROL_ENV, "/etc/slacktier/rank{tp_rank}.toml")
    vl.plugins.load_general_plugins()
    patched = [cls.__dict__[m] for cls, m in classes]
    assert all(getattr(p, "__slacktier__", False) and hasattr(p, "__wrapped__") for p in patched)
    plug.register()   # again: patched once
    assert [cls.__dict__[m] for cls, m in classes] == patched
    served = ple.served_embedding_class()
    assert issubclass(served, vl.common.Qwen4ExpPLEEmbedding) and served.supports_prefetch


def test_ple_hash_and_rows_equal_vllms_bit_for_bit(vl, world, worker, monkeypatch, tmp_path):
    """vLLM's CPU hash equals PleHasher; through start_prefetch / finalize_prefetch and vLLM's dequantize (times the
    per-tensor scale), both layers' embeddings equal vLLM's resident fp8 table's, over a prefill and a decode step."""
    monkeypatch.setenv(plug.CONTROL_ENV, "unused.toml")
    plug.register()
    monkeypatch.delenv(plug.CONTROL_ENV)
    stock = {layer: _load(_ngram(vl, layer), world.tables[layer]) for layer in LAYERS}
    monkeypatch.setenv(plug.CONTROL_ENV, str(ple_control(tmp_path / "tp1.toml", world.manifest)))
    served = {layer: _ngram(vl, layer) for layer in LAYERS}
    for layer, module in served.items():
        emb = module.ngram_embedding
        assert type(emb).__name__ == "ServedPLEEmbedding" and emb.weight.shape == (0, 256)
        assert emb.shard_indices == stock[layer].ngram_embedding.shard_indices   # vLLM's geometry, TP 1
        _load(module, world.tables[layer])   # rows skipped: a no-op on the zero-row weight
        assert emb.weight.shape == (0, 256) and float(emb.weight_scale) == pytest.approx(SCALE)
    history = [None, None]
    for step, (ids, qsl, context) in enumerate(_steps(world)):
        for layer in LAYERS:
            got_ids = stock[layer].compute_ngram_ids(ids, qsl, context).numpy()
            hasher = PleHasher(world.layouts[layer])
            want_ids = (np.concatenate([hasher.prefill(p) for p in world.prompts]) if step == 0
                        else hasher.decode(ids.numpy(), np.stack(history)))
            np.testing.assert_array_equal(got_ids, want_ids)
        with plug.step():
            for layer in LAYERS:   # the model starts each layer's prefetch one layer ahead
                served[layer].start_prefetch(ids, qsl, context)
            for layer in LAYERS:
                got = served[layer](None, ids, qsl, context)
                want = stock[layer](None, ids, qsl, context)
                assert want.dtype == torch.float8_e4m3fn and got.shape == (len(ids), DIM)
                emb, ref = served[layer].ngram_embedding, stock[layer].ngram_embedding
                assert_same_rows(emb.dequantize(got, torch.bfloat16), ref.dequantize(want, torch.bfloat16))
        history = [p[-2:] for p in world.prompts]


def test_error_in_forward_ends_the_step(vl, world, worker, monkeypatch, tmp_path):
    monkeypatch.setenv(plug.CONTROL_ENV, str(ple_control(tmp_path / "tp1.toml", world.manifest)))
    plug.register()
    served = {layer: _load(_ngram(vl, layer), None) for layer in LAYERS}
    ids, qsl, context = _steps(world)[0]
    with pytest.raises(RuntimeError, match="a layer failed"):
        with plug.step():
            served[1].start_prefetch(ids, qsl, context)
            served[3].start_prefetch(ids, qsl, context)
            raise RuntimeError("a layer failed")
    with plug.step():   # begin_step would refuse a step still open
        for layer in LAYERS:
            served[layer].start_prefetch(ids, qsl, context)
        assert served[1](None, ids, qsl, context).shape == (len(ids), DIM)


def test_dram_table_stays_vllms_own(vl, world, worker, monkeypatch, tmp_path):
    monkeypatch.setenv(plug.CONTROL_ENV, str(ple_control(tmp_path / "d.toml", world.manifest, dram=(3,))))
    plug.register()
    assert type(_ngram(vl, 1).ngram_embedding).__name__ == "ServedPLEEmbedding"
    own = _ngram(vl, 3).ngram_embedding
    assert type(own).__name__ == "Qwen4ExpPLEDeviceEmbedding" and own.weight.shape[0] >= world.layouts[3].rows
    assert vl.ngram.Qwen4ExpPLEDeviceEmbedding is vl.common.Qwen4ExpPLEDeviceEmbedding   # the swap was undone


@pytest.mark.parametrize("dtype, dim, words", [
    (None, DIM, "unquantized.*no exact fp8 form"),
    ("nvfp4", DIM, "NVFP4"),
    ("float8_e4m3fn", 16 * 128, "rows of 128 values"),
])
def test_formats_outside_slacktiers_rows_are_refused(vl, world, worker, monkeypatch, tmp_path, dtype, dim, words):
    monkeypatch.setenv(plug.CONTROL_ENV, str(ple_control(tmp_path / "tp1.toml", world.manifest)))
    plug.register()
    with pytest.raises(SlackTierError, match=words) as err:
        _ngram(vl, 1, dtype, dim)
    assert err.value.kind is ErrorKind.UNSUPPORTED and 'source = "dram"' in err.value.fix


def test_tp2_is_refused(vl, world, worker, monkeypatch, tmp_path):
    worker(tp=2)
    monkeypatch.setenv(plug.CONTROL_ENV, str(tmp_path / "rank{tp_rank}.toml"))
    plug.register()
    with pytest.raises(SlackTierError, match="PLE table at TP 2"):
        _ngram(vl, 1)
    base = dict(version=VLLM_VERSION, tp_size=1, tp_rank=0)
    plug.check_scope(plug.VllmServing(**base), 16, "PLE")
    with pytest.raises(SlackTierError, match="--enforce-eager"):
        plug.check_scope(plug.VllmServing(**base, enforce_eager=False), 16, "PLE")


# ---- a Qwen4Exp checkpoint staged by the CLI, and its identity ---------------------------------------------


def _module_stream(folder: Path, layer: int) -> list[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors of decoder layer `layer`'s n-gram module, named as its own load_weights reads them."""
    prefix = f"model.language_model.layers.{layer}.ple.ple_embedding."
    return [(name[len(prefix):], t) for name, t in shard_stream(folder) if name.startswith(prefix)]


def _split_ngram(vl: SimpleNamespace, layer: int) -> Any:
    from transformers import Qwen4ExpTextConfig

    config = Qwen4ExpTextConfig(ple_embed_dim=DIM, ngram_vocab_size_base=BASE, vocab_size=VOCAB, eos_token_id=EOS,
                                ple_embedding_dtype="float8_e4m3fn", split_ngram_parts=4)
    return vl.ngram.Qwen4ExpNGramEmbedding(config, DIM, LAYERS.index(layer), 512, data_parallel_rank=0,
                                           prefix=f"model.layers.{layer}.ple.ple_embedding")


def test_a_qwen_checkpoint_staged_by_the_cli_is_served_bit_for_bit(vl, world, worker, monkeypatch, tmp_path):
    """`slacktier stage --checkpoint DIR` stages the Qwen4Exp shards by their own names; vLLM's own
    Qwen4ExpNGramEmbedding.load_weights hands the served table the shards (identity checked) and loads the scale;
    rows through vLLM's prefetch and dequantize equal its resident table's, and not another table's."""
    from slacktier import cli

    folder = qwen_checkpoint(tmp_path / "qwen", world)
    target = tmp_path / "qwen.bin"
    assert cli.main(["stage", "--checkpoint", str(folder), "--target", str(target), "--no-progress"]) == 0
    monkeypatch.setenv(plug.CONTROL_ENV, "unused.toml")
    plug.register()
    monkeypatch.delenv(plug.CONTROL_ENV)
    stock = {layer: _load(_ngram(vl, layer), world.tables[layer]) for layer in LAYERS}
    other = {layer: _load(_ngram(vl, layer), torch.flip(world.tables[layer], [0])) for layer in LAYERS}
    monkeypatch.setenv(plug.CONTROL_ENV, str(ple_control(tmp_path / "q.toml", f"{target}.manifest.json")))
    served = {layer: _split_ngram(vl, layer) for layer in LAYERS}
    for layer, module in served.items():
        assert module.ngram_embedding.org_vocab_size == world.layouts[layer].padded_rows
        module.load_weights(_module_stream(folder, layer))
        emb = module.ngram_embedding
        assert emb._slacktier_identity.done and emb.weight.shape == (0, 256)
        assert float(emb.weight_scale) == pytest.approx(SCALE)
    differs = 0
    for ids, qsl, context in _steps(world):
        with plug.step():
            for layer in LAYERS:
                served[layer].start_prefetch(ids, qsl, context)
            for layer in LAYERS:
                emb = served[layer].ngram_embedding
                got = emb.dequantize(served[layer](None, ids, qsl, context), torch.bfloat16)
                ref = stock[layer].ngram_embedding
                assert_same_rows(got, ref.dequantize(stock[layer](None, ids, qsl, context), torch.bfloat16))
                differs += not same_rows(got, ref.dequantize(other[layer](None, ids, qsl, context), torch.bfloat16))
    assert differs == 2 * 2


def test_a_ple_table_from_another_checkpoint_is_refused_at_load(vl, world, worker, monkeypatch, tmp_path):
    from slacktier import cli

    staged = qwen_checkpoint(tmp_path / "qwen", world)
    target = tmp_path / "qwen.bin"
    assert cli.main(["stage", "--checkpoint", str(staged), "--target", str(target), "--no-progress"]) == 0
    other = qwen_checkpoint(tmp_path / "other", world, seed=70)
    monkeypatch.setenv(plug.CONTROL_ENV, str(ple_control(tmp_path / "q.toml", f"{target}.manifest.json")))
    plug.register()
    module = _split_ngram(vl, 1)
    with pytest.raises(SlackTierError) as err:
        module.load_weights(_module_stream(other, 1))
    text = str(err.value)
    assert err.value.kind is ErrorKind.CHECKPOINT and "\n" not in text and "qwen/model.safetensors" in text
