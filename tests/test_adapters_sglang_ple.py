"""The SGLang plug-in's PLE part against SGLang 0.5.23's own Qwen4Exp n-gram code, run on this CPU.

Oracles are SGLang's installed modules: its `_prepare_ple_batch` / `_commit_ple_batch`
(the step's n-gram context and its history), `Qwen4ExpNGramEmbedding.compute_ngram_ids`
(the hash) and, for rows, its resident-table path (`ple_offload_embedding = false`: a
VocabParallelEmbedding loaded through its own weight_loader, looked up with
F.embedding, then multiplied by the per-tensor `weight_scale`), the one SGLang
gather that runs on a CPU. The served table is SGLang's offloaded
`Qwen4ExpPinnedHostEmbedding`, built through the plug-in's hooks, applied by
SGLang's real `load_plugins()` and `HookRegistry`; its `forward` (gather, reduce)
and the scale multiplication stay SGLang's. SGLang's stock pinned-host gather is a
Triton kernel over a pinned (or file-mapped) host table read through UVA: against
it the rows need a GPU (benchmarks/engine/gpu_check_sglang.py, part ple, not yet run on a GPU).

SGLang's request pool (the per-request n-gram history the batch reads) is a small
fake with the three methods SGLang calls; everything else is SGLang's code.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from engines import SGLANG_VERSION, import_sglang, sglang_plugin_loaded
from ple_common import DIM, EOS, LAYERS, SCALE, RequestPool, assert_same_rows, fp8_rows, padded, ple_control, \
    ple_world, qwen_checkpoint, same_rows, sglang_batches, sglang_ngram, sglang_text_config, shard_stream
from slacktier.adapters import sglang as plug
from slacktier.adapters import sglang_binding
from slacktier.adapters import sglang_ple as ple
from slacktier.config import ControlFile, TableConfig, write_control
from slacktier.errors import ErrorKind, SlackTierError
from slacktier.tables.ple_hash import PleHasher
from slacktier.tables.stage import stage_checkpoint

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def sg() -> Iterator[SimpleNamespace]:
    """SGLang's modules, a published test context (overlap scheduler off), and the plug-in loaded."""
    qwen = import_sglang(ple.MODULE)
    modes = import_sglang("sglang.srt.model_executor.forward_batch_info")
    with sglang_plugin_loaded(plug.CONTROL_ENV) as rc:
        yield SimpleNamespace(qwen=qwen, rc=rc, ForwardMode=modes.ForwardMode)
        plug.close()


@pytest.fixture(scope="module")
def world(sg: SimpleNamespace, o_direct_module_dir: Path) -> SimpleNamespace:
    return ple_world(o_direct_module_dir)


@pytest.fixture
def tp1(sg: SimpleNamespace, monkeypatch: pytest.MonkeyPatch) -> Iterator[RequestPool]:
    """TP 1 published, and a fresh request pool for two requests."""
    pool = RequestPool(2)
    monkeypatch.setattr(sg.qwen, "get_req_to_token_pool", lambda: pool)
    with sg.rc.get_parallel().override(tp_size=1, tp_rank=0, attn_tp_size=1, moe_tp_size=1, tp_group=None):
        yield pool
    plug.close()


def _stock(sg: SimpleNamespace, world: SimpleNamespace, layer: int) -> Any:
    """SGLang's resident table, loaded through its own weight_loader, with the per-tensor scale."""
    module = sglang_ngram(sg.qwen, sglang_text_config(offload=False), layer)
    emb = module.ngram_embedding
    emb.weight_loader(emb.weight, padded(world.tables[layer], world.layouts[layer].padded_rows))
    emb.weight_scale.fill_(SCALE)
    return module


def _served(sg: SimpleNamespace, layer: int) -> Any:
    module = sglang_ngram(sg.qwen, sglang_text_config(offload=True), layer)
    module.ngram_embedding.weight_scale.fill_(SCALE)   # what SGLang's loader does with the checkpoint's scale
    return module


def _prepare(sg: SimpleNamespace, ids: torch.Tensor, batch: Any) -> Any:
    """SGLang's own (patched) _prepare_ple_batch, called as Qwen4ExpModel.forward calls it."""
    return sg.qwen._prepare_ple_batch(input_ids=ids, forward_batch=batch, ngram_size=3, ngram_eos_token_id=EOS)


# ---- layout and hash ---------------------------------------------------------------------------------------


def test_sglang_ple_hash_and_layout_equal_slacktiers(sg, world, tp1):
    """SGLang's sizes, offsets and multipliers are PleLayout's; its ids over a prefill and decode are PleHasher's."""
    stock = {layer: _stock(sg, world, layer) for layer in LAYERS}
    history = {r: None for r in range(2)}
    for ids, batch in sglang_batches(sg.ForwardMode, world):
        pb = _prepare(sg, ids, batch)
        for layer, lay in world.layouts.items():
            m = stock[layer]
            assert m.ngram_heads_vocab_sizes.tolist() == list(lay.sizes)
            assert m.layer_multipliers.tolist() == list(lay.multipliers)
            got = m.compute_ngram_ids(pb).numpy()
            hasher = PleHasher(lay)
            if batch.forward_mode.is_extend():
                want = np.concatenate([hasher.prefill(p) for p in world.prompts])
            else:
                want = hasher.decode(ids.numpy(), np.stack([history[r] for r in range(2)]))
            np.testing.assert_array_equal(got, want)
        sg.qwen._commit_ple_batch(pb, batch)
        chunks = world.prompts if batch.forward_mode.is_extend() else [ids[r:r + 1].numpy() for r in range(2)]
        for r in range(2):
            history[r] = PleHasher(world.layouts[LAYERS[0]]).next_history(history[r], chunks[r])


def test_entry_point_registers_the_ple_hooks(sg):
    import pkgutil

    for target, _ in ple.PATCHED:
        assert hasattr(pkgutil.resolve_name(target), "__wrapped__"), f"{target} not patched by HookRegistry"


# ---- rows ---------------------------------------------------------------------------------------------------


def test_ple_rows_equal_sglangs_resident_table_bit_for_bit(sg, world, tp1, monkeypatch, tmp_path):
    """A prefill of two requests and five decode steps, both tables: each layer's bf16 embeddings (rows times the
    per-tensor scale, SGLang's own multiplication) equal the stock path's; the history SGLang commits carries on."""
    stock = {layer: _stock(sg, world, layer) for layer in LAYERS}
    monkeypatch.setenv(plug.CONTROL_ENV, str(ple_control(tmp_path / "tp1.toml", world.manifest)))
    served = {layer: _served(sg, layer) for layer in LAYERS}
    for module in served.values():
        assert module.ngram_embedding.weight.shape == (0, 256)   # no host table in SGLang
    steps = 0
    for ids, batch in sglang_batches(sg.ForwardMode, world):
        pb = _prepare(sg, ids, batch)   # begin_step: both layers' ids
        for layer in LAYERS:
            want = stock[layer](pb, batch)
            got = served[layer](pb, batch)
            assert got.shape == (len(ids), DIM)
            assert_same_rows(got, want)
        sg.qwen._commit_ple_batch(pb, batch)   # end_step
        steps += 1
    assert steps == 6


def test_prefetch_into_sglangs_buffer(sg, world, tp1, monkeypatch, tmp_path):
    """The prefetch path's call, gather(ids, out=buffer): the rows land in SGLang's buffer."""
    stock = _stock(sg, world, LAYERS[0])
    monkeypatch.setenv(plug.CONTROL_ENV, str(ple_control(tmp_path / "tp1.toml", world.manifest)))
    served = {layer: _served(sg, layer) for layer in LAYERS}
    ids, batch = next(sglang_batches(sg.ForwardMode, world))
    pb = _prepare(sg, ids, batch)
    lookup = served[LAYERS[0]].compute_ngram_ids(pb)
    out = torch.full((*lookup.shape, 256), 7.0, dtype=torch.bfloat16)
    assert served[LAYERS[0]].ngram_embedding.gather(lookup, out=out) is out
    want = stock.ngram_embedding(lookup)   # rows before the scale
    assert_same_rows(out, want)
    with pytest.raises(SlackTierError, match="output buffer"):
        served[LAYERS[0]].ngram_embedding.gather(lookup, out=out[:, :8])
    sg.qwen._commit_ple_batch(pb, batch)


def test_error_in_forward_ends_the_step(sg, world, tp1, monkeypatch, tmp_path):
    """The patched Qwen4ExpModel.forward is `with step(): forward`: after an error the next step begins."""
    stock = _stock(sg, world, LAYERS[0])
    monkeypatch.setenv(plug.CONTROL_ENV, str(ple_control(tmp_path / "tp1.toml", world.manifest)))
    served = {layer: _served(sg, layer) for layer in LAYERS}
    batches = sglang_batches(sg.ForwardMode, world)
    ids, batch = next(batches)
    with pytest.raises(RuntimeError, match="a layer failed"):
        with plug.step():
            pb = _prepare(sg, ids, batch)
            served[LAYERS[0]](pb, batch)
            raise RuntimeError("a layer failed")
    pb = _prepare(sg, ids, batch)   # begin_step would refuse a step still open
    assert_same_rows(served[LAYERS[0]](pb, batch), stock(pb, batch))
    sg.qwen._commit_ple_batch(pb, batch)


def test_dram_table_stays_sglangs_own(sg, world, tp1, monkeypatch, tmp_path):
    """source = "dram": SGLang builds its own offloaded host table (its file backend, the one a CPU can map)."""
    monkeypatch.setenv(plug.CONTROL_ENV, str(ple_control(tmp_path / "d.toml", world.manifest, dram=(3,))))
    served = _served(sg, 1)
    config = sglang_text_config(offload=True, ple_offload_backend="file", ple_offload_dir=str(tmp_path))
    own = sglang_ngram(sg.qwen, config, 3)
    assert served.ngram_embedding.weight.shape[0] == 0
    assert own.ngram_embedding.weight.shape[0] >= world.layouts[3].rows   # SGLang's own rows (padded)


def test_checkpoint_rows_of_served_tables_are_skipped():
    served = {"model.layers.1.ple.ple_embedding.ngram_embedding"}
    for name in ("model.layers.1.ple.ple_embedding.ngram_embedding.weight",
                 "model.language_model.layers.1.ple.ple_embedding.ngram_embedding.shard_12.weight"):
        assert ple.served_row_tensor(name, served)
    for name in ("model.layers.1.ple.ple_embedding.ngram_embedding.weight_scale",
                 "model.layers.3.ple.ple_embedding.ngram_embedding.weight",
                 "model.layers.1.ple.key_proj.weight"):
        assert not ple.served_row_tensor(name, served)


# ---- refusals ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("config, words", [
    (dict(dtype=None), "bfloat16.*no exact fp8 form"),
    (dict(dim=16 * 128), "rows of 128 values"),
    (dict(offload=False), "ple_offload_embedding is false"),
])
def test_tables_outside_the_format_are_refused(sg, world, tp1, monkeypatch, tmp_path, config, words):
    monkeypatch.setenv(plug.CONTROL_ENV, str(ple_control(tmp_path / "tp1.toml", world.manifest)))
    settings = dict(offload=True) | config
    with pytest.raises(SlackTierError, match=words) as err:
        sg.qwen.Qwen4ExpNGramEmbedding(sglang_text_config(**settings), settings.get("dim", DIM), ple_layer_index=0,
                                       prefix="model.layers.1.ple.ple_embedding")
    assert err.value.kind is ErrorKind.UNSUPPORTED and 'source = "dram"' in err.value.fix


def test_a_table_staged_for_another_layout_is_refused(sg, world, tp1, monkeypatch, tmp_path):
    """The same rows staged with other head sizes (another ngram_vocab_size_base or PLE layer index) are refused."""
    layouts = world.layouts
    bounds = {layer: lay.column_bounds() for layer, lay in layouts.items()}
    bounds[1] = (0, bounds[1][1] + 2, *bounds[1][2:])
    manifest = stage_checkpoint(world.checkpoint, [world.dir / "other.bin"], ranks=1,
                                expected={layer: lay.rows for layer, lay in layouts.items()}, column_bounds=bounds,
                                overwrite=True, progress=False).path
    monkeypatch.setenv(plug.CONTROL_ENV, str(ple_control(tmp_path / "s.toml", manifest)))
    with pytest.raises(SlackTierError, match="another PLE hash layout"):
        _served(sg, 1)


def test_missing_table_and_tp2_are_refused(sg, world, monkeypatch, tmp_path):
    one = write_control(ControlFile(tables=(TableConfig(layer=3, manifest=world.manifest),)), tmp_path / "one.toml")
    monkeypatch.setenv(plug.CONTROL_ENV, str(one))
    with sg.rc.get_parallel().override(tp_size=1, tp_rank=0, attn_tp_size=1, moe_tp_size=1, tp_group=None):
        with pytest.raises(SlackTierError, match="no table for PLE layer 1") as err:
            _served(sg, 1)
        assert err.value.kind is ErrorKind.MISSING
    plug.close()
    monkeypatch.setenv(plug.CONTROL_ENV, str(tmp_path / "rank{tp_rank}.toml"))
    with sg.rc.get_parallel().override(tp_size=2, tp_rank=0, attn_tp_size=2, moe_tp_size=2, tp_group=None):
        with pytest.raises(SlackTierError, match="PLE table at TP 2"):
            _served(sg, 1)
    plug.close()


def test_an_unchecked_sglang_is_refused_when_the_ple_table_is_built(sg, world, tp1, monkeypatch, tmp_path):
    monkeypatch.setenv(plug.CONTROL_ENV, str(ple_control(tmp_path / "tp1.toml", world.manifest)))
    monkeypatch.setattr(sglang_binding, "installed_version", lambda: "0.5.24")
    with pytest.raises(SlackTierError, match="SGLang 0.5.24 is installed") as err:
        _served(sg, 1)
    assert err.value.kind is ErrorKind.UNSUPPORTED and f"sglang=={SGLANG_VERSION}" in err.value.fix


def test_prefix_without_a_layer_is_refused():
    assert ple.layer_of("model.language_model.layers.12.ple.ple_embedding") == 12
    with pytest.raises(SlackTierError, match="names no decoder layer"):
        ple.layer_of("ple.ple_embedding")


def test_breakable_prefill_graphs_are_refused_unless_the_gpu_check_opts_in(monkeypatch):
    """SGLang runs every PLE call of a prefill as an eager break; until a GPU run checks it, refused by default."""
    base = dict(version=SGLANG_VERSION, tp_size=1, tp_rank=0)
    breakable = plug.SglangServing(**base, prefill_graph="breakable")
    monkeypatch.delenv(plug.UNVERIFIED_ENV, raising=False)
    with pytest.raises(SlackTierError, match="not been run on a GPU"):
        plug.check_scope(breakable, 16, "PLE")
    monkeypatch.setenv(plug.UNVERIFIED_ENV, plug.BREAKABLE_PLE_PREFILL)
    plug.check_scope(breakable, 16, "PLE")
    plug.check_scope(breakable, 24)   # Engram: its calls are eager breaks
    with pytest.raises(SlackTierError, match="breakable CUDA graphs for decode"):
        plug.check_scope(plug.SglangServing(**base, decode_graph="breakable"), 16, "PLE")


# ---- a Qwen4Exp checkpoint staged by the CLI, and its identity ---------------------------------------------


def _load_through_the_hook(served: dict[int, Any], stream: list[tuple[str, torch.Tensor]]) -> list[str]:
    """The plug-in's load_weights hook over a checkpoint stream, around a stand-in for SGLang's own load_weights
    (which needs a whole Qwen4Exp model): returns the names the hook lets through to SGLang."""
    model = torch.nn.Module()
    model.config = SimpleNamespace(text_config=SimpleNamespace(split_ngram_parts=4))
    layers = torch.nn.ModuleDict()
    for layer, module in served.items():   # SGLang's own prefix: model.layers.N.ple.ple_embedding
        holder = torch.nn.Module()
        holder.ple = torch.nn.Module()
        holder.ple.ple_embedding = module
        layers[str(layer)] = holder
    model.model = torch.nn.Module()
    model.model.layers = layers
    return ple._around_load_weights(lambda m, weights: [name for name, _ in weights], model, stream)


def test_a_qwen_checkpoint_staged_by_the_cli_is_served_bit_for_bit(sg, world, tp1, monkeypatch, tmp_path):
    """`slacktier stage --checkpoint DIR` reads a Qwen4Exp model directory's PLE shards by their own names (head
    sizes from its config.json, SGLang's padding and shard rule); SGLang's loader stream passes the identity
    check and keeps the per-tensor scales; prefill and decode rows equal SGLang's resident table bit for bit,
    and not a table of other rows (the negative control)."""
    from slacktier import cli

    folder = qwen_checkpoint(tmp_path / "qwen", world)
    target = tmp_path / "qwen.bin"
    assert cli.main(["stage", "--checkpoint", str(folder), "--target", str(target), "--no-progress"]) == 0
    manifest = f"{target}.manifest.json"
    stock = {layer: _stock(sg, world, layer) for layer in LAYERS}
    other = {layer: _stock(sg, SimpleNamespace(layouts=world.layouts, tables={
        l: fp8_rows(world.layouts[l].rows, seed=50 + l) for l in LAYERS}), layer) for layer in LAYERS}
    monkeypatch.setenv(plug.CONTROL_ENV, str(ple_control(tmp_path / "q.toml", manifest)))
    served = {layer: _served(sg, layer) for layer in LAYERS}
    let_through = _load_through_the_hook(served, shard_stream(folder))
    assert sorted(let_through) == sorted(f"model.language_model.layers.{layer}.ple.ple_embedding.ngram_embedding."
                                         "weight_scale" for layer in LAYERS)   # the rows are skipped
    assert all(m.ngram_embedding._slacktier_identity.done for m in served.values())
    differs = 0
    for ids, batch in sglang_batches(sg.ForwardMode, world):
        pb = _prepare(sg, ids, batch)
        for layer in LAYERS:
            got = served[layer](pb, batch)
            assert_same_rows(got, stock[layer](pb, batch))
            differs += not same_rows(got, other[layer](pb, batch))
        sg.qwen._commit_ple_batch(pb, batch)
    assert differs == 2 * 6


def test_a_ple_table_from_another_checkpoint_is_refused_at_load(sg, world, tp1, monkeypatch, tmp_path):
    """SGLang's loader stream of another Qwen4Exp checkpoint of the same shapes: refused at the first shard that
    completes the sample, naming the manifest, its checkpoint and the tensor."""
    from slacktier import cli

    staged = qwen_checkpoint(tmp_path / "qwen", world)
    target = tmp_path / "qwen.bin"
    assert cli.main(["stage", "--checkpoint", str(staged), "--target", str(target), "--no-progress"]) == 0
    other = qwen_checkpoint(tmp_path / "other", world, seed=70)
    monkeypatch.setenv(plug.CONTROL_ENV, str(ple_control(tmp_path / "q.toml", f"{target}.manifest.json")))
    served = {layer: _served(sg, layer) for layer in LAYERS}
    with pytest.raises(SlackTierError) as err:
        _load_through_the_hook(served, shard_stream(other))
    text = str(err.value)
    assert err.value.kind is ErrorKind.CHECKPOINT and "\n" not in text
    assert "ngram_embedding.shard_3.weight" in text and "qwen/model.safetensors" in text
