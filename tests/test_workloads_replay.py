"""Replay traces: teacher-forced turns, radix-cached prefills, and ids equal to hashing the whole session."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from slacktier.errors import SlackTierError
from slacktier.tables.engram_hash import EngramLayout
from slacktier.workloads.hashing import EngramLookupHasher, history_before
from slacktier.workloads.replay import ReplayConfig, collect_trace, replay_steps, session_rows
from slacktier.workloads.sessions import render_session, truncate_turns
from slacktier.workloads.sharegpt import iter_chat_sessions


@pytest.fixture(scope="module")
def hasher():
    return EngramLookupHasher(EngramLayout.scaled(1000))


@pytest.fixture(scope="module")
def sessions():
    chats = itertools.islice(iter_chat_sessions(min_replies=2), 12)
    return [render_session(truncate_turns(s, 8)) for s in chats]


@pytest.mark.parametrize("config", [ReplayConfig(batch=4, decode_tokens=16, prefill_chunk_tokens=300),
                                    ReplayConfig(batch=8, decode_tokens=1000, pause_steps_mean=3.0, seed=2),
                                    ReplayConfig(batch=1, decode_tokens=5),
                                    ReplayConfig(batch=6, decode_tokens=20, start_spread_steps=40, seed=1)])
def test_replay_covers_each_session_once_and_hashes_like_a_full_prefill(hasher, sessions, config):
    full = [hasher.prefill(s.tokens.astype(np.int64)) for s in sessions]
    seen = [np.zeros(s.num_tokens, dtype=np.int8) for s in sessions]
    decoded = [np.zeros(s.num_tokens, dtype=bool) for s in sessions]
    last = -1
    for step in replay_steps(sessions, hasher, config):
        assert step.index == last + 1
        last = step.index
        assert step.ids.shape == (step.num_tokens, 2, 24)
        if step.kind == "decode":
            assert step.is_decode.all() and len(set(step.session_ids.tolist())) == step.num_tokens <= config.batch
        else:
            assert not step.is_decode.any() and step.num_tokens <= config.prefill_chunk_tokens
        assert len(set(step.session_ids.tolist())) <= config.batch
        for sid, pos, tok, ids, dec in zip(step.session_ids, step.positions, step.tokens, step.ids, step.is_decode):
            s = sessions[sid]
            assert tok == s.tokens[pos]
            assert np.array_equal(ids, full[sid][pos])  # decode path == prefill path of the whole session
            seen[sid][pos] += 1
            decoded[sid][pos] = dec
    for s, cnt, dec in zip(sessions, seen, decoded):
        n_last = min(config.decode_tokens, int(s.reply_end[-1] - s.reply_start[-1]))
        covered = int(s.reply_start[-1]) + n_last
        assert (cnt[:covered] == 1).all() and (cnt[covered:] == 0).all()  # every token forwarded exactly once
        for a, b in zip(s.reply_start, s.reply_end):
            n = min(config.decode_tokens, int(b - a))
            assert dec[a:a + n].all() and not dec[a + n:b].any()  # the first N reply tokens are decoded
        assert dec.sum() == sum(min(config.decode_tokens, int(b - a)) for a, b in zip(s.reply_start, s.reply_end))


def test_collect_trace_shapes(hasher, sessions):
    cfg = ReplayConfig(batch=4, decode_tokens=8)
    tr = collect_trace(replay_steps(sessions, hasher, cfg), hasher, "chat", 4)
    assert tr.rows.shape == (2, tr.num_tokens * 24) and tr.layer_ids == (1, 14)
    assert (np.diff(tr.token_step) >= 0).all()
    assert tr.lookup_decode().sum() == tr.token_decode.sum() * 24
    rows = tr.layer_rows(14)
    assert rows.max() < tr.table_rows[1] and rows.min() >= 0
    fit = session_rows(sessions[:3], hasher)
    assert fit.shape == (2, sum(s.num_tokens for s in sessions[:3]) * 24)
    with pytest.raises(SlackTierError):
        tr.layer_rows(7)


def test_history_before():
    toks = np.array([5, 6, 7, 8])
    assert history_before(toks, 0, 3).tolist() == [-1, -1, -1]
    assert history_before(toks, 1, 3).tolist() == [-1, -1, 5]
    assert history_before(toks, 4, 3).tolist() == [6, 7, 8]


def test_bad_config_is_refused():
    with pytest.raises(SlackTierError):
        ReplayConfig(batch=0)


def test_ple_hasher_replays_through_the_same_interface(sessions):
    from slacktier.tables.ple_hash import PleLayout
    from slacktier.workloads.hashing import PleLookupHasher

    ple = PleLookupHasher(PleLayout.scaled(1000))
    assert ple.spec.layer_ids == (1,) and ple.spec.n_columns == 16 and ple.spec.history_width == 2
    full = [ple.prefill(s.tokens.astype(np.int64)) for s in sessions[:3]]
    n = 0
    for step in replay_steps(sessions[:3], ple, ReplayConfig(batch=2, decode_tokens=4)):
        assert step.ids.shape == (step.num_tokens, 1, 16)
        for sid, pos, ids in zip(step.session_ids, step.positions, step.ids):
            assert np.array_equal(ids, full[sid][pos])
        n += step.num_tokens
    assert n > 0
