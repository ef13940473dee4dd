"""Characterization: miss pages per step, capacity sweeps, batch reuse, and the `characterize` verb end to end."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest

from slacktier.cli import main
from slacktier.tables.engram_hash import EngramLayout
from slacktier.workloads.characterize import (Capacity, batch_reuse, capacities_for, decode_step_pages, evaluate,
                                              fit_rankings, miss_page_curve, prepare_layer, read_miss_curves,
                                              run_policy, unseen_share, with_ranking)
from slacktier.workloads.hashing import EngramLookupHasher
from slacktier.workloads.policies import rank_rows
from slacktier.workloads.replay import LookupTrace, ReplayConfig, collect_trace, replay_steps, session_rows
from slacktier.workloads.sessions import render_session, truncate_turns
from slacktier.workloads.sharegpt import iter_chat_sessions


def _hand_trace() -> LookupTrace:
    # 4 tokens x 2 columns: step 0 prefill (token 0), step 1 decode (tokens 1, 2), step 2 decode (token 3)
    rows = np.array([[0, 14, 0, 14, 15, 29, 30, 31]], dtype=np.int64)
    return LookupTrace("hand", 2, (14,), (100,), 2, 1, 2, rows, np.array([0, 1, 1, 2], dtype=np.int32),
                       np.array([False, True, True, True]), np.array([0, 0, 1, 1], dtype=np.int32))


def test_pages_per_decode_step_worked_example():
    prep = prepare_layer(_hand_trace(), 14)
    nothing = np.zeros(8, dtype=np.uint8)
    # step 1 misses rows 0, 14, 15, 29 -> pages 0, 0, 1, 1 -> 2; step 2 misses 30, 31 -> page 2 -> 1
    assert decode_step_pages(prep, nothing).tolist() == [2, 1]
    lru = run_policy(prep, "lru", 10)
    assert lru.tolist() == [0, 0, 1, 1, 0, 0, 0, 0]
    assert decode_step_pages(prep, lru).tolist() == [1, 1]
    res = evaluate(prep, "lru", Capacity(10, "10 rows"))
    assert res.decode_lookups == 6 and res.decode_hits == 2 and res.pages_per_decode_step == 1.0
    assert res.order_hit_rate == {2: 1 / 3, 3: 1 / 3}


def test_public_list_reranks_only_the_static_policies():
    own = prepare_layer(_hand_trace(), 14, rank_rows(np.array([14, 14, 15], dtype=np.int64)))
    # a list fit on other traffic: row 30 twice, rows 0 and 31 once -> ranks 30:0, 0:1 (lower row wins), 31:2
    public = fit_rankings(np.array([[1, 1, 1, 1], [30, 30, 31, 0]], dtype=np.int64), (1, 14), [14])
    pub = with_ranking(own, public[14])
    assert run_policy(pub, "static", 2).tolist() == [1, 0, 1, 0, 0, 0, 1, 0]
    assert run_policy(own, "static", 2).tolist() == [0, 1, 0, 1, 1, 0, 0, 0]
    assert evaluate(pub, "static", Capacity(2, "2 rows")).decode_hits == 2
    assert unseen_share(pub) == 3 / 6   # decode rows 14, 15, 29 never in the public fit
    assert run_policy(pub, "lru", 10).tolist() == run_policy(own, "lru", 10).tolist()


@pytest.fixture(scope="module")
def chat_trace():
    hasher = EngramLookupHasher(EngramLayout.scaled(2000))
    sessions = [render_session(truncate_turns(s, 6)) for s in itertools.islice(iter_chat_sessions(min_replies=2), 16)]
    trace = collect_trace(replay_steps(sessions[:10], hasher, ReplayConfig(batch=8, decode_tokens=32)), hasher,
                          "chat", 8)
    return trace, session_rows(sessions[10:], hasher)


def test_lru_miss_curve_is_monotone_and_belady_bounds_every_policy(chat_trace):
    trace, fit = chat_trace
    preps = [prepare_layer(trace, layer, rank_rows(fit[i])) for i, layer in enumerate(trace.layer_ids)]
    u = max(p.n_items for p in preps)
    caps = [0, u // 100, u // 20, u // 5, u // 2, u]
    curve = miss_page_curve(preps, caps, policy="lru")
    assert set(curve["layers"]) == {"1", "14"} and curve["batch"] == 8
    for layer in curve["layers"].values():
        assert layer["capacity_rows"] == caps
        assert all(a >= b for a, b in zip(layer["pages_per_step"], layer["pages_per_step"][1:]))
        assert all(a <= b for a, b in zip(layer["hit_rate"], layer["hit_rate"][1:]))
        assert layer["hit_rate"][0] == 0.0 and layer["pages_per_step"][0] > 0
    json.dumps(curve)
    for prep in preps:
        for cap in capacities_for(trace, prep.layer_id, absolute_rows=(), table_shares=(),
                                  unique_shares=(0.05, 0.3)):
            got = {p: evaluate(prep, p, cap) for p in ("lru", "clock", "s3fifo", "static", "static_lru",
                                                       "belady", "belady_warm")}
            for p in ("lru", "clock", "s3fifo"):
                assert got[p].decode_hits <= got["belady"].decode_hits
            for p in got:
                assert got[p].decode_hits <= got["belady_warm"].decode_hits
                r = got[p]
                weighted = sum(rate * (r.decode_lookups / 3) for rate in r.order_hit_rate.values())
                assert abs(weighted - r.decode_hits) < 1e-6 * max(1, r.decode_hits)


def test_batch_reuse_counts_distinct_rows(chat_trace):
    trace, _ = chat_trace
    prep = prepare_layer(trace, 14)
    br = batch_reuse(prep, sample_tokens=64, samples=8, window_tokens=512)
    assert 0 < br.window_distinct <= br.sampled_distinct <= 1
    rows = prep.rows.reshape(-1, 24)[:512]
    assert abs(batch_reuse(prep, sample_tokens=64, samples=1, window_tokens=trace.num_tokens).window_distinct
               - np.unique(prep.rows).shape[0] / prep.rows.shape[0]) < 1e-12
    assert rows.shape == (512, 24)


def test_characterize_verb_writes_csv_json_and_plots(tmp_path, capsys):
    out = tmp_path / "out"
    rc = main(["characterize", "--agent-source", "template", "--agent-sources", "idna,packaging", "--agent-per-source", "1",
               "--chat-sessions", "4", "--batch", "2", "--decode-tokens", "16", "--capacities", "0,1000,100000",
               "--miss-points", "4", "--cache-dir", str(tmp_path / "cache"), "--out", str(out), "--policies", "all"])
    assert rc == 0
    err = capsys.readouterr().err
    # every slow phase between the progress bars is named as it starts and timed when it ends
    for phase in ("agent: hashing the fit split", "agent: batch reuse", "chat: miss-page curve", "drawing the plots"):
        assert f"characterize: {phase}" in err and err.count(f"characterize: {phase}") == 2, phase
    for name in ("hit_rates.csv", "hit_rates.json", "batch_reuse.csv", "summary.json", "miss_curve_agent_B2.json",
                 "miss_curve_chat_B2.json", "hit_rate_agent_L14.png", "miss_pages.png"):
        assert (out / name).stat().st_size > 0, name
    curve = json.loads((out / "miss_curve_agent_B2.json").read_text())
    curves = read_miss_curves(out / "miss_curve_agent_B2.json")
    assert set(curves) == {1, 14} and curves[14].pages_at(0) == curve["layers"]["14"]["pages_per_step"][0]
    assert curve["workload"] == "agent" and set(curve["layers"]) == {"1", "14"}
    assert len(curve["layers"]["14"]["pages_per_step"]) == len(curve["layers"]["14"]["capacity_rows"])
    summary = json.loads((out / "summary.json").read_text())
    assert summary["agent"]["holdout_sources"] == 1 and summary["agent"]["fit_sources"] == 1
    hits = json.loads((out / "hit_rates.json").read_text())
    assert {h["policy"] for h in hits} == {"lru", "clock", "s3fifo", "static", "static_lru", "belady", "belady_warm"}


def test_characterize_defaults_to_three_policies():
    from slacktier.cli import build_parser

    assert build_parser().parse_args(["characterize"]).policies == "clock,lru,belady"


def test_prepared_ranks_are_each_lookups_rank_in_the_fit(tmp_path):
    from slacktier.workloads import policies as pol
    from slacktier.workloads.characterize import prepare_layer
    from slacktier.workloads.hashing import lookup_hasher
    from slacktier.workloads.replay import ReplayConfig, collect_trace, replay_steps, session_rows

    from slacktier.workloads.corpus import CorpusConfig, load_workload

    split = load_workload("agent", CorpusConfig(agent_source="template", agent_sources=("idna", "packaging"),
                                                 cache_dir=tmp_path, agent_sessions_per_source=1))
    hasher = lookup_hasher("engram")
    trace = collect_trace(replay_steps(list(split.holdout), hasher, ReplayConfig(batch=1, decode_tokens=16)),
                          hasher, "agent", 1)
    fit = session_rows(list(split.fit), hasher)
    ranking = pol.rank_rows(fit[0][: fit.shape[1] // 2])   # half the fit: some lookups unseen
    prep = prepare_layer(trace, 1, ranking)
    assert np.array_equal(prep.ranks, pol.ranks_of(prep.rows, ranking))
    assert (prep.ranks == np.iinfo(np.int64).max).any() and (prep.ranks < 1000).any()
    ids, n = pol.densify(prep.rows)
    assert np.array_equal(prep.ids, ids) and prep.n_items == n


def test_miss_curve_grid_worked_example():
    from slacktier.workloads.report import miss_curve_grid

    assert miss_curve_grid(1000, 5) == [0, 1, 10, 100, 1000]
    assert miss_curve_grid(0, 12) == [0]


def test_report_table_csv_and_plots_from_hand_results(tmp_path):
    import csv

    from slacktier.workloads.report import (format_characterization, hit_row, lru_lookups_per_s, plot_hit_rates,
                                            write_csv)

    prep = prepare_layer(_hand_trace(), 14)
    results = [evaluate(prep, p, Capacity(c, f"{c} rows")) for p in ("clock", "lru") for c in (2, 10)]
    row = hit_row(results[0])
    assert "order_hit_rate" not in row and {"order2_decode_hit_rate", "order3_decode_hit_rate"} <= set(row)
    write_csv(tmp_path / "h.csv", [hit_row(r) for r in results])
    back = list(csv.DictReader((tmp_path / "h.csv").open()))
    assert [(r["policy"], int(r["capacity_rows"])) for r in back] == [("clock", 2), ("clock", 10), ("lru", 2),
                                                                       ("lru", 10)]
    write_csv(tmp_path / "empty.csv", [])
    assert (tmp_path / "empty.csv").read_text() == ""
    reuse = [{"workload": "hand", "layer": 14, "sample_tokens": 256, "sampled_distinct": 0.5,
              "consecutive_distinct": 0.25, "window_tokens": 8192, "window_distinct": 0.125}]
    text = format_characterization(results, reuse, {})
    lines = text.splitlines()
    assert lines[0].split()[-2:] == ["lru", "clock"]  # policies in POLICIES order, not in run order
    assert lines[3].split()[:3] == ["hand", "14", "10"] and lines[3].split()[-2:] == ["33.3%", "33.3%"]
    assert "consecutive 25.0%, in 8192-token windows 12.5%" in text
    assert lru_lookups_per_s(results) > 0 and lru_lookups_per_s(results[:2]) is None
    (png,) = plot_hit_rates(results, tmp_path)
    assert png.name == "hit_rate_hand_L14.png" and png.stat().st_size > 0


def test_characterize_config_refuses_unknown_names_before_any_work(tmp_path, capsys):
    from slacktier.errors import SlackTierError
    from slacktier.workloads.corpus import CorpusConfig
    from slacktier.workloads.replay import ReplayConfig
    from slacktier.workloads.report import CharacterizeConfig

    with pytest.raises(SlackTierError, match="unknown policy lfu"):
        CharacterizeConfig(CorpusConfig(), ReplayConfig(), policies=("lru", "lfu"))
    with pytest.raises(SlackTierError, match="unknown workload"):
        CharacterizeConfig(CorpusConfig(), ReplayConfig(), workloads=("code",))
    out = tmp_path / "out"
    assert main(["characterize", "--miss-policy", "fifo", "--out", str(out), "--no-progress"]) == 2
    assert "unknown policy fifo" in capsys.readouterr().err and not out.exists()
    assert main(["characterize", "--layers", "1,x", "--out", str(out), "--no-progress"]) == 2
    assert "--layers" in capsys.readouterr().err


def test_the_engines_admission_rules_are_policies_of_their_own(chat_trace, tmp_path):
    """"clock+RULE" is the served CLOCK with that [engine] admission rule, replayed by its pass: named in the
    table (in order, columns as wide as the name), on a miss-page curve, and accepted by the config."""
    from slacktier.workloads.corpus import CorpusConfig
    from slacktier.workloads.replay import ReplayConfig
    from slacktier.workloads.report import CharacterizeConfig, format_characterization, plot_hit_rates

    trace, _ = chat_trace
    prep = prepare_layer(trace, 14)
    cap = prep.n_items // 20
    for rule in ("prefill-cold", "counters"):
        assert run_policy(prep, f"clock+{rule}", cap).tolist() == run_policy(prep, "clock", cap,
                                                                            admission=rule).tolist()
    assert run_policy(prep, "clock+counters", cap).tolist() != run_policy(prep, "clock", cap).tolist()
    results = [evaluate(prep, p, Capacity(cap, "5%")) for p in ("clock+counters", "lru", "clock")]
    lines = format_characterization(results, [], {}).splitlines()
    assert lines[0].split()[-3:] == ["lru", "clock", "clock+counters"]
    assert len(lines[2]) == len(lines[0]) and lines[2].endswith("%")   # the wide column keeps its values aligned
    curve = miss_page_curve([prep], [0, cap], policy="clock+counters")
    assert curve["policy"] == "clock+counters" and curve["layers"]["14"]["hit_rate"][1] > 0
    assert plot_hit_rates(results, tmp_path)
    CharacterizeConfig(CorpusConfig(), ReplayConfig(), policies=("clock", "clock+counters"),
                       miss_policy="clock+prefill-cold")
