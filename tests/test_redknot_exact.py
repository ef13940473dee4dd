"""RedKnot-MLA exactness (float64): the runner against DeepseekV4ForCausalLM, relocation, merge, wo_a slices,
and the cases where reuse must equal full recompute (paper Equation 4)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from redknot_common import (CFG, MODEL, PROFILE, full, runner, services_closed, tokens,  # noqa: F401
                            two_docs_and_a_query)
from slacktier.redknot.artifacts import ArtifactStore
from slacktier.redknot.attention import apply_rope, grouped_projection, merge_partials, rope_tables, segment_partial
from slacktier.redknot.profile import HeadPolicy, profile_for_config
from slacktier.redknot.protect import ProtectionPolicy
from slacktier.redknot.runner import InMemoryLocal, RedKnotRunner
from slacktier.redknot.placement import artifact_placement
from slacktier.redknot.service import RedKnotService

D0, D1, Q = tokens(40, 1), tokens(45, 2), tokens(15, 3)
DOCS = [("d0", D0), ("d1", D1)]
LAYOUT = two_docs_and_a_query(D0, D1, Q)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_full_mode_equals_model_forward(runner, full):
    """Our per-head path reproduces DeepseekV4ForCausalLM (sliding, CSA + indexer, HCA, sinks, hyper-connections,
    MoE). The model itself rounds RoPE angles and inputs, norms and hyper-connection inputs to float32 even in
    float64, so agreement is at float32 resolution, not 1e-10."""
    ids = LAYOUT.tokens[None]
    with torch.no_grad():
        ref = MODEL(ids, logits_to_keep=1, use_cache=False)
        ref_hidden = MODEL.model(ids, use_cache=False).last_hidden_state[0]
    assert full.hidden.shape == ref_hidden.shape
    torch.testing.assert_close(full.hidden, ref_hidden, rtol=0, atol=5e-6)
    torch.testing.assert_close(full.last_logits, ref.logits[0, -1], rtol=0, atol=5e-6)
    assert full.hidden.abs().max() > 0.5  # not trivially small


def test_each_layer_attention_equals_model_attention(runner):
    """Same inputs into DeepseekV4Attention and into our per-head core: outputs agree layer by layer."""
    captured = {}

    def hook(i):
        def f(module, args, kwargs, out):
            x = args[0] if args else kwargs["hidden_states"]
            captured[i] = (x[0].clone(), out[0][0].clone())
        return f

    handles = [layer.self_attn.register_forward_hook(hook(i), with_kwargs=True)
               for i, layer in enumerate(MODEL.model.layers)]
    try:
        with torch.no_grad():
            MODEL.model(LAYOUT.tokens[None], use_cache=False)
    finally:
        for h in handles:
            h.remove()
    kinds = set()
    for i, layer in enumerate(MODEL.model.layers):
        x, ref = captured[i]
        out = runner.layer_attention(i, x, LAYOUT, per_segment_frames=False)
        z = grouped_projection(layer.self_attn.o_a_proj.weight, out, torch.arange(CFG.num_attention_heads),
                               CFG.o_groups)
        with torch.no_grad():
            mine = layer.self_attn.o_b_proj(z)
        assert float((mine - ref).abs().max() / ref.abs().max()) < 1e-6, layer.self_attn.layer_type
        kinds.add(layer.self_attn.layer_type)
    assert kinds == {"sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"}


def test_relocation_equals_true_positions(runner):
    """Keys stored at each document's canonical positions + queries rotated into that frame = true positions."""
    x = torch.randn(LAYOUT.rows, CFG.hidden_size, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    for i in range(CFG.num_hidden_layers):
        x_in = MODEL.model.layers[i].input_layernorm(x)
        true = runner.layer_attention(i, x_in, LAYOUT, per_segment_frames=False)
        reloc = runner.layer_attention(i, x_in, LAYOUT, per_segment_frames=True)
        torch.testing.assert_close(reloc, true, rtol=0, atol=1e-12)


@settings(max_examples=40, deadline=None)
@given(p=st.integers(0, 5000), o=st.integers(0, 5000), j=st.integers(0, 3000))
def test_relocated_score_matches(p, o, j):
    """q at p . k at o+j == q at p-o . k at j (the model's rotary buffers, float64)."""
    g = torch.Generator().manual_seed(p * 7 + o)
    q = torch.randn(1, CFG.head_dim, dtype=torch.float64, generator=g)
    k = torch.randn(1, CFG.head_dim, dtype=torch.float64, generator=g)
    rot = MODEL.model.rotary_emb

    def r(x, pos):
        cos, sin = rope_tables(rot, "compress", torch.tensor([pos]), torch.float64)
        return apply_rope(x, cos, sin)

    true = (r(q, p) * r(k, o + j)).sum()
    canon = (r(q, p - o) * r(k, j)).sum()
    assert abs(float(true - canon)) < 1e-10


@settings(max_examples=60, deadline=None)
@given(cuts=st.lists(st.integers(0, 12), min_size=1, max_size=5), empty_row=st.booleans(),
       seed=st.integers(0, 1000))
def test_merge_equals_union_softmax(cuts, empty_row, seed):
    """Stable LSE merge of segment partials (empty ones included) + sink == one softmax over the union."""
    g = torch.Generator().manual_seed(seed)
    n, h, k, d = 3, 2, 12, 8
    q = torch.randn(n, h, d, dtype=torch.float64, generator=g) * 3
    keys = torch.randn(n, k, d, dtype=torch.float64, generator=g)
    valid = torch.rand(n, k, generator=g) > 0.3
    if empty_row:
        valid[0] = False  # a row that sees nothing but the sink
    sinks = torch.randn(h, dtype=torch.float64, generator=g)
    bounds = sorted(set([0, k] + cuts))
    parts = []
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        seg = torch.zeros(n, k, dtype=torch.bool)
        seg[:, lo:hi] = True
        parts.append(segment_partial(q, keys, valid & seg, 0.5))
    parts.append(segment_partial(q, keys, torch.zeros(n, k, dtype=torch.bool), 0.5))  # an empty segment
    merged, _ = merge_partials(parts, sinks)
    scores = torch.einsum("nhd,nkd->nhk", q, keys) * 0.5
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    logits = torch.cat([scores, sinks[None, :, None].expand(n, h, 1)], dim=-1)
    probs = torch.softmax(logits, dim=-1)[..., :-1]
    ref = torch.einsum("nhk,nkd->nhd", probs, keys)
    assert torch.isfinite(merged).all()
    torch.testing.assert_close(merged, ref, rtol=0, atol=1e-12)


def test_wo_a_slices_add_up():
    """Sum of per-head-set wo_a slices == the model's grouped o_a_proj on all heads."""
    attn = MODEL.model.layers[2].self_attn
    H, d, G = CFG.num_attention_heads, CFG.head_dim, CFG.o_groups
    out = torch.randn(7, H, d, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    ref = attn.o_a_proj(out.reshape(7, G, H // G * d)).flatten(1)
    torch.testing.assert_close(grouped_projection(attn.o_a_proj.weight, out, torch.arange(H), G), ref,
                               rtol=0, atol=1e-12)
    policy = PROFILE.default_policy()
    glob = torch.tensor(policy.globals_of(2))
    loc = torch.tensor(policy.locals_of(2))
    parts = grouped_projection(attn.o_a_proj.weight, out[:, glob], glob, G) + \
        grouped_projection(attn.o_a_proj.weight, out[:, loc], loc, G)
    torch.testing.assert_close(parts, ref, rtol=0, atol=1e-12)
    perm = torch.randperm(H, generator=torch.Generator().manual_seed(2))
    pieces = [perm[:3], perm[3:9], perm[9:]]
    total = sum(grouped_projection(attn.o_a_proj.weight, out[:, p], p, G) for p in pieces)
    torch.testing.assert_close(total, ref, rtol=0, atol=1e-12)


def _service(tmp_path, runner, tier: str = "dram") -> RedKnotService:
    placement = artifact_placement(tmp_path / "store", runner.profile.reusable, tier)
    svc = RedKnotService(runner, ArtifactStore(tmp_path / "store"), placement=placement)
    for doc_id, toks in DOCS:
        svc.build(doc_id, toks)
    return svc


def test_every_row_protected_equals_full(tmp_path, runner, full):
    svc = _service(tmp_path, runner, "disk")
    rep = svc.prefill(DOCS, Q, ProtectionPolicy(0.1), dirty=torch.ones(LAYOUT.rows, dtype=torch.bool))
    assert rep.fallback_reason is None and rep.reads.pages > 0
    assert rep.result.stats.local_rows_reused == 0
    torch.testing.assert_close(rep.result.hidden, full.hidden, rtol=0, atol=1e-10)
    torch.testing.assert_close(rep.result.last_logits, full.last_logits, rtol=0, atol=1e-10)


def test_every_head_global_equals_full(tmp_path, full):
    r = RedKnotRunner(MODEL, PROFILE, HeadPolicy.all_global(CFG.num_hidden_layers, CFG.num_attention_heads),
                      chunk_rows=32)
    svc = _service(tmp_path, r)
    rep = svc.prefill(DOCS, Q, ProtectionPolicy(0.1))
    assert rep.fallback_reason is None and rep.result.stats.mode == "reuse"
    torch.testing.assert_close(rep.result.hidden, full.hidden, rtol=0, atol=1e-10)
    torch.testing.assert_close(rep.result.last_logits, full.last_logits, rtol=0, atol=1e-10)


def test_artifact_from_same_context_is_exact(tmp_path, runner, full):
    """d0 built alone at 0 (it opens the request) and d1 built after d0: reuse with no protection is exact."""
    svc = RedKnotService(runner, ArtifactStore(tmp_path / "store"))
    svc.build("d0", D0)
    svc.build("d1", D1, context=D0)
    rep = svc.prefill(DOCS, Q, ProtectionPolicy(0.0))
    st_ = rep.result.stats
    assert rep.fallback_reason is None and st_.local_rows_reused > 0 and st_.head_row_saving > 0.3
    torch.testing.assert_close(rep.result.hidden, full.hidden, rtol=0, atol=1e-10)
    torch.testing.assert_close(rep.result.last_logits, full.last_logits, rtol=0, atol=1e-10)
    # a context-bound artifact is refused after other tokens
    other = [("d2", tokens(40, 9)), ("d1", D1)]
    assert svc.prefill(other, Q, ProtectionPolicy(0.0)).fallback_reason.value == "token_mismatch"


def test_canonical_artifacts_approximate(tmp_path, runner, full):
    """Canonical artifacts in a new context: not exact, but close, and closer with more protection."""
    svc = _service(tmp_path, runner)
    kls = []
    for budget in (0.0, 0.25):
        rep = svc.prefill(DOCS, Q, ProtectionPolicy(budget))
        assert rep.fallback_reason is None
        p = torch.log_softmax(full.last_logits, -1)
        r = torch.log_softmax(rep.result.last_logits, -1)
        kls.append(float((p.exp() * (p - r)).sum()))
    assert 0 < kls[1] <= kls[0] < 0.05


def test_nan_poisoned_protected_rows_are_replaced(runner):
    """Stored values of protected rows are replaced by the online ones, never added: NaN there changes nothing."""
    exact = runner.full(LAYOUT, capture_layers=PROFILE.reusable)
    has = torch.ones(LAYOUT.rows, dtype=torch.bool)
    has[LAYOUT.query_rows()] = False
    clean = InMemoryLocal(has, {l: z.clone() for l, z in exact.captured.items()})
    policy = ProtectionPolicy(0.25)
    base = runner.reuse(LAYOUT, clean, policy)
    poisoned = {l: z.clone() for l, z in exact.captured.items()}
    for l, rows in base.stats.protected_rows.items():
        poisoned[l][rows] = float("nan")
    assert sum(int(torch.isnan(z).any(dim=1).sum()) for z in poisoned.values()) > 100
    res = runner.reuse(LAYOUT, InMemoryLocal(has, poisoned), policy)
    assert torch.isfinite(res.hidden).all() and torch.isfinite(res.last_logits).all()
    assert torch.equal(res.hidden, base.hidden)
    # those artifacts came from this very context, so the result is also the full recompute's
    torch.testing.assert_close(res.hidden, exact.hidden, rtol=0, atol=1e-10)
    # poisoning an unprotected row does reach the output (the check above is not vacuous)
    l0 = PROFILE.reusable[0]
    keep = torch.ones(LAYOUT.rows, dtype=torch.bool)
    keep[base.stats.protected_rows[l0]] = False
    keep &= has
    poisoned[l0][torch.nonzero(keep).flatten()[0]] = float("nan")
    assert torch.isnan(runner.reuse(LAYOUT, InMemoryLocal(has, poisoned), policy).hidden).any()


def test_reusable_first_layer_keeps_exactness(tmp_path):
    """With no front fence (layer 0, a sliding layer, reused too: the quality bench's --fence-front 0 ablation),
    every row protected and same-context artifacts both still give the full recompute."""
    assert CFG.layer_types[0] == "sliding_attention"
    profile = profile_for_config(CFG, name="tiny-0F", fence_front=0)
    assert profile.reusable[0] == 0
    r = RedKnotRunner(MODEL, profile, chunk_rows=32)
    full = r.full(LAYOUT)
    svc = _service(tmp_path, r, "disk")
    rep = svc.prefill(DOCS, Q, ProtectionPolicy(0.1), dirty=torch.ones(LAYOUT.rows, dtype=torch.bool))
    assert rep.fallback_reason is None and rep.result.stats.local_rows_reused == 0
    torch.testing.assert_close(rep.result.hidden, full.hidden, rtol=0, atol=1e-10)
    ctx = RedKnotService(r, ArtifactStore(tmp_path / "ctx"))
    ctx.build("d0", D0)
    ctx.build("d1", D1, context=D0)
    rep = ctx.prefill(DOCS, Q, ProtectionPolicy(0.0))
    assert rep.fallback_reason is None and rep.result.stats.local_rows_reused > 0
    torch.testing.assert_close(rep.result.hidden, full.hidden, rtol=0, atol=1e-10)
    torch.testing.assert_close(rep.result.last_logits, full.last_logits, rtol=0, atol=1e-10)
    # and layer 0's stored rows matter: zeroing them moves the result
    has = torch.zeros(LAYOUT.rows, dtype=torch.bool)
    has[:LAYOUT.starts[-1]] = True
    zero = InMemoryLocal(has, {l: torch.zeros(LAYOUT.rows, CFG.o_groups * CFG.o_lora_rank) for l in profile.reusable})
    moved = r.reuse(LAYOUT, zero, ProtectionPolicy(0.0))
    assert (moved.hidden - full.hidden).abs().max() > 1e-3
