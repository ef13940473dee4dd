"""The row-chunked CSA path (redknot/indexer.py) against the model's own compressor and Lightning Indexer."""

from __future__ import annotations

import pytest
import torch

from slacktier.redknot.indexer import csa_select
from slacktier.redknot.model import build_model, tiny_config
from slacktier.redknot.profile import profile_for_config
from slacktier.redknot.protect import ProtectionPolicy
from slacktier.redknot.runner import InMemoryLocal, Layout, RedKnotRunner, Segment

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# index_topk 8 < the 50 entries of 200 rows, so the indexer really chooses
CFG = tiny_config(index_topk=8)
MODEL = build_model(CFG, seed=3)
PROFILE = profile_for_config(CFG, name="tiny")


def _tokens(n: int, seed: int) -> tuple[int, ...]:
    return tuple(torch.randint(2, CFG.vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist())


LAYOUT = Layout.of([Segment("d0", _tokens(90, 1)), Segment("d1", _tokens(95, 2)),
                    Segment("q", _tokens(15, 3), "query")])


@pytest.mark.parametrize("chunk_rows", [1, 7, 64, 512])
def test_picks_and_entries_equal_the_model(chunk_rows):
    """Same compressed entries (bitwise) and the same set of valid picks per row as the model's compressor."""
    torch.manual_seed(0)
    S = 200
    x = torch.randn(1, S, CFG.hidden_size, dtype=torch.float64)
    q_res = torch.randn(1, S, CFG.q_lora_rank, dtype=torch.float64)
    pos = torch.arange(S)[None]
    checked = 0
    for layer in MODEL.model.layers:
        attn = layer.self_attn
        if attn.layer_type != "compressed_sparse_attention":
            continue
        ref_kv, ref_bias = attn.compressor(x, q_res, pos, None, attn.layer_idx)
        ckv, picks, valid = csa_select(attn.compressor, x, q_res, pos, chunk_rows)
        assert torch.equal(ckv, ref_kv[0, 0])
        assert picks.shape == (S, min(CFG.index_topk, ckv.shape[0]))
        mine = torch.full((S, ckv.shape[0]), float("-inf"), dtype=torch.float64)
        for r in range(S):
            mine[r, picks[r][valid[r]]] = 0.0
        assert torch.equal(mine, ref_bias[0, 0])
        assert int(valid.sum()) > S  # most rows pick something: the comparison is not vacuous
        checked += 1
    assert checked == 2


def test_chunked_runner_equals_model_path():
    """Full recompute and reuse through the chunked indexer equal the model-module path (float64)."""
    ref = RedKnotRunner(MODEL, PROFILE, chunk_rows=32)
    chunked = RedKnotRunner(MODEL, PROFILE, chunk_rows=32, indexer_chunk_rows=16)
    a, b = ref.full(LAYOUT, capture_layers=PROFILE.reusable), chunked.full(LAYOUT)
    torch.testing.assert_close(b.hidden, a.hidden, rtol=0, atol=1e-10)
    has = torch.zeros(LAYOUT.rows, dtype=torch.bool)
    has[:LAYOUT.starts[-1]] = True
    local = InMemoryLocal(has, dict(a.captured))
    ra = ref.reuse(LAYOUT, local, ProtectionPolicy(0.1))
    rb = chunked.reuse(LAYOUT, local, ProtectionPolicy(0.1))
    torch.testing.assert_close(rb.hidden, ra.hidden, rtol=0, atol=1e-10)
    assert rb.stats.head_row_saving == ra.stats.head_row_saving > 0
