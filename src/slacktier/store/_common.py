"""Pieces every page source shares: tickets, read validation, result and checksum checks.

A ticket is one submitted batch, split into parts (one per I/O worker). It
completes when its last part finishes; `wait` then raises the first part's
error, so a caller never sees buffers of a batch that had a failed read.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import crc32c
import numpy as np

from slacktier.errors import ErrorKind, SlackTierError
from slacktier.store.base import PageBufferPool, PageReads, ReadStats, RegionSpec
from slacktier.tables.layout import PAGE_BYTES

NOT_DONE = np.iinfo(np.int32).min  # a read result slot no completion has written


@dataclass
class _Pending:
    parts_left: int
    pages: int
    submit_ns: int
    done: threading.Event = field(default_factory=threading.Event)
    cpu_ns: int = 0
    end_ns: int = 0
    error: BaseException | None = None
    extra: dict[str, float] = field(default_factory=dict)


class TicketBook:
    """Hands out tickets, collects part completions, and answers `wait`; thread-safe."""

    def __init__(self, source_name: str) -> None:
        self._name = source_name
        self._lock = threading.Lock()
        self._pending: dict[int, _Pending] = {}
        self._next = 1
        self.closed = False

    def refuse_if_closed(self) -> None:
        """Raise CLOSED once the source was closed."""
        if self.closed:
            raise SlackTierError(ErrorKind.CLOSED, f"{self._name} is closed",
                                 fix="open a new source; a closed one takes no more work")

    def open(self, parts: int, pages: int) -> tuple[int, _Pending]:
        """A new ticket for a batch of `pages` pages done in `parts` parts (0 parts: done now)."""
        with self._lock:
            self.refuse_if_closed()
            ticket = self._next
            self._next += 1
            pending = _Pending(parts_left=parts, pages=pages, submit_ns=time.perf_counter_ns())
            self._pending[ticket] = pending
        if parts == 0:
            pending.end_ns = pending.submit_ns
            pending.done.set()
        return ticket, pending

    def finish_part(self, pending: _Pending, cpu_ns: int, error: BaseException | None,
                    extra: dict[str, float] | None = None) -> None:
        """Record one part's end; the ticket completes with its last part."""
        with self._lock:
            pending.cpu_ns += cpu_ns
            if error is not None and pending.error is None:
                pending.error = error
            if extra:
                for key, value in extra.items():
                    pending.extra[key] = pending.extra.get(key, 0.0) + value
            pending.parts_left -= 1
            last = pending.parts_left == 0
            if last:
                pending.end_ns = time.perf_counter_ns()
        if last:
            pending.done.set()

    def wait(self, ticket: int, timeout_s: float | None) -> ReadStats:
        """Block until `ticket` completed; raise its error, else return its stats."""
        with self._lock:
            self.refuse_if_closed()
            pending = self._pending.get(ticket)
        if pending is None:
            raise SlackTierError(ErrorKind.BAD_INPUT, f"{self._name} has no ticket {ticket}",
                                 fix="wait once on a ticket that submit returned")
        if not pending.done.wait(timeout_s):
            raise SlackTierError(ErrorKind.IO, f"{self._name}: ticket {ticket} ({pending.pages} pages) not done "
                                 f"after {timeout_s} s", fix="check the device or server; wait again or close")
        with self._lock:
            self._pending.pop(ticket, None)
        if pending.error is not None:
            raise pending.error
        return ReadStats(pages=pending.pages, read_us=(pending.end_ns - pending.submit_ns) / 1e3,
                         cpu_us=pending.cpu_ns / 1e3, extra=dict(pending.extra))

    def close(self) -> None:
        """Refuse new tickets from now on."""
        with self._lock:
            self.closed = True


def stop_workers(book: TicketBook, submit_lock: threading.Lock, queues: Iterable[queue.SimpleQueue],
                 threads: Iterable[threading.Thread]) -> None:
    """A source's close: refuse new batches, queue a stop marker behind each queue's batches, join the workers.

    Taken under the source's submit lock, so a batch is either queued before the
    stop marker (and finished) or refused with CLOSED.
    """
    with submit_lock:
        book.close()
        for q in queues:
            q.put(None)
    for thread in threads:
        thread.join()


@dataclass(frozen=True)
class RegionTable:
    """Per-region arrays for vectorized lookups: region index -> layer, rank, pages, ..."""

    regions: tuple[RegionSpec, ...]
    pages: np.ndarray   # [R] int64
    device: np.ndarray  # [R] int32
    base: np.ndarray    # [R] int64, index of the region's page 0 in a concatenation of all regions

    @classmethod
    def build(cls, regions: Sequence[RegionSpec]) -> RegionTable:
        """Table over `regions`; refuses an empty list or a (layer, rank) given twice."""
        regions = tuple(regions)
        if not regions:
            raise SlackTierError(ErrorKind.BAD_INPUT, "a page source needs at least one region",
                                 fix="pass the staged regions of the table")
        seen: set[tuple[int, int]] = set()
        for spec in regions:
            if (spec.layer, spec.rank) in seen:
                raise SlackTierError(ErrorKind.BAD_INPUT, "region given twice", layer=spec.layer, rank=spec.rank,
                                     fix="pass one region per (layer, rank)")
            seen.add((spec.layer, spec.rank))
            if spec.pages <= 0:
                raise SlackTierError(ErrorKind.BAD_INPUT, f"region has {spec.pages} pages", layer=spec.layer,
                                     rank=spec.rank, fix="stage at least one page per region")
        pages = np.array([s.pages for s in regions], dtype=np.int64)
        base = np.zeros(len(regions), dtype=np.int64)
        base[1:] = np.cumsum(pages)[:-1]
        return cls(regions, pages, np.array([s.device for s in regions], dtype=np.int32), base)

    def where(self, region: int, page: int) -> dict[str, int]:
        """Location keywords for SlackTierError: region index 2, page 7 -> layer, rank, page."""
        spec = self.regions[region]
        return {"layer": spec.layer, "rank": spec.rank, "page": int(page)}


def own_reads(reads: PageReads) -> PageReads:
    """A private copy (int32 region, int64 page, int32 buffer): callers may reuse their arrays after submit."""
    return PageReads(np.array(reads.region, dtype=np.int32), np.array(reads.page, dtype=np.int64),
                     np.array(reads.buffer, dtype=np.int32))


def check_reads(reads: PageReads, table: RegionTable, pool: PageBufferPool) -> None:
    """Refuse a batch whose regions, pages or buffers are out of range (nothing is read)."""
    n = len(reads)
    if reads.page.shape[0] != n or reads.buffer.shape[0] != n:
        raise SlackTierError(ErrorKind.BAD_INPUT, f"PageReads arrays differ in length: region {n}, page "
                             f"{reads.page.shape[0]}, buffer {reads.buffer.shape[0]}", fix="build all three with n entries")
    if n == 0:
        return
    region = reads.region
    bad = np.flatnonzero((region < 0) | (region >= len(table.regions)))
    if bad.size:
        raise SlackTierError(ErrorKind.BAD_INPUT, f"read {bad[0]} names region {region[bad[0]]} of "
                             f"{len(table.regions)}", fix="index the source's region list")
    bad = np.flatnonzero((reads.page < 0) | (reads.page >= table.pages[region]))
    if bad.size:
        i = int(bad[0])
        raise SlackTierError(ErrorKind.BAD_INPUT, f"page outside its region of {table.pages[region[i]]} pages",
                             fix="ask only for pages the region holds", **table.where(int(region[i]), reads.page[i]))
    bad = np.flatnonzero((reads.buffer < 0) | (reads.buffer >= pool.capacity))
    if bad.size:
        raise SlackTierError(ErrorKind.BAD_INPUT, f"read {bad[0]} targets buffer {reads.buffer[bad[0]]} of a "
                             f"pool of {pool.capacity}", fix="size the pool to the pages of one step")


def results_error(res: np.ndarray, region: np.ndarray, page: np.ndarray, table: RegionTable,
                  what: str) -> SlackTierError | None:
    """The error for the first read whose result is not a full page (bytes or -errno), else None."""
    bad = np.flatnonzero(res != PAGE_BYTES)
    if not bad.size:
        return None
    i = int(bad[0])
    got = int(res[i])
    where = table.where(int(region[i]), int(page[i]))
    others = f"; {bad.size - 1} more reads of the batch failed" if bad.size > 1 else ""
    if got == NOT_DONE:
        return SlackTierError(ErrorKind.IO, f"{what}: read never completed{others}", **where,
                              fix="report this: the I/O engine lost a completion")
    if got < 0:
        return SlackTierError(ErrorKind.IO, f"{what}: read failed: {os.strerror(-got)}{others}", **where,
                              fix="check the device and the region's file (dmesg, ls -l)")
    return SlackTierError(ErrorKind.IO, f"{what}: short read, {got} of {PAGE_BYTES} bytes{others}", **where,
                          fix="the region's file is shorter than its manifest says; stage it again")


def expected_checksums(table: RegionTable, page_crc32c: Sequence[np.ndarray] | None,
                       verify_reads: bool) -> np.ndarray | None:
    """Concatenate per-region CRC32C arrays ([pages] uint32 each) when verification is on."""
    if not verify_reads:
        return None
    if page_crc32c is None or len(page_crc32c) != len(table.regions):
        raise SlackTierError(ErrorKind.BAD_INPUT, "verify_reads needs one CRC32C array per region",
                             fix="pass page_crc32c from the staging manifest, in region order")
    for spec, sums in zip(table.regions, page_crc32c, strict=True):
        if np.asarray(sums).shape != (spec.pages,):
            raise SlackTierError(ErrorKind.BAD_INPUT, f"{np.asarray(sums).shape[0]} checksums for "
                                 f"{spec.pages} pages", layer=spec.layer, rank=spec.rank,
                                 fix="pass the manifest's checksums for this region")
    return np.concatenate([np.asarray(s, dtype=np.uint32) for s in page_crc32c])


def page_crc32c(pages: np.ndarray) -> np.ndarray:
    """CRC32C (Castagnoli, initial 0, as `crc32c.crc32c`) of each whole 4 KiB page: [P, 4096] -> [P] uint32."""
    return np.array([crc32c.crc32c(row) for row in pages], dtype=np.uint32)


def checksum_error(pool: PageBufferPool, region: np.ndarray, page: np.ndarray, buffer: np.ndarray,
                   table: RegionTable, expected: np.ndarray, what: str) -> SlackTierError | None:
    """Check each read page's CRC32C against the manifest; the first mismatch as an error, else None."""
    want = expected[table.base[region] + page]
    for i in range(buffer.shape[0]):
        got = crc32c.crc32c(pool.pages[buffer[i]])
        if got != want[i]:
            return SlackTierError(ErrorKind.CHECKSUM, f"{what}: page CRC32C {got:#010x}, manifest says "
                                  f"{int(want[i]):#010x}", **table.where(int(region[i]), int(page[i])),
                                  fix="the stored page is corrupt; stage the region again")
    return None
