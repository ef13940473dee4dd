"""The vLLM plug-in against vLLM 0.33.0's own modules, on this CPU.

What runs here: the plug-in loads through vLLM's load_general_plugins() from the
`vllm.general_plugins` entry point and patches Engram's seams; the head shards it
serves equal vLLM's own ParallelEngramEmbedding's and SlackTier's staged rank
regions at TP 1, 2 and 4; settings outside its scope are refused.

The rows against vLLM's own lookup kernel, run under Triton's interpreter on
this CPU: tests/test_adapters_vllm_parity.py. vLLM's hash kernel and its lookup
compiled for a GPU need one (benchmarks/engine/gpu_check_vllm.py, part rows).

vLLM's ParallelEngramEmbedding asks its process groups for the TP size and rank
and the GPU for its SM count; a CPU process has neither, so the geometry test
states them through those same getters (pytest's monkeypatch) and builds the
table on the meta device (vLLM's own no-allocation path).
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from engines import VLLM_VERSION, import_vllm
from slacktier.adapters import vllm as plug
from slacktier.errors import ErrorKind, SlackTierError
from slacktier.tables.engram_hash import EngramLayout
from slacktier.tables.manifest import StagedLayout, plan_regions
from slacktier.tables.stage import stage_synthetic


@pytest.fixture(scope="module")
def engram():
    return import_vllm(plug.ENGRAM_MODULE)


def test_entry_point_loads_the_plugin_and_patches_engrams_seams(engram, monkeypatch):
    plugins = import_vllm("vllm.plugins")
    classes = [(getattr(import_vllm(m), c), method) for m, c, method in plug.PATCHED]
    originals = [cls.__dict__[m] for cls, m in classes]
    monkeypatch.delenv(plug.CONTROL_ENV, raising=False)
    plug.register()   # inert without the variable
    assert all(cls.__dict__[m] is original for (cls, m), original in zip(classes, originals))
    monkeypatch.setenv("VLLM_PLUGINS", "slacktier")
    monkeypatch.setenv(plug.CONTROL_ENV, "/etc/slacktier/rank{tp_rank}.toml")
    plugins.load_general_plugins()
    patched = [cls.__dict__[m] for cls, m in classes]
    for (cls, m), original, now in zip(classes, originals, patched):
        assert now is not original and now.__wrapped__ is original, f"{cls.__name__}.{m} not patched"
    plug.register()   # vLLM may load plug-ins again in a process: patched once
    assert [cls.__dict__[m] for cls, m in classes] == patched


def _vllm_table(engram, monkeypatch, head_sizes: tuple[int, ...], tp: int, rank: int):
    """vLLM's own ParallelEngramEmbedding of TP rank `rank` of `tp`, built without rows (meta device)."""
    monkeypatch.setattr(engram, "get_engram_dp_size", lambda: 1)
    monkeypatch.setattr(engram, "get_tensor_model_parallel_world_size", lambda: tp)
    monkeypatch.setattr(engram, "get_tensor_model_parallel_rank", lambda: rank)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: SimpleNamespace(multi_processor_count=1))
    monkeypatch.setattr(torch.accelerator, "current_device_index", lambda: 0)
    with torch.device("meta"):
        return engram.ParallelEngramEmbedding(sum(head_sizes), 256, head_sizes)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_head_shards_equal_vllms_and_slacktiers_rank_regions(engram, monkeypatch, tp):
    layout = EngramLayout.v41()
    vllm_layout = engram.EngramLayout(SimpleNamespace(
        engram_layer_ids=list(layout.layer_ids), engram_num_embeddings=list(layout.rows_per_layer),
        engram_max_ngram_size=4, engram_n_heads=8, engram_head_dim=256, engram_compressed_vocab_size=99_092,
        engram_pad_token_id=2, engram_vocab_size=16_000_000))
    assert vllm_layout.primes == layout.primes
    regions = plan_regions(StagedLayout.from_layout(layout), tp, ["t.bin"])
    for i, layer in enumerate(layout.layer_ids):
        head_sizes = tuple(p for order in vllm_layout.primes[i] for p in order)
        for rank in range(tp):
            theirs = _vllm_table(engram, monkeypatch, head_sizes, tp, rank)
            ours = plug.ServedTable(layer, layout.layer_rows(layer), 256, head_sizes, tp, rank)
            region = next(r for r in regions if r.layer == layer and r.rank == rank)
            want = (theirs.head_start, theirs.part_n_hash_cols, theirs.vocab_start_idx, theirs.vocab_end_idx)
            assert (ours.head_start, ours.part_n_hash_cols, ours.vocab_start_idx, ours.vocab_end_idx) == want
            assert (region.row_start, region.row_start + region.rows) == want[2:]
            assert ours.weight.shape == (0, 256) and ours.weight_scale_inv.shape == (0, 8)   # no rows allocated
            assert (ours.dp_size, ours.cpu_offload, ours.n_hash_cols, ours.tp_size) == (1, False, 24, tp)


def test_tp_sharding_rule_is_vllms_head_shard(engram, monkeypatch):
    """tables.tp_sharding's vLLM rule (what inspect --tp and the staging refusals use) against vLLM's own table,
    at TP sizes that divide the 24 columns and one that does not."""
    from slacktier.tables.tp_sharding import vllm_rank_rows

    layout = EngramLayout.v41()
    bounds = layout.layer_column_bounds(1)
    head_sizes = tuple(int(b - a) for a, b in zip(bounds, bounds[1:]))
    for tp in (1, 3, 5, 6, 8):
        for rank in range(tp):
            theirs = _vllm_table(engram, monkeypatch, head_sizes, tp, rank)
            assert vllm_rank_rows(bounds, tp, rank) == (theirs.vocab_start_idx, theirs.vocab_end_idx)


@pytest.mark.parametrize("kind", ["columns", "balanced"])
def test_ranks_columns_all_gathered_through_vllms_embed_equal_the_whole_table(engram, monkeypatch, tmp_path, kind):
    """TP 2 under each partition: each rank's engine serves the columns its ServedTable looks up; vLLM's own
    Engram.embed all-gathers them (the collective as a concatenation in one process) and the patched embed puts
    them in column order: bit for bit the rows of one engine serving the whole table."""
    import numpy as np

    from slacktier.config import ControlFile, EngineConfig, TableConfig
    from slacktier.engine.step import StepEngine

    layout = EngramLayout.scaled(200)
    m = stage_synthetic([tmp_path / "t.bin"], layout, 2, 9, progress=False, partition=kind)

    def engine(rank: int, columns: int) -> StepEngine:
        tables = tuple(TableConfig(layer=layer, manifest=m.path, rank=rank, partition=kind, cache_share=0.5, order=i)
                       for i, layer in enumerate(layout.layer_ids))
        return StepEngine.from_config(ControlFile(engine=EngineConfig(cache_rows=500, check=True), tables=tables),
                                      columns=columns)

    rng = np.random.default_rng(4)
    ids = np.stack([np.asarray(layout.layer_column_bounds(layer)[:-1]) + rng.integers(0, np.diff(
        layout.layer_column_bounds(layer)), size=(8, 24)) for layer in layout.layer_ids], axis=1)   # [8, 2, 24]
    embed = engram.Engram.__dict__["embed"]
    embed = getattr(embed, "__wrapped__", embed)   # vLLM's own, whether or not the plug-in is registered
    with engine(-1, 24) as whole, engine(0, 12) as r0, engine(1, 12) as r1:
        served = {}
        for rank, e in enumerate((r0, r1)):
            tables = {layer: plug.ServedTable(layer, layout.layer_rows(layer), 256, tuple(int(x) for x in np.diff(
                layout.layer_column_bounds(layer))), 2, rank, m.partition) for layer in layout.layer_ids}
            cols = tables[layout.layer_ids[0]].columns
            e.begin_step(np.ascontiguousarray(ids[:, :, cols]))
            served[rank] = tables
        whole.begin_step(ids)
        for layer in layout.layer_ids:
            parts = [r0.gather(layer), r1.gather(layer)]
            monkeypatch.setattr(engram, "tensor_model_parallel_all_gather", lambda rows, dim: torch.cat(parts, dim))
            for rank in range(2):
                ns = SimpleNamespace(embed_tokens=served[rank][layer], use_sequence_parallel=False,
                                     _ready_rows=lambda n, rank=rank: parts[rank])
                got = plug._embed(embed, ns, torch.zeros(8, 24, dtype=torch.int64))
                assert torch.equal(got.view(torch.int16), whole.gather(layer).view(torch.int16))
        for e in (whole, r0, r1):
            e.end_step()
        assert sum(c.mismatches for e in (whole, r0, r1) for c in e.totals.values()) == 0


def test_served_table_skips_the_checkpoints_rows():
    table = plug.ServedTable(1, 2_400, 256, (100,) * 24, 2, 1)
    for param in (table.weight, table.weight_scale_inv):
        param.weight_loader(param, torch.zeros(2_400, param.shape[1]))   # a no-op: nothing to copy into
        assert param.shape[0] == 0
    with pytest.raises(SlackTierError, match="lookup of its own"):
        table(torch.zeros(3, 24, dtype=torch.int64))


def test_decode_flags_come_from_the_forward_contexts_attention_metadata(engram, monkeypatch):
    from slacktier.adapters.vllm_binding import decode_flags

    fc = import_vllm("vllm.forward_context")
    context = SimpleNamespace(attn_metadata=None)
    monkeypatch.setattr(fc, "is_forward_context_available", lambda: True)
    monkeypatch.setattr(fc, "get_forward_context", lambda: context)
    assert decode_flags(5) is None                              # no metadata: unknown (all decode)
    context.attn_metadata = {"layers.0.attn": SimpleNamespace(), "layers.0.swa": SimpleNamespace(num_decode_tokens=2)}
    assert decode_flags(5).tolist() == [True, True, False, False, False]   # decode tokens first, as vLLM orders
    context.attn_metadata = {"layers.0.swa": SimpleNamespace(num_decode_tokens=7)}
    assert decode_flags(5) is None                              # more than the step's tokens: not this batch's
    monkeypatch.setattr(fc, "is_forward_context_available", lambda: False)
    assert decode_flags(5) is None


def test_unchecked_version_is_refused_with_the_fix():
    plug.check_version(VLLM_VERSION)
    with pytest.raises(SlackTierError) as err:
        plug.check_version("0.34.0")
    assert err.value.kind is ErrorKind.UNSUPPORTED and f"vllm=={VLLM_VERSION}" in err.value.fix


@pytest.mark.parametrize("change, words", [
    (dict(enforce_eager=False), "torch.compile"),
    (dict(tp_size=5), "unequal hash heads"),
    (dict(pp_size=2), "pipeline"),
    (dict(pcp_size=2), "prefill context"),
    (dict(embedding_across_dp=True, dp_size=2), "across DP"),
    (dict(decode_backend="latency_specialized"), "decode_backend"),
    (dict(speculative=True), "speculative"),
    (dict(rocm=True), "ROCm"),
])
def test_scope_refusals(change, words):
    base = dict(version=VLLM_VERSION, tp_size=4, tp_rank=3)
    plug.check_scope(plug.VllmServing(**base), 24)
    plug.check_scope(plug.VllmServing(**base, embedding_across_dp=True), 24)   # one DP rank: not sharded
    with pytest.raises(SlackTierError, match=words) as err:
        plug.check_scope(plug.VllmServing(**base | change), 24)
    assert err.value.kind is ErrorKind.UNSUPPORTED and err.value.fix


def test_settings_are_read_from_vllms_own_config_classes(monkeypatch):
    """read_serving reads fields vLLM's config classes have, from real ParallelConfig and EngramConfig objects."""
    config = import_vllm("vllm.config")
    engram_config = import_vllm("vllm.config.engram")
    model_config = import_vllm("vllm.config.model")
    distributed = import_vllm("vllm.distributed")
    assert "enforce_eager" in {f.name for f in dataclasses.fields(model_config.ModelConfig)}
    assert {"additional_config", "speculative_config", "engram_config"} <= \
        {f.name for f in dataclasses.fields(config.VllmConfig)}
    monkeypatch.setattr(distributed, "get_tensor_model_parallel_rank", lambda: 1)
    vllm_config = SimpleNamespace(
        parallel_config=config.ParallelConfig(tensor_parallel_size=2), engram_config=engram_config.EngramConfig(),
        model_config=SimpleNamespace(enforce_eager=False), additional_config={}, speculative_config=None)
    s = plug.read_serving(vllm_config)
    assert (s.tp_size, s.tp_rank, s.pp_size, s.enforce_eager, s.decode_backend) == (2, 1, 1, False, "auto")
    with pytest.raises(SlackTierError, match="--enforce-eager"):
        plug.check_scope(s, 24)


# ---- checkpoint identity -------------------------------------------------------------------------------------


def _engram_checkpoint(path, layout: EngramLayout, seed: int) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """A safetensors checkpoint of `layout`'s Engram tables in DeepSeek's names, random bytes of `seed`."""
    import numpy as np
    from safetensors.torch import save_file

    rng = np.random.default_rng(seed)
    tables = {layer: (torch.from_numpy(rng.integers(0, 256, (layout.layer_rows(layer), 256), dtype=np.uint8))
                      .view(torch.float8_e4m3fn),
                      torch.from_numpy(rng.integers(110, 140, (layout.layer_rows(layer), 8), dtype=np.uint8))
                      .view(torch.float8_e8m0fnu)) for layer in layout.layer_ids}
    save_file({f"layers.{layer}.engram.embed.{part}": t for layer, (w, s) in tables.items()
               for part, t in (("weight", w), ("scale", s))}, str(path))
    return tables


@pytest.mark.parametrize("tp, rank", [(1, 0), (2, 1)])
def test_a_table_from_another_checkpoint_is_refused_at_load(engram, monkeypatch, tmp_path, tp, rank):
    """vLLM's Engram builds the served table through the patched _create_embedding (a real binding and engine);
    vLLM's loader hands its parameters the checkpoint's whole tensors: the staged checkpoint's are accepted,
    another checkpoint of the same shapes is refused in one line naming both."""
    from slacktier.config import ControlFile, DiskOptions, EngineConfig, TableConfig, write_control
    from slacktier.tables.stage import stage_checkpoint

    vllm_config = import_vllm("vllm.config")
    distributed = import_vllm("vllm.distributed")
    layout = EngramLayout.scaled(300)
    staged = _engram_checkpoint(tmp_path / "staged.safetensors", layout, 1)
    other = _engram_checkpoint(tmp_path / "other.safetensors", layout, 2)
    m = stage_checkpoint(tmp_path / "staged.safetensors", [tmp_path / "t.bin"], tp, expected=layout, progress=False)
    tables = tuple(TableConfig(layer=layer, manifest=m.path, rank=-1 if tp == 1 else rank, order=i,
                               options=DiskOptions(queue_depth=8), cache_share=0.5)
                   for i, layer in enumerate(layout.layer_ids))
    control = write_control(ControlFile(engine=EngineConfig(cache_rows=500, owned_only=tp > 1), tables=tables),
                            tmp_path / f"rank{rank}.toml")
    config = SimpleNamespace(parallel_config=vllm_config.ParallelConfig(tensor_parallel_size=tp),
                             engram_config=import_vllm("vllm.config.engram").EngramConfig(),
                             model_config=SimpleNamespace(enforce_eager=True, model="/models/dsv41"),
                             additional_config={}, speculative_config=None)
    monkeypatch.setattr(vllm_config, "get_current_vllm_config", lambda: config)
    monkeypatch.setattr(distributed, "get_tensor_model_parallel_rank", lambda: rank)
    monkeypatch.setenv(plug.CONTROL_ENV, str(tmp_path / "rank{tp_rank}.toml"))
    assert control.exists()
    vllm_layout = engram.EngramLayout(SimpleNamespace(
        engram_layer_ids=list(layout.layer_ids), engram_num_embeddings=list(layout.rows_per_layer),
        engram_max_ngram_size=4, engram_n_heads=8, engram_head_dim=256, engram_compressed_vocab_size=99_092,
        engram_pad_token_id=2, engram_vocab_size=300))

    def stock(*args):
        raise AssertionError("a served table must not be built by vLLM's own _create_embedding")

    try:
        served = {layer: plug._create_embedding(stock, None, vllm_layout, i)
                  for i, layer in enumerate(layout.layer_ids)}
        for layer, table in served.items():   # the staged checkpoint: accepted
            w, s = staged[layer]
            table.weight.weight_loader(table.weight, w)
            table.weight_scale_inv.weight_loader(table.weight_scale_inv, s)
            assert table.weight.shape[0] == 0
        again = plug._create_embedding(stock, None, vllm_layout, 0)
        with pytest.raises(SlackTierError) as err:
            again.weight.weight_loader(again.weight, other[layout.layer_ids[0]][0])
    finally:
        plug.close()
    e = err.value
    text = str(e)
    assert e.kind is ErrorKind.CHECKPOINT and "\n" not in text
    assert "vLLM loaded model.layers.1.engram.embed_tokens.weight from /models/dsv41" in text
    assert f"{m.path} was staged from checkpoint" in text and "staged.safetensors" in text
    assert "--checkpoint /models/dsv41" in e.fix
