"""A DeepSeek-V4.1-shaped model: transformers' DeepseekV4 decoder layers plus Engram modules.

transformers' `DeepseekV4ForCausalLM` (unmodified) provides every layer. Engram
is attached with a forward pre-hook on the decoder layers in `engram_layer_ids`:
the hook replaces the layer's incoming hyper-connection residual [B, S, hc, D]
by `Engram(residual, rows)` before the layer's attention runs, which is where
SGLang's `DeepseekV4Model` calls `engram(state.residual, ...)`. The rows come
from a `RowProvider`: the stock DRAM table, or SlackTier's step engine.

Two ways to run it, both through the same hooked layers:
- `forward_sequence`: one session, transformers' own `DeepseekV4ForCausalLM.forward`.
- `forward_step`: a batch of sessions, each with its own cache, run layer-major
  (layer 0 of every session, then layer 1, ...). Sessions cannot share one
  transformers forward because V4's caches (sliding window + compressor state)
  hold one sequence each; running layer-major keeps the step's layer order, so
  layer l's rows are needed after l layers of the whole batch, as in a batched
  server, and `rows(l)` is called once per step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import torch
from torch import nn

from slacktier.errors import optional_import

# transformers is the `models` extra: without it, importing this module refuses in one line naming it.
optional_import("transformers", "models", "the V4.1-shaped CPU model (slacktier.models)")
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM
from transformers.cache_utils import DynamicCache
from transformers.masking_utils import create_sliding_window_causal_mask

from slacktier.errors import ErrorKind, SlackTierError
from slacktier.models.engram import EngramModule, EngramShape
from slacktier.models.rows import RowProvider

DEEPSEEK_V4_VOCAB = 129_280  # ids of the DeepSeek-V4 tokenizer


@dataclass(frozen=True)
class V41Config:
    """Size of the V4.1-shaped model; presets by name (`V41Config.preset("tiny")`)."""

    layers: int = 40
    hidden_size: int = 256
    heads: int = 4
    head_dim: int = 64
    q_lora_rank: int = 128
    o_groups: int = 2
    o_lora_rank: int = 64
    experts: int = 8
    experts_per_token: int = 2
    moe_intermediate_size: int = 128
    index_heads: int = 2
    index_head_dim: int = 32
    index_topk: int = 16
    sliding_window: int = 64
    hc_mult: int = 4
    sinkhorn_iters: int = 20
    vocab_size: int = DEEPSEEK_V4_VOCAB
    engram_layer_ids: tuple[int, ...] = (1, 14)
    engram_columns: int = 24
    seed: int = 0
    # float32 by default: on CPUs bf16 matmuls run several times slower than fp32. Engram rows stay
    # bf16 (the gather's output); the model widens them exactly. "bfloat16" gives the checkpoint's dtype.
    dtype: str = "float32"

    def __post_init__(self) -> None:
        if self.dtype not in ("float32", "bfloat16"):
            raise SlackTierError(ErrorKind.BAD_INPUT, f"dtype {self.dtype!r}", fix="use float32 or bfloat16")
        bad = [l for l in self.engram_layer_ids if not 0 <= l < self.layers]
        if bad:
            raise SlackTierError(ErrorKind.BAD_INPUT, f"Engram layers {bad} outside 0..{self.layers - 1}",
                                 fix="pick Engram layers below the layer count")
        if list(self.engram_layer_ids) != sorted(set(self.engram_layer_ids)):
            raise SlackTierError(ErrorKind.BAD_INPUT, f"Engram layers {self.engram_layer_ids} must ascend",
                                 fix="list Engram layers in model order")

    @classmethod
    def preset(cls, name: str, **overrides) -> "V41Config":
        """'tiny' (4 layers, Engram at 1 and 3, for tests), 'small' (16 layers), 'v41' (40 layers, 1 and 14)."""
        presets = {
            "tiny": cls(layers=4, hidden_size=64, heads=2, head_dim=32, q_lora_rank=32, o_lora_rank=16,
                        experts=4, moe_intermediate_size=32, index_heads=2, index_head_dim=16, index_topk=8,
                        sliding_window=16, sinkhorn_iters=4, engram_layer_ids=(1, 3)),
            "small": cls(layers=16, hidden_size=128, heads=2, head_dim=64, q_lora_rank=64, o_lora_rank=32,
                         moe_intermediate_size=64, sliding_window=32, engram_layer_ids=(1, 14)),
            "v41": cls(),
            # The benchmark's model: 8 small layers, Engram at 1 and 3 (3/8 is about the relative depth of 14/40),
            # so that a decode step on one shared CPU core stands to the disk's read time roughly as in the paper.
            "bench": cls(layers=8, hidden_size=64, heads=2, head_dim=32, q_lora_rank=32, o_lora_rank=16,
                         moe_intermediate_size=32, sliding_window=64, engram_layer_ids=(1, 3)),
            "bench16": cls(layers=16, hidden_size=128, heads=2, head_dim=64, q_lora_rank=64, o_lora_rank=32,
                           moe_intermediate_size=64, sliding_window=64, engram_layer_ids=(1, 6)),
        }
        if name not in presets:
            raise SlackTierError(ErrorKind.BAD_INPUT, f"no V4.1 preset {name!r}", fix=f"use one of {sorted(presets)}")
        return replace(presets[name], **overrides)

    def hf_config(self) -> DeepseekV4Config:
        """The transformers config of the decoder stack."""
        return DeepseekV4Config(
            vocab_size=self.vocab_size, hidden_size=self.hidden_size, moe_intermediate_size=self.moe_intermediate_size,
            num_hidden_layers=self.layers, num_attention_heads=self.heads, num_key_value_heads=1,
            head_dim=self.head_dim, q_lora_rank=self.q_lora_rank, num_experts_per_tok=self.experts_per_token,
            n_routed_experts=self.experts, n_shared_experts=1, o_groups=self.o_groups, o_lora_rank=self.o_lora_rank,
            index_n_heads=self.index_heads, index_head_dim=self.index_head_dim, index_topk=self.index_topk,
            sliding_window=self.sliding_window, hc_mult=self.hc_mult, hc_sinkhorn_iters=self.sinkhorn_iters,
            max_position_embeddings=1 << 20, bos_token_id=0, eos_token_id=1, pad_token_id=2)


@dataclass
class StepSlot:
    """One session's share of a step: tokens [1, S] and its cache."""

    input_ids: torch.Tensor
    cache: DynamicCache


class V41Model(nn.Module):
    """transformers' DeepseekV4ForCausalLM with Engram modules hooked in front of the Engram layers."""

    def __init__(self, config: V41Config, provider: RowProvider | None = None) -> None:
        super().__init__()
        self.config = config
        torch.manual_seed(config.seed)  # transformers' own initializers draw from the global generator
        dtype = getattr(torch, config.dtype)
        self.hf = DeepseekV4ForCausalLM._from_config(config.hf_config(), dtype=dtype).eval()
        gen = torch.Generator().manual_seed(config.seed + 1)
        with torch.no_grad():
            for layer in self.hf.model.layers:
                gate = layer.mlp.gate
                if hasattr(gate, "tid2eid"):  # hash-MoE layers: a frozen token -> experts table
                    pick = torch.rand(gate.tid2eid.shape[0], config.experts, generator=gen).argsort(-1)
                    gate.tid2eid.copy_(pick[:, :config.experts_per_token])
        shape = EngramShape(dim=config.hidden_size, hc_mult=config.hc_mult, columns=config.engram_columns,
                            eps=self.hf.config.rms_norm_eps)
        self.engrams = nn.ModuleDict()
        for layer_id in config.engram_layer_ids:
            module = EngramModule(shape, dtype=dtype)
            module.reset_seeded(gen)
            self.engrams[str(layer_id)] = module
        self.provider = provider
        self._step_rows: dict[int, torch.Tensor] = {}
        self._row_slice = slice(0, 0)
        self._in_step = False
        self._t_issued = 0.0
        # Per step: ms from "all lookups issued" to the layer asking for its rows (its window, as measured;
        # it includes stalls at earlier layers), and ms spent in provider.rows(l) (exposed wait + gather).
        self.last_windows_ms: dict[int, float] = {}
        self.last_rows_ms: dict[int, float] = {}
        for layer_id in config.engram_layer_ids:
            self.hf.model.layers[layer_id].register_forward_pre_hook(self._make_hook(layer_id), with_kwargs=True)

    # -- the hook -------------------------------------------------------------------------------------
    def _make_hook(self, layer_id: int):
        engram = self.engrams[str(layer_id)]

        def hook(module, args, kwargs):
            hidden = args[0] if args else kwargs["hidden_states"]  # [B, S, hc, D]
            rows = self._rows_for(layer_id)[self._row_slice]       # [B*S, C, 256]
            b, s, hc, d = hidden.shape
            out = engram(hidden.reshape(b * s, hc, d), rows).view(b, s, hc, d)
            if args:
                return (out,) + tuple(args[1:]), kwargs
            return args, {**kwargs, "hidden_states": out}

        return hook

    def _rows_for(self, layer_id: int) -> torch.Tensor:
        if not self._in_step:
            raise SlackTierError(ErrorKind.BAD_INPUT, "an Engram layer ran outside a step",
                                 fix="call forward_sequence or forward_step, not the transformers model directly")
        rows = self._step_rows.get(layer_id)
        if rows is None:
            t0 = time.perf_counter()
            rows = self._step_rows[layer_id] = self.provider.rows(layer_id)
            self.last_windows_ms[layer_id] = (t0 - self._t_issued) * 1e3
            self.last_rows_ms[layer_id] = (time.perf_counter() - t0) * 1e3
        return rows

    def _begin(self, ids: torch.Tensor) -> None:
        if self.provider is None:
            raise SlackTierError(ErrorKind.MISSING, "no row provider", fix="set model.provider first")
        if ids.shape[1:] != (len(self.config.engram_layer_ids), self.config.engram_columns):
            raise SlackTierError(ErrorKind.BAD_INPUT, f"ids {tuple(ids.shape)} do not match Engram layers "
                                 f"{self.config.engram_layer_ids}", fix="hash with the model's Engram layout")
        self.provider.begin_step(ids)
        self._t_issued = time.perf_counter()
        self._step_rows = {}
        self.last_windows_ms, self.last_rows_ms = {}, {}
        self._in_step = True

    def _end(self) -> None:
        self._in_step = False
        self._step_rows = {}
        self.provider.end_step()

    # -- whole-sequence path (transformers' own forward) ----------------------------------------------
    def new_cache(self) -> DynamicCache:
        """An empty cache for one session."""
        return DynamicCache(config=self.hf.config)

    @torch.no_grad()
    def forward_sequence(self, input_ids: torch.Tensor, cache: DynamicCache, ids: torch.Tensor) -> torch.Tensor:
        """One session, one step through transformers' forward: input_ids [1, S], ids [S, L, C] -> logits [S, V]."""
        self._begin(ids)
        try:
            self._row_slice = slice(0, input_ids.shape[1])
            out = self.hf(input_ids=input_ids, cache=cache, use_cache=True)
        finally:
            self._end()
        return out.logits[0]

    # -- batched step, layer-major --------------------------------------------------------------------
    @torch.no_grad()
    def forward_step(self, slots: list[StepSlot], ids: torch.Tensor, all_logits: bool = False,
                     after_begin=None) -> list[torch.Tensor]:
        """Sessions' new tokens, ids [sum S, L, C] in slot order -> per slot logits [V] (last token) or [S, V]."""
        total = sum(int(s.input_ids.shape[1]) for s in slots)
        if ids.shape[0] != total:
            raise SlackTierError(ErrorKind.BAD_INPUT, f"{ids.shape[0]} id rows for {total} tokens",
                                 fix="hash every new token of every session in slot order")
        self._begin(ids)
        if after_begin is not None:
            after_begin()
        try:
            states = [self._prelude(s) for s in slots]
            for layer in self.hf.model.layers:
                offset = 0
                for slot, st in zip(slots, states):
                    n = int(slot.input_ids.shape[1])
                    self._row_slice = slice(offset, offset + n)
                    offset += n
                    st["hidden"] = layer(st["hidden"], position_embeddings=st["pe"], position_ids=st["pos"],
                                         attention_mask=st["mask"], input_ids=slot.input_ids, cache=slot.cache)
        finally:
            self._end()
        model = self.hf.model
        if all_logits:   # per session, exactly transformers' epilogue on [1, S]
            return [self.hf.lm_head(model.norm(model.hc_head(st["hidden"])))[0] for st in states]
        # Last tokens of all sessions through one lm_head call ([B, 1, hc, D] -> [B, V]): a 129k-wide
        # projection per session would dominate a small model's step.
        last = torch.cat([st["hidden"][:, -1:] for st in states], dim=0)
        return list(self.hf.lm_head(model.norm(model.hc_head(last)))[:, -1].unbind(0))

    def _prelude(self, slot: StepSlot) -> dict:
        # The same steps as DeepseekV4Model.forward before its layer loop, for one session.
        model = self.hf.model
        embeds = model.embed_tokens(slot.input_ids)
        past = slot.cache.get_seq_length()
        pos = (torch.arange(embeds.shape[1]) + past).unsqueeze(0)
        mask = create_sliding_window_causal_mask(config=self.hf.config, inputs_embeds=embeds, attention_mask=None,
                                                 cache=slot.cache, position_ids=pos)
        hidden = embeds.unsqueeze(2).expand(-1, -1, self.config.hc_mult, -1).contiguous()
        pe = {kind: model.rotary_emb(embeds, position_ids=pos, layer_type=kind) for kind in ("main", "compress")}
        return {"hidden": hidden, "pe": pe, "pos": pos, "mask": mask}
