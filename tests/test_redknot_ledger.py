"""RedKnot-MLA ledger, head policies, protected-row selection and the CLI."""

from __future__ import annotations

import json

import pytest
import torch

from slacktier.cli import main
from slacktier.redknot.ledger import (
    PROFILE_CONFIGS,
    ModelDims,
    head_row_ceiling,
    logical_head_row_saving,
    operator_ledger,
)
from slacktier.redknot.model import build_model, tiny_config
from slacktier.redknot.profile import FLASH, PRO, HeadPolicy, RedKnotProfile, policy_from_distances, profile_for_config
from slacktier.redknot.protect import ProtectionPolicy, select_protected
from slacktier.redknot.runner import InMemoryLocal, Layout, RedKnotRunner, Segment, measure_head_distances


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_profiles_and_ceilings():
    assert (FLASH.fence_layout, PRO.fence_layout) == ("3F-37R-3F", "3F-55R-3F")
    flash_policy = FLASH.default_policy()
    assert flash_policy.globals_of(10) == tuple(range(0, 64, 8)) and len(flash_policy.locals_of(10)) == 56
    assert len(PRO.default_policy().locals_of(3)) == 112
    assert head_row_ceiling(FLASH) == pytest.approx(37 / 43 * 56 / 64, abs=1e-15)
    assert head_row_ceiling(PRO) == pytest.approx(55 / 61 * 112 / 128, abs=1e-15)
    assert round(100 * head_row_ceiling(FLASH), 2) == 75.29
    assert round(100 * head_row_ceiling(PRO), 2) == 78.89
    with pytest.raises(Exception):
        RedKnotProfile("bad", num_layers=6, fence_front=3, fence_back=3, num_heads=8, o_groups=2)


def test_operator_ledger_counts():
    dims = ModelDims.of(PROFILE_CONFIGS["flash"][1]())
    assert dims.heads == 64 and dims.o_groups == 8 and len(dims.layer_types) == 43
    rows = {r.name: r for r in operator_ledger(dims, FLASH, None, doc_rows=65536, query_rows=64, budget=0.0)}
    # per-row-constant head-row operators save exactly the logical head-row share
    hr = logical_head_row_saving(FLASH, None, doc_rows=65536, query_rows=64, budget=0.0)
    assert rows["q_b"].saving == pytest.approx(hr, rel=1e-12)
    assert rows["o_a"].saving == pytest.approx(hr, rel=1e-12)
    assert rows["moe"].saving == 0 and rows["o_b"].saving == 0
    # attention cost per row differs by layer type, so the arithmetic share need not equal the logical one
    assert 0 < rows["whole prefill"].saving < rows["head-row ops"].saving
    assert abs(rows["head-row ops"].saving - head_row_ceiling(FLASH)) < 0.03
    # q_b MACs: layers * heads * q_lora * head_dim * rows
    assert rows["q_b"].full_macs == 43 * 64 * 1024 * 512 * (65536 + 64)
    savings = [{r.name: r for r in operator_ledger(dims, FLASH, None, doc_rows=65536, query_rows=64,
                                                  budget=b)}["head-row ops"].saving for b in (0, 0.1, 0.2, 0.25, 1)]
    assert savings == sorted(savings, reverse=True) and savings[-1] == pytest.approx(0, abs=1e-12)


def test_measured_head_row_saving_matches_ledger():
    """With no budget the runner's own counters give exactly the analytic head-row saving."""
    cfg = tiny_config()
    model = build_model(cfg)
    prof = profile_for_config(cfg)
    runner = RedKnotRunner(model, prof, chunk_rows=64)
    toks = torch.randint(2, cfg.vocab_size, (70,), generator=torch.Generator().manual_seed(0)).tolist()
    layout = Layout.of([Segment("a", tuple(toks[:30])), Segment("b", tuple(toks[30:60])),
                        Segment("q", tuple(toks[60:]), "query")])
    captured = runner.full(layout, capture_layers=prof.reusable).captured
    has = torch.ones(70, dtype=torch.bool)
    has[60:] = False
    res = runner.reuse(layout, InMemoryLocal(has, captured), ProtectionPolicy(0.0))
    want = logical_head_row_saving(prof, None, doc_rows=60, query_rows=10, budget=0.0)
    assert res.stats.head_row_saving == pytest.approx(want, abs=1e-12)


def test_distance_policy():
    cfg = tiny_config(layer_types=("sliding_attention",) * 6)
    model = build_model(cfg)
    with torch.no_grad():  # head 5 of layer 2 gets zero queries: uniform over its window
        w = model.model.layers[2].self_attn.q_b_proj.weight.view(cfg.num_attention_heads, cfg.head_dim, -1)
        w[5] = 0
        model.model.layers[2].self_attn.sinks[5] = -1e4
    runner = RedKnotRunner(model, profile_for_config(cfg), chunk_rows=64)
    samples = [torch.randint(2, cfg.vocab_size, (48,), generator=torch.Generator().manual_seed(s)).tolist()
               for s in range(2)]
    dist = measure_head_distances(runner, samples)
    assert dist.shape == (6, cfg.num_attention_heads) and torch.isfinite(dist).all() and (dist >= 0).all()
    window = cfg.sliding_window
    expect = sum((min(window, i + 1) - 1) / 2 for i in range(48)) / 48
    assert float(dist[2, 5]) == pytest.approx(expect, abs=1e-9)
    policy = policy_from_distances(dist, global_fraction=1 / 8)
    assert all(len(g) == 2 for g in policy.global_heads)
    assert all(int(torch.argmax(dist[l])) in policy.globals_of(l) for l in range(6))
    assert policy.digest() != HeadPolicy.every_nth(6, cfg.num_attention_heads, 8).digest()


def test_protection_budget_and_priority():
    S = 100
    has = torch.ones(S, dtype=torch.bool)
    has[90:] = False  # query
    dirty = torch.zeros(S, dtype=torch.bool)
    dirty[5] = True
    kw = dict(has_artifact=has, dirty=dirty, query_rows=torch.arange(90, 100), doc_starts=[0, 30, 60],
              doc_ends=[30, 60, 90], window=8)
    p = select_protected(policy=ProtectionPolicy(0.1), **kw)  # budget 9 of 90 candidate rows
    assert p.counts["budget"] == 9 and p.counts["boundary"] == 9 and p.counts["mandatory"] == 11
    rows = set(p.rows.tolist())
    assert {5, *range(90, 100)} <= rows
    assert {30, 60, 31, 61, 32, 62, 33, 63, 34} <= rows and 0 not in rows  # nearest the boundary, interleaved
    p = select_protected(policy=ProtectionPolicy(0.25), indexer_entries=torch.tensor([3, 1]), compress_rate=4, **kw)
    assert p.counts["boundary"] == 16 and p.counts["indexer"] == 6 and p.counts["tail"] == 0
    assert {12, 13, 14, 15, 4, 6} <= set(p.rows.tolist())  # entry 3 -> rows 12..15 then entry 1 (5 is dirty)
    p = select_protected(policy=ProtectionPolicy(1.0), **kw)
    assert p.counts["tail"] == 8 - 0 and set(range(82, 90)) <= set(p.rows.tolist())
    with pytest.raises(Exception):
        ProtectionPolicy(1.5)


def test_cli_ledger(capsys):
    assert main(["redknot", "ledger", "--json", "--context", "4096", "--budgets", "0,0.2"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert round(100 * out["flash"]["head_row_ceiling"], 2) == 75.29
    assert round(100 * out["pro"]["head_row_ceiling"], 2) == 78.89


def test_cli_build_and_run(tmp_path, capsys):
    args = ["--store", str(tmp_path / "s"), "--model", "tiny", "--docs", "2", "--doc-tokens", "48",
            "--dtype", "float64"]
    assert main(["redknot", "build", *args]) == 0
    assert "src-1: 48 rows" in capsys.readouterr().out
    assert main(["redknot", "run", *args, "--budget", "0.25", "--source", "disk"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["mode"] == "reuse" and out["pages_read"] > 0 and out["local_rows_reused"] > 0
    assert main(["redknot", "run", *args, "--seed", "3"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["fallback_reason"] == "model_mismatch" and out["counters"]["fallback.model_mismatch"] == 1
    assert main(["redknot", "run", *args, "--policy", "distance"]) == 0  # artifacts were built with stride-8
    assert json.loads(capsys.readouterr().out)["fallback_reason"] == "head_policy_mismatch"


def test_ledger_report_text_and_json(capsys):
    from slacktier.redknot.report import LedgerConfig, ledger, profile_ledger

    entry, text = profile_ledger("flash", 4096, 64, (0.0, 0.2))
    assert set(entry["budgets"]) == {0.0, 0.2} and entry["local_global"] == "56/8"
    assert text.splitlines()[0] == "flash: 3F-37R-3F, 56/8 Local/Global heads, logical head-row ceiling 75.29%"
    assert text.count("[flash, 4096 doc + 64 query tokens, budget") == 2
    assert entry["budgets"][0.2]["logical_head_row_saving"] < entry["budgets"][0.0]["logical_head_row_saving"]
    got = ledger(LedgerConfig(profiles=("pro",), context=4096, budgets=(0.0,)))
    out = capsys.readouterr().out
    assert out.startswith("pro: ") and "whole prefill" in out and set(got) == {"pro"}
    ledger(LedgerConfig(profiles=("pro",), context=4096, budgets=(0.0,), as_json=True))
    assert json.loads(capsys.readouterr().out)["pro"]["budgets"]["0.0"] == pytest.approx(got["pro"]["budgets"][0.0])


def test_report_configs_refuse_bad_input(tmp_path, capsys):
    from slacktier.errors import SlackTierError
    from slacktier.redknot.report import LedgerConfig, RedKnotRunConfig

    with pytest.raises(SlackTierError, match="unknown profiles"):
        LedgerConfig(profiles=("flash", "nano"))
    with pytest.raises(SlackTierError):
        RedKnotRunConfig(store=tmp_path, fence=(1, -1))
    with pytest.raises(SlackTierError):
        RedKnotRunConfig(store=tmp_path, model="huge")
    assert main(["redknot", "ledger", "--profiles", "nano"]) == 2
    assert "unknown profiles" in capsys.readouterr().err
    assert main(["redknot", "build", "--store", str(tmp_path / "s"), "--fence", "1"]) == 2
    assert "front,back" in capsys.readouterr().err
    # issue 11: these divided by zero, or printed negative and NaN savings
    for args, says in ((["--context", "0", "--query", "0"], "--context 0"), (["--budgets=-1,2"], "outside [0, 1]"),
                       (["--budgets=nan"], "[nan]")):
        assert main(["redknot", "ledger", *args]) == 2
        assert says in capsys.readouterr().err


def test_format_build_line():
    from types import SimpleNamespace

    from slacktier.redknot.report import format_build

    certs = [SimpleNamespace(rows=48, covered_layers=(1, 2), generation=3, region_pages=(2, 1)),
             SimpleNamespace(rows=48, covered_layers=(1, 2), generation=3, region_pages=(4,))]
    assert format_build("src-1", certs, 0.126) == ("src-1: 48 rows, layers [1, 2], generation 3, 2 rank(s), 7 pages, "
                                                  "0.13 s")
