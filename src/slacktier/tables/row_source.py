"""`RowSource`: where a staged table's rows come from (a seeded generator, a safetensors checkpoint).

Staging asks a source to fill whole pages (rows and, while a page is still in
cache, its CRC32C); verification and the engine's checkers ask it for single
rows. Implementations: tables.synthetic_source.SyntheticSource and
tables.checkpoint_source.CheckpointSource.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from slacktier.tables.manifest import StagedLayout


class RowSource(Protocol):
    """Where a table's rows come from: fills pages for staging, returns rows for verification."""

    layout: StagedLayout

    @property
    def digest(self) -> str:
        """"sha256:..." identity of the rows: a target header and manifest record it."""
        ...

    def spec(self) -> dict[str, Any]:
        """The manifest's "source" object: kind, digest and what rebuilds the source."""
        ...

    def fill_pages(self, layer: int, row_start: int, rows: int, pages: np.ndarray,
                   crcs: np.ndarray | None = None) -> None:
        """Fill pages [ceil(rows/15), 4096] uint8 with global rows [row_start, row_start + rows) of `layer`,
        zero padded, and each page's CRC32C into crcs [P] uint32 when given."""
        ...

    def rows(self, layer: int, row_ids: np.ndarray) -> np.ndarray:
        """Global rows `row_ids` [n] of `layer` -> raw [n, 264] uint8."""
        ...
