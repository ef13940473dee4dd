"""Small DeepSeek-V4 models for tests and CPU benchmarks, and the weights digest.

These are transformers' own `DeepseekV4ForCausalLM` at reduced width and depth
with random weights (no small trained V4 checkpoint exists; train.py trains a
tiny one on a retrieval task for quality measurements). `build_model`
also draws the attention sinks and compressor position biases (zero at init)
so the sink and gate paths are exercised.

Sequence lengths and compressed attention: every tiny config keeps the real
layer mix (sliding, CSA with the Lightning Indexer, HCA). `tiny_config` uses
window 16 and compress rates 4 / 8 so 40-200 token test prompts cross windows
and compressed blocks; `bench_config` keeps V4's window 128 and rates 4 / 128
with index_topk 64 so 4K-16K prompts fit in a few GB.

Indexer ties: with random weights an indexer score is exactly 0 when every
index head's ReLU is 0 (probability 2^-index_n_heads), and torch.topk breaks such
ties differently for different sequence lengths - the model then attends to
different blocks for the same prefix. Tests use 16 index heads (no ties in
practice); the bench model uses 4 (memory: the model's indexer materializes
[S, heads, S/4] scores), which leaves ties possible only for rows whose visible
block count is just above index_topk (absolute rows ~256-272).
"""

from __future__ import annotations

import hashlib

import torch

from slacktier.errors import optional_import

# transformers is the `models` extra: without it, importing this module refuses in one line naming it.
optional_import("transformers", "models", "RedKnot's DeepSeek-V4 model (slacktier.redknot)")
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

TINY_LAYER_TYPES = ("sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                    "compressed_sparse_attention", "heavily_compressed_attention", "sliding_attention")


def tiny_config(*, layers: int = 6, heads: int = 16, o_groups: int = 2, vocab: int = 512,
                window: int = 16, csa_rate: int = 4, hca_rate: int = 8, index_topk: int = 4,
                layer_types: tuple[str, ...] | None = None) -> DeepseekV4Config:
    """A DeepseekV4Config small enough for float64 exactness tests on a CPU."""
    types = list(layer_types or (TINY_LAYER_TYPES * ((layers + 5) // 6))[:layers])
    return DeepseekV4Config(
        vocab_size=vocab, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=layers,
        num_attention_heads=heads, head_dim=32, q_lora_rank=32, partial_rotary_factor=0.25,
        num_experts_per_tok=2, n_routed_experts=4, o_groups=o_groups, o_lora_rank=16,
        index_n_heads=16, index_head_dim=16, index_topk=index_topk, sliding_window=window,
        layer_types=types, compress_rates={"compressed_sparse_attention": csa_rate,
                                           "heavily_compressed_attention": hca_rate},
        hc_sinkhorn_iters=5, max_position_embeddings=1 << 20, bos_token_id=0, eos_token_id=1,
        experts_implementation="eager", attn_implementation="eager")


def bench_config(*, layers: int = 7, heads: int = 16, o_groups: int = 2, vocab: int = 129_280
                 ) -> DeepseekV4Config:
    """The CPU benchmark model: V4's window (128) and compress rates (4 / 128), narrow width."""
    types = ["sliding_attention"] + ["compressed_sparse_attention", "heavily_compressed_attention"] * 3
    return DeepseekV4Config(
        vocab_size=vocab, hidden_size=256, moe_intermediate_size=128, num_hidden_layers=layers,
        num_attention_heads=heads, head_dim=64, q_lora_rank=128, partial_rotary_factor=0.25,
        num_experts_per_tok=2, n_routed_experts=4, o_groups=o_groups, o_lora_rank=64,
        index_n_heads=4, index_head_dim=32, index_topk=64, sliding_window=128,
        layer_types=types[:layers], hc_sinkhorn_iters=10, max_position_embeddings=1 << 20,
        bos_token_id=0, eos_token_id=1, experts_implementation="eager", attn_implementation="eager")


@torch.no_grad()
def build_model(config: DeepseekV4Config, *, seed: int = 0, dtype: torch.dtype = torch.float64,
                lm_head_scale: float = 1.0) -> DeepseekV4ForCausalLM:
    """A randomly initialised DeepseekV4ForCausalLM in eval mode, sinks and biases drawn too.

    `lm_head_scale` multiplies the output head: at init (std 0.02) the next-token
    distribution of a random model is almost uniform, so benchmarks scale it up to
    get a peaked distribution whose KL divergence says something.
    """
    torch.manual_seed(seed)
    model = DeepseekV4ForCausalLM(config)
    gen = torch.Generator().manual_seed(seed + 1)
    for name, p in model.named_parameters():
        if name.endswith("sinks"):
            p.copy_(torch.randn(p.shape, generator=gen) * 1.0)
        elif name.endswith("position_bias"):
            p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    for name, buf in model.named_buffers():
        if name.endswith("tid2eid"):  # hash routing table: a real checkpoint ships one; draw a valid one
            buf.copy_(torch.randint(0, config.n_routed_experts, buf.shape, generator=gen))
    model.lm_head.weight.mul_(lm_head_scale)
    return model.to(dtype).eval()


def model_digest(model: torch.nn.Module) -> str:
    """sha256 over the config and every parameter and persistent buffer (name, dtype, shape, bytes)."""
    h = hashlib.sha256(model.config.to_json_string(use_diff=False).encode())
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(str(t.dtype).encode())
        h.update(str(tuple(t.shape)).encode())
        h.update(t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()
