"""Compiled RESP reply scanning for the Redis tier's page reads (one node's pipelined MGET replies).

A node's replies arrive into one byte buffer (`recv_into`, no per-value Python
object). `scan_mget_replies` walks the replies received so far: per MGET an
array header `*k`, then k bulk strings `$4100` + data, or `$-1` (no such key);
or an error line (`-MOVED 3999 127.0.0.1:7002`, `-NOPERM ...`). It records
each value's offset and length and each command's outcome, and stops at the
first incomplete reply, to be called again when more bytes arrive. The
caller lands the pages (`land_values`, called by _wire.py).

Worked example: replies "*2\\r\\n$4100\\r\\n<4100 B>\\r\\n$-1\\r\\n" for one MGET of two keys
-> value 0 at offset 11, length 4100; value 1 length -1; command 0 status OK.
"""

from __future__ import annotations

import ctypes

import numpy as np
from numba import njit

from slacktier.store.redis.keys import VALUE_BYTES   # a stored value: the page, then its CRC32C
from slacktier.tables.layout import PAGE_BYTES

# libc's memmove, called from compiled code: a numba slice copy of uint8 measured several times slower than
# memmove over a batch's pages.
_memmove = ctypes.CDLL(None).memmove
_memmove.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
_memmove.restype = ctypes.c_void_p

OK, ERROR, MALFORMED = 0, 1, 2
CR, LF = 13, 10


@njit(nogil=True, cache=True)
def _line_int(buf: np.ndarray, p: int, end: int) -> tuple[int, int]:
    """The integer after a type byte at p, up to CRLF: (value, position after the CRLF), or (0, -1) if the line
    is not complete yet, or (0, -2) if it is not an integer."""
    q = p + 1
    neg = False
    if q < end and buf[q] == 45:  # '-'
        neg = True
        q += 1
    value = 0
    digits = 0
    while q < end and buf[q] != CR:
        c = buf[q]
        if c < 48 or c > 57:
            return 0, -2
        value = value * 10 + (c - 48)
        digits += 1
        q += 1
    if q + 1 >= end:
        return 0, -1
    if buf[q + 1] != LF or digits == 0:
        return 0, -2
    return (-value if neg else value), q + 2


@njit(nogil=True, cache=True)
def scan_mget_replies(buf: np.ndarray, start: int, end: int, first_cmd: int, keys: np.ndarray,
                      value_base: np.ndarray, value_off: np.ndarray, value_len: np.ndarray,
                      status: np.ndarray, error_at: np.ndarray) -> tuple[int, int]:
    """Scan complete replies in buf[start:end] for commands first_cmd, first_cmd + 1, ...

    keys[c]: keys of command c; value_base[c]: index of its first value in value_off / value_len.
    Fills value_off / value_len (-1: nil) for OK commands, status[c] (OK, ERROR, MALFORMED) and, for ERROR,
    error_at[c] (offset of the '-' line). Returns (position after the last complete reply, commands done)."""
    p = start
    c = first_cmd
    n_cmd = keys.shape[0]
    while c < n_cmd and p < end:
        t = buf[p]
        if t == 45:  # '-': an error reply
            q = p + 1
            while q + 1 < end and not (buf[q] == CR and buf[q + 1] == LF):
                q += 1
            if q + 1 >= end:
                break
            status[c] = ERROR
            error_at[c] = p
            p = q + 2
            c += 1
            continue
        if t != 42:  # not '*'
            status[c] = MALFORMED
            return p, c + 1 - first_cmd
        k, q = _line_int(buf, p, end)
        if q == -1:
            break
        if q == -2 or k != keys[c]:
            status[c] = MALFORMED
            return p, c + 1 - first_cmd
        base = value_base[c]
        complete = True
        for i in range(k):
            if q >= end:
                complete = False
                break
            if buf[q] != 36:  # '$'
                status[c] = MALFORMED
                return p, c + 1 - first_cmd
            n, r = _line_int(buf, q, end)
            if r == -1:
                complete = False
                break
            if r == -2:
                status[c] = MALFORMED
                return p, c + 1 - first_cmd
            if n < 0:
                value_off[base + i] = 0
                value_len[base + i] = -1
                q = r
                continue
            if r + n + 2 > end:
                complete = False
                break
            value_off[base + i] = r
            value_len[base + i] = n
            q = r + n + 2
        if not complete:
            break
        status[c] = OK
        p = q
        c += 1
    return p, c - first_cmd


@njit(nogil=True, cache=True)
def _digits(x: int) -> int:
    n = 1
    while x >= 10:
        x //= 10
        n += 1
    return n


@njit(nogil=True, cache=True)
def _put_int(out: np.ndarray, p: int, x: int) -> int:
    n = _digits(x)
    for i in range(n - 1, -1, -1):
        out[p + i] = 48 + x % 10
        x //= 10
    return p + n


@njit(nogil=True, cache=True)
def mget_bytes_bound(head_off: np.ndarray, groups: np.ndarray, keys: np.ndarray) -> int:
    """An upper bound on `pack_mgets`' output (20 digits per page number)."""
    total = 0
    for c in range(groups.shape[0]):
        h = head_off[groups[c] + 1] - head_off[groups[c]]
        total += 32 + keys[c] * (h + 20 + 16)
    return total


@njit(nogil=True, cache=True)
def pack_mgets(heads: np.ndarray, head_off: np.ndarray, groups: np.ndarray, keys: np.ndarray, pages: np.ndarray,
               out: np.ndarray) -> int:
    """RESP commands "MGET <head><page> ..." for each command c (keys[c] pages of group groups[c], in order in
    `pages`), written into `out`; returns the bytes written. Same bytes as redis-py's and hiredis' packing (tested)."""
    p = 0
    j = 0
    for c in range(groups.shape[0]):
        out[p] = 42  # '*'
        p = _put_int(out, p + 1, keys[c] + 1)
        out[p] = CR
        out[p + 1] = LF
        for b in b"$4\r\nMGET\r\n":
            out[p + 2] = b
            p += 1
        p += 2
        h0, h1 = head_off[groups[c]], head_off[groups[c] + 1]
        for _ in range(keys[c]):
            page = pages[j]
            j += 1
            out[p] = 36  # '$'
            p = _put_int(out, p + 1, (h1 - h0) + _digits(page))
            out[p] = CR
            out[p + 1] = LF
            p += 2
            out[p:p + (h1 - h0)] = heads[h0:h1]
            p = _put_int(out, p + (h1 - h0), page)
            out[p] = CR
            out[p + 1] = LF
            p += 2
    return p


@njit(nogil=True)   # not cached: it calls libc through a pointer that differs per process (compiled by warm())
def land_values(buf: np.ndarray, done: int, keys: np.ndarray, base: np.ndarray, off: np.ndarray,
                length: np.ndarray, status: np.ndarray, position: np.ndarray, pages: np.ndarray, buffer: np.ndarray,
                stored: np.ndarray, have: np.ndarray, bad: np.ndarray) -> int:
    """For the first `done` commands whose status is OK: copy each whole-page value's 4,096 bytes into
    pages[buffer[position[v]]], its stored CRC32C into stored[position[v]], and set have[...]; values that are
    not whole pages (nil, wrong size) go to `bad` (value indices). Returns how many are bad."""
    src = buf.ctypes.data
    dst = pages.ctypes.data
    row = pages.shape[1]
    nbad = 0
    for c in range(done):
        if status[c] != OK:
            continue
        for v in range(base[c], base[c] + keys[c]):
            if length[v] != VALUE_BYTES:
                bad[nbad] = v
                nbad += 1
                continue
            i = position[v]
            o = off[v]
            _memmove(dst + buffer[i] * row, src + o, PAGE_BYTES)
            c = o + PAGE_BYTES
            stored[i] = (np.uint32(buf[c]) | (np.uint32(buf[c + 1]) << 8) |
                         (np.uint32(buf[c + 2]) << 16) | (np.uint32(buf[c + 3]) << 24))
            have[i] = True
    return nbad


def warm() -> None:
    """Compile the scan (or load it from numba's cache) on a two-value reply."""
    buf = np.frombuffer(b"*2\r\n$1\r\nx\r\n$-1\r\n", dtype=np.uint8).copy()   # writable, as a link's buffer
    keys, base = np.array([2], np.int64), np.zeros(1, np.int64)
    off, length = np.zeros(2, np.int64), np.zeros(2, np.int64)
    status, error_at = np.zeros(1, np.int8), np.zeros(1, np.int64)
    end, done = scan_mget_replies(buf, 0, buf.shape[0], 0, keys, base, off, length, status, error_at)
    assert (end, done, int(length[0]), int(length[1])) == (buf.shape[0], 1, 1, -1)
    heads, head_off = np.frombuffer(b"{t}:", np.uint8).copy(), np.array([0, 4], np.int64)
    out = np.empty(mget_bytes_bound(head_off, np.zeros(1, np.int64), keys), np.uint8)
    n = pack_mgets(heads, head_off, np.zeros(1, np.int64), keys, np.array([7, 12], np.int64), out)
    assert out[:n].tobytes() == b"*3\r\n$4\r\nMGET\r\n$5\r\n{t}:7\r\n$6\r\n{t}:12\r\n"
    page = np.zeros((1, 4096), np.uint8)
    land_values(buf, 1, keys, base, off, length, status, np.zeros(2, np.int64), page, np.zeros(1, np.int32),
                np.zeros(1, np.uint32), np.zeros(1, np.bool_), np.zeros(2, np.int64))
