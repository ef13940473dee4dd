"""Real text for RedKnot runs: installed source files, tokenized with the DeepSeek-V4 tokenizer."""

from __future__ import annotations

from pathlib import Path

from slacktier.errors import ErrorKind, SlackTierError, optional_import
from slacktier.tables.tokenizer import encode

QUESTION = ("\n\nQuestion: across the files above, which functions deal with rotary position embeddings, "
            "and what does each one return?\nAnswer:")


def source_roots() -> list[Path]:
    """Source trees used as documents: transformers' model code, then torch's Python sources."""
    import torch

    transformers = optional_import("transformers", "models", "RedKnot's documents (transformers' sources)")
    return [Path(transformers.__file__).parent / "models", Path(torch.__file__).parent / "nn"]


def documents(n_docs: int, doc_tokens: int, *, skip_files: int = 0) -> list[tuple[str, tuple[int, ...]]]:
    """`n_docs` documents of exactly `doc_tokens` tokens, each cut from one or more real source files.

    Files are read in sorted path order, so the same arguments always give the same
    documents; ids are 'src-<k>'.
    """
    files = sorted(p for root in source_roots() for p in root.rglob("*.py"))[skip_files:]
    docs: list[tuple[str, tuple[int, ...]]] = []
    buf: list[int] = []
    for path in files:
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        buf += encode(f"# file: {path.name}\n{text}\n")
        while len(buf) >= doc_tokens and len(docs) < n_docs:
            docs.append((f"src-{len(docs)}", tuple(buf[:doc_tokens])))
            buf = buf[doc_tokens:]
        if len(docs) == n_docs:
            return docs
    raise SlackTierError(ErrorKind.MISSING, f"only {len(docs)} documents of {doc_tokens} tokens in the sources",
                         fix="ask for fewer or shorter documents")


def question_tokens() -> tuple[int, ...]:
    """The question appended after the documents."""
    return tuple(encode(QUESTION))
