"""`TableLayout`: what staging, sharding and the engine need to know about a hashed table.

A hashed table has one sub-table per model layer that looks it up. Each token
reads `n_columns` rows of every such layer, one per hash column, and column c
of a layer owns the global rows [b[c], b[c + 1]) of that layer's table, with
b = layer_column_bounds(layer_id). Worked example: DeepSeek-V4.1's Engram has
layer_ids (1, 14), 24 columns, and layer_rows(1) = 384,006,168 =
layer_column_bounds(1)[-1].

`EngramLayout` (tables.engram_hash) and `PleLayout` (tables.ple_hash) implement
it; the manifest records any implementation as a `StagedLayout`
(tables.manifest, `StagedLayout.from_layout`).
"""

from __future__ import annotations

from typing import Protocol


class TableLayout(Protocol):
    """Layer ids, rows and hash-column bounds of a hashed table (keyed by model layer id, not position)."""

    @property
    def layer_ids(self) -> tuple[int, ...]:
        """Model layer ids that look the table up, in model order."""
        ...

    @property
    def n_columns(self) -> int:
        """Hash columns per layer: the rows one token reads from each layer's table."""
        ...

    def layer_rows(self, layer_id: int) -> int:
        """Rows of `layer_id`'s table (its last column bound)."""
        ...

    def layer_column_bounds(self, layer_id: int) -> tuple[int, ...]:
        """Column c of `layer_id` owns rows [b[c], b[c+1]); b[0] = 0, b[-1] = layer_rows(layer_id)."""
        ...
