"""Property tests: random sequences, scaled layouts and small token maps against the scalar references."""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from slacktier.tables.engram_hash import EngramHasher, EngramLayout
from slacktier.tables.ple_hash import PleHasher, PleLayout
from test_tables_hash_real import _ref_engram_params, _ref_ple_params, _windows, assert_chunked_prefill_equals, \
    scalar_engram, scalar_ple

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def engram_case(draw):
    raw_vocab = draw(st.integers(3, 300))
    compressed = draw(st.integers(1, raw_vocab))
    token_map = draw(st.lists(st.integers(0, compressed - 1), min_size=raw_vocab, max_size=raw_vocab))
    n_layers = draw(st.integers(1, 3))
    layer_ids = tuple(draw(st.lists(st.integers(0, 60), min_size=n_layers, max_size=n_layers, unique=True)))
    # Small tables exercise the exact divide, tables >= 2**13 rows per head the reciprocal modulo.
    engram_vocab = draw(st.one_of(st.integers(2, 400), st.integers(8192, 2**31)))
    max_ngram = draw(st.integers(2, 5))
    n_heads = draw(st.integers(1, 8))
    seq = draw(st.lists(st.integers(0, raw_vocab - 1), max_size=200))
    return raw_vocab, compressed, token_map, layer_ids, engram_vocab, max_ngram, n_heads, seq


@SETTINGS
@given(engram_case(), st.randoms(use_true_random=False))
def test_engram_scaled_equals_scalar_reference(case, rnd):
    raw_vocab, compressed, token_map, layer_ids, engram_vocab, max_ngram, n_heads, seq = case
    layout = EngramLayout.scaled(engram_vocab, layer_ids=layer_ids, n_heads=n_heads, max_ngram=max_ngram,
                                 compressed_vocab=compressed, pad_token_id=rnd.randrange(raw_vocab))
    hasher = EngramHasher(layout, token_map=np.array(token_map))
    params = _ref_engram_params(layer_ids, max_ngram, n_heads, engram_vocab, compressed)
    ids = np.array(seq, dtype=np.int64)
    whole = hasher.prefill(ids)
    want = scalar_engram(seq, token_map, layout.pad_token_id, params, n_heads, max_ngram)
    np.testing.assert_array_equal(whole, np.array(want, dtype=np.int64).reshape(whole.shape))
    for layer in range(len(layer_ids)):
        assert np.all((whole[:, layer] >= 0) & (whole[:, layer] < layout.rows(layer)))
    np.testing.assert_array_equal(EngramHasher(layout, token_map=np.array(token_map), reciprocal_mod=True).prefill(ids),
                                  whole)
    # Decode of every window and chunked prefill reproduce the whole prefill.
    np.testing.assert_array_equal(hasher.decode(ids, _windows(ids, max_ngram - 1)), whole)
    assert_chunked_prefill_equals(hasher, ids, whole, lambda: rnd.randrange(0, 40))


@SETTINGS
@given(st.lists(st.integers(0, 129_279), max_size=300), st.integers(0, 2))
def test_engram_reciprocal_modulo_equals_divide_on_v41(seq, extreme):
    # Extreme token maps push the rolling XOR towards 2**63 (compressed id V-1 everywhere).
    layout = EngramLayout.v41()
    token_map = None if extreme == 0 else np.full(129_280, layout.compressed_vocab - extreme, dtype=np.int64)
    fast = EngramHasher(layout, token_map=token_map, reciprocal_mod=True)
    exact = EngramHasher(layout, token_map=token_map)
    ids = np.array(seq, dtype=np.int64)
    np.testing.assert_array_equal(fast.prefill(ids), exact.prefill(ids))


@SETTINGS
@given(st.integers(8192, 2**40), st.lists(st.integers(0, 1), min_size=1, max_size=100))
def test_reciprocal_modulo_near_int64_max(engram_vocab, seq):
    # compressed_vocab=2 makes multipliers ~2**61..2**62, so XORs of them reach close to 2**63.
    layout = EngramLayout.scaled(engram_vocab, compressed_vocab=2, n_heads=2)
    ids = np.array(seq, dtype=np.int64)
    fast = EngramHasher(layout, token_map=np.array([0, 1, 1]), reciprocal_mod=True).prefill(ids)
    exact = EngramHasher(layout, token_map=np.array([0, 1, 1])).prefill(ids)
    np.testing.assert_array_equal(fast, exact)
    want = scalar_engram(seq, [0, 1, 1], 2, _ref_engram_params((1, 14), 4, 2, engram_vocab, 2), 2, 4)
    np.testing.assert_array_equal(fast, np.array(want, dtype=np.int64))


@st.composite
def ple_case(draw):
    vocab = draw(st.integers(2, 400))
    eos = draw(st.integers(0, vocab - 1))
    base = draw(st.one_of(st.integers(2, 300), st.integers(8192, 2**31)))
    ngram = draw(st.integers(2, 5))
    heads = draw(st.integers(1, 8))
    layer_index = draw(st.integers(0, 2))
    seed = draw(st.integers(0, 2**32))
    # EOS-dense sequences: every token is EOS with probability ~1/3.
    seq = draw(st.lists(st.one_of(st.just(eos), st.integers(0, vocab - 1), st.integers(0, vocab - 1)), max_size=200))
    return vocab, eos, base, ngram, heads, layer_index, seed, seq


@SETTINGS
@given(ple_case(), st.randoms(use_true_random=False))
def test_ple_scaled_equals_scalar_reference(case, rnd):
    vocab, eos, base, ngram, heads, layer_index, seed, seq = case
    layout = PleLayout.scaled(base, vocab_size=vocab, eos_token_id=eos, ngram_size=ngram, heads_per_ngram=heads,
                              ple_layer_index=layer_index, seed=seed)
    hasher = PleHasher(layout)
    ids = np.array(seq, dtype=np.int64)
    whole = hasher.prefill(ids)
    want = scalar_ple(seq, eos, _ref_ple_params(vocab, ngram, heads, base, layer_index, seed), heads, ngram)
    np.testing.assert_array_equal(whole, np.array(want, dtype=np.int64).reshape(whole.shape))
    assert np.all((whole >= 0) & (whole < layout.rows))
    np.testing.assert_array_equal(PleHasher(layout, reciprocal_mod=True).prefill(ids), whole)
    # -1 and EOS are the same thing in a PLE history; decode and chunks reproduce the prefill.
    windows = _windows(ids, ngram - 1)
    np.testing.assert_array_equal(hasher.decode(ids, windows), whole)
    np.testing.assert_array_equal(hasher.decode(ids, np.where(windows < 0, eos, windows)), whole)
    assert_chunked_prefill_equals(hasher, ids, whole, lambda: rnd.randrange(0, 40))


@SETTINGS
@given(st.lists(st.integers(0, 248_319), max_size=300), st.lists(st.integers(0, 299), max_size=60))
def test_ple_qwen38_reciprocal_modulo_equals_divide(seq, eos_at):
    layout = PleLayout.qwen38()
    ids = np.array(seq, dtype=np.int64)
    ids[[i for i in eos_at if i < len(seq)]] = layout.eos_token_id
    np.testing.assert_array_equal(PleHasher(layout, reciprocal_mod=True).prefill(ids), PleHasher(layout).prefill(ids))
