"""Context packing, the traffic side: pages per step against a plain-Python reference, choosing on the fit half
only, budgets, and the pack list file field by field as the format states it (workloads.packing's docstring)."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest

from slacktier.errors import SlackTierError
from slacktier.tables.engram_hash import EngramLayout
from slacktier.workloads import packing as P
from slacktier.workloads.hashing import EngramLookupHasher
from slacktier.workloads.replay import LookupTrace, ReplayConfig
from slacktier.workloads.sessions import render_session, truncate_turns
from slacktier.workloads.sharegpt import iter_chat_sessions
from slacktier.workloads.split import split_by_source


def _trace(rows_by_token, steps, decode, columns=6, table_rows=1000) -> LookupTrace:
    rows = np.asarray(rows_by_token, dtype=np.int64).reshape(1, -1)
    return LookupTrace("hand", 2, (14,), (table_rows,), columns, 2, 2, rows, np.asarray(steps, dtype=np.int32),
                       np.asarray(decode, dtype=bool), np.zeros(len(steps), dtype=np.int32))


def test_worked_example_of_the_module_docstring():
    # one decode step, tokens A and B on one rank owning all 6 columns (one packed page per context)
    tr = _trace([[0, 30, 60, 200, 201, 202], [14, 90, 300, 301, 302, 303]], [0, 0], [True, True])
    lk = P.rank_lookups(tr, 14, 0, 1)
    hit = np.array([0, 0, 0, 1, 1, 1, 0, 0, 1, 1, 1, 1], dtype=np.uint8)
    assert P.step_pages(lk, hit).tolist() == [4]                                     # pages 0, 2, 4, 6
    assert P.step_pages(lk, hit, np.array([0, -1])).tolist() == [3]                 # A's packed page, 0, 6
    assert P.step_pages(lk, hit, np.array([0, 1])).tolist() == [2]                  # two packed pages
    assert P.token_savings(lk, hit).tolist() == [1.0, 0.0]                           # A: {2, 4} - 1; B: {6} - 1
    assert P.packed_pages_per_context(6) == 1 and P.packed_pages_per_context(24) == 2


def _ref_pages(rows, hit, token_step, decode, pack, n_columns, shard_start, pack_pages):
    """Plain Python: per decode step, the first miss of each row is a read; packed tokens read their context's
    page(s) instead; distinct pages counted. Also each token's saving packed alone."""
    pages, saved = [], [0.0] * len(token_step)
    for s in sorted(set(token_step)):
        toks = [t for t in range(len(token_step)) if token_step[t] == s]
        if not decode[toks[0]]:
            continue
        seen_rows, keys, reads = set(), set(), []
        for t in toks:
            for c in range(n_columns):
                x = t * n_columns + c
                if hit[x] or rows[x] in seen_rows:
                    continue
                seen_rows.add(rows[x])
                page = (rows[x] - shard_start) // 15
                keys.add(("packed", pack[t]) if pack[t] >= 0 else ("row", page))
                reads.append((t, page))
        pages.append(sum(pack_pages if k[0] == "packed" else 1 for k in keys))
        readers: dict[int, set] = {}
        for t, page in reads:
            readers.setdefault(page, set()).add(t)
        for t in {t for t, _ in reads}:
            saved[t] += sum(1 for page, who in readers.items() if who == {t}) - pack_pages
    return pages, saved


@pytest.mark.parametrize("seed", range(12))
def test_pages_match_the_plain_python_reference(seed):
    rng = np.random.default_rng(seed)
    n_tok, cols = int(rng.integers(1, 40)), int(rng.choice([2, 6, 24]))
    steps = np.sort(rng.integers(0, 6, n_tok)).astype(np.int32)
    decode = np.array([bool(s % 3) for s in steps])     # steps are all-decode or all-prefill
    rows = rng.integers(0, 200, (n_tok, cols))          # a small row space: rows and pages collide
    hit = (rng.random(n_tok * cols) < 0.3).astype(np.uint8)
    pack = np.where(rng.random(n_tok) < 0.5, rng.integers(0, 4, n_tok), -1)
    tr = _trace(rows, steps, decode, columns=cols, table_rows=200)
    lk = P.rank_lookups(tr, 14, 0, 1)
    pp = P.packed_pages_per_context(cols)
    want_pages, want_saved = _ref_pages(rows.reshape(-1).tolist(), hit.tolist(), steps.tolist(), decode.tolist(),
                                        pack.tolist(), cols, 0, pp)
    assert P.step_pages(lk, hit, pack).tolist() == want_pages
    assert P.token_savings(lk, hit).tolist() == pytest.approx(want_saved)


@pytest.fixture(scope="module")
def chat():
    hasher = EngramLookupHasher(EngramLayout.scaled(2000))
    sessions = [render_session(truncate_turns(s, 6)) for s in itertools.islice(iter_chat_sessions(min_replies=2), 16)]
    split = split_by_source(sessions, seed=0)
    return hasher, split, ReplayConfig(batch=4, decode_tokens=24)


def _contexts(trace, layer) -> set:
    return set(map(tuple, P.token_contexts(trace, layer).tolist()))


def test_served_clock_pages_with_a_pack_list_match_the_reference(chat):
    hasher, split, replay = chat
    caps = {1: 300, 14: 300}
    choice = P.choose_for_split(split, hasher, replay, "chat", (1, 14), caps, ranks=4)
    hold = P.fit_trace(split.__class__(split.holdout, split.fit, split.holdout_sources, split.fit_sources),
                       hasher, replay, "chat")
    for layer in (1, 14):
        assert choice.count(layer) > 0
        packed = {tuple(r): i for i, r in enumerate(choice.ids[layer].tolist())}   # exact keys, no digests
        ctx = P.token_contexts(hold, layer).tolist()
        pack = np.array([packed.get(tuple(r), -1) for r in ctx])
        assert P.lookup_contexts(choice.ids[layer], P.token_contexts(hold, layer)).tolist() == pack.tolist()
        for rank in range(4):
            lk = P.rank_lookups(hold, layer, rank, 4)
            hit = P.hit_mask(lk, caps[layer])
            want, _ = _ref_pages(lk.trace.rows[0].tolist(), hit.tolist(), hold.token_step.tolist(),
                                 hold.token_decode.tolist(), pack.tolist(), 6, lk.shard_start, 1)
            got = P.step_pages(lk, hit, pack)
            assert got.tolist() == want
            assert got.sum() <= P.step_pages(lk, hit).sum()


def test_choosing_sees_only_the_fit_half(chat):
    hasher, split, replay = chat
    caps = {14: 300}
    assert not (split.fit_sources & split.holdout_sources)
    choice = P.choose_for_split(split, hasher, replay, "chat", (14,), caps, ranks=4)
    fit = P.fit_trace(split, hasher, replay, "chat")
    swapped = split.__class__(split.holdout, split.fit, split.holdout_sources, split.fit_sources)
    hold = P.fit_trace(swapped, hasher, replay, "chat")
    held_only = _contexts(hold, 14) - _contexts(fit, 14)
    listed = set(map(tuple, choice.ids[14].tolist()))
    assert listed and listed <= _contexts(fit, 14)
    assert not (listed & held_only), "a context only the held-out half holds was chosen"
    # the held-out half has contexts worth packing: had it been replayed, some would be listed
    leaked = P.choose_for_split(swapped, hasher, replay, "chat", (14,), caps, ranks=4)
    assert set(map(tuple, leaked.ids[14].tolist())) & held_only
    assert choice.meta["split"] == "fit"


def test_contexts_are_grouped_exactly_and_looked_up_by_their_ids():
    ids = np.array([[1, 2, 3], [4, 5, 6], [1, 2, 3], [7, 8, 9], [4, 5, 6]], dtype=np.int64)
    ctx, of = P.context_index(ids)
    assert ctx.tolist() == [[1, 2, 3], [4, 5, 6], [7, 8, 9]] and of.tolist() == [0, 1, 0, 2, 1]
    assert P.lookup_contexts(ctx[[2, 0]], ids).tolist() == [1, -1, 1, 0, -1]
    assert P.lookup_contexts(ctx[:0], ids).tolist() == [-1] * 5
    with pytest.raises(SlackTierError, match="listed twice"):
        P.lookup_contexts(ctx[[0, 0]], ids)


def _choice(n1=3, n14=2) -> P.PackChoice:
    rng = np.random.default_rng(0)
    meta = P.pack_meta("agent", 0, 128, 1_000_000, 4, "columns", "deepseek")
    return P.PackChoice((1, 14), {1: rng.integers(0, 10**8, (n1, 24)), 14: rng.integers(0, 10**8, (n14, 24))},
                        {1: np.array([9.0, 5.0, 1.0])[:n1], 14: np.array([7.0, 2.0])[:n14]}, 1, meta)


def test_budget_keeps_each_layers_prefix_within_an_equal_share_as_staging_does():
    c = _choice()                                   # 3 contexts at layer 1, 2 at layer 14
    assert c.extra_disk_bytes() == 5 * 4096 and c.index_bytes() == 2 * 16 * 12   # two indexes of 16 entries
    assert c.disk_to_hold_all() == 2 * 3 * 4096
    b = c.within(disk_bytes=4 * 4096 + 100)         # 2 pages per layer
    assert (b.count(1), b.count(14)) == (2, 2) and b.ids[1].tolist() == c.ids[1][:2].tolist()
    assert b.saved[1].tolist() == [9.0, 5.0]
    assert c.within(disk_bytes=c.disk_to_hold_all()).ids[1].tolist() == c.ids[1].tolist()
    assert c.within(index_bytes=2 * 16 * 12).count(14) == 2 and c.within(index_bytes=2 * 16 * 12).count(1) == 3
    assert c.within(index_bytes=100).count(1) == 0   # not even the smallest index fits half of 100 B
    with pytest.raises(SlackTierError):
        c.within(disk_bytes=-1)


def test_pack_list_file_field_by_field(tmp_path):
    c = _choice()
    path = P.write_pack_list(tmp_path / "pack.npz", c)
    assert path == tmp_path / "pack.npz" and not (tmp_path / "pack.npz.tmp").exists()
    with np.load(path, allow_pickle=False) as z:
        assert set(z.files) == {"layers", "ids_1", "saved_1", "ids_14", "saved_14", "meta"}
        assert z["layers"].dtype == np.int64 and z["layers"].tolist() == [1, 14]
        for layer in (1, 14):
            ids, saved = z[f"ids_{layer}"], z[f"saved_{layer}"]
            assert ids.dtype == np.int64 and ids.shape == (c.count(layer), 24)
            assert ids.tolist() == c.ids[layer].tolist()                   # file order = best first
            assert saved.dtype == np.float64 and saved.tolist() == c.saved[layer].tolist()
            assert all(a >= b for a, b in zip(saved, saved[1:]))
        meta = z["meta"]
        assert meta.shape == () and meta.dtype.kind == "U"
        doc = json.loads(str(meta))
    assert set(doc) == {"format", "version", "workload", "split", "seed", "batch", "cache_rows", "ranks",
                        "partition", "tokens"}
    assert doc == {"format": "slacktier-pack-list", "version": 1, "workload": "agent", "split": "fit", "seed": 0,
                   "batch": 128, "cache_rows": 1_000_000, "ranks": 4, "partition": "columns", "tokens": "deepseek"}


def test_pack_list_reads_back_through_the_staging_reader(tmp_path):
    reader = pytest.importorskip("slacktier.tables.packing").read_pack_list
    c = _choice()
    got = reader(P.write_pack_list(tmp_path / "pack.npz", c))
    assert got.layers == c.layers and got.meta == c.meta
    for layer in c.layers:
        assert got.ids[layer].tolist() == c.ids[layer].tolist()
        assert got.saved[layer].tolist() == c.saved[layer].tolist()


def test_pack_list_without_fit_meta_is_refused(tmp_path):
    c = _choice()
    bad = P.PackChoice(c.layers, c.ids, c.saved, 1, dict(c.meta, split="holdout"))
    with pytest.raises(SlackTierError, match="fit"):
        P.write_pack_list(tmp_path / "p.npz", bad)
    with pytest.raises(SlackTierError, match="admission"):
        P.named_rule("sometimes")
    with pytest.raises(SlackTierError, match="order"):
        P.PackConfig(out=tmp_path / "p.npz", order="alphabetical")
    with pytest.raises(SlackTierError, match="one size for every layer"):
        P.PackConfig(out=tmp_path / "p.npz", cache_rows=(1, 2, 3)).rows_of((1, 14))


def test_characterize_writes_a_pack_list_and_rank_curves_that_plan_reads(tmp_path, capsys):
    from slacktier.cli import main
    from slacktier.plan import load_miss_curves

    out = tmp_path / "out"
    rc = main(["characterize", "--workloads", "agent", "--agent-source", "template", "--agent-sources",
               "idna,packaging", "--agent-per-source", "1", "--batch", "2", "--decode-tokens", "16", "--capacities",
               "0,1000", "--miss-points", "4", "--policies", "clock", "--no-plots", "--no-progress", "--cache-dir",
               str(tmp_path / "cache"), "--out", str(out), "--pack-list", str(tmp_path / "pack.npz"),
               "--pack-cache-rows", "1000", "--admission", "counters"])
    assert rc == 0
    assert "agent packing (chosen on the fit half)" in capsys.readouterr().out
    with np.load(tmp_path / "pack.npz") as z:
        meta = json.loads(str(z["meta"]))
        assert z["layers"].tolist() == [1, 14] and z["ids_14"].shape[1] == 24
        assert meta["split"] == "fit" and meta["ranks"] == 4 and meta["batch"] == 2 and meta["cache_rows"] == 2000
    plain = load_miss_curves(out / "miss_curve_agent_B2_rank3.json")
    packed = load_miss_curves(out / "miss_curve_agent_B2_rank3_packed.json")
    assert "no context packing" in plain.describe() and "rank 3 of TP4" in plain.describe()
    assert "context packing: L1" in packed.describe() and packed.packing["chosen_on"] == "fit"
    assert 'admission "counters" (served)' in packed.describe()   # the engine's rule, replayed by its pass
    for layer in (1, 14):
        a, b = plain.curve(layer), packed.curve(layer)
        assert a.capacity_rows == b.capacity_rows
        assert all(y <= x for x, y in zip(a.pages_per_step, b.pages_per_step))
    # packing and admission flags without a list are refused, not ignored
    assert main(["characterize", "--workloads", "agent", "--pack-disk-gb", "5"]) == 2


def test_plan_says_which_curve_it_used_and_predicts_fewer_pages_with_packing(tmp_path, o_direct_dir, capsys):
    from slacktier import cli
    from slacktier.tables.stage import stage_synthetic

    l1 = stage_synthetic([o_direct_dir / "l1.bin"], {1: 150}, 1, 0, progress=False).path
    l14 = stage_synthetic([o_direct_dir / "l14.bin"], {14: 150}, 1, 0, progress=False).path
    tiers = tmp_path / "tiers.toml"
    tiers.write_text('[[tier]]\nname = "disk"\nintercept_ms = 0.30\npage_ms = 0.00305\ncontention_page_ms = 0.00037\n'
                     'buffer_bytes = 1048576\n')
    caps = [0, 250_000, 500_000, 1_000_000]
    plans = {}
    for name, scale, packing in (("today", 1.0, None), ("packed", 0.8, {
            "pack_list": "pack.npz", "chosen_on": "fit", "contexts": {"1": 10, "14": 20},
            "extra_disk_bytes_per_rank": 30 * 4096, "index_bytes_per_rank": 30 * 16})):
        curves = tmp_path / f"{name}.json"
        curves.write_text(json.dumps({"workload": "agent", "batch": 128, "policy": "clock", "ranks": 4, "rank": 3,
                                      "partition": "columns", "packing": packing, "layers": {
            "1": {"capacity_rows": caps, "pages_per_step": [scale * p for p in (3000, 250, 40, 10)]},
            "14": {"capacity_rows": caps, "pages_per_step": [scale * p for p in (2500, 300, 60, 20)]}}}))
        rc = cli.main(["plan", "--table", f"1={l1}:1000000", "--table", f"14={l14}:1000000", "--window", "1=0.5",
                       "--window", "14=9", "--tiers", str(tiers), "--curves", str(curves), "--cache-rows", "1000000",
                       "--target-ms", "5", "--out", str(tmp_path / f"{name}.toml"), "--json",
                       str(tmp_path / f"{name}_plan.json"), "--no-plot"])
        assert rc == 0
        text = capsys.readouterr().out
        assert f"miss-page curves: {curves}: agent traffic, B=128, clock, rank 3 of TP4 (columns)" in text
        plans[name] = json.loads((tmp_path / f"{name}_plan.json").read_text())
    assert "context packing: L1 10, L14 20 contexts" in plans["packed"]["miss_curves"]["described"]
    assert plans["today"]["miss_curves"]["packing"] is None
    pages = {k: sum(t["pages_per_step"] for t in v["tables"]) for k, v in plans.items()}
    assert pages["packed"] < pages["today"]


def test_ordering_by_sources_puts_a_context_useful_in_more_sources_first():
    # 6 columns, one rank, no cache: every token misses its 6 rows on 6 pages -> it saves 6 - 1 = 5 pages alone.
    # context A: 3 tokens, all in source 0 (15 pages); context B: 2 tokens, sources 0 and 1 (10 pages)
    a, b = [0, 15, 30, 45, 60, 75], [90, 105, 120, 135, 150, 165]
    tr = _trace([a, a, a, b, b], [0, 1, 2, 3, 4], [True] * 5)
    by_pages = P.choose_contexts(tr, (14,), {14: 0}, ranks=1)
    assert by_pages.ids[14].tolist() == [a, b] and by_pages.saved[14].tolist() == [15.0, 10.0]
    by_src = P.choose_contexts(tr, (14,), {14: 0}, ranks=1, token_groups=np.array([0, 0, 0, 0, 1]))
    assert by_src.ids[14].tolist() == [b, a] and by_src.saved[14].tolist() == [10.0, 15.0]
    assert by_src.within(disk_bytes=4096).ids[14].tolist() == [b]
    assert by_pages.within(disk_bytes=4096).ids[14].tolist() == [a]
