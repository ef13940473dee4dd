"""The SGLang plug-in against SGLang 0.5.23's own Engram code, run on this CPU.

Oracles are SGLang's installed modules: its EngramLayout, EngramHasher, shard
rule, and the stock EngramEmbedding (loaded through its own weight_loader) on
its torch path. The plug-in is loaded the way a server loads it: SGLang's
load_plugins() finds it in the `sglang.srt.plugins` entry-point group and its
real HookRegistry patches SGLang's classes. SGLang's TP all-reduce is a sum of
the ranks' outputs here, inside one process (no NCCL, no GPU). Tables come from
a small safetensors checkpoint staged by SlackTier (`stage_checkpoint`), with
the special bytes (fp8 NaN and -0.0, e8m0 0x00 and 0xFF) in it.
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
from slacktier.adapters import sglang as plug
from slacktier.config import ControlFile, DiskOptions, EngineConfig, TableConfig, write_control
from slacktier.testing.engine import real_text
from slacktier.errors import ErrorKind, SlackTierError
from slacktier.tables.engram_hash import EngramHasher as StHasher
from slacktier.tables.engram_hash import EngramLayout as StLayout
from slacktier.tables.layout import shard_bounds
from slacktier.tables.stage import stage_checkpoint
from slacktier.tables.tokenizer import encode, load_deepseek_tokenizer

pytestmark = pytest.mark.usefixtures("one_torch_thread")

VOCAB = 2_000            # engram_vocab_size of the scaled table: ~48,000 rows per layer
LAYERS = (1, 14)
DIM = 256
TOKENS = 300


class _HFTokenizer:
    """What SGLang's build_compressed_token_map reads from a transformers tokenizer."""

    def __init__(self, backend: Any) -> None:
        self.backend_tokenizer = backend

    def __len__(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)


@pytest.fixture(scope="module")
def sg() -> Iterator[SimpleNamespace]:
    """SGLang's modules, a published test context (overlap scheduler off), and the plug-in loaded."""
    engram = import_sglang("sglang.srt.layers.engram")
    model = import_sglang("sglang.srt.models.deepseek_v4")
    modes = import_sglang("sglang.srt.model_executor.forward_batch_info")
    with sglang_plugin_loaded(plug.CONTROL_ENV) as rc:
        yield SimpleNamespace(engram=engram, rc=rc, model=model, ForwardMode=modes.ForwardMode)
        plug.close()


def _config(layout: StLayout) -> SimpleNamespace:
    """The Engram keys of a DeepSeek-V4.1 config, at the scaled vocab size."""
    return SimpleNamespace(engram_layer_ids=list(LAYERS), engram_max_ngram_size=4, engram_n_heads=8,
                           engram_vocab_size=VOCAB, engram_num_embeddings=list(layout.rows_per_layer),
                           engram_head_dim=DIM, engram_pad_token_id=2, engram_compressed_vocab_size=99_092,
                           rms_norm_eps=1e-6, hidden_size=64, hc_mult=2)


def _table(rows: int, seed: int, nan: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8 rows [rows, 256] and e8m0 scales [rows, 8], with -0.0, e8m0 0x00 and (with `nan`) the NaN bytes."""
    rng = np.random.default_rng(seed)
    w = rng.integers(0, 256, size=(rows, DIM), dtype=np.uint8)
    s = rng.integers(110, 140, size=(rows, DIM // 32), dtype=np.uint8)
    if nan:
        w[::97, 3] = 0x7F
        s[::79, 2] = 0xFF
    else:   # a real checkpoint's bytes: fp8 0x7F / 0xFF (NaN) become +-448, scales near 1
        w[(w & 0x7F) == 0x7F] ^= 1
        s = rng.integers(115, 128, size=(rows, DIM // 32), dtype=np.uint8)
    w[::89, 5] = 0x80
    s[::83, 1] = 0x00
    return (torch.from_numpy(w).view(torch.float8_e4m3fn), torch.from_numpy(s).view(torch.float8_e8m0fnu))


@pytest.fixture(scope="module")
def world(sg: SimpleNamespace, o_direct_module_dir: Path) -> SimpleNamespace:
    """The scaled layout both ways, one checkpoint staged for TP 1 and TP 2, real tokens and SGLang's hasher."""
    from safetensors.torch import save_file

    st_layout = StLayout.scaled(VOCAB)
    config = _config(st_layout)
    tables = {layer: _table(st_layout.layer_rows(layer), seed=layer) for layer in LAYERS}
    clean = {layer: _table(st_layout.layer_rows(layer), seed=layer, nan=False) for layer in LAYERS}
    manifests = {}
    for name, rows, ranks in (("tp1", tables, 1), ("tp2", tables, 2), ("clean", clean, 1)):
        ckpt = o_direct_module_dir / f"{name}.safetensors"
        save_file({f"layers.{layer}.engram.embed.{part}": t for layer, (w, s) in rows.items()
                   for part, t in (("weight", w), ("scale", s))}, str(ckpt))
        manifests[name] = stage_checkpoint(ckpt, [o_direct_module_dir / f"{name}.bin"], ranks=ranks,
                                           expected=st_layout, overwrite=True).path
    tokens = np.asarray(encode(real_text(8 * TOKENS))[:TOKENS], dtype=np.int64)
    hasher = sg.engram.EngramHasher(sg.engram.EngramLayout.from_config(config),
                                    _HFTokenizer(load_deepseek_tokenizer()), 2, 99_092)
    hasher.init_history(4, "cpu")
    return SimpleNamespace(st_layout=st_layout, config=config, tables=tables, clean=clean, manifests=manifests,
                           tokens=tokens, hasher=hasher, dir=o_direct_module_dir)


def _batch(sg: SimpleNamespace, n: int) -> SimpleNamespace:
    """A one-request prefill batch: what SGLang's hasher reads of a ForwardBatch."""
    return SimpleNamespace(forward_mode=sg.ForwardMode.EXTEND, req_pool_indices=torch.tensor([0]),
                           positions=torch.arange(n), extend_seq_lens=torch.tensor([n]),
                           extend_start_loc=torch.tensor([0]), extend_seq_lens_cpu=[n], engram_history=None,
                           out_cache_loc=torch.arange(1, n + 1), spec_info=None)


class _Model:
    """Stands in for DeepseekV4Model's body: the real (patched) DeepseekV4Model.forward calls _forward_impl."""

    def __init__(self, hasher: Any, embeds: dict[int, Any], fail_after: int | None = None,
                 lookup: str = "forward") -> None:
        self.hasher, self.embeds, self.fail_after, self.lookup = hasher, embeds, fail_after, lookup

    def _forward_impl(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: Any, *rest: Any) -> list:
        hash_ids = self.hasher(input_ids, batch)            # [T, 2, 24]: the plug-in's begin_step runs here
        out = []
        for i, layer in enumerate(LAYERS):
            if self.fail_after == i:
                raise RuntimeError("a layer failed")
            embed = self.embeds[layer]
            ids = hash_ids[:, i]
            out.append(embed(ids) if self.lookup == "forward" else embed._owned_rows(ids))
        return out


def _step(sg: SimpleNamespace, world: SimpleNamespace, embeds: dict[int, Any], **kw: Any) -> list[torch.Tensor]:
    ids = torch.from_numpy(world.tokens)
    model = _Model(world.hasher, embeds, **kw)
    return sg.model.DeepseekV4Model.forward(model, ids, torch.arange(len(ids)), _batch(sg, len(ids)), None)


def _stock(sg: SimpleNamespace, world: SimpleNamespace, layer: int) -> Any:
    """SGLang's own table, loaded through its own weight_loader (the current TP rank's shard)."""
    i = LAYERS.index(layer)
    layout = sg.engram.EngramLayout.from_config(world.config)
    emb = sg.engram.EngramEmbedding(layout.num_embeddings[i], DIM, layer, column_bounds=layout.column_bounds(i))
    w, s = world.tables[layer]
    emb.weight.weight_loader(emb.weight, w)
    emb.scale.weight_loader(emb.scale, s)
    return emb


def _served(sg: SimpleNamespace, world: SimpleNamespace, layer: int) -> Any:
    i = LAYERS.index(layer)
    layout = sg.engram.EngramLayout.from_config(world.config)   # the plug-in records the layer order here
    return sg.engram.EngramEmbedding(layout.num_embeddings[i], DIM, layer, column_bounds=layout.column_bounds(i))


def _control(path: Path, manifest: str, *, rank: int = -1, owned_only: bool = False,
             dram: tuple[int, ...] = (), partition: str = "columns") -> Path:
    tables = tuple(TableConfig(layer=layer, manifest=manifest, source="dram" if layer in dram else "disk",
                               options=None if layer in dram else DiskOptions(queue_depth=32), rank=rank,
                               cache_share=0.5, order=i, partition=partition) for i, layer in enumerate(LAYERS))
    return write_control(ControlFile(engine=EngineConfig(cache_rows=4_000, owned_only=owned_only), tables=tables),
                         path)


def _bits(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(torch.int16).numpy()


def _assert_same_rows(got: torch.Tensor, want: torch.Tensor) -> None:
    """Bit for bit, except that a NaN's payload is free (slacktier.tables.codec: torch's CPU conversion writes
    0xFFFF for every NaN on its vector path, 0x7FC0 on its scalar one; SlackTier writes 0x7FC0)."""
    assert got.dtype == want.dtype and got.shape == want.shape
    nan = torch.isnan(want).numpy()
    np.testing.assert_array_equal(torch.isnan(got).numpy(), nan)
    np.testing.assert_array_equal(_bits(got)[~nan], _bits(want)[~nan])


@pytest.fixture
def tp(sg: SimpleNamespace) -> Any:
    """`with tp(size, rank):` SGLang's parallel state of that TP rank."""
    def enter(size: int, rank: int, **more: int) -> Any:
        return sg.rc.get_parallel().override(tp_size=size, tp_rank=rank, attn_tp_size=size // more.get(
            "attn_dp_size", 1), moe_tp_size=size, **more)
    yield enter
    plug.close()


# ---- layout, hash and shards ------------------------------------------------------------------------


def test_layout_hash_and_shards_equal_slacktiers(sg, world):
    st = world.st_layout
    layout = sg.engram.EngramLayout.from_config(world.config)
    assert layout.primes == st.primes
    for i, layer in enumerate(LAYERS):
        assert layout.column_bounds(i) == st.layer_column_bounds(layer)
        assert layout.num_embeddings[i] == st.layer_rows(layer)
        for tp_size in (1, 2, 3, 4, 5, 6, 7, 8, 24):   # whole heads where TP divides 24, equal rows elsewhere
            for rank in range(tp_size):
                assert sg.engram.shard_range(st.layer_rows(layer), layout.column_bounds(i), rank, tp_size) == \
                    shard_bounds(st.layer_rows(layer), st.layer_column_bounds(layer), rank, tp_size)
    n = len(world.tokens)
    want = world.hasher(torch.from_numpy(world.tokens), _batch(sg, n)).numpy()
    np.testing.assert_array_equal(StHasher(st).prefill(world.tokens), want)


def test_entry_point_is_registered():
    from importlib.metadata import entry_points

    found = [ep for ep in entry_points(group="sglang.srt.plugins") if ep.name == "slacktier"]
    assert found, "no `slacktier` entry point in sglang.srt.plugins: reinstall the package (pip install -e .)"
    assert found[0].value == "slacktier.adapters.sglang:register"


# ---- rows ---------------------------------------------------------------------------------------------


def test_tp1_rows_equal_stock_forward_bit_for_bit(sg, world, tp, monkeypatch, tmp_path):
    with tp(1, 0):
        stock = {layer: _stock(sg, world, layer) for layer in LAYERS}
        want = _step(sg, world, stock)
        monkeypatch.setenv(plug.CONTROL_ENV, str(_control(tmp_path / "tp1.toml", world.manifests['tp1'])))
        served = {layer: _served(sg, world, layer) for layer in LAYERS}
        assert all(e.weight.shape[0] == 0 and e.scale.shape[0] == 0 for e in served.values())   # no rows in SGLang
        for _ in range(2):   # the second step hits the cache
            got = _step(sg, world, served)
            for g, w in zip(got, want):
                assert g.dtype == torch.bfloat16 and g.shape == (len(world.tokens), 24, DIM)
                _assert_same_rows(g, w)


def test_decode_flags_follow_the_forward_batch(sg):
    modes = sg.ForwardMode

    def flags(mode, lens=None, tokens=5):
        got = plug.decode_flags(SimpleNamespace(forward_mode=mode, extend_seq_lens_cpu=lens), tokens)
        return None if got is None else got.tolist()

    assert flags(modes.DECODE) == [True] * 5
    assert flags(modes.EXTEND, [5]) == [False] * 5
    assert flags(modes.MIXED, [3, 1, 1]) == [False, False, False, True, True]   # the module doc's example
    assert flags(modes.MIXED, [3, 1]) is None       # lengths that do not add up: unknown (all decode)
    assert flags(modes.IDLE) is None


def test_the_hasher_forward_gives_begin_step_its_batch_flags(sg, world, tp, monkeypatch, tmp_path):
    from slacktier.engine import StepEngine

    seen = []
    real = StepEngine.begin_step

    def spy(self, ids, decode=None):
        seen.append(None if decode is None else decode.tolist())
        return real(self, ids, decode)

    monkeypatch.setattr(StepEngine, "begin_step", spy)
    with tp(1, 0):
        monkeypatch.setenv(plug.CONTROL_ENV, str(_control(tmp_path / "flags.toml", world.manifests['tp1'])))
        served = {layer: _served(sg, world, layer) for layer in LAYERS}
        _step(sg, world, served)   # a one-request EXTEND batch: every token a prefill token
    assert seen == [[False] * len(world.tokens)]


def test_tp2_rank_rows_and_their_sum_equal_stock(sg, world, tp, monkeypatch, tmp_path):
    stock_rank, served_rank = [], []
    for rank in range(2):
        _control(tmp_path / f"rank{rank}.toml", world.manifests['tp2'], rank=rank, owned_only=True)
    for rank in range(2):
        with tp(2, rank):
            monkeypatch.delenv(plug.CONTROL_ENV, raising=False)
            stock = {layer: _stock(sg, world, layer) for layer in LAYERS}
            stock_rank.append(_step(sg, world, stock, lookup="owned"))
            monkeypatch.setenv(plug.CONTROL_ENV, str(tmp_path / "rank{tp_rank}.toml"))
            served = {layer: _served(sg, world, layer) for layer in LAYERS}
            served_rank.append(_step(sg, world, served, lookup="owned"))
    for i in range(len(LAYERS)):
        for rank in range(2):   # each rank's output as SGLang's own, +0.0 in the other rank's rows
            _assert_same_rows(served_rank[rank][i], stock_rank[rank][i])
        _assert_same_rows(served_rank[0][i] + served_rank[1][i], stock_rank[0][i] + stock_rank[1][i])


def test_balanced_partition_ranks_sum_to_the_stock_tp2_sum(sg, world, tp, monkeypatch, tmp_path):
    """Balanced: each rank serves 4 heads of every order (+0.0 elsewhere, its columns equal to the stock TP 1
    rows there); the sum over ranks equals SGLang's own TP 2 sum bit for bit (each element is its owner's value
    plus +0.0, whichever rank owns it)."""
    ckpt = world.dir / "tp2.safetensors"
    manifest = stage_checkpoint(ckpt, [tmp_path / "balanced.bin"], ranks=2, expected=world.st_layout,
                                partition="balanced", progress=False).path
    with tp(1, 0):
        whole = _step(sg, world, {layer: _stock(sg, world, layer) for layer in LAYERS}, lookup="owned")
    stock_rank, served_rank = [], []
    for rank in range(2):
        _control(tmp_path / f"rank{rank}.toml", manifest, rank=rank, owned_only=True, partition="balanced")
    for rank in range(2):
        with tp(2, rank):
            monkeypatch.delenv(plug.CONTROL_ENV, raising=False)
            stock_rank.append(_step(sg, world, {layer: _stock(sg, world, layer) for layer in LAYERS},
                                    lookup="owned"))
            monkeypatch.setenv(plug.CONTROL_ENV, str(tmp_path / "rank{tp_rank}.toml"))
            served = {layer: _served(sg, world, layer) for layer in LAYERS}
            served_rank.append(_step(sg, world, served, lookup="owned"))
    owned = [[c for o in range(3) for c in range(8 * o + 4 * rank, 8 * o + 4 * rank + 4)] for rank in range(2)]
    for i in range(len(LAYERS)):
        for rank in range(2):
            got = served_rank[rank][i]
            _assert_same_rows(got[:, owned[rank]], whole[i][:, owned[rank]])
            others = [c for c in range(24) if c not in owned[rank]]
            assert bool((_bits(got[:, others]) == 0).all())   # +0.0, SGLang's own fill
        _assert_same_rows(served_rank[0][i] + served_rank[1][i], stock_rank[0][i] + stock_rank[1][i])
    # the same control files over a columns-staged table: refused at start-up, naming both partitions
    _control(tmp_path / "wrong0.toml", world.manifests["tp2"], rank=0, owned_only=True, partition="balanced")
    with tp(2, 0):
        monkeypatch.setenv(plug.CONTROL_ENV, str(tmp_path / "wrong{tp_rank}.toml"))
        with pytest.raises(SlackTierError, match="'columns' rank partition.*'balanced'"):
            _served(sg, world, LAYERS[0])


def test_dram_table_stays_on_sglangs_own_path(sg, world, tp, monkeypatch, tmp_path):
    with tp(1, 0):
        stock = {layer: _stock(sg, world, layer) for layer in LAYERS}
        want = _step(sg, world, stock)
        monkeypatch.setenv(plug.CONTROL_ENV, str(_control(tmp_path / "dram14.toml", world.manifests['tp1'], dram=(14,))))
        served = {1: _served(sg, world, 1), 14: _stock(sg, world, 14)}
        assert served[1].weight.shape[0] == 0
        assert served[14].weight.shape[0] == world.st_layout.layer_rows(14)   # SGLang's own rows, loaded
        got = _step(sg, world, served)
        for g, w in zip(got, want):
            _assert_same_rows(g, w)


def test_whole_engram_forward_equals_stock(sg, world, tp, monkeypatch, tmp_path):
    """Gate and projection too: SGLang's Engram module, stock table against the plug-in's."""
    layer = 1
    with tp(1, 0):
        layout = sg.engram.EngramLayout.from_config(world.config)
        torch.manual_seed(0)
        stock = sg.engram.Engram(world.config, layer, layout)
        stock.wkv.to(torch.bfloat16)   # SGLang builds it in the model's dtype
        w, s = world.clean[layer]
        stock.embed.weight.weight_loader(stock.embed.weight, w)
        stock.embed.scale.weight_loader(stock.embed.scale, s)
        with torch.no_grad():   # SGLang allocates them uninitialized; the checkpoint would fill them
            stock.wkv.weight.normal_(0.0, 0.02)
            for p in ("q_weight", "k_weight"):
                getattr(stock, p).normal_()
        n = len(world.tokens)
        x = torch.randn(n, world.config.hc_mult, world.config.hidden_size, dtype=torch.bfloat16)
        ids = torch.from_numpy(world.tokens)
        want = stock(x, world.hasher(ids, _batch(sg, n))[:, 0], None, input_ids=ids)
        monkeypatch.setenv(plug.CONTROL_ENV, str(_control(tmp_path / "tp1.toml", world.manifests["clean"],
                                                          dram=(14,))))
        served = sg.engram.Engram(world.config, layer, layout)
        served.wkv.to(torch.bfloat16)
        served.wkv.load_state_dict(stock.wkv.state_dict())
        with torch.no_grad():
            for p in ("q_weight", "k_weight"):
                getattr(served, p).copy_(getattr(stock, p))

        class Body:
            def _forward_impl(self, *args: Any) -> torch.Tensor:
                h = world.hasher(ids, _batch(sg, n))
                return served(x, h[:, 0], None, input_ids=ids)

        got = sg.model.DeepseekV4Model.forward(Body(), ids, torch.arange(n), _batch(sg, n), None)
        assert not torch.isnan(want).any()
        np.testing.assert_array_equal(_bits(got), _bits(want))


# ---- end_step after an error ---------------------------------------------------------------------------


@pytest.mark.parametrize("fail_after", [0, 1])
def test_error_in_forward_ends_the_step(sg, world, tp, monkeypatch, tmp_path, fail_after):
    with tp(1, 0):
        stock = {layer: _stock(sg, world, layer) for layer in LAYERS}
        want = _step(sg, world, stock)
        monkeypatch.setenv(plug.CONTROL_ENV, str(_control(tmp_path / "tp1.toml", world.manifests['tp1'])))
        served = {layer: _served(sg, world, layer) for layer in LAYERS}
        with pytest.raises(RuntimeError, match="a layer failed"):
            _step(sg, world, served, fail_after=fail_after)   # after begin_step, before or after layer 1's gather
        got = _step(sg, world, served)   # begin_step would refuse a step still open
        for g, w in zip(got, want):
            _assert_same_rows(g, w)


# ---- refusals ---------------------------------------------------------------------------------------------


def test_unchecked_version_is_refused_with_the_fix():
    plug.check_version(SGLANG_VERSION)
    with pytest.raises(SlackTierError) as err:
        plug.check_version("0.5.24")
    assert err.value.kind is ErrorKind.UNSUPPORTED
    assert f"sglang=={SGLANG_VERSION}" in err.value.fix


@pytest.mark.parametrize("change, words", [
    (dict(pp_size=2), "pipeline"),
    (dict(attn_dp_size=2), "DP attention"),
    (dict(attn_cp_size=2), "context parallelism"),
    (dict(tp_size=5), "whole heads"),
    (dict(overlap_schedule=True), "overlap scheduler"),
    (dict(decode_graph="full"), "full CUDA graphs for decode"),
    (dict(prefill_graph="full"), "full CUDA graphs for prefill"),
    (dict(speculative="EAGLE"), "speculative"),
    (dict(two_batch_overlap=True), "two-batch overlap"),
])
def test_scope_refusals(change, words):
    base = dict(version=SGLANG_VERSION, tp_size=2, tp_rank=0)
    plug.check_scope(plug.SglangServing(**base), 24)
    plug.check_scope(plug.SglangServing(**base, decode_graph="breakable", prefill_graph="breakable"), 24)
    with pytest.raises(SlackTierError, match=words) as err:
        plug.check_scope(plug.SglangServing(**base | change), 24)
    assert err.value.kind is ErrorKind.UNSUPPORTED and err.value.fix


def _refused_at_build(sg, world, monkeypatch, control: Path) -> SlackTierError:
    monkeypatch.setenv(plug.CONTROL_ENV, str(control))
    with pytest.raises(SlackTierError) as err:
        _served(sg, world, 1)
    return err.value


def test_sglang_settings_outside_the_scope_refuse_the_table(sg, world, tp, monkeypatch, tmp_path):
    control = _control(tmp_path / "tp1.toml", world.manifests['tp1'])
    ctx = sg.rc.get_context().override_server_args(disable_overlap_schedule=False)
    ctx.install()
    try:
        with tp(1, 0):
            assert "overlap scheduler" in str(_refused_at_build(sg, world, monkeypatch, control))
    finally:
        ctx.restore()
    with tp(4, 0, attn_dp_size=2):
        assert "DP attention" in str(_refused_at_build(sg, world, monkeypatch, control))
    with tp(5, 0):
        assert "whole heads" in str(_refused_at_build(sg, world, monkeypatch, control))


def test_control_files_that_do_not_fit_the_rank_are_refused(sg, world, tp, monkeypatch, tmp_path):
    with tp(2, 1):
        err = _refused_at_build(sg, world, monkeypatch, _control(tmp_path / "a.toml", world.manifests['tp2'], rank=1))
        assert err.kind is ErrorKind.BAD_INPUT and "owned_only = true" in err.fix
        err = _refused_at_build(sg, world, monkeypatch, _control(tmp_path / "b.toml", world.manifests['tp2'], rank=0,
                                                                 owned_only=True))
        assert err.kind is ErrorKind.BAD_INPUT and "rank = 1" in err.fix
    with tp(1, 0):   # TP 1 over a table staged for 2 ranks: rank 0's region is half of SGLang's table
        err = _refused_at_build(sg, world, monkeypatch, _control(tmp_path / "c.toml", world.manifests['tp2'], rank=0,
                                                                 owned_only=True))
        assert "--ranks 1" in err.fix
        one = write_control(ControlFile(tables=(TableConfig(layer=14, manifest=world.manifests['tp1']),)),
                            tmp_path / "d.toml")
        err = _refused_at_build(sg, world, monkeypatch, one)
        assert err.kind is ErrorKind.MISSING and 'source = "dram"' in err.fix


def test_inert_without_the_variable(sg, world, tp, monkeypatch):
    monkeypatch.delenv(plug.CONTROL_ENV, raising=False)
    with tp(1, 0):
        emb = _served(sg, world, 1)
    assert emb.weight.shape[0] == world.st_layout.layer_rows(1)   # SGLang's own table, untouched


def _edge_hash_ids(sg, world) -> torch.Tensor:
    """SGLang's hash ids of the test tokens, then in token 0 ids a hasher never emits: each layer's last row, the
    rows just past it, far past it, the pad id and another negative id."""
    ids = world.hasher(torch.from_numpy(world.tokens), _batch(sg, len(world.tokens))).clone()
    for i, layer in enumerate(LAYERS):
        rows = world.st_layout.layer_rows(layer)
        ids[0, i, :8] = torch.tensor([rows - 1, rows, rows + 1, rows + 40, 2**40, -1, -7, 0])
    return ids


@pytest.mark.parametrize("partition", ["columns", "balanced"])
def test_ids_outside_the_table_give_sglangs_zero_rows(sg, world, tp, monkeypatch, tmp_path, partition):
    """SGLang's own lookup masks an id outside its table to a +0.0 row (at TP 1, and summed over TP 2 ranks); the
    plug-in gives the same rows bit for bit, under either partition, and counts them."""
    ids = _edge_hash_ids(sg, world)
    manifest = world.manifests["tp1"]
    if partition == "balanced":
        manifest = stage_checkpoint(world.dir / "tp2.safetensors", [tmp_path / "balanced.bin"], ranks=2,
                                    expected=world.st_layout, partition="balanced", progress=False).path
    for size in (1, 2):
        _control(tmp_path / "rank-1.toml", world.manifests["tp1"])
        for rank in range(size):
            _control(tmp_path / f"rank{rank}.toml", world.manifests["tp2"] if partition == "columns" else manifest,
                     rank=rank, owned_only=True, partition=partition)
        want, got = [], []
        for rank in range(size):
            with tp(size, rank):
                monkeypatch.delenv(plug.CONTROL_ENV, raising=False)
                stock = {layer: _stock(sg, world, layer) for layer in LAYERS}
                want.append([stock[layer]._owned_rows(ids[:, i]) for i, layer in enumerate(LAYERS)])
                template = "rank-1.toml" if size == 1 else "rank{tp_rank}.toml"
                monkeypatch.setenv(plug.CONTROL_ENV, str(tmp_path / template))
                served = {layer: _served(sg, world, layer) for layer in LAYERS}
                binding = plug.current()
                with plug.step():
                    binding.begin(ids)
                    got.append([served[layer]._owned_rows(ids[:, i]) for i, layer in enumerate(LAYERS)])
                counts = binding.engine.last_step.layers
                assert [counts[layer].out_of_table for layer in LAYERS] == [5, 5]   # rows, +1, +40, 2**40, -7
                plug.close()
        for i in range(len(LAYERS)):
            total_want, total_got = want[0][i], got[0][i]
            for rank in range(1, size):
                total_want, total_got = total_want + want[rank][i], total_got + got[rank][i]
            _assert_same_rows(total_got, total_want)
            assert not bool(_bits(total_got[0, 1:7]).any())   # the ids outside the table: +0.0 rows
            assert bool(_bits(total_got[0, [0, 7]]).any())    # the last row and row 0: the table's (can fail)


# ---- checkpoint identity -------------------------------------------------------------------------------------


def _load(embeds: dict[int, Any], tables: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
    """What SGLang's load_weights does with each Engram tensor: the parameter's own weight_loader, whole tensor."""
    for layer, e in embeds.items():
        w, s = tables[layer]
        e.weight.weight_loader(e.weight, w)
        e.scale.weight_loader(e.scale, s)


@pytest.mark.parametrize("size, rank", [(1, 0), (2, 1)])
def test_a_table_from_another_checkpoint_is_refused_at_load(sg, world, tp, monkeypatch, tmp_path, size, rank):
    """SGLang's loader hands the served table the checkpoint's tensors: the staged checkpoint's are accepted and the
    table serves; another checkpoint of the same shapes (the `clean` one) is refused in one line naming both."""
    manifest = world.manifests["tp1" if size == 1 else "tp2"]
    control = _control(tmp_path / f"rank{rank}.toml", manifest, rank=-1 if size == 1 else rank,
                       owned_only=size > 1)
    with tp(size, rank):
        monkeypatch.delenv(plug.CONTROL_ENV, raising=False)
        want = _step(sg, world, {layer: _stock(sg, world, layer) for layer in LAYERS}, lookup="owned")
        monkeypatch.setenv(plug.CONTROL_ENV, str(control))
        served = {layer: _served(sg, world, layer) for layer in LAYERS}
        _load(served, world.tables)   # the staged checkpoint: accepted
        for g, w in zip(_step(sg, world, served, lookup="owned"), want):
            _assert_same_rows(g, w)
        other = {LAYERS[0]: _served(sg, world, LAYERS[0])}
        with pytest.raises(SlackTierError) as err:
            _load(other, world.clean)
    e = err.value
    assert e.kind is ErrorKind.CHECKPOINT and e.layer == LAYERS[0]
    text = str(e)
    assert "\n" not in text and f"{manifest} was staged from checkpoint" in text
    assert f"{'tp1' if size == 1 else 'tp2'}.safetensors" in text and "model.layers.1.engram.embed.weight" in text
    assert "slacktier stage --checkpoint" in e.fix


def test_another_checkpoints_scales_alone_are_refused(sg, world, tp, monkeypatch, tmp_path):
    """Values and scales are compared apart: the staged values with another checkpoint's scales are refused."""
    with tp(1, 0):
        monkeypatch.setenv(plug.CONTROL_ENV, str(_control(tmp_path / "tp1.toml", world.manifests["tp1"])))
        e = _served(sg, world, 14)
        w, _ = world.tables[14]
        e.weight.weight_loader(e.weight, w)
        with pytest.raises(SlackTierError, match="engram.embed.scale.*sampled rows digest"):
            e.scale.weight_loader(e.scale, world.clean[14][1])


def test_a_synthetic_table_is_refused_beside_a_checkpoint_and_says_so(sg, world, tp, monkeypatch, tmp_path):
    """A table staged from the seeded generator stands for no checkpoint: an engine that loads one is refused,
    naming the synthetic source; an engine that loads no Engram tensors (dummy weights) serves it with a warning."""
    from slacktier.tables.stage import stage_synthetic

    m = stage_synthetic([tmp_path / "syn.bin"], world.st_layout, 1, 5, progress=False)
    with tp(1, 0):
        monkeypatch.setenv(plug.CONTROL_ENV, str(_control(tmp_path / "syn.toml", m.path)))
        served = {layer: _served(sg, world, layer) for layer in LAYERS}
        with pytest.raises(SlackTierError, match="synthetic table .*seed 5.*not a checkpoint"):
            _load(served, world.tables)
    plug.close()
    with tp(1, 0):
        served = {layer: _served(sg, world, layer) for layer in LAYERS}
        from slacktier import adapters
        with _captured_warnings(adapters.log) as logged:
            _step(sg, world, served)
        assert any("not compared" in line and "synthetic" in line for line in logged)


class _captured_warnings:
    """The warnings a logger emits inside the block, as text."""

    def __init__(self, logger: Any) -> None:
        import logging

        self.logger, self.lines = logger, []
        self.handler = logging.Handler(logging.WARNING)
        self.handler.emit = lambda record: self.lines.append(record.getMessage())

    def __enter__(self) -> list[str]:
        self.logger.addHandler(self.handler)
        return self.lines

    def __exit__(self, *exc: object) -> None:
        self.logger.removeHandler(self.handler)


def test_tables_staged_for_another_tp_partition_or_sharding_are_refused_naming_both(sg, world, tp, monkeypatch,
                                                                                    tmp_path):
    from slacktier.tables.tp_sharding import sglang_rank_rows

    ckpt = world.dir / "tp2.safetensors"
    layout = sg.engram.EngramLayout.from_config(world.config)
    for i, layer in enumerate(LAYERS):   # tables.tp_sharding's rule is SGLang's shard_range
        for tp_size in (1, 2, 3, 4, 5, 6, 8):
            for rank in range(tp_size):
                assert sglang_rank_rows(layout.column_bounds(i), tp_size, rank) == \
                    sg.engram.shard_range(layout.num_embeddings[i], layout.column_bounds(i), rank, tp_size)
    tp4 = stage_checkpoint(ckpt, [tmp_path / "tp4.bin"], ranks=4, expected=world.st_layout, progress=False).path
    equal = stage_checkpoint(ckpt, [tmp_path / "eq.bin"], ranks=2, progress=False).path   # no column bounds
    balanced = stage_checkpoint(ckpt, [tmp_path / "bal.bin"], ranks=2, expected=world.st_layout,
                                partition="balanced", progress=False).path
    with tp(2, 1):
        err = _refused_at_build(sg, world, monkeypatch, _control(tmp_path / "a.toml", tp4, rank=1, owned_only=True))
        assert "staged for 4 TP ranks; SGLang 0.5.23 runs TP 2" in err.message and "--ranks 2" in err.fix
        err = _refused_at_build(sg, world, monkeypatch, _control(tmp_path / "b.toml", equal, rank=1, owned_only=True))
        assert "without the model's hash-column bounds" in err.message and "--config" in err.fix
        err = _refused_at_build(sg, world, monkeypatch, _control(tmp_path / "c.toml", balanced, rank=1,
                                                                 owned_only=True))
        assert "'balanced' rank partition" in err.message and "'columns'" in err.message
        assert 'partition = "balanced"' in err.fix
