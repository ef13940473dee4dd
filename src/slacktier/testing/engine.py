"""Helpers for tests and benchmarks of the engine: an in-memory page source with fault injection, real-token ids.

`ArraySource` is a fake, not a mock: a complete PageSource over numpy page
arrays that really copies pages into the caller's pool (at `wait`, so a read is
in flight between submit and wait), and can be told to fail a given page the
way a real tier fails: an I/O error, a short read or a checksum mismatch. A
failed batch leaves garbage (0xAB) in its buffers, so a test can show that no
garbage row ever comes out of the engine.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from slacktier.errors import ErrorKind, SlackTierError
from slacktier.store.base import PageBufferPool, PageReads, PageSource, ReadStats
from slacktier.tables.regions import Region
from slacktier.tables.layout import PAGE_BYTES, pack_rows_into_pages, pages_for_rows

FAULTS = ("io", "short", "checksum")


#: raw_rows [N, 264] uint8 -> pages [ceil(N/15), 4096] uint8, zero padded (row r at page r // 15); the layout's packer
pack_pages = pack_rows_into_pages


class ArraySource(PageSource):
    """Pages held in numpy arrays (one [pages, 4096] uint8 per region), copied into the pool at `wait`."""

    def __init__(self, regions: Sequence[Region], pages: Sequence[np.ndarray]) -> None:
        if len(regions) != len(pages):
            raise SlackTierError(ErrorKind.BAD_INPUT, f"{len(pages)} page arrays for {len(regions)} regions",
                                 fix="one array per region")
        self.regions = tuple(regions)
        self.pages = [np.asarray(p, dtype=np.uint8) for p in pages]
        self.faults: dict[tuple[int, int], str] = {}   # (region index, page) -> fault kind
        self.batches = 0
        self.pages_read = 0
        self._tickets = itertools.count(1)
        self._pending: dict[int, tuple[PageReads, PageBufferPool, int]] = {}
        self._lock = threading.Lock()
        self._closed = False

    def fail(self, region: int, page: int, kind: str) -> None:
        """Make every later read of (region, page) fail with `kind` ("io", "short" or "checksum")."""
        if kind not in FAULTS:
            raise SlackTierError(ErrorKind.BAD_INPUT, f"unknown fault {kind!r}", fix=f"use one of {FAULTS}")
        self.faults[(region, page)] = kind

    def heal(self) -> None:
        """Clear every injected fault."""
        self.faults.clear()

    def _refuse_if_closed(self) -> None:
        if self._closed:
            raise SlackTierError(ErrorKind.CLOSED, "ArraySource is closed", fix="open a new source")

    def submit(self, reads: PageReads, pool: PageBufferPool) -> int:
        """Record the batch; the copy happens at wait."""
        self._refuse_if_closed()
        reads = PageReads(reads.region.copy(), reads.page.copy(), reads.buffer.copy())
        for r, p in zip(reads.region, reads.page):
            if not (0 <= r < len(self.regions) and 0 <= p < self.regions[r].pages):
                raise SlackTierError(ErrorKind.BAD_INPUT, f"page {p} of region {r} does not exist",
                                     fix="ask only for pages the region holds")
        with self._lock:
            ticket = next(self._tickets)
            self._pending[ticket] = (reads, pool, time.perf_counter_ns())
        return ticket

    def wait(self, ticket: int, timeout_s: float | None = None) -> ReadStats:
        """Copy the batch's pages; raise SlackTierError naming layer, rank and page on an injected fault."""
        self._refuse_if_closed()
        with self._lock:
            reads, pool, t0 = self._pending.pop(ticket)
        self.batches += 1
        error: SlackTierError | None = None
        for region, page, buf in zip(reads.region, reads.page, reads.buffer):
            spec = self.regions[region]
            fault = self.faults.get((int(region), int(page)))
            if fault is None:
                pool.pages[buf] = self.pages[region][page]
                continue
            pool.pages[buf] = 0xAB
            where = {"layer": spec.layer, "rank": spec.rank, "page": int(page)}
            if error is None:
                error = {
                    "io": SlackTierError(ErrorKind.IO, "read failed: Input/output error (EIO)",
                                         fix="check the device", **where),
                    "short": SlackTierError(ErrorKind.IO, f"short read: 1024 of {PAGE_BYTES} bytes",
                                            fix="the region is truncated; stage it again", **where),
                    "checksum": SlackTierError(ErrorKind.CHECKSUM, "page CRC32C does not match the manifest",
                                               fix="stage the region again", **where),
                }[fault]
        self.pages_read += len(reads)
        if error is not None:
            raise error
        return ReadStats(pages=len(reads), read_us=(time.perf_counter_ns() - t0) / 1e3)

    def close(self) -> None:
        """Refuse work from now on."""
        self._closed = True


def real_text(max_bytes: int, start_file: int = 0) -> str:
    """Real source text from the installed packages (numpy's and torch's .py files), about `max_bytes` long."""
    import numpy
    import torch
    files = sorted(Path(numpy.__file__).parent.rglob("*.py")) + sorted(Path(torch.__file__).parent.rglob("*.py"))
    parts, total = [], 0
    for f in files[start_file:]:
        text = f.read_text(errors="replace")
        parts.append(text)
        total += len(text)
        if total >= max_bytes:
            break
    return "".join(parts)[:max_bytes]


def real_token_ids(n_tokens: int, layout: object, start_file: int = 0) -> np.ndarray:
    """Engram row ids [n_tokens, L, 24] of real text tokenized with the DeepSeek-V4 tokenizer.

    `layout` is a slacktier.tables.engram_hash.EngramLayout (v41 or scaled).
    """
    from slacktier.tables.engram_hash import EngramHasher
    from slacktier.tables.tokenizer import encode
    tokens: list[int] = []
    budget = n_tokens * 5
    while len(tokens) < n_tokens:
        tokens = encode(real_text(budget, start_file))
        budget *= 2
    return EngramHasher(layout).prefill(np.asarray(tokens[:n_tokens], dtype=np.int64))


def array_tables(rows: dict[int, int], ranks: int = 2, seed: int = 5, cache_shares: dict[int, float] | None = None,
                 ) -> tuple[list, ArraySource, dict[int, np.ndarray]]:
    """Synthetic table layers served by one ArraySource: (TableSpecs in dict order, source, raw rows per layer).

    Layer l's raw rows [rows, 264] are `codec.synthetic_rows(seed + l, 0, rows)`; each
    layer is split over `ranks` ranks by `shard_bounds`, one region per rank.
    """
    from slacktier.engine.checker import ArrayRowReader
    from slacktier.engine.tables import TableSpec
    from slacktier.tables.codec import synthetic_rows
    from slacktier.tables.layout import shard_bounds
    regions, pages, raws, index = [], [], {}, {}
    for layer, n in rows.items():
        raws[layer] = synthetic_rows(seed + layer, 0, n)
        for rank in range(ranks):
            lo, hi = shard_bounds(n, None, rank, ranks)
            index.setdefault(layer, []).append(len(regions))
            regions.append(Region(layer=layer, rank=rank, path=f"mem:{layer}:{rank}", offset_bytes=0,
                                  pages=pages_for_rows(hi - lo), row_start=lo, rows=hi - lo))
            pages.append(pack_pages(raws[layer][lo:hi]))
    source = ArraySource(regions, pages)
    shares = cache_shares or {layer: 1.0 / len(rows) for layer in rows}
    tables = [TableSpec(layer=layer, row_start=0, rows=n, regions=tuple(regions[i] for i in index[layer]),
                        region_index=tuple(index[layer]), source=source, cache_share=shares[layer],
                        reference=ArrayRowReader(raws[layer]))
              for layer, n in rows.items()]
    return tables, source, raws
