"""The V4.1-shaped model: transformers' DeepseekV4 layers with Engram hooked in front of the Engram layers."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from slacktier.errors import SlackTierError
from slacktier.models.deepseek_v41 import StepSlot, V41Config, V41Model
from slacktier.models.engram import EngramModule, EngramShape, engram_gate
from slacktier.models.rows import DramRowProvider, DramTable


pytestmark = pytest.mark.usefixtures("one_torch_thread")

ROWS = 3000


@pytest.fixture(scope="module")
def model() -> V41Model:
    cfg = V41Config.preset("tiny")
    tables = {l: DramTable.synthetic(11 + l, ROWS) for l in cfg.engram_layer_ids}
    return V41Model(cfg, DramRowProvider(tables, cfg.engram_layer_ids))


def _ids(gen: torch.Generator, n: int) -> torch.Tensor:
    return torch.randint(0, ROWS, (n, 2, 24), generator=gen)


def test_layer_major_step_equals_transformers_forward(model: V41Model) -> None:
    gen = torch.Generator().manual_seed(1)
    a_toks, b_toks = torch.randint(3, 129_280, (1, 9), generator=gen), torch.randint(3, 129_280, (1, 5), generator=gen)
    a_ids, b_ids = _ids(gen, 9), _ids(gen, 5)
    # transformers' own forward, one session at a time
    ca, cb = model.new_cache(), model.new_cache()
    ref_a = model.forward_sequence(a_toks, ca, a_ids)
    ref_b = model.forward_sequence(b_toks, cb, b_ids)
    # both sessions in one layer-major step
    sa, sb = StepSlot(a_toks, model.new_cache()), StepSlot(b_toks, model.new_cache())
    got_a, got_b = model.forward_step([sa, sb], torch.cat([a_ids, b_ids]), all_logits=True)
    assert torch.equal(ref_a, got_a) and torch.equal(ref_b, got_b)
    # a decode step continues both caches identically
    na, nb = torch.tensor([[7]]), torch.tensor([[8]])
    ia, ib = _ids(gen, 1), _ids(gen, 1)
    ref_a = model.forward_sequence(na, ca, ia)
    ref_b = model.forward_sequence(nb, cb, ib)
    sa.input_ids, sb.input_ids = na, nb
    got_a, got_b = model.forward_step([sa, sb], torch.cat([ia, ib]), all_logits=True)
    assert torch.equal(ref_a, got_a) and torch.equal(ref_b, got_b)


def test_rows_reach_the_logits(model: V41Model) -> None:
    gen = torch.Generator().manual_seed(2)
    toks, ids = torch.randint(3, 129_280, (1, 6), generator=gen), _ids(gen, 6)
    base = model.forward_sequence(toks, model.new_cache(), ids)
    other = ids.clone()
    other[:, 1] = (other[:, 1] + 1) % ROWS   # other rows for the second Engram layer only
    assert not torch.equal(base, model.forward_sequence(toks, model.new_cache(), other))


def test_zero_value_projection_leaves_transformers_model_unchanged() -> None:
    cfg = V41Config.preset("tiny", seed=3)
    m = V41Model(cfg, DramRowProvider({l: DramTable.synthetic(l, ROWS) for l in cfg.engram_layer_ids},
                                      cfg.engram_layer_ids))
    with torch.no_grad():
        for e in m.engrams.values():
            e.wkv.weight[-cfg.hidden_size:] = 0   # the value rows: gate * 0 adds nothing
    gen = torch.Generator().manual_seed(3)
    toks = torch.randint(3, 129_280, (1, 7), generator=gen)
    hooked = m.forward_sequence(toks, m.new_cache(), _ids(gen, 7))
    with torch.no_grad():   # the plain transformers model, same weights, hooks bypassed
        for layer in m.hf.model.layers:
            layer._forward_pre_hooks.clear()
        plain = m.hf(input_ids=toks, use_cache=False).logits[0]
    assert torch.equal(hooked, plain)


def test_engram_acts_on_the_residual_before_attention(model: V41Model) -> None:
    layer_id = model.config.engram_layer_ids[0]
    seen = {}
    layer = model.hf.model.layers[layer_id]
    h1 = layer.attn_hc.register_forward_pre_hook(lambda mod, args: seen.__setitem__("attn_hc_in", args[0].clone()))
    h0 = model.hf.model.layers[layer_id - 1].register_forward_hook(
        lambda mod, args, out: seen.__setitem__("prev_out", out.clone()))
    gen = torch.Generator().manual_seed(4)
    toks, ids = torch.randint(3, 129_280, (1, 4), generator=gen), _ids(gen, 4)
    try:
        model.forward_sequence(toks, model.new_cache(), ids)
    finally:
        h0.remove()
        h1.remove()
    rows = model.provider.tables[layer_id].gather(ids[:, 0])
    prev = seen["prev_out"][0]                          # [S, hc, D]
    want = model.engrams[str(layer_id)](prev, rows)
    assert torch.equal(seen["attn_hc_in"][0], want)
    assert not torch.equal(want, prev)


def test_engram_gate_matches_float64_formula() -> None:
    gen = torch.Generator().manual_seed(5)
    t, hc, dim = 5, 4, 32
    x = torch.randn(t, hc, dim, generator=gen)
    kv = torch.randn(t, (hc + 1) * dim, generator=gen).to(torch.bfloat16)
    q = (1 + 0.1 * torch.randn(hc, dim, generator=gen)).to(torch.bfloat16)
    k = (1 + 0.1 * torch.randn(hc, dim, generator=gen)).to(torch.bfloat16)
    out = engram_gate(x, kv, q, k, 1e-6, 1e-6)
    xd, kvd = x.double(), kv.double()
    key, value = kvd[:, :hc * dim].view(t, hc, dim), kvd[:, hc * dim:]
    dot = (xd * q.double() * k.double() * key).sum(-1)
    dot = dot / torch.sqrt((xd ** 2).mean(-1) + 1e-6) / torch.sqrt((key ** 2).mean(-1) + 1e-6) / dim ** 0.5
    gate = torch.sigmoid(torch.sign(dot) * torch.sqrt(dot.abs().clamp_min(1e-6)))
    want = xd + gate[..., None] * value[:, None, :]
    torch.testing.assert_close(out.double(), want, rtol=1e-2, atol=1e-2)


def test_wrong_row_shape_is_refused() -> None:
    module = EngramModule(EngramShape(dim=8, hc_mult=2))
    with pytest.raises(SlackTierError):
        module(torch.zeros(3, 2, 8, dtype=torch.bfloat16), torch.zeros(3, 23, 256, dtype=torch.bfloat16))


def test_engram_layer_outside_a_step_is_refused(model: V41Model) -> None:
    with pytest.raises(SlackTierError):
        with torch.no_grad():
            model.hf(input_ids=torch.tensor([[5, 6]]), use_cache=False)
