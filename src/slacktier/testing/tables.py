"""Helpers for tests of staging: a row source that stops partway, the way a restage dies."""

from __future__ import annotations

from typing import Any

import numpy as np

from slacktier.tables.synthetic_source import SyntheticSource


class FailingSource(SyntheticSource):
    """A seeded synthetic table whose `fill_pages` raises RuntimeError after `fail_after` chunks."""

    def __init__(self, layout: Any, seed: int, fail_after: int) -> None:
        super().__init__(layout, seed)
        self.calls, self.fail_after = 0, fail_after

    def fill_pages(self, layer: int, row_start: int, rows: int, pages: np.ndarray,
                   crcs: np.ndarray | None = None) -> None:
        """Fill like the synthetic source, until the chunk after `fail_after`."""
        self.calls += 1
        if self.calls > self.fail_after:
            raise RuntimeError("row source failed")
        super().fill_pages(layer, row_start, rows, pages, crcs)
