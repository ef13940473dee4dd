"""The Engram module of DeepSeek-V4.1: gathered n-gram rows gate a value into every hyper-connection copy.

Follows the arithmetic of SGLang 0.5.23's `Engram.forward` on its torch path
(own code): the C gathered rows of a token are flattened to C*256 features, one
linear map `wkv` turns them into hc_mult keys and one shared value of the model
width, each residual copy is scored against its key (both RMS-normalized per
copy, scaled by 1/sqrt(dim), signed square root), and sigmoid(score) times the
value is added to that copy. SGLang applies it to the layer's incoming
hyper-connection residual, before the layer's attention mixes the copies; the
hook in `deepseek_v41` does the same.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from slacktier.errors import ErrorKind, SlackTierError
from slacktier.tables.layout import ROW_VALUES


@dataclass(frozen=True)
class EngramShape:
    """Sizes of one Engram module."""

    dim: int            # model width
    hc_mult: int        # hyper-connection copies
    columns: int = 24   # rows gathered per token: (max n-gram - 1) orders * heads
    row_dim: int = ROW_VALUES
    eps: float = 1e-6
    clamp_value: float = 1e-6

    def __post_init__(self) -> None:
        if min(self.dim, self.hc_mult, self.columns, self.row_dim) <= 0:
            raise SlackTierError(ErrorKind.BAD_INPUT, f"Engram sizes must be positive: {self}",
                                 fix="check the model config")


class EngramModule(nn.Module):
    """One Engram layer's projection and gate; the rows come from outside (a RowProvider)."""

    def __init__(self, shape: EngramShape, dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__()
        self.shape = shape
        self.wkv = nn.Linear(shape.columns * shape.row_dim, (shape.hc_mult + 1) * shape.dim, bias=False, dtype=dtype)
        self.q_weight = nn.Parameter(torch.ones(shape.hc_mult, shape.dim, dtype=dtype), requires_grad=False)
        self.k_weight = nn.Parameter(torch.ones(shape.hc_mult, shape.dim, dtype=dtype), requires_grad=False)

    def reset_seeded(self, generator: torch.Generator, std: float = 0.02) -> None:
        """Seeded random weights: wkv ~ N(0, std), q/k weights ~ 1 + N(0, 0.1)."""
        with torch.no_grad():
            self.wkv.weight.copy_(torch.randn(self.wkv.weight.shape, generator=generator) * std)
            self.q_weight.copy_(1 + 0.1 * torch.randn(self.q_weight.shape, generator=generator))
            self.k_weight.copy_(1 + 0.1 * torch.randn(self.k_weight.shape, generator=generator))

    def forward(self, residual: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """residual [T, hc, dim], rows [T, C, 256] bf16 -> residual with the gated value added [T, hc, dim]."""
        s = self.shape
        if rows.shape[0] != residual.shape[0] or rows.shape[1:] != (s.columns, s.row_dim):
            raise SlackTierError(ErrorKind.BAD_INPUT, f"rows {tuple(rows.shape)} do not fit residual "
                                 f"{tuple(residual.shape)} (want [T, {s.columns}, {s.row_dim}])",
                                 fix="gather one set of rows per token of the step")
        if residual.shape[0] == 0:
            return residual
        kv = self.wkv(rows.flatten(-2).to(self.wkv.weight.dtype))  # [T, (hc + 1) * dim]
        return engram_gate(residual, kv, self.q_weight, self.k_weight, s.eps, s.clamp_value)


def engram_gate(x: torch.Tensor, kv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                eps: float, clamp_value: float) -> torch.Tensor:
    """x [T, hc, dim]; kv [T, (hc + 1) * dim] = hc keys then one value -> x + gate * value, in fp32, cast back."""
    hc, dim = x.shape[-2:]
    keys, value = kv.split([hc * dim, dim], dim=-1)
    keys = keys.float().unflatten(-1, (hc, dim))           # [T, hc, dim]
    h = x.float()
    # Each (token, copy) is normalized on its own, the residual copy and its key alike.
    inv_rms = torch.rsqrt(h.square().mean(-1) + eps) * torch.rsqrt(keys.square().mean(-1) + eps)  # [T, hc]
    score = (h * (q_weight.float() * k_weight.float()) * keys).sum(-1) * inv_rms * dim ** -0.5
    gate = torch.sigmoid(torch.copysign(score.abs().clamp_min(clamp_value).sqrt(), score))  # [T, hc]
    return (h + gate.unsqueeze(-1) * value.float().unsqueeze(-2)).to(x.dtype)
