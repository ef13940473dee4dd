"""Adaptive sparse MoE: per token, the fewest routed experts (3..6) whose router mass reaches a threshold.

Rule (per token, in each adaptive layer): take the router's native top-k (k = 6:
top-6 of `scores + e_score_correction_bias`), normalise their scores to
weights w_1 >= ... >= w_6 summing to 1 (as the native router does), and keep the
smallest n in [min_experts, max_experts] with w_1 + ... + w_n >= threshold; the
kept weights are renormalised to sum to 1 (so the routed output keeps its scale)
and times routed_scaling_factor. The shared expert always runs. Fence layers -
the first and the last top-k-routed MoE layer, and hash-routed layers (their
experts are fixed per token id, there is no router mass to cut) - keep native top-k.

Worked example, threshold 0.7: weights (0.30, 0.22, 0.16, 0.12, 0.11, 0.09) ->
cumulative 0.30, 0.52, 0.68, 0.80 -> n = 4, kept weights 0.30/0.80, 0.22/0.80, ...

Dropped experts get the sentinel index `n_routed_experts`, which transformers'
eager expert loop skips (it one-hots into n_routed_experts + 1 classes and
ignores the last), so no dropped expert does any work. The grouped_mm / batched_mm
expert kernels do not know the sentinel (a loaded model defaults to grouped_mm and
gives NaN), so inside the block the model's expert implementation is switched to
eager (logged) and restored after; compare timings against an eager baseline.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field

import torch

from slacktier.errors import ErrorKind, SlackTierError

log = logging.getLogger(__name__)


@dataclass
class SparseMoEStats:
    """Routed expert-token assignments actually run, against native top-k, over the adaptive layers."""

    routed_native: int = 0
    routed_kept: int = 0
    per_layer_mean: dict[int, list[float]] = field(default_factory=dict)

    @property
    def saving(self) -> float:
        """Share of routed expert-token work skipped in the adaptive layers."""
        return 1.0 - self.routed_kept / max(self.routed_native, 1)


def adaptive_counts(weights: torch.Tensor, threshold: float, min_experts: int, max_experts: int) -> torch.Tensor:
    """Experts kept per token [N] from top-k weights [N, k] sorted descending (the rule above)."""
    cum = weights.cumsum(-1)
    reach = (cum < threshold - 1e-12).sum(-1) + 1      # first n with cum >= threshold
    return reach.clamp(min_experts, min(max_experts, weights.shape[-1]))


def moe_fences(model) -> tuple[int, ...]:
    """Fence MoE layers: hash-routed layers plus the first and last top-k-routed layer."""
    types = list(model.config.mlp_layer_types)
    routed = [i for i, t in enumerate(types) if t == "moe"]
    hashed = [i for i, t in enumerate(types) if t == "hash_moe"]
    return tuple(sorted(set(hashed) | ({routed[0], routed[-1]} if routed else set())))


@contextlib.contextmanager
def adaptive_moe(model, threshold: float, *, min_experts: int = 3, max_experts: int = 6,
                 fences: tuple[int, ...] | None = None):
    """Within the block, the model's non-fence top-k MoE layers route adaptively; yields SparseMoEStats."""
    if not 0.0 < threshold <= 1.0 or not 1 <= min_experts <= max_experts:
        raise SlackTierError(ErrorKind.BAD_INPUT, f"threshold {threshold}, experts {min_experts}..{max_experts}",
                             fix="use a threshold in (0, 1] and 1 <= min_experts <= max_experts (paper: 3..6)")
    fences = moe_fences(model) if fences is None else fences
    stats = SparseMoEStats()
    patched = []
    for li, layer in enumerate(model.model.layers):
        gate = layer.mlp.gate
        if li in fences or model.config.mlp_layer_types[li] != "moe":
            continue

        def forward(hidden_states, _gate=gate, _li=li):
            flat = hidden_states.reshape(-1, _gate.hidden_dim)
            logits = torch.nn.functional.linear(flat, _gate.weight)
            scores = _gate.score_fn(logits)
            idx = torch.topk(scores + _gate.e_score_correction_bias, _gate.top_k, dim=-1).indices   # [N, k]
            w = scores.gather(1, idx)
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
            order = w.argsort(-1, descending=True)
            w, idx = w.gather(1, order), idx.gather(1, order)
            n = adaptive_counts(w, threshold, min_experts, max_experts)            # [N]
            keep = torch.arange(w.shape[1])[None, :] < n[:, None]
            w = torch.where(keep, w, torch.zeros_like(w))
            w = w / w.sum(-1, keepdim=True)
            idx = torch.where(keep, idx, torch.full_like(idx, _gate.num_experts))
            stats.routed_native += int(idx.numel())
            stats.routed_kept += int(n.sum())
            stats.per_layer_mean.setdefault(_li, []).append(float(n.float().mean()))
            return logits, w * _gate.routed_scaling_factor, idx

        gate.forward = forward
        patched.append(gate)
    impl = getattr(model.config, "_experts_implementation", "eager")
    if impl != "eager":
        log.info("adaptive MoE: expert implementation %s -> eager for the block (it skips the sentinel)", impl)
        model.config._experts_implementation = "eager"
    try:
        yield stats
    finally:
        model.config._experts_implementation = impl
        for gate in patched:
            del gate.forward   # back to the class's forward
