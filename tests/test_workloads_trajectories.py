"""Published-trajectory parsers on the vendored real files, including corrupted copies of them."""

import gzip
import json
import shutil
from collections import Counter

import numpy as np
import pytest

from slacktier.errors import SlackTierError
from slacktier.workloads.corpus import CorpusConfig, clip_to_tokens, load_workload
from slacktier.workloads.hashing import EngramLookupHasher
from slacktier.workloads.replay import ReplayConfig, replay_steps
from slacktier.workloads.sessions import render_session, render_text
from slacktier.workloads.split import split_by_source
from slacktier.workloads.trajectories import (SAMPLE_DIR, LoadStats, TrajectoryError, format_of, iter_file,
                                              load_trajectories, repo_of_instance, trajectory_files)

FILES = {p.name: p for p in trajectory_files(SAMPLE_DIR)}


@pytest.fixture(scope="module")
def tok():
    from slacktier.tables.tokenizer import load_deepseek_tokenizer
    return load_deepseek_tokenizer()


def _one(name):
    stats = LoadStats()
    sessions = list(iter_file(FILES[name], stats))
    assert not stats.skipped, stats.skipped
    return sessions


def test_sweagent_traj_keeps_the_models_raw_responses():
    (s,) = _one("gpt4__pydicom__pydicom-1458.traj.gz")
    assert (s.framework, s.model, s.source) == ("swe-agent", "gpt4", "repo:pydicom/pydicom")
    first = next(t for t in s.turns if t.role == "assistant")
    assert first.text.startswith("First, I'll create a new Python script")
    assert "create reproduce_bug.py" in first.text  # the action as the model wrote it


def test_sweagent_function_calling_has_tool_calls_and_tool_turns():
    (s,) = _one("fc__marshmallow-code__marshmallow-1867.traj.gz")
    calls = [c for t in s.turns for c in t.tool_calls]
    assert calls and calls[0].name == "create" and json.loads(calls[0].arguments) == {"filename": "reproduce.py"}
    assert sum(t.role == "tool" for t in s.turns) >= 5
    assert s.source == "repo:marshmallow-code/marshmallow"


def test_openhands_record_is_rendered_from_the_model_response():
    (s,) = _one("gpt-5__alibaba__fastjson2.output.jsonl.gz")
    assert s.framework == "openhands" and s.model.startswith("openai/gpt-5") and s.source == "repo:alibaba/fastjson2"
    assistants = [t for t in s.turns if t.role == "assistant"]
    assert assistants[0].tool_calls[0].name == "execute_bash"
    assert "ls -la /home" in assistants[0].tool_calls[0].arguments
    assert any(t.role == "tool" and "total 40" in t.text for t in s.turns)


def test_old_openhands_resolver_records_and_mini_message_lists_parse():
    resolver = _one("resolver.output.jsonl.gz")
    assert [s.source for s in resolver] == ["repo:neubig/pr-viewer"] * 2
    assert resolver[0].turns[0].text.startswith("Please fix the following issue")
    assert resolver[1].turns[1].tool_calls[0].name == "run"
    assert json.loads(resolver[1].turns[1].tool_calls[0].arguments) == {"command": "ls -R /workspace"}
    (mini,) = _one("github_issue.traj.json.gz")
    assert mini.framework == "mini-swe-agent" and "mswea_bash_command" in mini.turns[2].text


def test_nebius_swe_agent_rows_keep_the_models_replies_and_the_observations_it_was_sent():
    (s,) = _one("ARM-software__mango-11.nebius.json.gz")
    assert (s.framework, s.model, s.source) == ("swe-agent", "swe-agent-llama-70b", "repo:ARM-software/mango")
    assert s.session_id == "nebius:ARM-software__mango-11"
    roles = [t.role for t in s.turns]
    assert roles[:3] == ["system", "user", "assistant"] and roles[-1] == "assistant"
    assert s.turns[0].text.startswith("SETTING: You are an autonomous programmer")
    assert all(a == "user" for a, b in zip(roles[1::2], roles[2::2])) and set(roles[2::2]) == {"assistant"}
    first = s.turns[2]
    assert "create reproduce.py" in first.text and not first.tool_calls  # the command as the model wrote it
    assert s.turns[-1].text.rstrip().endswith("submit\n```")
    assert format_of(FILES["ARM-software__mango-11.nebius.json.gz"]) == "nebius"


def test_malformed_nebius_rows_are_named_counted_and_skipped(tmp_path):
    row = json.loads(gzip.decompress(FILES["ARM-software__mango-11.nebius.json.gz"].read_bytes()))
    (tmp_path / "a__b-1.nebius.json").write_text(json.dumps({**row, "trajectory": "x"}))
    bad_role = {**row, "trajectory": row["trajectory"][:3] + [{"role": "robot", "text": "hi"}]}
    (tmp_path / "a__b-2.nebius.json").write_text(json.dumps(bad_role))
    (tmp_path / "a__b-3.nebius.json").write_text(json.dumps({**row, "trajectory": row["trajectory"][:2]}))
    (tmp_path / "a__b-4.nebius.json").write_text(json.dumps(row))
    stats = LoadStats()
    (s,) = load_trajectories(tmp_path, stats)
    assert s.source == "repo:ARM-software/mango"  # the row's instance_id, not the file name
    reasons = {p.split("/")[-1]: r for p, _, r in stats.skipped}
    assert set(reasons) == {"a__b-1.nebius.json", "a__b-2.nebius.json", "a__b-3.nebius.json"}
    assert "no `trajectory` list" in reasons["a__b-1.nebius.json"]
    assert "robot" in reasons["a__b-2.nebius.json"] and "no assistant turn" in reasons["a__b-3.nebius.json"]


def test_vendored_sample_fills_b128_on_both_sides_of_a_repository_split():
    stats = LoadStats()
    sessions = load_trajectories(None, stats)
    assert not stats.skipped and len(sessions) == stats.sessions >= 256
    split = split_by_source(sessions, holdout_share=0.5, seed=0)
    assert not split.fit_sources & split.holdout_sources
    assert len(split.fit) >= 128 and len(split.holdout) >= 128
    assert len({s.source for s in sessions}) >= 256
    assert len({s.framework for s in sessions}) >= 3
    models = Counter(s.model for s in sessions if s.model)
    assert len(models) >= 5 and all(n >= 1 for n in models.values())


def test_malformed_files_and_records_are_named_counted_and_skipped(tmp_path):
    raw = gzip.decompress(FILES["resolver.output.jsonl.gz"].read_bytes()).decode().splitlines()
    (tmp_path / "bad.output.jsonl").write_text("\n".join([raw[0], "{not json", json.dumps({"history": 3}), raw[1]]))
    traj = gzip.decompress(FILES["gpt4__pydicom__pydicom-1458.traj.gz"].read_bytes())
    (tmp_path / "cut__cut__cut-1.traj").write_bytes(traj[: len(traj) // 2])
    (tmp_path / "nobody.traj.json").write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}))
    (tmp_path / "broken.traj.gz").write_bytes(b"not gzip")
    shutil.copy(FILES["local.traj.json.gz"], tmp_path / "local.traj.json.gz")
    stats = LoadStats()
    sessions = load_trajectories(tmp_path, stats)
    assert len(sessions) == 3 and stats.sessions == 3
    where = {(p.split("/")[-1], r) for p, r, _ in stats.skipped}
    assert where == {("bad.output.jsonl", 1), ("bad.output.jsonl", 2), ("cut__cut__cut-1.traj", 0),
                     ("nobody.traj.json", 0), ("broken.traj.gz", None)}
    with pytest.raises(TrajectoryError, match="bad.output.jsonl record 1"):
        raise TrajectoryError(tmp_path / "bad.output.jsonl", 1, "x")
    with pytest.raises(SlackTierError):
        load_trajectories(tmp_path / "absent")


def test_instance_ids_name_repositories():
    assert repo_of_instance("pydicom__pydicom-1458") == "pydicom/pydicom"
    assert repo_of_instance("scikit-learn__scikit-learn-10297") == "scikit-learn/scikit-learn"
    assert repo_of_instance("no-instance") is None


def test_rendering_marks_tool_calls_tool_output_and_thinking(tok):
    (s,) = _one("fc__marshmallow-code__marshmallow-1867.traj.gz")
    text = render_text(s)
    assert "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>create<｜tool▁sep｜>" in text
    assert "<｜tool▁output▁begin｜>[File: reproduce.py" in text
    ts = render_session(s, tok)
    end = tok.token_to_id("<｜end▁of▁sentence｜>")
    for a, b in zip(ts.reply_start, ts.reply_end):
        assert ts.tokens[b - 1] == end and ts.tokens[a - 1] == tok.token_to_id("</think>")
    assert ts.num_replies == sum(t.role == "assistant" for t in s.turns)
    assert tok.decode(ts.tokens.tolist(), skip_special_tokens=False) == text


def test_thinking_text_is_decoded_inside_think(tok):
    from slacktier.workloads.sessions import Session, ToolCall, Turn
    s = Session("t", "repo:a/b", "agent", (Turn("user", "fix it"),
                                           Turn("assistant", "ok", reasoning="look first",
                                                tool_calls=(ToolCall("bash", '{"cmd": "ls"}'),))))
    ts = render_session(s, tok)
    assert ts.tokens[ts.reply_start[0] - 1] == tok.token_to_id("<think>")
    assert "look first</think>ok<｜tool▁calls▁begin｜>" in tok.decode(ts.tokens[ts.reply_start[0]:].tolist(),
                                                                       skip_special_tokens=False)


def test_published_agent_workload_is_split_by_repository(small_agent_sample):
    split = load_workload("agent", CorpusConfig(agent_source="published", agent_dir=small_agent_sample,
                                                cache_dir=None))
    assert not split.fit_sources & split.holdout_sources
    assert {s.source for s in split.fit} == set(split.fit_sources)
    assert {s.source for s in split.holdout} == set(split.holdout_sources)
    assert len(split.fit) + len(split.holdout) == len(load_trajectories(small_agent_sample))
    assert {s.session_id.split(":")[0] for s in split.fit + split.holdout} == {"sweagent", "mini", "openhands",
                                                                               "nebius"}


def test_clip_keeps_whole_replies(small_agent_sample):
    split = load_workload("agent", CorpusConfig(agent_source="published", agent_dir=small_agent_sample,
                                                cache_dir=None, agent_max_tokens=4000))
    for s in split.fit + split.holdout:
        assert s.num_tokens <= 4000 and s.reply_end[-1] == s.num_tokens
    s = split.holdout[0]
    assert clip_to_tokens(s, int(s.reply_end[0]) - 1) is None


def test_replayed_row_ids_equal_hashing_whole_sessions(small_agent_sample):
    split = load_workload("agent", CorpusConfig(agent_source="published", agent_dir=small_agent_sample,
                                                cache_dir=None, agent_max_tokens=3000))
    sessions = list(split.fit + split.holdout)
    hasher = EngramLookupHasher()
    full = [hasher.prefill(s.tokens.astype(np.int64)) for s in sessions]
    n = 0
    for step in replay_steps(sessions, hasher, ReplayConfig(batch=4, decode_tokens=16)):
        for i in range(step.num_tokens):
            np.testing.assert_array_equal(step.ids[i], full[int(step.session_ids[i])][int(step.positions[i])])
            n += 1
    assert n > 0
