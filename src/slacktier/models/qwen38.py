"""A Qwen3.8-shaped model: transformers' Qwen4Exp with its per-layer n-gram embedding table served by SlackTier.

transformers' `Qwen4ExpTextNGramEmbedding.forward` hashes each token's 2- and
3-grams into C = 16 row ids and then reads `self.ngram_embedding` (an
`nn.Embedding`, a bf16 table of `ple_embed_dim / 16` columns). Only that read is
replaced: `serve_ngram_tables` swaps each PLE layer's `ngram_embedding` module
for a `ServedNgramRows` module that returns the provider's rows for the same ids.
Hashing, the PLE gate, the convolution and the caches stay transformers' code.

Row format. The tier's row is 256 fp8 values + 8 e8m0 scales (264 B). We set
`ple_embed_dim = 16 * 256` so a table row has 256 values, and fill the
unmodified model's bf16 `nn.Embedding` with the exact dequantization of the
staged fp8 rows (bf16(fp32(v) * 2^(e-127)), representable in bf16 without
rounding). The unmodified model and the served model therefore hold the same
table; the served one reads it through SlackTier. A checkpoint with arbitrary
bf16 rows of another width would need a bf16 row codec; we did not build one.

Lookups are issued at step start: `forward_step` first runs transformers' own
hashing (the n-gram module's forward with a read-only view of the session's
cache and the served module in capture mode), hands all PLE layers' ids to the
provider, then runs the model. Every id the model asks for during the real
forward is checked against the ids the step began with.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import nn

from slacktier.errors import optional_import

# transformers is the `models` extra: without it, importing this module refuses in one line naming it.
optional_import("transformers", "models", "the Qwen3.8-shaped CPU model (slacktier.models)")
from transformers import Qwen4ExpForCausalLM, Qwen4ExpTextConfig
from transformers.cache_utils import DynamicCache

from slacktier.errors import ErrorKind, SlackTierError
from slacktier.models.rows import DramTable, RowProvider
from slacktier.tables.layout import ROW_VALUES


@dataclass(frozen=True)
class Q38Config:
    """Size of the Qwen3.8-shaped model; presets by name."""

    layers: int = 4
    hidden_size: int = 64
    heads: int = 2
    head_dim: int = 32
    linear_heads: int = 2
    linear_head_dim: int = 16
    experts: int = 4
    experts_per_token: int = 2
    moe_intermediate_size: int = 32
    hc_count: int = 2
    hc_lowrank: int = 16
    ple_layer_ids: tuple[int, ...] = (1, 2)   # one-indexed, as transformers' config: decoder layers 0 and 1
    ngram_vocab_size_base: int = 1000        # 20,000,000 in Qwen3.8; small so the unmodified table fits
    vocab_size: int = 129_280                 # the DeepSeek-V4 tokenizer's ids (our traces' tokenizer)
    eos_token_id: int = 1
    seed: int = 0
    dtype: str = "float32"   # as V41Config: bf16 matmuls are slow on CPUs; the table values are bf16-exact

    @classmethod
    def preset(cls, name: str, **overrides) -> "Q38Config":
        """'tiny' (4 layers, tests) or 'small' (8 layers)."""
        presets = {"tiny": cls(), "small": cls(layers=8, hidden_size=128, ple_layer_ids=(1, 2, 5))}
        if name not in presets:
            raise SlackTierError(ErrorKind.BAD_INPUT, f"no Qwen3.8 preset {name!r}", fix=f"use one of {sorted(presets)}")
        return replace(presets[name], **overrides)

    def hf_config(self) -> Qwen4ExpTextConfig:
        """The transformers config; ple_embed_dim = 16 heads * 256 values per row."""
        return Qwen4ExpTextConfig(
            vocab_size=self.vocab_size, hidden_size=self.hidden_size, num_hidden_layers=self.layers,
            num_attention_heads=self.heads, num_key_value_heads=1, head_dim=self.head_dim,
            linear_key_head_dim=self.linear_head_dim, linear_value_head_dim=self.linear_head_dim,
            linear_num_key_heads=self.linear_heads, linear_num_value_heads=self.linear_heads,
            moe_intermediate_size=self.moe_intermediate_size,
            shared_expert_intermediate_size=self.moe_intermediate_size, num_experts=self.experts,
            num_experts_per_tok=self.experts_per_token, hc_count=self.hc_count, hc_lowrank=self.hc_lowrank,
            ple_layer_ids=list(self.ple_layer_ids), ple_embed_dim=16 * ROW_VALUES,
            ngram_vocab_size_base=self.ngram_vocab_size_base, eos_token_id=self.eos_token_id,
            indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=self.head_dim, indexer_budget=16,
            indexer_compress_ratio=4)


def build_qwen38(config: Q38Config) -> Qwen4ExpForCausalLM:
    """The unmodified transformers model with seeded random weights (bf16)."""
    torch.manual_seed(config.seed)
    return Qwen4ExpForCausalLM._from_config(config.hf_config(), dtype=getattr(torch, config.dtype)).eval()


def ple_modules(model: Qwen4ExpForCausalLM) -> dict[int, nn.Module]:
    """Decoder layer index -> that layer's `Qwen4ExpTextNGramEmbedding`."""
    return {i: layer.ple.ple_embedding for i, layer in enumerate(model.model.layers) if layer.ple is not None}


def ple_table_rows(model: Qwen4ExpForCausalLM) -> dict[int, int]:
    """Decoder layer index -> rows of its n-gram table (sum of its 16 head primes)."""
    return {i: int(m.total_vocab_size) for i, m in ple_modules(model).items()}


def ple_column_bounds(model: Qwen4ExpForCausalLM) -> dict[int, tuple[int, ...]]:
    """Decoder layer index -> column c owns rows [b[c], b[c+1]) (the 16 heads' offsets, then the total)."""
    return {i: tuple(int(o) for o in m.head_offsets) + (int(m.total_vocab_size),)
            for i, m in ple_modules(model).items()}


def ple_tables_from(source, model: Qwen4ExpForCausalLM) -> dict[int, DramTable]:
    """Per PLE layer, its rows from a staging RowSource (tables.stage.SyntheticSource) as DRAM tables."""
    return {i: DramTable.from_source(source, i, rows) for i, rows in ple_table_rows(model).items()}


def load_ple_tables(model: Qwen4ExpForCausalLM, tables: dict[int, DramTable]) -> None:
    """Write each table's exact dequantization into the unmodified model's bf16 `ngram_embedding`."""
    for i, module in ple_modules(model).items():
        table = tables[i]
        weight = module.ngram_embedding.weight
        if weight.shape[1] != ROW_VALUES or table.rows > weight.shape[0]:
            raise SlackTierError(ErrorKind.CHECKPOINT, f"layer {i} n-gram table is {tuple(weight.shape)}, rows "
                                 f"{table.rows}", fix="build the model with ple_embed_dim = 16 * 256")
        with torch.no_grad():
            weight.zero_()
            weight[:table.rows] = table.gather(torch.arange(table.rows)).to(weight.dtype)


class _ReadOnlyCache:
    """Lets the n-gram module read a session's token context without updating it (for the hash pass)."""

    def __init__(self, cache: DynamicCache | None) -> None:
        self.cache = cache

    def get_conv_state(self, layer_idx: int, state_idx: int):
        if self.cache is None:
            return None
        return self.cache.get_conv_state(layer_idx, state_idx=state_idx)

    def update_conv_state(self, *args, **kwargs):
        return None


class ServedNgramRows(nn.Module):
    """Stands where `ngram_embedding` stood: ids [B, S, 16] -> rows [B, S, 16, 256] from the provider."""

    def __init__(self, owner: "Q38Served", layer_idx: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.owner = owner.__dict__  # no submodule cycle; reads the owner's step state
        self.layer_idx = layer_idx
        self.dtype = dtype
        self.weight = torch.empty(0, ROW_VALUES, dtype=dtype)  # `.device` read by transformers; holds no rows

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        st = self.owner
        if st["_capture"] is not None:
            st["_capture"][self.layer_idx] = ids.clone()
            return torch.zeros(*ids.shape, ROW_VALUES, dtype=self.dtype)
        if not st["_in_step"]:
            raise SlackTierError(ErrorKind.BAD_INPUT, "the n-gram table was read outside a step",
                                 fix="run the model through Q38Served.forward_step")
        expected = st["_step_ids"][st["_row_slice"], st["_layer_pos"][self.layer_idx]]  # [S, 16]
        if ids.shape[0] != 1 or not torch.equal(ids[0], expected):
            raise SlackTierError(ErrorKind.BAD_INPUT, "the model asked for other rows than the step issued",
                                 fix="hash with the same session context as the forward", layer=self.layer_idx)
        rows = st["_rows"].get(self.layer_idx)
        if rows is None:
            rows = st["_rows"][self.layer_idx] = st["provider"].rows(self.layer_idx)
        return rows[st["_row_slice"]].unsqueeze(0).to(self.dtype)


@dataclass
class QwenSlot:
    """One session's share of a step."""

    input_ids: torch.Tensor  # [1, S]
    cache: DynamicCache


class Q38Served:
    """A transformers Qwen4Exp model whose PLE tables are read through a RowProvider."""

    def __init__(self, model: Qwen4ExpForCausalLM, provider: RowProvider) -> None:
        self.model = model
        self.provider = provider
        self.modules = ple_modules(model)
        self.layer_ids = tuple(self.modules)
        if tuple(provider.layer_ids) != self.layer_ids:
            raise SlackTierError(ErrorKind.BAD_INPUT, f"provider serves layers {provider.layer_ids}, model has PLE "
                                 f"at {self.layer_ids}", fix="key tables by decoder layer index")
        self._layer_pos = {l: k for k, l in enumerate(self.layer_ids)}
        self._capture: dict[int, torch.Tensor] | None = None
        self._in_step = False
        self._step_ids: torch.Tensor | None = None
        self._row_slice = slice(0, 0)
        self._rows: dict[int, torch.Tensor] = {}
        self.originals = {}
        dtype = next(model.parameters()).dtype
        for i, module in self.modules.items():
            self.originals[i] = module.ngram_embedding
            module.ngram_embedding = ServedNgramRows(self, i, dtype)

    def restore(self) -> Qwen4ExpForCausalLM:
        """Put the original `nn.Embedding` tables back (the unmodified model again)."""
        for i, module in self.modules.items():
            module.ngram_embedding = self.originals[i]
        return self.model

    def new_cache(self) -> DynamicCache:
        """An empty cache for one session."""
        return DynamicCache(config=self.model.config)

    @torch.no_grad()
    def hash_ids(self, input_ids: torch.Tensor, cache: DynamicCache) -> torch.Tensor:
        """transformers' own n-gram hashing of a session's new tokens: [1, S] -> ids [S, L, 16]."""
        self._capture = {}
        try:
            for i, module in self.modules.items():
                module(input_ids, _ReadOnlyCache(cache))
            return torch.stack([self._capture[i][0] for i in self.layer_ids], dim=1)
        finally:
            self._capture = None

    @torch.no_grad()
    def forward_step(self, slots: list[QwenSlot], after_begin=None) -> list[torch.Tensor]:
        """Issue every PLE lookup of the batch, then run each session: per slot, logits [S, V]."""
        ids = torch.cat([self.hash_ids(s.input_ids, s.cache) for s in slots], dim=0)  # [sum S, L, 16]
        self.provider.begin_step(ids)
        if after_begin is not None:
            after_begin()
        self._step_ids, self._rows, self._in_step = ids, {}, True
        out, offset = [], 0
        try:
            for s in slots:
                n = int(s.input_ids.shape[1])
                self._row_slice = slice(offset, offset + n)
                offset += n
                out.append(self.model(input_ids=s.input_ids, cache=s.cache, use_cache=True).logits[0])
        finally:
            self._in_step = False
            self._step_ids, self._rows = None, {}
            self.provider.end_step()
        return out
