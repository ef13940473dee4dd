"""Host DRAM tier: every region's pages held in one host array; a read is a memcpy.

The pages live in one [total_pages, 4096] uint8 array (region i starts at row
`base[i]`); a worker thread copies a batch into the pool with a compiled loop
(numba, GIL released), so `submit` returns at once like the other tiers.
Pinning is the engine's business: it registers the pool, not this array.

Worked example: regions of 10 and 20 pages -> page 3 of region 1 is row 13.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from numba import njit

from slacktier.errors import ErrorKind, SlackTierError
from slacktier.store._common import (RegionTable, TicketBook, _Pending, check_reads, checksum_error,
                                     expected_checksums, own_reads, stop_workers)
from slacktier.store.base import PageBufferPool, PageReads, PageSource, ReadStats, RegionSpec
from slacktier.tables.layout import PAGE_BYTES

log = logging.getLogger(__name__)


@njit(nogil=True, cache=True)
def copy_pages(src: np.ndarray, src_rows: np.ndarray, dst: np.ndarray, dst_rows: np.ndarray) -> None:
    """dst[dst_rows[i]] = src[src_rows[i]] for each i; src, dst [*, 4096] uint8."""
    for i in range(src_rows.shape[0]):
        dst[dst_rows[i], :] = src[src_rows[i], :]


def load_region_pages(spec: RegionSpec) -> np.ndarray:
    """Read one region's pages from its file with buffered reads: -> [pages, 4096] uint8."""
    out = np.empty((spec.pages, PAGE_BYTES), dtype=np.uint8)
    try:
        fd = os.open(spec.path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError as exc:
        raise SlackTierError(ErrorKind.MISSING, f"region file {spec.path} does not exist", layer=spec.layer,
                             rank=spec.rank, fix="stage the table first, or fix the path") from exc
    try:
        view = memoryview(out).cast("B")
        done = 0
        while done < out.nbytes:
            got = os.preadv(fd, [view[done:]], spec.offset_bytes + done)
            if got == 0:
                raise SlackTierError(ErrorKind.IO, f"{spec.path} ends {out.nbytes - done} bytes before the region",
                                     layer=spec.layer, rank=spec.rank, page=done // PAGE_BYTES,
                                     fix="the file is truncated; stage the region again")
            done += got
    finally:
        os.close(fd)
    return out


@dataclass
class _Part:
    pending: _Pending
    pool: PageBufferPool
    region: np.ndarray  # [n] int32
    page: np.ndarray    # [n] int64
    buffer: np.ndarray  # [n] int32


class DramSource(PageSource):
    """Pages held in host memory: loaded from the regions' files, or given as arrays."""

    capabilities = frozenset({"local", "dram"})
    engine_name = "memcpy"

    def __init__(self, regions: Sequence[RegionSpec], pages: Sequence[np.ndarray] | None = None, *,
                 verify_reads: bool = False, page_crc32c: Sequence[np.ndarray] | None = None) -> None:
        self._table = RegionTable.build(regions)
        self._expected = expected_checksums(self._table, page_crc32c, verify_reads)
        self.verify_reads = verify_reads
        if verify_reads:
            self.capabilities = self.capabilities | {"verify"}
        if pages is not None and len(pages) != len(self._table.regions):
            raise SlackTierError(ErrorKind.BAD_INPUT, f"{len(pages)} page arrays for {len(self._table.regions)} "
                                 "regions", fix="pass one [pages, 4096] uint8 array per region, in order")
        total = int(self._table.pages.sum())
        self._pages = np.empty((total, PAGE_BYTES), dtype=np.uint8)  # [total_pages, 4096]
        for i, spec in enumerate(self._table.regions):
            lo = int(self._table.base[i])
            if pages is None:
                self._pages[lo:lo + spec.pages] = load_region_pages(spec)
                continue
            given = np.asarray(pages[i])
            if given.dtype != np.uint8 or given.shape != (spec.pages, PAGE_BYTES):
                raise SlackTierError(ErrorKind.BAD_INPUT, f"page array is {given.shape} {given.dtype}, want "
                                     f"({spec.pages}, {PAGE_BYTES}) uint8", layer=spec.layer, rank=spec.rank,
                                     fix="pack rows with slacktier.tables.layout.pack_rows_into_pages")
            self._pages[lo:lo + spec.pages] = given
        self.nbytes = self._pages.nbytes
        self._book = TicketBook("DramSource")
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._submit_lock = threading.Lock()  # a batch is queued before close's stop marker, or refused
        self._thread = threading.Thread(target=self._worker, daemon=True, name="slacktier-dram")
        self._thread.start()
        log.info("DramSource: engine %s, %d regions, %.1f MiB in host memory", self.engine_name,
                 len(self._table.regions), self.nbytes / 2**20)

    def _worker(self) -> None:
        while True:
            part = self._queue.get()
            if part is None:
                return
            t0 = time.thread_time_ns()
            error: BaseException | None = None
            try:
                copy_pages(self._pages, self._table.base[part.region] + part.page, part.pool.pages, part.buffer)
                if self._expected is not None:
                    error = checksum_error(part.pool, part.region, part.page, part.buffer, self._table,
                                           self._expected, "dram read")
            except BaseException as exc:  # wait() re-raises it
                error = exc
            self._book.finish_part(part.pending, time.thread_time_ns() - t0, error)

    def submit(self, reads: PageReads, pool: PageBufferPool) -> int:
        """Queue the copies on the worker; returns a ticket at once."""
        self._book.refuse_if_closed()
        reads = own_reads(reads)
        check_reads(reads, self._table, pool)
        n = len(reads)
        with self._submit_lock:
            ticket, pending = self._book.open(1 if n else 0, n)
            if n:
                self._queue.put(_Part(pending, pool, reads.region, reads.page, reads.buffer))
        return ticket

    def wait(self, ticket: int, timeout_s: float | None = None) -> ReadStats:
        """Block until the batch was copied; raise SlackTierError naming layer/rank/page on a checksum mismatch."""
        return self._book.wait(ticket, timeout_s)

    def close(self) -> None:
        """Finish queued copies and stop the worker; later calls raise CLOSED."""
        stop_workers(self._book, self._submit_lock, [self._queue], [self._thread])
