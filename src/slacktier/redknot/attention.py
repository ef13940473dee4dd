"""Per-head DeepSeek-V4 attention over segments, with the model's own weights.

Pieces:
- RoPE tables from the model's rotary module (`inv_freq`, `attention_scaling`),
  evaluated in float64 so a query rotated into a document's canonical frame
  (position p - o) meets keys stored at canonical positions exactly as keys at
  true positions would (the model's own rotary rounds angles to float32, which
  would cap relocation exactness near 1e-6).
- `Partial`: one segment's attention (normalized output + log-sum-exp), and
  `merge_partials`: the stable log-sum-exp merge with the per-head sink.
- `attend`: sliding-window latents per segment frame plus the compressed (CSA /
  HCA) entries at true positions, for any sorted row set and any head set.
- `grouped_projection`: the sliced `o_a_proj` (wo_a) for any head subset.

Shapes: S rows in the request, h selected heads, d = head_dim, W = sliding window,
T compressed entries, G output groups of R = o_lora_rank channels.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from slacktier.errors import optional_import

# transformers is the `models` extra: without it, importing this module refuses in one line naming it.
optional_import("transformers", "models", "RedKnot's attention (slacktier.redknot)")
from transformers.models.deepseek_v4.modeling_deepseek_v4 import rotate_half

NEG_INF = float("-inf")


def rope_tables(rotary, rope_type: str, positions: torch.Tensor, dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [n, rope_dim/2] for integer `positions` [n], from the module's own buffers, in float64."""
    inv_freq = getattr(rotary, f"{rope_type}_inv_freq").to(torch.float64)
    scale = float(getattr(rotary, f"{rope_type}_attention_scaling"))
    freqs = positions.to(torch.float64)[:, None] * inv_freq[None, :]
    return (freqs.cos() * scale).to(dtype), (freqs.sin() * scale).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """V4 interleaved RoPE on the trailing rope slice of x [n, ..., d]; cos/sin [n, r/2]; no dtype change."""
    cos = cos.repeat_interleave(2, dim=-1)
    sin = sin.repeat_interleave(2, dim=-1)
    for _ in range(x.dim() - 2):
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    r = cos.shape[-1]
    nope, rope = x[..., :-r], x[..., -r:]
    return torch.cat([nope, rope * cos + rotate_half(rope) * sin], dim=-1)


@dataclass
class Partial:
    """One segment's attention for n rows and h heads."""

    out: torch.Tensor  # [n, h, d], normalized within the segment, rope slice back in the relative frame
    lse: torch.Tensor  # [n, h], log-sum-exp of the segment's scores; -inf where the segment is empty
    dist: torch.Tensor | None = None  # [n, h], mean query-key distance within the segment (optional)


def segment_partial(q: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor, scaling: float,
                    bias: torch.Tensor | None = None, dist: torch.Tensor | None = None) -> Partial:
    """Attention of q [n, h, d] over per-row keys [n, k, d] (K = V) where valid [n, k]; optional bias [n, k]."""
    scores = torch.einsum("nhd,nkd->nhk", q, keys) * scaling
    if bias is not None:
        scores = scores + bias[:, None, :]
    scores = scores.masked_fill(~valid[:, None, :], NEG_INF)
    lse = torch.logsumexp(scores, dim=-1)  # [n, h]
    finite = torch.isfinite(lse)
    probs = torch.exp(scores - torch.where(finite, lse, torch.zeros_like(lse))[..., None])
    probs = torch.where(valid[:, None, :], probs, torch.zeros_like(probs))
    out = torch.einsum("nhk,nkd->nhd", probs, keys)
    mean_dist = None
    if dist is not None:
        mean_dist = torch.einsum("nhk,nk->nh", probs, dist.to(probs.dtype))
    return Partial(out, lse, mean_dist)


def shared_keys_partial(q: torch.Tensor, keys: torch.Tensor, scaling: float, bias: torch.Tensor | None,
                        dist: torch.Tensor | None = None) -> Partial:
    """Attention of q [n, h, d] over keys [T, d] shared by all rows, plus bias [n, T] (-inf = hidden)."""
    scores = torch.einsum("nhd,td->nht", q, keys) * scaling
    if bias is not None:
        scores = scores + bias[:, None, :]
    lse = torch.logsumexp(scores, dim=-1)
    finite = torch.isfinite(lse)
    probs = torch.exp(scores - torch.where(finite, lse, torch.zeros_like(lse))[..., None])
    probs = torch.nan_to_num(probs, nan=0.0)
    out = torch.einsum("nht,td->nhd", probs, keys)
    mean_dist = None
    if dist is not None:
        mean_dist = torch.einsum("nht,nt->nh", probs, dist.to(probs.dtype))
    return Partial(out, lse, mean_dist)


def merge_partials(parts: list[Partial], sinks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Stable log-sum-exp merge of segment partials with the per-head sink logit.

    out = sum_s e^(lse_s - m) out_s / (sum_s e^(lse_s - m) + e^(sink - m)), m = max(lse_s, sink).
    Empty segments (lse = -inf) weigh exactly 0 and their `out` (possibly NaN) is
    never read; the sink is a logit with no value, so it only enlarges the denominator.
    Returns (out [n, h, d], mean distance [n, h] over non-sink mass or None).
    """
    sinks = sinks.to(parts[0].out.dtype)
    lses = torch.stack([p.lse for p in parts])  # [P, n, h]
    m = torch.maximum(lses.max(dim=0).values, sinks[None, :].expand_as(lses[0]))
    w = torch.exp(lses - m[None])  # exp(-inf) = 0
    num = torch.zeros_like(parts[0].out)
    for i, p in enumerate(parts):
        wi = w[i][..., None]
        num = num + torch.where(wi > 0, wi * p.out, torch.zeros_like(p.out))
    den = w.sum(dim=0) + torch.exp(sinks[None, :] - m)
    out = num / den[..., None]
    mean_dist = None
    if all(p.dist is not None for p in parts):
        mass = w.sum(dim=0)
        acc = sum(torch.where(w[i] > 0, w[i] * p.dist, torch.zeros_like(p.dist)) for i, p in enumerate(parts))
        mean_dist = acc / torch.clamp(mass, min=torch.finfo(mass.dtype).tiny)
    return out, mean_dist


def grouped_projection(o_a_weight: torch.Tensor, out: torch.Tensor, heads: torch.Tensor, o_groups: int
                       ) -> torch.Tensor:
    """Sum over the given heads of their `o_a_proj` (wo_a) slices: z [n, G*R].

    o_a_weight is the model's [G*R, H/G*d] grouped weight; group g reads heads
    [g*H/G, (g+1)*H/G). Head 9 with H=16, G=2: group 1, slot 1 -> columns d..2d of
    group 1's block. out [n, h, d] holds the selected heads' outputs in `heads` order.
    Summing the slices of disjoint head sets gives the full projection (checked in tests).
    """
    n, _, d = out.shape
    gr, gin = o_a_weight.shape
    per_group = gin // d
    rank = gr // o_groups
    w = o_a_weight.view(o_groups, rank, per_group, d)
    z = out.new_zeros((n, o_groups, rank))
    heads_l = heads.tolist()
    for g in range(o_groups):
        sel = [i for i, h in enumerate(heads_l) if h // per_group == g]
        if not sel:
            continue
        slots = [heads_l[i] % per_group for i in sel]
        x = out[:, sel, :].reshape(n, len(sel) * d)
        wg = w[g][:, slots, :].reshape(rank, len(sel) * d)
        z[:, g, :] = x @ wg.T
    return z.reshape(n, o_groups * rank)
