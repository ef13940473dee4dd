"""A long-context retrieval task built from real source text, in a compact vocabulary.

Text: the Python files of the installed `transformers/models` tree, tokenized
with the DeepSeek-V4 tokenizer. Files are split by a hash of their relative
path: `crc32(path) % 8 == 0` is held out (evaluation documents), the rest train.

Records: `\\n@<key> <value>\\n` lines inserted at line starts of the real text
(built at the token level: newline, '@', key, value, newline). <key> is a word
of the same real text that is one DeepSeek-V4 token (identifier parts such as
`hidden`, `config`, `dropout`; the 128 most frequent such words of the split),
<value> a number 100-163 (64 values, one token each). A query is `\\n@<key>` at
the end of the context; the answer is the value's token. Chance: 1/64 for a
guess over values, 1/records for copying a random value of the context.
(Earlier recipes - 2-4 token keys with a ':' separator and 900 values, then
one-token keys with 900 values - sat at the uniform-over-values loss, ln 900,
for 150-220 steps: too slow for a 20-minute one-thread budget.)

Compact vocabulary: the 4,000 most frequent DeepSeek-V4 ids of the training text,
plus the 900 value tokens and the record punctuation, plus UNK (id 0) and pad/eos
(id 1): `VocabMap.compact(deepseek_ids)`. The map is saved with the weights.

Worked example: key "hidden" (DeepSeek-V4 id 50024), value 417 (id 22309) -> record
ids [201, 34, 50024, 22309, 201] ("\\n", "@", "hidden", "417", "\\n") -> compact ids via
`VocabMap.to_compact`; the question is [201, 34, 50024].
"""

from __future__ import annotations

import random
import re
import zlib
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from slacktier.errors import ErrorKind, SlackTierError
from slacktier.tables.tokenizer import encode

VALUES = range(100, 1000)     # value tokens kept in the vocabulary
TASK_VALUES = range(100, 164)  # the values records use
N_KEYS = 128
UNK, EOS = 0, 1
WORD = re.compile(r"[a-z]{3,12}")


def corpus_root() -> Path:
    """The source tree the task's text comes from."""
    import transformers

    return Path(transformers.__file__).parent / "models"


def split_files(held_out: bool) -> list[Path]:
    """Sorted .py files of one split (held out: crc32 of the relative path % 8 == 0)."""
    root = corpus_root()
    files = sorted(root.rglob("*.py"))
    return [p for p in files if (zlib.crc32(str(p.relative_to(root)).encode()) % 8 == 0) == held_out]


def read_split(held_out: bool, max_tokens: int) -> tuple[list[int], list[str]]:
    """DeepSeek-V4 ids of a split's files in order (up to `max_tokens`), and the identifiers seen in them."""
    ids: list[int] = []
    idents: set[str] = set()
    for path in split_files(held_out):
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        ids += encode(f"# file: {path.name}\n{text}\n")
        idents.update(WORD.findall(text))
        if len(ids) >= max_tokens:
            break
    return ids[:max_tokens], sorted(idents)


@dataclass
class VocabMap:
    """DeepSeek-V4 ids <-> compact ids (0 = UNK, 1 = EOS)."""

    deepseek_ids: np.ndarray  # [V] int64: deepseek id of each compact id (-1 for UNK / EOS)

    def __post_init__(self) -> None:
        self._lookup = {int(d): i for i, d in enumerate(self.deepseek_ids.tolist()) if d >= 0}

    @property
    def size(self) -> int:
        """Compact vocabulary size."""
        return int(self.deepseek_ids.shape[0])

    @classmethod
    def build(cls, train_ids: list[int], top: int = 4000) -> VocabMap:
        """The `top` most frequent training ids, the value tokens and record punctuation; sorted, UNK/EOS first."""
        keep = {i for i, _ in Counter(train_ids).most_common(top)}
        keep |= {encode(str(v))[0] for v in VALUES}
        keep |= set(encode("\n@:"))
        return cls(np.array([-1, -1] + sorted(keep), dtype=np.int64))

    def to_compact(self, ids) -> list[int]:
        """Compact ids of DeepSeek-V4 ids (unknown -> UNK)."""
        return [self._lookup.get(int(i), UNK) for i in ids]

    def covers(self, ids) -> bool:
        """True if every id has its own compact id."""
        return all(int(i) in self._lookup for i in ids)


@dataclass(frozen=True)
class Sample:
    """One retrieval context: documents (compact ids), the query, the answer and every record's value."""

    documents: list[tuple[int, ...]]
    query: tuple[int, ...]
    answer: int                     # compact id of the value token
    context_values: tuple[int, ...]  # compact ids of every record value in the context (for the copy-chance)


class RetrievalTask:
    """Builds records, training sequences and evaluation samples from one split of real text."""

    def __init__(self, vocab: VocabMap, text_ids: list[int], identifiers: list[str]) -> None:
        self.vocab = vocab
        self.text = np.array(vocab.to_compact(text_ids), dtype=np.int64)  # [N]
        self.newline = vocab.to_compact(encode("\n"))[0]
        self.line_starts = np.nonzero(self.text[:-1] == self.newline)[0] + 1  # rows right after a newline
        self.prefix = vocab.to_compact(encode("\n@"))
        self.value_ids = [vocab.to_compact(encode(str(v)))[0] for v in TASK_VALUES]
        counts = Counter(self.text.tolist())
        keys = set()
        for name in identifiers:
            toks = encode(name)
            if len(toks) == 1 and vocab.covers(toks):
                keys.add(tuple(vocab.to_compact(toks)))
        if len(keys) < N_KEYS:
            raise SlackTierError(ErrorKind.MISSING, f"only {len(keys)} usable keys in the text",
                                 fix="read more text (max_tokens) or lower the vocabulary's size cut")
        self.keys = sorted(sorted(keys, key=lambda k: (-counts[k[0]], k))[:N_KEYS])

    def record(self, key: tuple[int, ...], value: int) -> list[int]:
        """`\\n@key value\\n` in compact ids."""
        return self.prefix + list(key) + [value] + [self.newline]

    def question(self, key: tuple[int, ...]) -> list[int]:
        """`\\n@key` in compact ids; the next token is the answer."""
        return self.prefix + list(key)

    def _filler(self, rng: random.Random, n: int) -> np.ndarray:
        start = rng.randrange(0, len(self.text) - n - 1)
        return self.text[start:start + n]

    def _with_records(self, rng: random.Random, n_tokens: int, pairs: list[tuple[tuple[int, ...], int]]
                      ) -> list[int]:
        """`n_tokens` of real text with the records inserted at line starts (total length n_tokens)."""
        rec = [self.record(k, v) for k, v in pairs]
        body = n_tokens - sum(len(r) for r in rec)
        if body < 16:
            raise SlackTierError(ErrorKind.BAD_INPUT, f"{len(pairs)} records do not fit {n_tokens} tokens",
                                 fix="use fewer records or longer documents")
        text = self._filler(rng, body)
        starts = np.nonzero(text[:-1] == self.newline)[0] + 1
        cut = sorted(rng.sample(starts.tolist(), len(rec)) if len(starts) >= len(rec)
                     else rng.sample(range(1, body), len(rec)))
        out: list[int] = []
        prev = 0
        for c, r in zip(cut, rec):
            out += text[prev:c].tolist() + r
            prev = c
        return out + text[prev:].tolist()

    def _pairs(self, rng: random.Random, n: int) -> list[tuple[tuple[int, ...], int]]:
        keys = rng.sample(self.keys, n)
        return [(k, rng.choice(self.value_ids)) for k in keys]

    def value_rows(self, toks: list[int], pairs: list[tuple[tuple[int, ...], int]]) -> dict[tuple[int, ...], int]:
        """Row of each record's value token in `toks` (the last `@ key value` match of each key)."""
        at = self.prefix[-1]
        want = {k: v for k, v in pairs}
        rows = {}
        for i in range(len(toks) - 2):
            k = (toks[i + 1],)
            if toks[i] == at and want.get(k) == toks[i + 2]:
                rows[k] = i + 2
        return rows

    def train_sequence(self, rng: random.Random, context: int, records: int, queries: int
                       ) -> tuple[list[int], list[int], list[int]]:
        """Context of `context` tokens with `records` records, then `queries` questions each followed by
        its answer. Returns (tokens, answer rows p, value rows): the model must predict tokens[p] at row
        p-1; the record it asks for has its value at the matching value row."""
        pairs = self._pairs(rng, records)
        toks = self._with_records(rng, context, pairs)
        where = self.value_rows(toks, pairs)
        answers, sources = [], []
        for k, v in rng.sample(pairs, min(queries, records)):
            toks += self.question(k)
            answers.append(len(toks))
            sources.append(where[k])
            toks.append(v)
        return toks, answers, sources

    def eval_sample(self, rng: random.Random, n_docs: int, doc_tokens: int, records_per_doc: int) -> Sample:
        """`n_docs` documents of `doc_tokens` tokens, each with its own records; the question asks one record."""
        pairs = self._pairs(rng, n_docs * records_per_doc)
        docs = [tuple(self._with_records(rng, doc_tokens, pairs[i * records_per_doc:(i + 1) * records_per_doc]))
                for i in range(n_docs)]
        key, value = rng.choice(pairs)
        return Sample(docs, tuple(self.question(key)), value, tuple(v for _, v in pairs))
