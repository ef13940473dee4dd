"""Sessions as Qwen3.8 tokens: Qwen's chat format (ChatML), tokenized with Qwen's own tokenizer.

PLE (Qwen3.8's n-gram table) hashes Qwen token ids, so PLE traffic is the same
sessions rendered here rather than the DeepSeek stream of `sessions`. The turns
follow Qwen3's chat template (the Qwen3.5/3.6 family keeps its roles and
special tokens):

    <|im_start|>system\\n{system}<|im_end|>\\n
    <|im_start|>user\\n{user}<|im_end|>\\n
    <|im_start|>assistant\\n<think>\\n{reasoning}\\n</think>\\n\\n{reply}<|im_end|>\\n
    <|im_start|>user\\n<tool_response>\\n{tool output}\\n</tool_response><|im_end|>\\n

Consecutive tool turns share one user block (one `<tool_response>` each), as in
the template. A tool call is `\\n<tool_call>\\n{"name": NAME, "arguments": ARGS}\\n</tool_call>`
after the reply text (ARGS inserted as the source stored it: JSON text or a
command), Qwen3's form. Decisions where the template and a replayed stream differ:

- A turn without reasoning keeps the empty `<think>\\n\\n</think>\\n\\n`, the
  non-thinking generation prompt; with reasoning the decode span starts after
  `<think>\\n`, the thinking generation prompt. Reasoning stays in the history
  (the template drops it from earlier turns) so a session is one token stream,
  as in the DeepSeek rendering.
- The reply's decode span ends with `<|im_end|>` (248,046), Qwen's end of turn.
  `<|im_end|>` is not the PLE's EOS: Qwen3.8's n-gram module reads
  `text_config.eos_token_id`, `<|endoftext|>` (248,044), which a chat stream
  never contains, so n-grams run across turns and only the session start reads
  as EOS (see tables.ple_hash).

Text between two special tokens is encoded as one piece (`user\\n` with the
message), which gives the ids of encoding the whole rendered string; a reply's
decode start also splits a piece, so the reply's ids are the ones a model
would emit after its prompt.
"""

from __future__ import annotations

from typing import Iterable

import numpy as np

from slacktier.workloads.sessions import Session, TokenSession

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
THINK_START = "<think>"
THINK_END = "</think>"
TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
TOOL_RESPONSE_START = "<tool_response>"
TOOL_RESPONSE_END = "</tool_response>"
SPECIAL_TOKENS = (IM_START, IM_END, THINK_START, THINK_END, TOOL_CALL_START, TOOL_CALL_END, TOOL_RESPONSE_START,
                  TOOL_RESPONSE_END)


def _segments(session: Session) -> list[tuple[str, str | None]]:
    """The session as ("special", name), ("text", str), ("start", None), ("end", None) pieces, in order."""
    seg: list[tuple[str, str | None]] = []
    turns = session.turns
    for i, turn in enumerate(turns):
        if turn.role == "tool":
            if i == 0 or turns[i - 1].role != "tool":
                seg += [("special", IM_START), ("text", "user")]
            seg += [("text", "\n"), ("special", TOOL_RESPONSE_START), ("text", "\n" + turn.text + "\n"),
                    ("special", TOOL_RESPONSE_END)]
            if i + 1 == len(turns) or turns[i + 1].role != "tool":
                seg += [("special", IM_END), ("text", "\n")]
        elif turn.role in ("system", "user"):
            seg += [("special", IM_START), ("text", f"{turn.role}\n{turn.text}"), ("special", IM_END), ("text", "\n")]
        else:
            seg += [("special", IM_START), ("text", "assistant\n"), ("special", THINK_START)]
            if turn.reasoning:
                seg += [("text", "\n"), ("start", None), ("text", turn.reasoning + "\n"), ("special", THINK_END),
                        ("text", "\n\n")]
            else:
                seg += [("text", "\n\n"), ("special", THINK_END), ("text", "\n\n"), ("start", None)]
            seg.append(("text", turn.text))
            for k, call in enumerate(turn.tool_calls):
                if k > 0 or turn.text:
                    seg.append(("text", "\n"))
                seg += [("special", TOOL_CALL_START),
                        ("text", f'\n{{"name": "{call.name}", "arguments": {call.arguments or "{}"}}}\n'),
                        ("special", TOOL_CALL_END)]
            seg += [("special", IM_END), ("end", None), ("text", "\n")]
    if len(seg) >= 2 and seg[-2][0] == "end":
        seg.pop()   # the newline after the last reply belongs to a next turn's prompt; the stream ends on the reply
    return seg


def render_qwen_text(session: Session) -> str:
    """The whole session as one string in Qwen's chat format (for reading and checking)."""
    return "".join(v for k, v in _segments(session) if k in ("special", "text"))


def render_qwen_session(session: Session, tokenizer=None) -> TokenSession:
    """Tokenize a session in Qwen's chat format with Qwen's tokenizer: one reply span per assistant turn.

    Worked example: user "Hi", assistant "Hello" -> 15 ids; the prompt `<|im_start|>user\\nHi<|im_end|>\\n
    <|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n` is ids [0, 13) and the reply `Hello<|im_end|>` ids
    [13, 15) = [9419, 248046].
    """
    from slacktier.tables.tokenizer import load_qwen_tokenizer, qwen_special_id

    tok = load_qwen_tokenizer() if tokenizer is None else tokenizer
    special = {name: qwen_special_id(tok, name) for name in SPECIAL_TOKENS}
    out: list[int] = []
    starts: list[int] = []
    ends: list[int] = []
    pending: list[str] = []

    def flush() -> None:
        if pending:
            out.extend(tok.encode("".join(pending)))
            pending.clear()

    for kind, value in _segments(session):
        if kind == "text":
            pending.append(value)
            continue
        flush()
        if kind == "special":
            out.append(special[value])
        elif kind == "start":
            starts.append(len(out))
        else:
            ends.append(len(out))
    flush()
    return TokenSession(session.session_id, session.source, session.kind, np.asarray(out, dtype=np.int32),
                        np.asarray(starts, dtype=np.int64), np.asarray(ends, dtype=np.int64))


def render_qwen_sessions(sessions: Iterable[Session], tokenizer=None) -> list[TokenSession]:
    """render_qwen_session over many sessions."""
    return [render_qwen_session(s, tokenizer) for s in sessions]
