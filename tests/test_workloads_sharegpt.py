"""ShareGPT parsing: every complete record of a truncated JSON array is recovered, nothing else."""

from __future__ import annotations

import io
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from slacktier.errors import SlackTierError
from slacktier.workloads.sharegpt import ParseStats, conversation_of, iter_chat_sessions, iter_json_array


def _records(n: int) -> list[dict]:
    texts = ['plain text', 'braces } { ] [ and "quotes" \\ backslash', 'unicode é漢字 🙂 <｜User｜>',
             'a,\n"b": [1, 2]}', '']
    return [{"id": f"conv{i // 2}_{i % 2}",
             "conversations": [{"from": "human", "value": texts[i % len(texts)] * (i % 3 + 1)},
                               {"from": "gpt", "value": texts[(i + 1) % len(texts)]}]}
            for i in range(n)]


def _file(records: list[dict], ensure_ascii: bool) -> tuple[str, list[int]]:
    """The array as the real file writes it, and the end offset of each record."""
    parts = ["[\n"]
    ends = []
    for i, r in enumerate(records):
        if i:
            parts.append(",\n")
        parts.append(json.dumps(r, indent=2, ensure_ascii=ensure_ascii))
        ends.append(len("".join(parts)))
    parts.append("\n]")
    return "".join(parts), ends


def _parse(text: str, chunk: int, binary: bool) -> tuple[list, ParseStats]:
    stats = ParseStats()
    stream = io.BytesIO(text.encode()) if binary else io.StringIO(text)
    return list(iter_json_array(stream, stats, chunk_chars=chunk)), stats


RECORDS = _records(9)


@pytest.mark.parametrize("ensure_ascii", [True, False])
@pytest.mark.parametrize("chunk", [1, 7, 64, 1 << 20])
def test_every_cut_point_recovers_exactly_the_complete_records(ensure_ascii, chunk):
    text, ends = _file(RECORDS, ensure_ascii)
    step = 1 if chunk == 7 else 13
    for cut in list(range(2, len(text), step)) + [ends[3] - 1, ends[3], ends[3] + 1]:
        got, stats = _parse(text[:cut], chunk, binary=False)
        expected = [r for r, e in zip(RECORDS, ends) if e <= cut]
        assert got == expected, cut
        assert not stats.closed


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_byte_cuts_inside_multibyte_characters(data):
    text, ends = _file(RECORDS, ensure_ascii=False)
    raw = text.encode()
    cut = data.draw(st.integers(2, len(raw) - 1))
    # cutting bytes can split a UTF-8 character: decode what a truncated download would hold
    truncated = raw[:cut].decode("utf-8", errors="ignore")
    got, _ = _parse(truncated, data.draw(st.sampled_from([3, 50, 4096])), binary=False)
    expected = [r for r, e in zip(RECORDS, ends) if e <= len(truncated)]
    assert got == expected


def test_closed_array_and_binary_stream():
    text, _ = _file(RECORDS, ensure_ascii=False)
    got, stats = _parse(text, 5, binary=True)
    assert got == RECORDS and stats.closed and stats.truncated_tail_chars == 0


def test_numbers_split_across_chunks_are_not_cut():
    got, _ = _parse("[1234567, 89, 1e10]", 3, binary=False)
    assert got == [1234567, 89, 1e10]
    got, _ = _parse("[1234567, 89", 3, binary=False)
    assert got == [1234567]  # the last number might go on: a truncated tail


def test_not_an_array_is_refused():
    with pytest.raises(SlackTierError):
        _parse('{"a": 1}', 8, binary=False)


def test_sessions_from_records_map_roles_and_sources():
    text, ends = _file(RECORDS, ensure_ascii=False)
    stats = ParseStats()
    sessions = list(iter_chat_sessions(io.StringIO(text[: ends[4] + 10]), stats=stats))
    assert len(sessions) == 5
    assert sessions[0].turns[0].role == "user" and sessions[0].turns[1].role == "assistant"
    assert sessions[0].source == sessions[1].source == "sharegpt:conv0"
    assert conversation_of("QWJhYvA_12") == "QWJhYvA" and conversation_of("abc") == "abc"


def test_the_shipped_file_is_truncated_and_parses():
    stats = ParseStats()
    n = sum(1 for _ in iter_chat_sessions(stats=stats))
    assert stats.truncated_tail_chars > 0 and not stats.closed
    assert stats.records > 17_000 and n == stats.records - sum(stats.skipped.values())
