"""`SyntheticSource`: a seeded synthetic table whose rows are a pure function of (seed, layer, global row id).

Any row can be regenerated alone, so a staged synthetic table is verified (and
the engine's reads checked) without keeping a copy. Row bytes come from
`codec.synthetic_row_into`; pages are filled by compiled kernels that also take
each page's CRC32C while it is still in L1.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import numba
import numpy as np

from slacktier.tables.codec import _mix64, synthetic_row_into, synthetic_seed
from slacktier.tables.identity import source_identity
from slacktier.tables.layout import PAGE_USED_WORDS, PAGE_WORDS, ROW_BYTES, ROW_WORDS, ROWS_PER_PAGE
from slacktier.tables.manifest import StagedLayout
from slacktier.tables.pagecrc import HW_CRC32C, crc_page_words, page_crcs

SYNTHETIC_GENERATOR = "slacktier-splitmix64-fp8-v1"

# numba's cache=True keys a kernel on this file only: after editing codec.synthetic_row_into or
# pagecrc.crc_page_words, delete __pycache__/synthetic_source.*.nbi/.nbc (the tests compare against both and
# would fail on a stale kernel).

@numba.njit(nogil=True, cache=True, inline="always")
def _synthetic_page(seed: np.uint64, row_start: np.int64, rows: np.int64, pages64: np.ndarray, p: np.int64) -> None:
    # page p of the chunk: rows p*15 .. p*15+14 (zeros past `rows`), then 17 zero words of padding
    base = p * PAGE_WORDS
    for k in range(ROWS_PER_PAGE):
        i = p * ROWS_PER_PAGE + k
        if i < rows:
            synthetic_row_into(seed, row_start + i, pages64, base + k * ROW_WORDS)
        else:
            for w in range(ROW_WORDS):
                pages64[base + k * ROW_WORDS + w] = 0
    for w in range(PAGE_USED_WORDS, PAGE_WORDS):
        pages64[base + w] = 0


@numba.njit(nogil=True, cache=True)
def _synthetic_pages(seed: np.uint64, row_start: np.int64, rows: np.int64, pages64: np.ndarray) -> None:
    # pages64: [P * 512] uint64 for P = ceil(rows / 15) pages; row i -> page i // 15, word (i % 15) * 33
    for p in range((rows + ROWS_PER_PAGE - 1) // ROWS_PER_PAGE):
        _synthetic_page(seed, row_start, rows, pages64, p)


@numba.njit(nogil=True, cache=True)
def _synthetic_pages_crc(seed: np.uint64, row_start: np.int64, rows: np.int64, pages64: np.ndarray,
                         crcs: np.ndarray) -> None:
    # as _synthetic_pages, and each page's CRC32C while it is still in L1: crcs [P] uint32
    for p in range((rows + ROWS_PER_PAGE - 1) // ROWS_PER_PAGE):
        _synthetic_page(seed, row_start, rows, pages64, p)
        crcs[p] = crc_page_words(pages64, p * PAGE_WORDS)


@numba.njit(nogil=True, cache=True)
def _synthetic_gather(seed: np.uint64, row_ids: np.ndarray, out64: np.ndarray) -> None:
    # row_ids: [n] int64 global rows; out64: [n * 33] uint64
    for i in range(row_ids.shape[0]):
        synthetic_row_into(seed, row_ids[i], out64, i * ROW_WORDS)


def layer_seed(seed: int, layer: int) -> np.uint64:
    """The generator seed of one layer: a mix of the table seed and the layer id."""
    with np.errstate(over="ignore"):
        return np.uint64(_mix64(synthetic_seed(seed) ^ (np.uint64(layer) * np.uint64(0xA24BAED4963EE407))))


class SyntheticSource:
    """A seeded synthetic table: row bytes are a pure function of (seed, layer, global row id).

    Layer `l`'s row `r` equals `codec.synthetic_rows(s, r, 1)` for the seed
    `s = layer_seed(seed, l)` (as an int), so any row can be regenerated alone.
    """

    kind = "synthetic"

    def __init__(self, layout: StagedLayout, seed: int) -> None:
        self.layout = layout
        self.seed = int(seed)
        spec = {"generator": SYNTHETIC_GENERATOR, "seed": self.seed, "layout": layout.to_json()}
        self._digest = "sha256:" + hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()

    @property
    def digest(self) -> str:
        """sha256 of the generator, seed and layout."""
        return self._digest

    def spec(self) -> dict[str, Any]:
        """The manifest's "source" object: generator, seed and identity (tables.identity: the plug-ins refuse a
        checkpoint whose rows are not these)."""
        return {"kind": self.kind, "digest": self.digest, "generator": SYNTHETIC_GENERATOR, "seed": self.seed,
                "identity": source_identity(self)}

    def fill_pages(self, layer: int, row_start: int, rows: int, pages: np.ndarray,
                   crcs: np.ndarray | None = None) -> None:
        """Fill pages [P = ceil(rows/15), 4096] uint8 (C-contiguous) with global rows [row_start, row_start + rows),
        and their CRC32Cs into `crcs` [P] uint32 if given."""
        words = pages.reshape(-1).view(np.uint64)
        seed = layer_seed(self.seed, layer)
        if crcs is not None and HW_CRC32C:
            _synthetic_pages_crc(seed, np.int64(row_start), np.int64(rows), words, crcs)
            return
        _synthetic_pages(seed, np.int64(row_start), np.int64(rows), words)
        if crcs is not None:
            page_crcs(pages, crcs)

    def rows(self, layer: int, row_ids: np.ndarray) -> np.ndarray:
        """Global rows `row_ids` [n] of `layer` -> raw [n, 264] uint8."""
        ids = np.ascontiguousarray(row_ids, dtype=np.int64)
        out = np.empty((ids.shape[0], ROW_BYTES), dtype=np.uint8)
        _synthetic_gather(layer_seed(self.seed, layer), ids, out.reshape(-1).view(np.uint64))
        return out
