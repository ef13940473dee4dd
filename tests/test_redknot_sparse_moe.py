"""Adaptive sparse MoE: the keep rule, its exact limit (keep all six = native top-6), fences, restoration."""

from __future__ import annotations

import pytest
import torch

from slacktier.errors import SlackTierError
from slacktier.redknot.model import build_model, tiny_config
from benchmarks.redknot.sparse_moe import adaptive_counts, adaptive_moe, moe_fences

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _model():
    cfg = tiny_config()
    cfg.num_experts_per_tok, cfg.n_routed_experts = 6, 8
    cfg.mlp_layer_types = ["hash_moe"] + ["moe"] * 5
    return build_model(cfg, seed=0)


def test_keep_rule_worked_example():
    w = torch.tensor([[0.30, 0.22, 0.16, 0.12, 0.11, 0.09], [0.9, 0.02, 0.02, 0.02, 0.02, 0.02],
                      [1 / 6] * 6])
    assert adaptive_counts(w, 0.7, 3, 6).tolist() == [4, 3, 5]
    assert adaptive_counts(w, 1.0, 3, 6).tolist() == [6, 6, 6]


def test_fences_are_hash_layers_and_first_and_last_routed_layer():
    assert moe_fences(_model()) == (0, 1, 5)


def test_keeping_all_six_equals_native_and_is_restored():
    model = _model()
    ids = torch.randint(2, 512, (1, 50), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        native = model(ids, use_cache=False).logits
        with adaptive_moe(model, 1.0, min_experts=6) as stats:
            same = model(ids, use_cache=False).logits
        with adaptive_moe(model, 0.5) as cut:
            sparse = model(ids, use_cache=False).logits
        after = model(ids, use_cache=False).logits
    torch.testing.assert_close(same, native, rtol=0, atol=1e-9)
    assert stats.saving == 0.0 and stats.routed_native == 3 * 50 * 6
    assert 0.0 < cut.saving <= 0.5 and not torch.allclose(sparse, native)
    torch.testing.assert_close(after, native, rtol=0, atol=0)


def test_bad_threshold_is_refused():
    with pytest.raises(SlackTierError):
        with adaptive_moe(_model(), 0.0):
            pass


def test_grouped_mm_models_switch_to_eager_inside_the_block():
    """A loaded model defaults to grouped_mm, which does not skip the dropped-expert sentinel (it gave NaN)."""
    model = _model()
    model.config._experts_implementation = "grouped_mm"
    ids = torch.randint(2, 512, (1, 40), generator=torch.Generator().manual_seed(2))
    with torch.no_grad(), adaptive_moe(model, 0.5):
        out = model(ids, use_cache=False).logits
    assert torch.isfinite(out).all()
    assert model.config._experts_implementation == "grouped_mm"
