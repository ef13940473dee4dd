"""The n-gram hash pieces the Engram and PLE hashers share: primes, the compiled rolling hash, input checks.

Both hashers map a window of ids (shift 0 = the token, shift s = its s-th
predecessor) to one row id per (order, head) column:

    x_n = (w[0] * m[0]) ^ (w[1] * m[1]) ^ ... ^ (w[n-1] * m[n-1])     (int64, wrapping)
    ids[(n - 2) * H + h] = x_n % primes[(n - 2) * H + h] + offsets[(n - 2) * H + h]

for orders n = 2 .. len(w). Worked example (H = 1, w = [5, 7], m = [3, 11],
primes = [13], offsets = [0]): x_2 = 15 ^ 77 = 66 -> id 66 % 13 = 1.

What differs between the hashers (Engram's compressed token map and several
layers, PLE's EOS rule) is applied to the window before `rolling_hash` runs.

Kernel status codes: OK, BAD_TOKEN (a token id outside the map; the index is
the position, or -1 - k for history slot k) and BAD_HISTORY (a -1 after a real
token in a history row).
"""

from __future__ import annotations

import numba
import numpy as np

from slacktier.errors import ErrorKind, SlackTierError

OK, BAD_TOKEN, BAD_HISTORY = 0, 1, 2
# The float-reciprocal modulo is exact when x < 2**63 and p >= 2**13 (see mod_reciprocal).
FAST_MOD_MIN_PRIME = 1 << 13

# ---------------------------------------------------------------------------
# Deterministic primality (Miller-Rabin, witnesses exact for n < 3.3e24).

_MR_WITNESSES = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37)


def is_prime(n: int) -> bool:
    """Exact primality for n < 3.3e24: is_prime(16000057) -> True."""
    if n < 2:
        return False
    for p in _MR_WITNESSES:
        if n % p == 0:
            return n == p
    odd, twos = n - 1, 0
    while odd % 2 == 0:
        odd //= 2
        twos += 1
    for a in _MR_WITNESSES:
        x = pow(a, odd, n)
        if x in (1, n - 1):
            continue
        for _ in range(twos - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def next_prime(n: int) -> int:
    """Smallest prime strictly above n (sympy.nextprime's contract): next_prime(19999999) -> 20000003."""
    candidate = max(n + 1, 2)
    while not is_prime(candidate):
        candidate += 1
    return candidate


# ---------------------------------------------------------------------------
# Compiled pieces, inlined into each hasher's prefill and decode kernels.

@numba.njit(nogil=True, cache=True, inline="always")
def mod_reciprocal(x, x_float, p, inv_p):
    """x % p for 0 <= x < 2**63 and p >= 2**13 without a divide: q = trunc(float(x) * (1/p)) is
    off by at most one (three roundings of 2**-53 on a quotient below 2**50 stay under 3/8),
    and two branchless steps fix it."""
    r = x - np.int64(x_float * inv_p) * p
    r += p & (r >> 63)
    r -= p
    return r + (p & (r >> 63))


@numba.njit(nogil=True, cache=True, inline="always")
def mod_divide(x, p):
    """x % p for 0 <= x < 2**63 by an unsigned hardware divide (no sign fix-ups)."""
    return np.int64(np.uint64(x) % np.uint64(p))


@numba.njit(nogil=True, cache=True, inline="always")
def bucket(rolling, base, n_heads, primes, inv_primes, offsets, fast, out, out_base):
    """Columns base..base+n_heads: out[out_base + h] = rolling % primes[base + h] + offsets[base + h]."""
    if fast:
        rolling_float = np.float64(rolling)
        for head in range(n_heads):
            col = base + head
            out[out_base + head] = mod_reciprocal(rolling, rolling_float, primes[col], inv_primes[col]) + offsets[col]
    else:
        for head in range(n_heads):
            col = base + head
            out[out_base + head] = mod_divide(rolling, primes[col]) + offsets[col]


@numba.njit(nogil=True, cache=True, inline="always")
def rolling_hash(window, mult, mult_base, primes, inv_primes, offsets, col_base, fast, n_heads, out, out_row):
    """All (order, head) columns of one window: orders 2..n, n_heads columns each.

    window [n] int64 ids by shift; mult[mult_base + shift]; column c = col_base + (n - 2) * n_heads + h
    reads primes/inv_primes/offsets[c] and writes out[out_row + c].
    """
    n = window.shape[0]
    rolling = window[0] * mult[mult_base]
    for shift in range(1, n):
        rolling ^= window[shift] * mult[mult_base + shift]
        col = col_base + (shift - 1) * n_heads
        bucket(rolling, col, n_heads, primes, inv_primes, offsets, fast, out, out_row + col)


# ---------------------------------------------------------------------------
# Input checks around the kernels (plain Python).

def as_int64(name: str, values: np.ndarray, ndim: int) -> np.ndarray:
    """`values` as a C-contiguous int64 array of `ndim` dimensions (refused otherwise)."""
    array = np.ascontiguousarray(values, dtype=np.int64)
    if array.ndim != ndim:
        raise SlackTierError(ErrorKind.BAD_INPUT, f"{name} must have {ndim} dimension(s), got shape {array.shape}",
                             fix=f"pass {name} as a {ndim}-d integer array")
    return array


def prefill_history(history: np.ndarray | None, width: int) -> np.ndarray:
    """A prefill chunk's history [width] as int64: all -1 for None (the chunk starts the sequence), else checked."""
    if history is None:
        return np.full(width, -1, dtype=np.int64)
    hist = as_int64("history", history, 1)
    if hist.shape[0] != width:
        raise SlackTierError(ErrorKind.BAD_INPUT, f"history must hold {width} ids, got {hist.shape[0]}",
                             fix="pass the n-1 predecessors, oldest first, -1 before the sequence start")
    return hist


def decode_inputs(new_tokens: np.ndarray, history: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray]:
    """A decode step's new tokens [B] and history [B, width] as int64, shapes checked."""
    new = as_int64("new_tokens", new_tokens, 1)
    hist = as_int64("history", history, 2)
    if hist.shape != (new.shape[0], width):
        raise SlackTierError(ErrorKind.BAD_INPUT, f"history must be [{new.shape[0]}, {width}], got {list(hist.shape)}",
                             fix="one row of n-1 predecessors per new token, oldest first")
    return new, hist


def output(out: np.ndarray | None, shape: tuple[int, ...]) -> np.ndarray:
    """`out` checked to be a C-contiguous int64 array of `shape`, or a new one when None."""
    if out is None:
        return np.empty(shape, dtype=np.int64)
    if out.shape != shape or out.dtype != np.int64 or not out.flags.c_contiguous:
        raise SlackTierError(ErrorKind.BAD_INPUT, f"out must be a C-contiguous int64 array of shape {shape}",
                             fix="allocate it with new_output(n_tokens)")
    return out


def run_prefill(kernel, args: tuple, token_ids: np.ndarray, history: np.ndarray | None, width: int,
                checked_out, what: str, vocab: int) -> np.ndarray:
    """A hasher's prefill: the chunk's tokens and history checked, `kernel(ids, hist, *args, flat out)` run
    into `checked_out(n_tokens)`, its status raised as a SlackTierError; the output returned."""
    ids = as_int64("token_ids", token_ids, 1)
    hist = prefill_history(history, width)
    out = checked_out(ids.shape[0])
    status, index = kernel(ids, hist, *args, out.reshape(-1))
    raise_for_status(status, index, what, vocab)
    return out


def raise_for_status(status: int, index: int, what: str, vocab: int) -> None:
    """Turn a kernel status code into a SlackTierError; OK passes."""
    if status == BAD_TOKEN:
        where = f"history slot {-1 - index}" if index < 0 else f"position {index}"
        raise SlackTierError(ErrorKind.BAD_INPUT, f"{what}: token id at {where} is outside 0..{vocab - 1}",
                             fix="pass raw token ids of the tokenizer the hasher was built for")
    if status == BAD_HISTORY:
        raise SlackTierError(ErrorKind.BAD_INPUT,
                             f"{what}: history row {index} has a -1 (before sequence start) after a real token",
                             fix="history is oldest first; -1 may only fill its oldest slots")


def next_history(history: np.ndarray | None, token_ids: np.ndarray, width: int) -> np.ndarray:
    """History row ([width] oldest first, -1 before start) after appending token_ids: [-1,-1,5] + [7] -> [-1,5,7]."""
    prior = np.full(width, -1, dtype=np.int64) if history is None else np.asarray(history, dtype=np.int64)
    joined = np.concatenate([prior, np.asarray(token_ids, dtype=np.int64).reshape(-1)])
    return joined[-width:].copy()
