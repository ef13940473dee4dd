"""CSA's compressor and Lightning Indexer, row-chunked, for long prefills on a CPU.

transformers' `DeepseekV4CSACompressor.forward` (no cache) scores every query
row against every compressed key at once: the indexer's scorer materializes
[S, index heads, S/4] float32 three times (matmul, ReLU, weighted) and the
compressor then builds an [S, S/4 + 1] block bias. At 64K rows with 4 index
heads that is 16 GiB per copy, more than a CPU host can spare. A GPU indexer
kernel never materializes the score matrix either; it streams rows.

`csa_select` computes the same thing - the compressed KV entries and each
row's top-`index_topk` picks, -1 picks dropped - with the scorer applied to
`chunk_rows` rows at a time, so memory is O(chunk_rows * S/4). The
compression steps are the model's own code path restated (the same ops in
the same order, so the entries are bitwise the model's). The scores are the
scorer's formula in float32 (as the model computes them, even for a float64
model), evaluated per chunk as one GEMM and one batched weighted sum, faster
on a CPU than the scorer's n small [heads, c] x [c, T] products.
They round differently in the last bits, so a pick can differ from the
model's only where two entries' scores agree to float32 rounding;
tests/test_redknot_indexer.py checks the picks equal the model's.

Worked example: S = 65536, m = 4 -> T = 16384 entries; with chunk_rows 64
a chunk's scores are [64, 4, 16384] float32 = 16 MiB instead of 16 GiB.
"""

from __future__ import annotations

import torch

from slacktier.errors import optional_import

# transformers is the `models` extra: without it, importing this module refuses in one line naming it.
optional_import("transformers", "models", "RedKnot's indexer (slacktier.redknot)")
from transformers.models.deepseek_v4.modeling_deepseek_v4 import apply_rotary_pos_emb


def _overlap_compress(kv: torch.Tensor, gate: torch.Tensor, position_bias: torch.Tensor, ratio: int,
                      head_dim: int, norm, rotary) -> torch.Tensor:
    """Overlapping (Ca | Cb) window compression of [1, S, 2*head_dim] kv and gate -> [1, T, head_dim]."""
    usable = (kv.shape[1] // ratio) * ratio
    kv, gate = kv[:, :usable], gate[:, :usable]
    n = usable // ratio
    if n == 0:
        return kv.new_zeros((1, 0, head_dim))
    kv = kv.view(1, n, ratio, -1)
    gate = gate.view(1, n, ratio, -1) + position_bias
    new_kv = kv.new_zeros((1, n, 2 * ratio, head_dim))
    new_gate = gate.new_full((1, n, 2 * ratio, head_dim), float("-inf"))
    new_kv[:, :, ratio:] = kv[..., head_dim:]
    new_gate[:, :, ratio:] = gate[..., head_dim:]
    if n > 1:
        new_kv[:, 1:, :ratio] = kv[:, :-1, :, :head_dim]
        new_gate[:, 1:, :ratio] = gate[:, :-1, :, :head_dim]
    compressed = norm((new_kv * new_gate.softmax(dim=2, dtype=torch.float32).to(new_kv.dtype)).sum(dim=2))
    positions = (torch.arange(n, device=compressed.device) * ratio)[None]
    cos, sin = rotary(compressed, position_ids=positions, layer_type="compress")
    return apply_rotary_pos_emb(compressed.unsqueeze(1), cos, sin).squeeze(1)


def csa_compress(compressor, x: torch.Tensor) -> torch.Tensor:
    """The CSA compressor's entries [T, d] for input x [1, S, D] (no cache, as the model's forward)."""
    c = compressor
    out = _overlap_compress(c.kv_proj(x), c.gate_proj(x), c.position_bias, c.compress_rate, c.head_dim,
                            c.kv_norm, c.rotary_emb)
    return out[0]


def indexer_select(indexer, x: torch.Tensor, q_res: torch.Tensor, positions: torch.Tensor, chunk_rows: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's top-k entry picks [S, k] int64 (invalid ones set to 0) and their validity [S, k] bool.

    x: [1, S, D] (the layer's normed input); q_res: [1, S, q_lora]; positions: [1, S].
    """
    ix = indexer
    S = x.shape[1]
    keys = _overlap_compress(ix.kv_proj(x), ix.gate_proj(x), ix.position_bias, ix.compress_rate, ix.head_dim,
                             ix.kv_norm, ix.rotary_emb)  # [1, T, c]
    T = keys.shape[1]
    k = min(ix.index_topk, T)
    if k == 0:
        return torch.zeros((S, 0), dtype=torch.long), torch.zeros((S, 0), dtype=torch.bool)
    cos_q, sin_q = ix.rotary_emb(x, position_ids=positions, layer_type="compress")
    q = ix.q_b_proj(q_res).view(1, S, -1, ix.head_dim).transpose(1, 2)
    q = apply_rotary_pos_emb(q, cos_q, sin_q).transpose(1, 2)  # [1, S, Hi, c]
    threshold = (positions[0] + 1) // ix.compress_rate      # [S]: entries < threshold are complete
    entries = torch.arange(T)
    picks = torch.empty((S, k), dtype=torch.long)
    sc = ix.scorer
    keys_t = keys[0].float().T.contiguous()                               # [c, T]
    weights = sc.weights_proj(x[0]).float() * sc.weights_scaling          # [S, Hi]
    hi = q.shape[2]
    for start in range(0, S, chunk_rows):
        end = min(start + chunk_rows, S)
        n = end - start
        # the scorer's sum_h w_h * ReLU(q_h . k) * scale as one GEMM and one batched weighted sum
        # (DeepseekV4IndexerScorer computes it as n small [Hi, c] x [c, T] products)
        scores = (q[0, start:end].float().reshape(n * hi, -1) @ keys_t).view(n, hi, T)
        scores = scores.relu_().mul_(sc.softmax_scale)
        scores = torch.bmm(weights[start:end, None, :], scores)[:, 0]    # [n, T]
        scores = scores.masked_fill(entries[None, :] >= threshold[start:end, None], float("-inf"))
        picks[start:end] = scores.topk(k, dim=-1).indices
    valid = picks < threshold[:, None]
    return torch.where(valid, picks, torch.zeros_like(picks)), valid


def csa_select(compressor, x: torch.Tensor, q_res: torch.Tensor, positions: torch.Tensor, chunk_rows: int
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(entries [T, d], picks [S, k], valid [S, k]) of one CSA layer; see the module docstring."""
    picks, valid = indexer_select(compressor.indexer, x, q_res, positions, chunk_rows)
    return csa_compress(compressor, x), picks, valid
