"""The compiled RESP scan of MGET replies (store/redis/_resp.py), against hiredis' own parser, fed in every split."""

from __future__ import annotations

import hiredis
import numpy as np
import pytest

from slacktier.store.redis import _resp


def _scan_all(data: bytes, keys: list[int], chunk: int):
    """Feed `data` `chunk` bytes at a time, scanning after each, as a link does."""
    buf = np.zeros(len(data) + 1, np.uint8)
    k = np.array(keys, np.int64)
    base = np.zeros(len(keys), np.int64)
    base[1:] = np.cumsum(k)[:-1]
    off, length = np.zeros(int(k.sum()), np.int64), np.zeros(int(k.sum()), np.int64)
    status, error_at = np.full(len(keys), -1, np.int8), np.zeros(len(keys), np.int64)
    got = scanned = done = 0
    while got < len(data):
        n = min(chunk, len(data) - got)
        buf[got:got + n] = np.frombuffer(data[got:got + n], np.uint8)
        got += n
        scanned, d = _resp.scan_mget_replies(buf, scanned, got, done, k, base, off, length, status, error_at)
        done += d
    return buf, off, length, status, error_at, done, scanned


def _reply(values: list[bytes | None]) -> bytes:
    out = [b"*%d\r\n" % len(values)]
    for v in values:
        out.append(b"$-1\r\n" if v is None else b"$%d\r\n%s\r\n" % (len(v), v))
    return b"".join(out)


@pytest.mark.parametrize("chunk", [1, 7, 4111, 1 << 20])
def test_scan_finds_every_value_nil_and_error_in_any_split(chunk):
    rng = np.random.default_rng(chunk)
    pages = [rng.integers(0, 256, 4100, dtype=np.uint8).tobytes() for _ in range(5)]
    replies = [_reply(pages[:3]), b"-MOVED 3999 127.0.0.1:7002\r\n", _reply([pages[3], None, b"short", pages[4]])]
    data = b"".join(replies)
    buf, off, length, status, error_at, done, scanned = _scan_all(data, [3, 2, 4], chunk)
    assert done == 3 and scanned == len(data)
    assert status.tolist() == [_resp.OK, _resp.ERROR, _resp.OK]
    assert bytes(buf[error_at[1]:error_at[1] + 6]) == b"-MOVED"
    want = hiredis.Reader()
    want.feed(data)
    parsed = [want.gets() for _ in range(3)]
    got_values = []
    for i in (0, 1, 2, 5, 6, 7, 8):   # values of commands 0 and 2 (command 1's two, 3 and 4, are never filled)
        got_values.append(None if length[i] < 0 else bytes(buf[off[i]:off[i] + length[i]]))
    assert got_values == parsed[0] + parsed[2]


def test_an_incomplete_reply_is_left_for_later_and_garbage_is_malformed():
    page = bytes(range(256)) * 16 + b"abcd"
    data = _reply([page, page])
    buf, off, length, status, error_at, done, scanned = _scan_all(data[:-3], [2], 1 << 20)
    assert done == 0 and scanned == 0
    for bad in (b"+OK\r\n", b"*3\r\n", b"*2\r\n$x\r\n", b"*1\r\n:5\r\n"):
        buf, off, length, status, error_at, done, scanned = _scan_all(bad + b"\r\n" * 8, [2], 1 << 20)
        assert status[0] == _resp.MALFORMED, bad


def test_packed_mgets_equal_hiredis_packing():
    rng = np.random.default_rng(3)
    heads = [b"{st-%s:%d:%d:%d}:" % (b"ab" * int(rng.integers(1, 9)), int(rng.integers(0, 40)),
                                      int(rng.integers(0, 8)), g) for g in range(7)]
    data = np.frombuffer(b"".join(heads), np.uint8).copy()
    off = np.zeros(len(heads) + 1, np.int64)
    off[1:] = np.cumsum([len(h) for h in heads])
    groups = rng.integers(0, len(heads), 12).astype(np.int64)
    keys = rng.integers(1, 300, 12).astype(np.int64)
    pages = np.concatenate([rng.integers(0, 10 ** int(rng.integers(1, 11)), k) for k in keys]).astype(np.int64)
    pages[:3] = [0, 9, 10]
    out = np.empty(_resp.mget_bytes_bound(off, groups, keys), np.uint8)
    n = _resp.pack_mgets(data, off, groups, keys, pages, out)
    want, j = [], 0
    for g, k in zip(groups.tolist(), keys.tolist()):
        want.append(hiredis.pack_command(("MGET", *[b"%s%d" % (heads[g], p) for p in pages[j:j + k].tolist()])))
        j += k
    assert out[:n].tobytes() == b"".join(want)
