"""DeepSeek-V4.1 Engram hashing, bit-exact with SGLang 0.5.23.

Each token t and its predecessors t-1, t-2, t-3 (compressed ids c_0..c_3, c_s the
s-th predecessor) give, per Engram layer l, 24 row ids: for order n = 2, 3, 4 the
rolling XOR  x_n = (c_0 * m[l,0]) ^ (c_1 * m[l,1]) ^ ... ^ (c_{n-1} * m[l,n-1])  is
bucketed by each of the order's 8 head primes, and the head's offset (exclusive
prefix sum of the layer's primes in (order, head) column order) is added:

    ids[t, l, (n - 2) * 8 + h] = x_n % primes[l][n - 2][h] + offsets[l][(n - 2) * 8 + h]

Look-back before the sequence start reads the compressed pad id (token 2 through
the compressed map). Worked example: the first token of a sequence hashes its
2-gram as (c_0 * m[l,0]) ^ (pad * m[l,1]).

Primes: one ascending search above engram_vocab_size - 1 per (layer, order),
drawn in (layer, order, head) order with a shared seen-set, so every one of the
48 V4.1 primes is distinct. Multipliers: 2 * default_rng(10007 * layer).integers(
0, (INT64_MAX // V) // 2, 4) + 1 with V the compressed vocab size; V4.1's values
are frozen below (numpy RNG streams may change) and tests re-derive them.

History convention (both entry points): a row of n - 1 raw token ids, oldest
first, -1 where the position is before the sequence start; the -1s must form a
prefix of the row (a refused row otherwise). Example: the third token of a
sequence (ids t0 t1 t2) has history [-1, t0, t1].
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import numba
import numpy as np

from slacktier.errors import ErrorKind, SlackTierError

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
# Frozen DeepSeek-V4.1 facts (tests re-derive every one of them).

V41_LAYER_IDS = (1, 14)
V41_MAX_NGRAM = 4
V41_N_HEADS = 8
V41_ENGRAM_VOCAB_SIZE = 16_000_000
V41_COMPRESSED_VOCAB = 99_092
V41_PAD_TOKEN_ID = 2
V41_ROWS = (384_006_168, 384_016_682)
# [layer][order - 2][head]
V41_PRIMES = (
    (
        (16000057, 16000079, 16000081, 16000097, 16000121, 16000129, 16000133, 16000183),
        (16000189, 16000207, 16000211, 16000253, 16000277, 16000289, 16000307, 16000321),
        (16000339, 16000381, 16000393, 16000399, 16000403, 16000409, 16000447, 16000463),
    ),
    (
        (16000477, 16000487, 16000499, 16000507, 16000511, 16000573, 16000609, 16000627),
        (16000667, 16000669, 16000693, 16000697, 16000711, 16000729, 16000759, 16000769),
        (16000781, 16000799, 16000813, 16000819, 16000841, 16000877, 16000879, 16000889),
    ),
)
# [layer][shift]
V41_MULTIPLIERS = (
    (76632096046245, 4839876093313, 35959672319349, 73987337458391),
    (67716810739261, 51510806800915, 30921347202721, 82619226485591),
)

_INT64_MAX = (1 << 63) - 1
# The float-reciprocal modulo is exact when x < 2**63 and p >= 2**13 (see _mod).
_FAST_MOD_MIN_PRIME = 1 << 13


def derive_engram_primes(layer_ids: tuple[int, ...], max_ngram: int, n_heads: int,
                         engram_vocab_size: int) -> tuple[tuple[tuple[int, ...], ...], ...]:
    """Primes [layer][order - 2][head]: per (layer, order) an ascending search from vocab_size - 1, shared seen-set."""
    seen: set[int] = set()
    primes = []
    for _ in layer_ids:
        per_order = []
        for _ in range(max_ngram - 1):
            current, heads = engram_vocab_size - 1, []
            for _ in range(n_heads):
                current = next_prime(current)
                while current in seen:
                    current = next_prime(current)
                seen.add(current)
                heads.append(current)
            per_order.append(tuple(heads))
        primes.append(tuple(per_order))
    return tuple(primes)


def derive_engram_multipliers(layer_ids: tuple[int, ...], max_ngram: int,
                              compressed_vocab: int) -> tuple[tuple[int, ...], ...]:
    """Odd multipliers [layer][shift] = 2 * default_rng(10007 * layer).integers(0, bound, n) + 1."""
    bound = max(1, (_INT64_MAX // compressed_vocab) // 2)
    rows = []
    for layer_id in layer_ids:
        draws = np.random.default_rng(10007 * layer_id).integers(0, bound, size=(max_ngram,), dtype=np.int64)
        rows.append(tuple(int(v) * 2 + 1 for v in draws))
    return tuple(rows)


@dataclass(frozen=True)
class EngramLayout:
    """Where each Engram hash column lands: primes, offsets, multipliers and rows per layer."""

    layer_ids: tuple[int, ...]
    max_ngram: int
    n_heads: int
    engram_vocab_size: int
    compressed_vocab: int
    pad_token_id: int
    primes: tuple[tuple[tuple[int, ...], ...], ...]      # [layer][order - 2][head]
    multipliers: tuple[tuple[int, ...], ...]             # [layer][shift]
    primes_array: np.ndarray = field(init=False, repr=False, compare=False)       # [L, C] int64
    offsets_array: np.ndarray = field(init=False, repr=False, compare=False)      # [L, C] int64
    multipliers_array: np.ndarray = field(init=False, repr=False, compare=False)  # [L, n] int64

    def __post_init__(self) -> None:
        n_layers, n_orders = len(self.layer_ids), self.max_ngram - 1
        if n_layers == 0 or self.max_ngram < 2 or self.n_heads < 1:
            raise SlackTierError(ErrorKind.BAD_INPUT,
                                 f"an Engram layout needs layers, max_ngram >= 2 and heads, got "
                                 f"{self.layer_ids}, {self.max_ngram}, {self.n_heads}",
                                 fix="use EngramLayout.v41() or EngramLayout.scaled(...)")
        shape_ok = (len(self.primes) == n_layers
                    and all(len(per) == n_orders and all(len(h) == self.n_heads for h in per)
                            for per in self.primes)
                    and len(self.multipliers) == n_layers
                    and all(len(m) == self.max_ngram for m in self.multipliers))
        if not shape_ok:
            raise SlackTierError(ErrorKind.BAD_INPUT, "Engram primes or multipliers have the wrong shape",
                                 fix="primes are [layer][order-2][head], multipliers [layer][shift]")
        flat = [p for per in self.primes for heads in per for p in heads]
        if len(set(flat)) != len(flat) or min(flat) < 2:
            raise SlackTierError(ErrorKind.BAD_INPUT, "Engram primes must be distinct and >= 2",
                                 fix="derive them with derive_engram_primes")
        bound = _INT64_MAX // self.compressed_vocab
        if any(m % 2 == 0 or not 0 < m < bound for row in self.multipliers for m in row):
            raise SlackTierError(ErrorKind.BAD_INPUT,
                                 "Engram multipliers must be odd and below INT64_MAX // compressed_vocab",
                                 fix="derive them with derive_engram_multipliers")
        primes = np.array([[p for heads in per for p in heads] for per in self.primes], dtype=np.int64)
        offsets = np.zeros_like(primes)
        offsets[:, 1:] = np.cumsum(primes[:, :-1], axis=1)
        for name, value in (("primes_array", primes), ("offsets_array", offsets),
                            ("multipliers_array", np.array(self.multipliers, dtype=np.int64))):
            value.setflags(write=False)
            object.__setattr__(self, name, value)

    @classmethod
    def v41(cls) -> EngramLayout:
        """DeepSeek-V4.1: layers (1, 14), orders 2..4, 8 heads, 384,006,168 and 384,016,682 rows."""
        return _v41_layout()

    @classmethod
    def scaled(cls, engram_vocab_size: int, layer_ids: tuple[int, ...] = V41_LAYER_IDS, n_heads: int = V41_N_HEADS,
               max_ngram: int = V41_MAX_NGRAM, compressed_vocab: int = V41_COMPRESSED_VOCAB,
               pad_token_id: int = V41_PAD_TOKEN_ID) -> EngramLayout:
        """The same hash over smaller (or other) tables: scaled(1000) gives ~24,000 rows per layer."""
        layer_ids = tuple(int(i) for i in layer_ids)
        return cls(layer_ids=layer_ids, max_ngram=max_ngram, n_heads=n_heads,
                   engram_vocab_size=engram_vocab_size, compressed_vocab=compressed_vocab,
                   pad_token_id=pad_token_id,
                   primes=derive_engram_primes(layer_ids, max_ngram, n_heads, engram_vocab_size),
                   multipliers=derive_engram_multipliers(layer_ids, max_ngram, compressed_vocab))

    @property
    def n_layers(self) -> int:
        """Number of Engram layers (2 in V4.1)."""
        return len(self.layer_ids)

    @property
    def n_columns(self) -> int:
        """Hash columns per layer: (max_ngram - 1) * n_heads = 24 in V4.1."""
        return (self.max_ngram - 1) * self.n_heads

    @property
    def rows_per_layer(self) -> tuple[int, ...]:
        """Rows of every layer's table: (384,006,168, 384,016,682) in V4.1."""
        return tuple(self.rows(i) for i in range(self.n_layers))

    def rows(self, layer_index: int) -> int:
        """Rows of one layer's table (sum of its primes): rows(0) -> 384,006,168 in V4.1."""
        return int(sum(p for heads in self.primes[layer_index] for p in heads))

    def column_bounds(self, layer_index: int) -> tuple[int, ...]:
        """Column c of a layer owns rows [b[c], b[c+1]); b[0] = 0, b[-1] = rows(layer_index)."""
        return (0, *(int(v) for v in np.cumsum(self.primes_array[layer_index])))


@functools.lru_cache(maxsize=1)
def _v41_layout() -> EngramLayout:
    return EngramLayout(layer_ids=V41_LAYER_IDS, max_ngram=V41_MAX_NGRAM, n_heads=V41_N_HEADS,
                        engram_vocab_size=V41_ENGRAM_VOCAB_SIZE, compressed_vocab=V41_COMPRESSED_VOCAB,
                        pad_token_id=V41_PAD_TOKEN_ID, primes=V41_PRIMES, multipliers=V41_MULTIPLIERS)


# ---------------------------------------------------------------------------
# Compiled hot loops. Status codes: 0 ok, 1 token id out of the map, 2 bad history row.

_OK, _BAD_TOKEN, _BAD_HISTORY = 0, 1, 2


@numba.njit(nogil=True, cache=True, inline="always")
def _mod_reciprocal(x, x_float, p, inv_p):
    """x % p for 0 <= x < 2**63 and p >= 2**13 without a divide: q = trunc(float(x) * (1/p)) is
    off by at most one (three roundings of 2**-53 on a quotient below 2**50 stay under 3/8),
    and two branchless steps fix it."""
    r = x - np.int64(x_float * inv_p) * p
    r += p & (r >> 63)
    r -= p
    return r + (p & (r >> 63))


@numba.njit(nogil=True, cache=True, inline="always")
def _mod_divide(x, p):
    """x % p for 0 <= x < 2**63 by an unsigned hardware divide (no sign fix-ups)."""
    return np.int64(np.uint64(x) % np.uint64(p))


@numba.njit(nogil=True, cache=True, inline="always")
def _bucket(rolling, base, n_heads, primes, inv_primes, offsets, fast, out, out_base):
    # Columns base..base+n_heads of one layer: out[out_base + h] = rolling % primes[base + h] + offsets[base + h]
    if fast:
        rolling_float = np.float64(rolling)
        for head in range(n_heads):
            col = base + head
            out[out_base + head] = _mod_reciprocal(rolling, rolling_float, primes[col], inv_primes[col]) + offsets[col]
    else:
        for head in range(n_heads):
            col = base + head
            out[out_base + head] = _mod_divide(rolling, primes[col]) + offsets[col]


@numba.njit(nogil=True, cache=True, inline="always")
def _hash_window(comp, mult, primes, inv_primes, offsets, fast, n_heads, out, row):
    # comp [n] compressed ids by shift; mult [L*n]; primes/inv_primes/offsets [L*C] flat; out [T*L*C] flat
    n = comp.shape[0]
    n_layers = mult.shape[0] // n
    n_cols = (n - 1) * n_heads
    for layer in range(n_layers):
        rolling = comp[0] * mult[layer * n]
        for shift in range(1, n):
            rolling ^= comp[shift] * mult[layer * n + shift]
            base = layer * n_cols + (shift - 1) * n_heads
            _bucket(rolling, base, n_heads, primes, inv_primes, offsets, fast, out, row * n_layers * n_cols + base)


@numba.njit(nogil=True, cache=True)
def _engram_prefill_kernel(ids, history, token_map, pad_id, mult, primes, inv_primes, offsets, fast, n_heads, out):
    # ids [T] raw; history [n-1] raw oldest first, -1 before start; out [T*L*C] flat view of [T, L, C].
    # Returns (status, index).
    n = history.shape[0] + 1
    vocab = token_map.shape[0]
    comp = np.empty(n, dtype=np.int64)
    started = False
    for k in range(n - 1):
        tok = history[k]
        if tok < 0:
            if started:
                return _BAD_HISTORY, k
            comp[n - 1 - k] = pad_id
        else:
            if tok >= vocab:
                return _BAD_TOKEN, -1 - k
            started = True
            comp[n - 1 - k] = token_map[tok]
    for t in range(ids.shape[0]):
        tok = ids[t]
        if tok < 0 or tok >= vocab:
            return _BAD_TOKEN, t
        comp[0] = token_map[tok]
        _hash_window(comp, mult, primes, inv_primes, offsets, fast, n_heads, out, t)
        for shift in range(n - 1, 0, -1):
            comp[shift] = comp[shift - 1]
    return _OK, 0


@numba.njit(nogil=True, cache=True)
def _engram_decode_kernel(new_tokens, history, token_map, pad_id, mult, primes, inv_primes, offsets, fast, n_heads, out):
    # new_tokens [B] raw; history [B, n-1] raw oldest first, -1 before start; out [B*L*C] flat view of [B, L, C].
    n = history.shape[1] + 1
    vocab = token_map.shape[0]
    comp = np.empty(n, dtype=np.int64)
    for b in range(new_tokens.shape[0]):
        tok = new_tokens[b]
        if tok < 0 or tok >= vocab:
            return _BAD_TOKEN, b
        comp[0] = token_map[tok]
        started = False
        for k in range(n - 1):
            prev = history[b, k]
            if prev < 0:
                if started:
                    return _BAD_HISTORY, b
                comp[n - 1 - k] = pad_id
            else:
                if prev >= vocab:
                    return _BAD_TOKEN, b
                started = True
                comp[n - 1 - k] = token_map[prev]
        _hash_window(comp, mult, primes, inv_primes, offsets, fast, n_heads, out, b)
    return _OK, 0


def _as_int64(name: str, values: np.ndarray, ndim: int) -> np.ndarray:
    array = np.ascontiguousarray(values, dtype=np.int64)
    if array.ndim != ndim:
        raise SlackTierError(ErrorKind.BAD_INPUT, f"{name} must have {ndim} dimension(s), got shape {array.shape}",
                             fix=f"pass {name} as a {ndim}-d integer array")
    return array


def _prefill_history(history: np.ndarray | None, width: int) -> np.ndarray:
    """A prefill chunk's history [width] as int64: all -1 for None (the chunk starts the sequence), else checked."""
    if history is None:
        return np.full(width, -1, dtype=np.int64)
    hist = _as_int64("history", history, 1)
    if hist.shape[0] != width:
        raise SlackTierError(ErrorKind.BAD_INPUT, f"history must hold {width} ids, got {hist.shape[0]}",
                             fix="pass the n-1 predecessors, oldest first, -1 before the sequence start")
    return hist


def _decode_inputs(new_tokens: np.ndarray, history: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray]:
    """A decode step's new tokens [B] and history [B, width] as int64, shapes checked."""
    new = _as_int64("new_tokens", new_tokens, 1)
    hist = _as_int64("history", history, 2)
    if hist.shape != (new.shape[0], width):
        raise SlackTierError(ErrorKind.BAD_INPUT, f"history must be [{new.shape[0]}, {width}], got {list(hist.shape)}",
                             fix="one row of n-1 predecessors per new token, oldest first")
    return new, hist


def _output(out: np.ndarray | None, shape: tuple[int, ...]) -> np.ndarray:
    """`out` checked to be a C-contiguous int64 array of `shape`, or a new one when None."""
    if out is None:
        return np.empty(shape, dtype=np.int64)
    if out.shape != shape or out.dtype != np.int64 or not out.flags.c_contiguous:
        raise SlackTierError(ErrorKind.BAD_INPUT, f"out must be a C-contiguous int64 array of shape {shape}",
                             fix="allocate it with new_output(n_tokens)")
    return out


def raise_for_status(status: int, index: int, what: str, vocab: int) -> None:
    """Turn a kernel status code into a SlackTierError (shared by the Engram and PLE hashers)."""
    if status == _BAD_TOKEN:
        where = f"history slot {-1 - index}" if index < 0 else f"position {index}"
        raise SlackTierError(ErrorKind.BAD_INPUT, f"{what}: token id at {where} is outside 0..{vocab - 1}",
                             fix="pass raw token ids of the tokenizer the hasher was built for")
    if status == _BAD_HISTORY:
        raise SlackTierError(ErrorKind.BAD_INPUT,
                             f"{what}: history row {index} has a -1 (before sequence start) after a real token",
                             fix="history is oldest first; -1 may only fill its oldest slots")


def next_history(history: np.ndarray | None, token_ids: np.ndarray, width: int) -> np.ndarray:
    """History row ([width] oldest first, -1 before start) after appending token_ids: [-1,-1,5] + [7] -> [-1,5,7]."""
    prior = np.full(width, -1, dtype=np.int64) if history is None else np.asarray(history, dtype=np.int64)
    joined = np.concatenate([prior, np.asarray(token_ids, dtype=np.int64).reshape(-1)])
    return joined[-width:].copy()


class EngramHasher:
    """Engram row ids for a sequence (prefill, chunked or whole) or one new token per session (decode)."""

    def __init__(self, layout: EngramLayout, token_map: np.ndarray | None = None, *,
                 reciprocal_mod: bool = False) -> None:
        if token_map is None:
            from slacktier.tables.compressed_vocab import deepseek_v4_compressed_map
            token_map = deepseek_v4_compressed_map()
        token_map = np.ascontiguousarray(token_map, dtype=np.int64)
        if token_map.ndim != 1 or token_map.size == 0 or token_map.min() < 0 \
                or token_map.max() >= layout.compressed_vocab:
            raise SlackTierError(ErrorKind.BAD_TOKENIZER,
                                 f"the token map must be 1-d with values in 0..{layout.compressed_vocab - 1}",
                                 fix="build the layout with the token map's compressed size "
                                     "(EngramLayout.scaled(..., compressed_vocab=...))")
        if not 0 <= layout.pad_token_id < token_map.shape[0]:
            raise SlackTierError(ErrorKind.BAD_TOKENIZER, f"pad token {layout.pad_token_id} is outside the token map",
                                 fix="use a token map that covers the pad token")
        self.layout = layout
        self.token_map = token_map            # [V_raw] int64 raw id -> compressed id
        self.pad_id = int(token_map[layout.pad_token_id])
        # Flat [L*C] / [L*n] copies: the kernels index them with one running offset.
        self._primes = layout.primes_array.reshape(-1).copy()
        self._offsets = layout.offsets_array.reshape(-1).copy()
        self._mult = layout.multipliers_array.reshape(-1).copy()
        self._inv_primes = 1.0 / self._primes.astype(np.float64)
        # reciprocal_mod swaps the divide for a float-reciprocal modulo (bit-identical, needs primes >= 2**13).
        # Off by default: on the Zen 4 CI machine the unsigned divide measured faster (bench_tables_hash.py);
        # it is kept for CPUs with a slow 64-bit divide.
        self._fast = bool(reciprocal_mod and layout.primes_array.min() >= _FAST_MOD_MIN_PRIME)
        self.history_width = layout.max_ngram - 1

    def _args(self) -> tuple:
        return (self.token_map, self.pad_id, self._mult, self._primes, self._inv_primes, self._offsets, self._fast,
                self.layout.n_heads)

    def new_output(self, n_tokens: int) -> np.ndarray:
        """An uninitialized [n_tokens, L, C] int64 output."""
        return np.empty((n_tokens, self.layout.n_layers, self.layout.n_columns), dtype=np.int64)

    def prefill(self, token_ids: np.ndarray, history: np.ndarray | None = None,
                out: np.ndarray | None = None) -> np.ndarray:
        """Row ids [T, L, C] of one sequence's tokens [T]; history [n-1] (oldest first, -1 before start)
        continues an earlier chunk, None means the chunk starts the sequence."""
        ids = _as_int64("token_ids", token_ids, 1)
        hist = _prefill_history(history, self.history_width)
        out = self._check_out(out, ids.shape[0])
        status, index = _engram_prefill_kernel(ids, hist, *self._args(), out.reshape(-1))
        raise_for_status(status, index, "Engram prefill", self.token_map.shape[0])
        return out

    def decode(self, new_tokens: np.ndarray, history: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """Row ids [B, L, C] of one new token per session [B], given history [B, n-1] (oldest first, -1 before start)."""
        new, hist = _decode_inputs(new_tokens, history, self.history_width)
        out = self._check_out(out, new.shape[0])
        status, index = _engram_decode_kernel(new, hist, *self._args(), out.reshape(-1))
        raise_for_status(status, index, "Engram decode", self.token_map.shape[0])
        return out

    def next_history(self, history: np.ndarray | None, token_ids: np.ndarray) -> np.ndarray:
        """The history row after appending token_ids to a sequence: feed it to the next prefill chunk or decode."""
        return next_history(history, token_ids, self.history_width)

    def _check_out(self, out: np.ndarray | None, n_tokens: int) -> np.ndarray:
        return _output(out, (n_tokens, self.layout.n_layers, self.layout.n_columns))
