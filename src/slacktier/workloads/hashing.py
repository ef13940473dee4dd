"""The hasher seen by the workloads: token ids in, row ids [T, L, C] out, plus the table's shape.

Wraps slacktier.tables' EngramHasher (DeepSeek-V4.1, [T, 2, 24]) and PleHasher
(Qwen3.8, [T, 16] -> [T, 1, 16]) behind one small interface, so traces and the
characterization never care which table they describe. Anything with
`prefill(tokens [T], history [n-1] | None) -> [T, L, C]`,
`decode(new [B], history [B, n-1]) -> [B, L, C]` and a `spec` works (tests may
pass a scaled layout).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from slacktier.errors import ErrorKind, SlackTierError


@dataclass(frozen=True)
class HashSpec:
    """Shape of the hashed tables: layers, rows per layer, columns and how columns map to n-gram orders."""

    name: str
    layer_ids: tuple[int, ...]
    table_rows: tuple[int, ...]                      # rows per layer
    column_bounds: tuple[tuple[int, ...], ...]       # per layer: column c owns rows [b[c], b[c+1])
    n_columns: int                                   # C: 24 for Engram V4.1
    heads_per_order: int                             # 8: column // 8 is (order - min_order)
    min_order: int                                   # 2
    history_width: int                               # n - 1 predecessors a token's ids depend on

    def __post_init__(self) -> None:
        if len(self.layer_ids) != len(self.table_rows) or len(self.column_bounds) != len(self.layer_ids):
            raise SlackTierError(ErrorKind.BAD_INPUT, "HashSpec: one row count and column bounds per layer",
                                 fix="build the spec from a layout")
        if self.n_columns % self.heads_per_order:
            raise SlackTierError(ErrorKind.BAD_INPUT, "HashSpec: columns must be whole orders of heads",
                                 fix="n_columns = orders * heads_per_order")

    @property
    def n_layers(self) -> int:
        return len(self.layer_ids)

    def order_of_column(self, column: int) -> int:
        """n-gram order of a column: column 9 of Engram -> order 3."""
        return self.min_order + column // self.heads_per_order

    def layer_index(self, layer_id: int) -> int:
        """Index into the hasher's layer axis of model layer `layer_id` (Engram: 14 -> 1)."""
        if layer_id not in self.layer_ids:
            raise SlackTierError(ErrorKind.BAD_INPUT, f"layer {layer_id} is not one of {self.layer_ids}",
                                 fix=f"pick a layer among {self.layer_ids}")
        return self.layer_ids.index(layer_id)


class LookupHasher(Protocol):
    """What traces need from a hasher."""

    spec: HashSpec

    def prefill(self, token_ids: np.ndarray, history: np.ndarray | None = None) -> np.ndarray: ...

    def decode(self, new_tokens: np.ndarray, history: np.ndarray) -> np.ndarray: ...


class EngramLookupHasher:
    """DeepSeek-V4.1 Engram rows ([T, 2, 24], layers 1 and 14) through slacktier.tables.engram_hash."""

    def __init__(self, layout=None) -> None:
        from slacktier.tables.engram_hash import EngramHasher, EngramLayout

        layout = EngramLayout.v41() if layout is None else layout
        self._hasher = EngramHasher(layout)
        self.spec = HashSpec(
            name="engram", layer_ids=tuple(int(i) for i in layout.layer_ids),
            table_rows=tuple(layout.rows(i) for i in range(layout.n_layers)),
            column_bounds=tuple(layout.column_bounds(i) for i in range(layout.n_layers)),
            n_columns=layout.n_columns, heads_per_order=layout.n_heads, min_order=2,
            history_width=layout.max_ngram - 1)

    def prefill(self, token_ids: np.ndarray, history: np.ndarray | None = None) -> np.ndarray:
        """Row ids [T, L, C] of tokens [T] continuing `history` ([n-1], -1 before start; None = sequence start)."""
        return self._hasher.prefill(token_ids, history)

    def decode(self, new_tokens: np.ndarray, history: np.ndarray) -> np.ndarray:
        """Row ids [B, L, C] of one new token per session."""
        return self._hasher.decode(new_tokens, history)


class PleLookupHasher:
    """Qwen3.8 PLE rows ([T, 1, 16], consumed at layer 1) through slacktier.tables.ple_hash.

    PLE hashes Qwen3.8 token ids: replay sessions rendered with Qwen's tokenizer
    (`CorpusConfig(tokens="qwen")`, workloads.qwen_sessions). DeepSeek-V4 ids give
    a valid access pattern of the same shape but not Qwen3.8's own traffic.
    """

    def __init__(self, layout=None) -> None:
        from slacktier.tables.ple_hash import PleHasher, PleLayout

        layout = PleLayout.qwen38() if layout is None else layout
        self._hasher = PleHasher(layout)
        self.spec = HashSpec(name="ple", layer_ids=(1,), table_rows=(layout.rows,),
                             column_bounds=(layout.column_bounds(),), n_columns=layout.n_columns,
                             heads_per_order=layout.heads_per_ngram, min_order=2,
                             history_width=layout.ngram_size - 1)

    def prefill(self, token_ids: np.ndarray, history: np.ndarray | None = None) -> np.ndarray:
        """Row ids [T, 1, C]."""
        return self._hasher.prefill(token_ids, history)[:, None, :]

    def decode(self, new_tokens: np.ndarray, history: np.ndarray) -> np.ndarray:
        """Row ids [B, 1, C]."""
        return self._hasher.decode(new_tokens, history)[:, None, :]


TABLES = ("engram", "ple")
TABLE_TOKENS = {"engram": "deepseek", "ple": "qwen"}   # the tokenizer whose ids each table hashes


def table_layer_ids(table: str) -> tuple[int, ...]:
    """Model layers the workloads key `table` by: engram (1, 14), ple (1,)."""
    if table == "engram":
        from slacktier.tables.engram_hash import V41_LAYER_IDS
        return tuple(V41_LAYER_IDS)
    if table == "ple":
        from slacktier.tables.ple_hash import PleLayout
        return (PleLayout.qwen38().layer_id,)
    raise SlackTierError(ErrorKind.BAD_INPUT, f"unknown table {table!r}", fix=f"use one of {TABLES}")


def lookup_hasher(table: str, engram_vocab: int = 0) -> LookupHasher:
    """The hasher of `table`: "engram" (DeepSeek-V4.1, layers 1 and 14; full size, or scaled to `engram_vocab`
    rows per head as `slacktier whatif --vocab` stages it) or "ple" (Qwen3.8, layer 1, full size only)."""
    if engram_vocab and table != "engram":
        raise SlackTierError(ErrorKind.BAD_INPUT, f"an engram vocabulary for table {table!r}",
                             fix="scale only the engram table (or drop --engram-vocab)")
    if table == "engram":
        if engram_vocab:
            from slacktier.tables.engram_hash import EngramLayout

            return EngramLookupHasher(EngramLayout.scaled(engram_vocab, (1, 14)))
        return EngramLookupHasher()
    if table == "ple":
        return PleLookupHasher()
    raise SlackTierError(ErrorKind.BAD_INPUT, f"unknown table {table!r}", fix=f"use one of {TABLES}")


def history_before(tokens: np.ndarray, position: int, width: int) -> np.ndarray:
    """The `width` raw ids before `position`, oldest first, -1 before the start: ([5,6,7], 1, 3) -> [-1,-1,5]."""
    out = np.full(width, -1, dtype=np.int64)
    lo = max(0, position - width)
    got = tokens[lo:position]
    if len(got):
        out[width - len(got):] = got
    return out
