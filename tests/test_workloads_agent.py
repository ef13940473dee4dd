"""Agent sessions: deterministic from the seed, made of real command output on real source trees."""

from __future__ import annotations

import re
import subprocess

import numpy as np
import pytest

from slacktier.errors import SlackTierError
from slacktier.workloads.agent import (AgentParams, agent_sessions, available_sources, cache_key,
                                       generate_agent_session, load_template, site_packages)
from slacktier.workloads.sessions import render_session, render_text

SOURCE = "idna"
PARAMS = AgentParams(min_explore_turns=3, max_explore_turns=5)
COMMAND = re.compile(r"```mswea_bash_command\n(.*?)\n```", re.S)
OUTPUT = re.compile(r"<returncode>(-?\d+)</returncode>\n<output>\n(.*)</output>$", re.S)


@pytest.fixture(scope="module")
def session():
    return generate_agent_session(SOURCE, seed=11, index=0, params=PARAMS)


def _pairs(session):
    """(command, returncode, output) of every action."""
    out = []
    turns = session.turns
    for a, o in zip(turns[2::2], turns[3::2]):
        assert a.role == "assistant" and o.role == "user"
        cmd = COMMAND.search(a.text).group(1)
        m = OUTPUT.search(o.text)
        assert m, o.text[:200]
        out.append((cmd, int(m.group(1)), m.group(2)))
    return out


def test_same_seed_is_byte_identical_and_another_seed_differs(session):
    again = generate_agent_session(SOURCE, seed=11, index=0, params=PARAMS)
    assert render_text(again).encode() == render_text(session).encode()
    t1, t2 = render_session(session), render_session(again)
    assert t1.tokens.tobytes() == t2.tokens.tobytes()
    other = generate_agent_session(SOURCE, seed=12, index=0, params=PARAMS)
    assert render_text(other) != render_text(session)


def test_uses_the_shipped_swebench_template(session):
    tpl = load_template()
    # jinja2 drops one trailing newline when rendering, as mini-swe-agent's own rendering does
    assert session.turns[0].text == tpl.system_template.removesuffix("\n")
    assert "<pr_description>" in session.turns[1].text and "mswea_bash_command" in session.turns[1].text
    assert session.turns[-2].text.endswith("echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT && cat patch.txt\n```")


def test_observations_are_real_command_output(session):
    root = site_packages()
    pairs = _pairs(session)
    kinds = {cmd.split()[0] for cmd, _, _ in pairs}
    assert {"ls", "find", "grep", "sed", "python", "git"} <= kinds
    edited = False
    checked = 0
    for cmd, rc, out in pairs:
        if cmd.startswith("sed -i"):
            edited = True
        if cmd.startswith("find "):
            # rerun on the installed tree: the copy holds the same .py files
            real = subprocess.run(["bash", "-c", cmd], cwd=root, capture_output=True, text=True,
                                  env={"LC_ALL": "C", "PATH": "/usr/bin:/bin"})
            assert out == real.stdout and rc == real.returncode, cmd
            checked += 1
        g = re.fullmatch(r"grep -rn '([^']+)' --include='\*\.py' \. \| sort \| head -n (\d+)", cmd)
        if g and not edited:
            # recompute the matches from the installed files, sorted bytewise as LC_ALL=C sort does
            pattern, limit = g.group(1), int(g.group(2))
            hits = []
            for f in sorted((root / SOURCE).rglob("*.py")):
                if "__pycache__" in f.parts:
                    continue
                rel = f.relative_to(root)
                for n, line in enumerate(f.read_text().splitlines(), 1):
                    if pattern in line:
                        hits.append(f"./{rel}:{n}:{line}".encode())
            assert out == "".join(h.decode() + "\n" for h in sorted(hits)[:limit]), cmd
            checked += 1
        m = re.fullmatch(r"sed -n '(\d+),(\d+)p' (\S+)", cmd)
        if m and not edited:
            a, b, path = int(m.group(1)), int(m.group(2)), m.group(3)
            lines = (root / path).read_text().splitlines(keepends=True)
            assert out == "".join(lines[a - 1:b])
            checked += 1
        if cmd.startswith("cat ") and not edited:
            assert out == (root / cmd.split()[1]).read_text()
            checked += 1
    assert checked >= 3
    diff = next(out for cmd, _, out in pairs if cmd == "git diff")
    sed = next(cmd for cmd, _, _ in pairs if cmd.startswith("sed -i"))
    old, new = re.search(r"s/\\b(\w+)\\b/(\w+)/g", sed).groups()
    path = sed.split()[-1]
    assert diff.startswith(f"diff --git a/{path} b/{path}")
    minus = [ln[1:] for ln in diff.splitlines() if ln.startswith("-") and not ln.startswith("---")]
    plus = [ln[1:] for ln in diff.splitlines() if ln.startswith("+") and not ln.startswith("+++")]
    original = (root / path).read_text().splitlines()
    assert minus and all(ln in original for ln in minus)
    assert all(re.sub(rf"\b{old}\b", new, m_) == p_ for m_, p_ in zip(minus, plus))
    compiled = next(out for cmd, _, out in pairs if "py_compile" in cmd)
    assert compiled == "compiled OK\n"


def test_cache_round_trip(tmp_path):
    first = agent_sessions([SOURCE], 1, 5, tmp_path, PARAMS)
    files = sorted(tmp_path.glob("*.npz"))
    assert [f.stem for f in files] == [cache_key(SOURCE, 5, 0, PARAMS)]
    mtime = files[0].stat().st_mtime_ns
    second = agent_sessions([SOURCE], 1, 5, tmp_path, PARAMS)
    assert files[0].stat().st_mtime_ns == mtime  # read back, not regenerated
    (s1, t1), (s2, t2) = first[0], second[0]
    assert s1 == s2 and np.array_equal(t1.tokens, t2.tokens) and np.array_equal(t1.reply_start, t2.reply_start)
    # each reply is the assistant text plus EOS, and the prompt ends with the assistant header
    assert t1.num_replies == sum(t.role == "assistant" for t in s1.turns)
    assert (t1.tokens[t1.reply_end - 1] == 1).all() and (t1.tokens[t1.reply_start - 2] == 128804).all()


def test_unknown_source_is_refused():
    assert SOURCE in available_sources()
    with pytest.raises(SlackTierError):
        available_sources(["no_such_tree_here"])
