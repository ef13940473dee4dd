"""Session rendering in the DeepSeek chat format, and fit/holdout splits that never share a source."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from slacktier.errors import SlackTierError
from slacktier.tables.tokenizer import load_deepseek_tokenizer
from slacktier.workloads.agent import AGENT_SOURCES
from slacktier.workloads.sessions import Session, TokenSession, Turn, render_session, render_text, truncate_turns
from slacktier.workloads.sharegpt import iter_chat_sessions
from slacktier.workloads.split import split_by_source


def test_render_round_trips_and_marks_replies():
    tok = load_deepseek_tokenizer()
    s = Session("x", "src", "chat", (Turn("system", "Be brief."), Turn("user", "Hi there"),
                                     Turn("assistant", "Hello! How can I help?"), Turn("user", "2+2?"),
                                     Turn("assistant", "4")))
    ts = render_session(s)
    assert tok.decode(ts.tokens.tolist(), skip_special_tokens=False) == render_text(s)
    assert ts.tokens[0] == tok.token_to_id("<｜begin▁of▁sentence｜>")
    assert ts.num_replies == 2
    for k, text in enumerate(["Hello! How can I help?", "4"]):
        reply = ts.tokens[ts.reply_start[k]:ts.reply_end[k]]
        assert reply[-1] == tok.token_to_id("<｜end▁of▁sentence｜>")
        assert tok.decode(reply[:-1].tolist()) == text
        assert ts.tokens[ts.reply_start[k] - 2] == tok.token_to_id("<｜Assistant｜>")
        assert ts.tokens[ts.reply_start[k] - 1] == tok.token_to_id("</think>")


def test_truncate_ends_on_a_reply_and_bad_roles_are_refused():
    s = Session("x", "src", "chat", (Turn("user", "a"), Turn("assistant", "b"), Turn("user", "c")))
    assert [t.role for t in truncate_turns(s, 3).turns] == ["user", "assistant"]
    with pytest.raises(SlackTierError):
        Turn("robot", "x")
    with pytest.raises(SlackTierError):
        Turn("tool", "x", reasoning="only assistants think")
    with pytest.raises(SlackTierError):
        TokenSession("x", "s", "chat", np.zeros(3, np.int32), np.array([2]), np.array([5]))


@settings(max_examples=100, deadline=None)
@given(st.lists(st.sampled_from([f"src{i}" for i in range(12)]), min_size=2, max_size=60),
       st.floats(0.05, 0.95), st.integers(0, 5))
def test_split_never_shares_a_source(sources, share, seed):
    sessions = [Session(f"s{i}", src, "chat", ()) for i, src in enumerate(sources)]
    if len(set(sources)) < 2:
        with pytest.raises(SlackTierError):
            split_by_source(sessions, holdout_share=share, seed=seed)
        return
    sp = split_by_source(sessions, holdout_share=share, seed=seed)
    assert not ({s.source for s in sp.fit} & {s.source for s in sp.holdout})
    assert sp.fit and sp.holdout and len(sp.fit) + len(sp.holdout) == len(sessions)
    assert sp == split_by_source(sessions, holdout_share=share, seed=seed)  # deterministic


def test_sharegpt_parts_of_one_conversation_stay_together():
    sessions = list(itertools.islice(iter_chat_sessions(min_replies=1), 300))
    sp = split_by_source(sessions, seed=0)
    fit_conv = {s.session_id.rpartition("_")[0] for s in sp.fit}
    hold_conv = {s.session_id.rpartition("_")[0] for s in sp.holdout}
    assert not fit_conv & hold_conv and not sp.fit_sources & sp.holdout_sources


def test_agent_repositories_split_by_repository():
    sessions = [Session(f"agent:{src}:0:{i}", f"repo:{src}", "agent", ()) for src in AGENT_SOURCES for i in range(3)]
    sp = split_by_source(sessions, seed=0)
    assert len(sp.fit_sources) + len(sp.holdout_sources) == len(AGENT_SOURCES)
    assert not {s.source for s in sp.fit} & {s.source for s in sp.holdout}
