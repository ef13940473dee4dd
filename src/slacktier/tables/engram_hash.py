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
import numbers
from dataclasses import dataclass, field

import numba
import numpy as np

from slacktier.errors import ErrorKind, SlackTierError
from slacktier.tables.hash_kernels import BAD_HISTORY, BAD_TOKEN, FAST_MOD_MIN_PRIME, OK, decode_inputs, next_history, \
    next_prime, output, raise_for_status, rolling_hash, run_prefill

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
    """Where each Engram hash column lands: primes, offsets, multipliers and rows per layer.

    Implements slacktier.tables.table_layout.TableLayout (`layer_rows`, `layer_column_bounds` by layer id);
    `rows(i)` and `column_bounds(i)` take the layer's position i in `layer_ids`.
    """

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
        if isinstance(self.engram_vocab_size, bool) or not isinstance(self.engram_vocab_size, numbers.Integral) \
                or self.engram_vocab_size < 2:
            raise SlackTierError(ErrorKind.BAD_INPUT, f"engram vocab size {self.engram_vocab_size!r} is not an "
                                 "integer >= 2", fix="pass an engram vocab size such as 100000 (V4.1: 16000000)")
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

    # slacktier.tables.table_layout.TableLayout: the same facts keyed by model layer id, not position.

    def layer_rows(self, layer_id: int) -> int:
        """Rows of model layer `layer_id`'s table: layer_rows(14) -> 384,016,682 in V4.1."""
        return self.rows(self._index_of(layer_id))

    def layer_column_bounds(self, layer_id: int) -> tuple[int, ...]:
        """Column bounds of model layer `layer_id`'s table (see column_bounds)."""
        return self.column_bounds(self._index_of(layer_id))

    def _index_of(self, layer_id: int) -> int:
        if layer_id not in self.layer_ids:
            raise SlackTierError(ErrorKind.BAD_INPUT,
                                 f"layer {layer_id} has no Engram table (layers {self.layer_ids})",
                                 fix="pick one of the layout's layer_ids", layer=layer_id)
        return self.layer_ids.index(layer_id)


@functools.lru_cache(maxsize=1)
def _v41_layout() -> EngramLayout:
    return EngramLayout(layer_ids=V41_LAYER_IDS, max_ngram=V41_MAX_NGRAM, n_heads=V41_N_HEADS,
                        engram_vocab_size=V41_ENGRAM_VOCAB_SIZE, compressed_vocab=V41_COMPRESSED_VOCAB,
                        pad_token_id=V41_PAD_TOKEN_ID, primes=V41_PRIMES, multipliers=V41_MULTIPLIERS)


# ---------------------------------------------------------------------------
# Compiled hot loops (the shared rolling hash is slacktier.tables.hash_kernels.rolling_hash).

@numba.njit(nogil=True, cache=True, inline="always")
def _hash_window(comp, mult, primes, inv_primes, offsets, fast, n_heads, out, row):
    # comp [n] compressed ids by shift; mult [L*n]; primes/inv_primes/offsets [L*C] flat; out [T*L*C] flat
    n = comp.shape[0]
    n_layers = mult.shape[0] // n
    n_cols = (n - 1) * n_heads
    for layer in range(n_layers):
        rolling_hash(comp, mult, layer * n, primes, inv_primes, offsets, layer * n_cols, fast, n_heads, out,
                     row * n_layers * n_cols)


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
                return BAD_HISTORY, k
            comp[n - 1 - k] = pad_id
        else:
            if tok >= vocab:
                return BAD_TOKEN, -1 - k
            started = True
            comp[n - 1 - k] = token_map[tok]
    for t in range(ids.shape[0]):
        tok = ids[t]
        if tok < 0 or tok >= vocab:
            return BAD_TOKEN, t
        comp[0] = token_map[tok]
        _hash_window(comp, mult, primes, inv_primes, offsets, fast, n_heads, out, t)
        for shift in range(n - 1, 0, -1):
            comp[shift] = comp[shift - 1]
    return OK, 0


@numba.njit(nogil=True, cache=True)
def _engram_decode_kernel(new_tokens, history, token_map, pad_id, mult, primes, inv_primes, offsets, fast, n_heads, out):
    # new_tokens [B] raw; history [B, n-1] raw oldest first, -1 before start; out [B*L*C] flat view of [B, L, C].
    n = history.shape[1] + 1
    vocab = token_map.shape[0]
    comp = np.empty(n, dtype=np.int64)
    for b in range(new_tokens.shape[0]):
        tok = new_tokens[b]
        if tok < 0 or tok >= vocab:
            return BAD_TOKEN, b
        comp[0] = token_map[tok]
        started = False
        for k in range(n - 1):
            prev = history[b, k]
            if prev < 0:
                if started:
                    return BAD_HISTORY, b
                comp[n - 1 - k] = pad_id
            else:
                if prev >= vocab:
                    return BAD_TOKEN, b
                started = True
                comp[n - 1 - k] = token_map[prev]
        _hash_window(comp, mult, primes, inv_primes, offsets, fast, n_heads, out, b)
    return OK, 0


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
        # Off by default: on a current x86 CPU (Zen 4) the unsigned divide measured faster
        # (benchmarks/micro/bench_tables_hash.py); it is kept for CPUs with a slow 64-bit divide.
        self._fast = bool(reciprocal_mod and layout.primes_array.min() >= FAST_MOD_MIN_PRIME)
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
        return run_prefill(_engram_prefill_kernel, self._args(), token_ids, history, self.history_width,
                           lambda n: self._check_out(out, n), "Engram prefill", self.token_map.shape[0])

    def decode(self, new_tokens: np.ndarray, history: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """Row ids [B, L, C] of one new token per session [B], given history [B, n-1] (oldest first, -1 before start)."""
        new, hist = decode_inputs(new_tokens, history, self.history_width)
        out = self._check_out(out, new.shape[0])
        status, index = _engram_decode_kernel(new, hist, *self._args(), out.reshape(-1))
        raise_for_status(status, index, "Engram decode", self.token_map.shape[0])
        return out

    def next_history(self, history: np.ndarray | None, token_ids: np.ndarray) -> np.ndarray:
        """The history row after appending token_ids to a sequence: feed it to the next prefill chunk or decode."""
        return next_history(history, token_ids, self.history_width)

    def _check_out(self, out: np.ndarray | None, n_tokens: int) -> np.ndarray:
        return output(out, (n_tokens, self.layout.n_layers, self.layout.n_columns))
