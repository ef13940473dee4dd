"""The RedKnot-MLA ledger: logical head-row ceiling and per-operator arithmetic of a prefill.

Logical head-row ceiling (length independent, no protected rows):
    ceiling = (reusable layers / layers) * (Local heads / heads)
    Flash: 37/43 * 56/64 = 0.752907 -> 75.29 %;  Pro: 55/61 * 112/128 = 0.788934 -> 78.89 %
(with a per-layer policy: sum over reusable layers of Local heads / (layers * heads)).

Arithmetic (multiply-accumulates, MACs) of one prefill of `doc_rows` document rows
plus `query_rows` query rows, per decoder layer and row at position p:
  hc        2 hyper-connection projections: 2 * (hc*D) * (2+hc)*hc
  q_a       D * q_lora                           kv        D * d
  q_b       H * q_lora * d          (head-row)   o_a       H * d * R       (head-row)
  attn      H * 2 * d * keys(p)     (head-row)   o_b       G*R * D
  compress  CSA: 2*D*2d, HCA: 2*D*d; the CSA indexer adds 2*D*2c + q_lora*Hi*c + D*Hi + Hi*c*floor((p+1)/4)
  moe       D*E router + (k + shared) * 3*D*I
  keys(p) = min(W, p+1) + (CSA: min(topk, floor((p+1)/4)), HCA: floor((p+1)/128), sliding: 0)
Reuse skips, in reusable layers, the head-row operators of Local heads on
unprotected document rows; protected rows are `budget * doc_rows` spread evenly
over the documents (the budget fully used), query rows are always online.
These are analytic counts, not measured FLOPs, bytes or time.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from slacktier.errors import optional_import
from slacktier.redknot.profile import FLASH, PRO, HeadPolicy, RedKnotProfile


def head_row_ceiling(profile: RedKnotProfile, policy: HeadPolicy | None = None) -> float:
    """Share of (layer, head, row) attention triples an artifact can replace, with no protected rows."""
    policy = policy or profile.default_policy()
    return policy.local_count(profile.reusable) / (profile.num_layers * profile.num_heads)


@dataclass(frozen=True)
class ModelDims:
    """The dimensions the arithmetic needs (from a DeepseekV4Config)."""

    hidden: int
    heads: int
    head_dim: int
    q_lora: int
    o_groups: int
    o_lora: int
    window: int
    index_heads: int
    index_dim: int
    index_topk: int
    csa_rate: int
    hca_rate: int
    hc: int
    experts: int
    experts_per_tok: int
    shared_experts: int
    moe_inter: int
    layer_types: tuple[str, ...]

    @classmethod
    def of(cls, config) -> ModelDims:
        """Read dims from a DeepseekV4Config."""
        return cls(config.hidden_size, config.num_attention_heads, config.head_dim, config.q_lora_rank,
                   config.o_groups, config.o_lora_rank, config.sliding_window, config.index_n_heads,
                   config.index_head_dim, config.index_topk, config.compress_rates["compressed_sparse_attention"],
                   config.compress_rates["heavily_compressed_attention"], config.hc_mult, config.n_routed_experts,
                   config.num_experts_per_tok, config.n_shared_experts, config.moe_intermediate_size,
                   tuple(config.layer_types))


def flash_config():
    """DeepSeek-V4-Flash: the transformers DeepseekV4Config defaults (43 layers, 64 heads, 8 groups)."""
    return _transformers().DeepseekV4Config()


def pro_config():
    """DeepSeek-V4-Pro dims (public config.json: 61 layers, hidden 7168, 128 heads, 16 groups, q_lora 1536,
    384 experts of 3072, top-6); layer schedule: transformers' default HCA/CSA interleave."""
    return _transformers().DeepseekV4Config(num_hidden_layers=61, hidden_size=7168, num_attention_heads=128,
                                            o_groups=16, q_lora_rank=1536, moe_intermediate_size=3072,
                                            n_routed_experts=384)


def _transformers():
    """transformers (the `models` extra), or one line naming the extra."""
    return optional_import("transformers", "models", "the RedKnot ledger's DeepSeek-V4 configs")


PROFILE_CONFIGS = {"flash": (FLASH, flash_config), "pro": (PRO, pro_config)}


@dataclass(frozen=True)
class OpRow:
    """One operator's MACs over the whole prefill, full recompute vs reuse."""

    name: str
    head_row: bool
    full_macs: float
    reuse_macs: float

    @property
    def saving(self) -> float:
        """Fraction of this operator's MACs reuse skips."""
        return 1.0 - self.reuse_macs / self.full_macs if self.full_macs else 0.0


def operator_ledger(dims: ModelDims, profile: RedKnotProfile, policy: HeadPolicy | None, *, doc_rows: int,
                    query_rows: int, budget: float) -> list[OpRow]:
    """Per-operator MACs of one prefill; the last two rows are the head-row subtotal and the total."""
    policy = policy or profile.default_policy()
    S = doc_rows + query_rows
    p = np.arange(S, dtype=np.float64)
    doc = p < doc_rows
    D, H, d, R, G = dims.hidden, dims.heads, dims.head_dim, dims.o_lora, dims.o_groups
    totals: dict[str, list[float]] = {}
    head_row_ops = {"q_b", "attn", "o_a"}

    def add(name: str, full: float, reuse: float) -> None:
        acc = totals.setdefault(name, [0.0, 0.0])
        acc[0] += full
        acc[1] += reuse

    for layer, kind in enumerate(dims.layer_types):
        keys = np.minimum(dims.window, p + 1)
        comp = np.zeros(S)
        if kind == "compressed_sparse_attention":
            comp = np.minimum(dims.index_topk, np.floor((p + 1) / dims.csa_rate))
        elif kind == "heavily_compressed_attention":
            comp = np.floor((p + 1) / dims.hca_rate)
        per_head_row = {"q_b": np.full(S, dims.q_lora * d, dtype=np.float64),
                        "attn": 2.0 * d * (keys + comp),
                        "o_a": np.full(S, d * R, dtype=np.float64)}
        reusable = profile.is_reusable(layer)
        n_local = len(policy.locals_of(layer)) if reusable else 0
        for name, cost in per_head_row.items():
            full = H * cost.sum()
            skipped = n_local * (1.0 - budget) * cost[doc].sum()
            add(name, full, full - skipped)
        fixed = {"hc": 2.0 * dims.hc * D * (2 + dims.hc) * dims.hc * S, "q_a": float(D * dims.q_lora * S),
                 "kv": float(D * d * S), "o_b": float(G * R * D * S),
                 "moe": float(S * (D * dims.experts + (dims.experts_per_tok + dims.shared_experts) * 3 * D
                                   * dims.moe_inter))}
        if kind == "compressed_sparse_attention":
            c, hi = dims.index_dim, dims.index_heads
            fixed["compress"] = float(S * (2 * D * 2 * d + 2 * D * 2 * c + dims.q_lora * hi * c + D * hi)
                                      + hi * c * np.floor((p + 1) / dims.csa_rate).sum())
        elif kind == "heavily_compressed_attention":
            fixed["compress"] = float(S * 2 * D * d)
        for name, macs in fixed.items():
            add(name, macs, macs)
    rows = [OpRow(n, n in head_row_ops, f, r) for n, (f, r) in totals.items()]
    hr = [r for r in rows if r.head_row]
    rows.append(OpRow("head-row ops", True, sum(r.full_macs for r in hr), sum(r.reuse_macs for r in hr)))
    rows.append(OpRow("whole prefill", False, sum(r.full_macs for r in rows[:-1]),
                      sum(r.reuse_macs for r in rows[:-1])))
    return rows


def logical_head_row_saving(profile: RedKnotProfile, policy: HeadPolicy | None, *, doc_rows: int,
                            query_rows: int, budget: float) -> float:
    """Head-row saving of one prefill: ceiling * (1 - budget) * document share of rows."""
    return head_row_ceiling(profile, policy) * (1.0 - budget) * doc_rows / (doc_rows + query_rows)


def format_ledger(name: str, rows: list[OpRow]) -> str:
    """A readable table of operator_ledger's rows (GMAC = 1e9 multiply-accumulates)."""
    out = [f"{'operator':<14} {'full GMAC':>12} {'reuse GMAC':>12} {'saving':>8}"]
    for r in rows:
        out.append(f"{r.name:<14} {r.full_macs / 1e9:>12.1f} {r.reuse_macs / 1e9:>12.1f} {100 * r.saving:>7.2f}%")
    return f"[{name}]\n" + "\n".join(out)
