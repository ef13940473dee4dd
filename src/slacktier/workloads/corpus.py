"""The two workloads as token sessions, split by source: `load_workload("agent" | "chat", config)`.

Agent traffic comes from published trajectories of real coding agents
(`agent_source="published"`, `trajectories`): the vendored sample, or a whole
downloaded set with `agent_dir`; this is the default. The vendored sample
holds 308 sessions over 305 repositories (data/agent/SOURCES.md); split by
repository it gives 155 fit and 153 holdout sessions, enough for B = 128.
Rendering all of it costs seconds of tokenizer time, once: the rendering is
kept in `cache_dir` under a digest of the files. Template sessions
(`agent_source="template"`: real tool output around fixed THOUGHT lines, far
more repetitive than a real agent) remain as an explicit synthetic option;
every figure taken on template traffic says so.

Token ids: `tokens="deepseek"` (the DeepSeek-V4 tokenizer, Engram traffic) or
`tokens="qwen"` (Qwen's chat format and tokenizer, `qwen_sessions`: PLE
traffic). Which sessions, and where each is cut, is decided on the DeepSeek
rendering either way (`chat_max_tokens`, `agent_max_tokens` count DeepSeek
tokens), so both tokenizations replay the same turns of the same sessions.
"""

from __future__ import annotations

import hashlib
import logging
import os
import pickle
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from slacktier.errors import ErrorKind, SlackTierError
from slacktier.workloads.agent import AgentParams, agent_sessions, available_sources
from slacktier.workloads.sessions import Session, TokenSession, render_session, truncate_turns
from slacktier.workloads.sharegpt import ParseStats, iter_chat_sessions
from slacktier.workloads.split import Split, split_by_source
from slacktier.workloads.trajectories import SAMPLE_DIR, LoadStats, load_trajectories, trajectory_files

log = logging.getLogger(__name__)

WORKLOADS = ("agent", "chat")
AGENT_SOURCES = ("published", "template")
TOKENIZERS = ("deepseek", "qwen")   # DeepSeek-V4 ids (Engram V4.1), Qwen3.8 ids (PLE)
DEFAULT_CACHE_DIR = Path("data/workloads")


@dataclass(frozen=True)
class CorpusConfig:
    """How many sessions of each workload, and from where."""

    agent_source: str = "published"  # "published": real trajectories; "template": synthetic (see module docstring)
    agent_dir: Path | None = None    # a downloaded trajectory set (None: the vendored sample)
    agent_max_tokens: int = 65536    # published sessions are cut to their replies that end within this
    agent_sources: tuple[str, ...] | None = None  # template only; None: every installed source in AGENT_SOURCES
    agent_sessions_per_source: int = 5
    agent_params: AgentParams = field(default_factory=AgentParams)
    chat_sessions: int = 192
    chat_min_replies: int = 2      # multi-turn conversations only
    chat_max_turns: int = 24
    chat_max_tokens: int = 32768   # longer conversations are skipped (counted)
    holdout_share: float = 0.5
    seed: int = 0
    cache_dir: Path | None = DEFAULT_CACHE_DIR
    tokens: str = "deepseek"       # "deepseek" (Engram traffic) or "qwen" (PLE traffic), see the module docstring

    def __post_init__(self) -> None:
        if self.tokens not in TOKENIZERS:
            raise SlackTierError(ErrorKind.BAD_INPUT, f"unknown tokenizer {self.tokens!r}",
                                 fix=f"use one of {TOKENIZERS}")
        if self.agent_source not in AGENT_SOURCES:
            raise SlackTierError(ErrorKind.BAD_INPUT, f"unknown agent source {self.agent_source!r}",
                                 fix=f"use one of {AGENT_SOURCES}")
        if self.agent_sessions_per_source < 1 or self.chat_sessions < 2 or not 0 < self.holdout_share < 1:
            raise SlackTierError(ErrorKind.BAD_INPUT, f"bad corpus config {self}",
                                 fix="agent_sessions_per_source >= 1, chat_sessions >= 2, 0 < holdout_share < 1")


def chat_token_sessions(n_sessions: int, min_replies: int = 2, max_turns: int = 24, max_tokens: int = 32768,
                        stats: ParseStats | None = None, tokens: str = "deepseek") -> list[TokenSession]:
    """The first `n_sessions` ShareGPT conversations (file order) with >= min_replies replies and <= max_tokens
    DeepSeek tokens, as `tokens` ids."""
    from slacktier.tables.tokenizer import load_deepseek_tokenizer

    tok = load_deepseek_tokenizer()
    stats = stats if stats is not None else ParseStats()
    out: list[tuple[Session, TokenSession]] = []
    for session in iter_chat_sessions(min_replies=min_replies, stats=stats):
        session = truncate_turns(session, max_turns)
        if sum(t.role == "assistant" for t in session.turns) < min_replies:
            stats.skip("too_few_replies_after_cut")
            continue
        ts = render_session(session, tok)
        if ts.num_tokens > max_tokens:
            stats.skip("too_long")
            continue
        out.append((session, ts))
        if len(out) == n_sessions:
            break
    if len(out) < n_sessions:
        raise SlackTierError(ErrorKind.MISSING, f"ShareGPT gave only {len(out)} of {n_sessions} sessions",
                             fix="ask for fewer sessions or relax min_replies / max_tokens")
    if stats.skipped:
        log.info("ShareGPT sessions skipped: %s", stats.skipped)
    return as_tokens(out, tokens)


def clip_to_tokens(ts: TokenSession, max_tokens: int) -> TokenSession | None:
    """The session cut after its last reply that ends within `max_tokens` (None if even the first does not)."""
    k = int(np.searchsorted(ts.reply_end, max_tokens, side="right"))
    if k == 0:
        return None
    if k == ts.num_replies and ts.num_tokens <= max_tokens:
        return ts
    end = int(ts.reply_end[k - 1])
    return TokenSession(ts.session_id, ts.source, ts.kind, ts.tokens[:end].copy(), ts.reply_start[:k].copy(),
                        ts.reply_end[:k].copy())


def keep_replies(ts: TokenSession, replies: int) -> TokenSession:
    """The session cut after its first `replies` replies (all of it when it has no more)."""
    if replies >= ts.num_replies:
        return ts
    if replies < 1:
        raise SlackTierError(ErrorKind.BAD_INPUT, f"session {ts.session_id}: keep {replies} replies",
                             fix="keep at least one reply")
    end = int(ts.reply_end[replies - 1])
    return TokenSession(ts.session_id, ts.source, ts.kind, ts.tokens[:end].copy(),
                        ts.reply_start[:replies].copy(), ts.reply_end[:replies].copy())


def as_tokens(pairs: list[tuple[Session, TokenSession]], tokens: str) -> list[TokenSession]:
    """Token sessions in `tokens` ids: the DeepSeek ones as given, or each Session rendered in Qwen's format and
    cut to as many replies as its DeepSeek rendering kept."""
    if tokens == "deepseek":
        return [ts for _, ts in pairs]
    if tokens != "qwen":
        raise SlackTierError(ErrorKind.BAD_INPUT, f"unknown tokenizer {tokens!r}", fix=f"use one of {TOKENIZERS}")
    from slacktier.tables.tokenizer import load_qwen_tokenizer
    from slacktier.workloads.qwen_sessions import render_qwen_session

    tok = load_qwen_tokenizer()
    return [keep_replies(render_qwen_session(s, tok), ts.num_replies) for s, ts in pairs]


#: bump when rendering or clipping changes, so older cached renderings are not reused
PUBLISHED_CACHE_VERSION = 1


def published_cache_key(config: CorpusConfig) -> str:
    """A digest of the trajectory files (names and bytes) and of how they are rendered and clipped."""
    root = Path(config.agent_dir) if config.agent_dir is not None else SAMPLE_DIR
    h = hashlib.sha256(f"{PUBLISHED_CACHE_VERSION}|{config.agent_max_tokens}".encode())
    for path in trajectory_files(root):
        h.update(str(path.relative_to(root)).encode() + b"\0" + hashlib.sha256(path.read_bytes()).digest())
    return h.hexdigest()[:20]


def published_token_sessions(config: CorpusConfig, stats: LoadStats | None = None) -> list[TokenSession]:
    """Published agent trajectories (vendored sample or `config.agent_dir`) as `config.tokens` sessions, clipped.

    Rendered once with the DeepSeek tokenizer (seconds for the vendored sample) and kept in `config.cache_dir`
    under a digest of the files (`published_cache_key`); a changed file is a new key."""
    stats = stats if stats is not None else LoadStats()
    cache = None
    if config.cache_dir is not None:
        cache = Path(config.cache_dir) / f"published-{published_cache_key(config)}.pkl"
        if cache.exists():
            with cache.open("rb") as f:   # written by this function, below
                out, skipped = pickle.load(f)
            stats.skipped.extend(skipped)
            return as_tokens(out, config.tokens)
    from slacktier.tables.tokenizer import load_deepseek_tokenizer

    tok = load_deepseek_tokenizer()
    out = []
    for session in load_trajectories(config.agent_dir, stats):
        ts = clip_to_tokens(render_session(session, tok), config.agent_max_tokens)
        if ts is not None:
            out.append((session, ts))
    if stats.skipped:
        log.warning("agent trajectories: %d records skipped: %s", len(stats.skipped), stats.skipped[:5])
    if cache is not None:
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_suffix(".tmp")
        with tmp.open("wb") as f:
            pickle.dump((out, list(stats.skipped)), f)
        os.replace(tmp, cache)
    return as_tokens(out, config.tokens)


def agent_token_sessions(config: CorpusConfig, progress: bool = False) -> list[TokenSession]:
    """Agent sessions: published trajectories by default, template sessions when asked for."""
    if config.agent_source == "published":
        return published_token_sessions(config)
    sources = available_sources(config.agent_sources)
    pairs = agent_sessions(sources, config.agent_sessions_per_source, config.seed, config.cache_dir,
                           config.agent_params, progress=progress)
    return as_tokens(pairs, config.tokens)


def load_workload(name: str, config: CorpusConfig = CorpusConfig(), progress: bool = False) -> Split[TokenSession]:
    """The workload's token sessions (`config.tokens` ids) split by source into fit and holdout."""
    if name == "agent":
        sessions = agent_token_sessions(config, progress)
    elif name == "chat":
        sessions = chat_token_sessions(config.chat_sessions, config.chat_min_replies, config.chat_max_turns,
                                       config.chat_max_tokens, tokens=config.tokens)
    else:
        raise SlackTierError(ErrorKind.BAD_INPUT, f"unknown workload {name!r}", fix=f"use one of {WORKLOADS}")
    return split_by_source(sessions, holdout_share=config.holdout_share, seed=config.seed)
