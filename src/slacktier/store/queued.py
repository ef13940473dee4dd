"""The queued-source base: workers, queues, tickets, checks, checksums and close, so a tier writes only its read.

A `QueuedSource` runs one or more workers; a worker is one thread with its
own queue. `submit` checks and copies the batch, splits it over the workers
(by the regions' device when the tier asks for per-device workers, then
evenly over that device's workers), queues one `Part` per worker and returns
a ticket (store/tickets.py). Each worker calls the tier's
`_read(worker, part)`, then (when the source was
given the manifest's checksums) checks every read page's CRC32C in one
compiled pass over the part (`_common.pool_page_crcs`). `wait`
raises the first failed part's error, never returning buffers of a failed
batch. `close` queues a stop marker behind each worker's batches and joins
them, so a batch is either finished or refused with CLOSED.

A tier implements:

- ``_read(worker, part) -> SlackTierError | None``: fill ``part.pool`` for
  the part's reads; return (or raise) the error of the first bad read.
- optionally ``_open_worker(worker)`` / ``_close_worker(worker)``: setup and
  teardown, run on the worker's own thread (a connection, a ring: state that
  only the thread that made it may drive). ``worker.state`` holds what setup
  made.

Worked example: regions of 10 and 20 pages -> page 3 of region 1 is page
10 + 3 = 13 of the concatenation, where its CRC32C sits in the checksums.
"""

from __future__ import annotations

import abc
import os
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, TypeVar

import numpy as np
from numba import njit

from slacktier.config import Options
from slacktier.errors import ErrorKind, SlackTierError
from slacktier.store._common import NOT_DONE, pool_page_crcs
from slacktier.store.base import PageBufferPool, PageReads, PageSource, ReadStats
from slacktier.store.tickets import Ticket, TicketBook
from slacktier.tables.layout import PAGE_BYTES
from slacktier.tables.regions import Region

S = TypeVar("S")
O = TypeVar("O", bound=Options)

#: the workers of a source whose workers are not tied to a device (DRAM, Redis)
ANY_DEVICE = -1


@dataclass(eq=False)
class Part:
    """The reads of one batch that one worker performs."""

    pool: PageBufferPool  # kept referenced until the reads land
    region: np.ndarray    # [n] int32, index into the source's regions
    page: np.ndarray      # [n] int64, page inside that region
    buffer: np.ndarray    # [n] int32, destination buffer in the pool
    ticket: Ticket | None = None  # set under the submit lock, before the part is queued
    cpu_ns: int = 0       # CPU the tier spent on other threads (a thread pool); added to the batch's cpu_us


@dataclass(eq=False)
class Worker(Generic[S]):
    """One worker thread and its queue; `state` is what the tier's `_open_worker` made (e.g. a connection)."""

    index: int
    device: int           # the device whose reads it serves, or ANY_DEVICE
    queue: queue.SimpleQueue
    state: S | None = None


def typed_options(options: Options | None, kind: type[O]) -> O:
    """`options`, or `kind()` when None; refuses options of another tier."""
    if options is None:
        return kind()
    if type(options) is not kind:
        raise SlackTierError(ErrorKind.BAD_INPUT, f"{type(options).__name__} given where {kind.__name__} belongs",
                             fix=f"pass {kind.__name__} (or None for its defaults)")
    return options


_I32 = np.dtype(np.int32)
_I64 = np.dtype(np.int64)
BAD_REGION, BAD_PAGE, BAD_BUFFER = 0, 1, 2   # what `taken_reads` found out of range first


@njit(nogil=True, cache=True)
def taken_reads(region, page, buffer, region_pages, capacity):
    """A batch's own copy, checked: (region [n] int32, page [n] int64, buffer [n] int32, what, i), `what` -1
    when every read is in range, else the first bad kind in the order regions, pages, buffers (BAD_*) and
    `i` its first read. One compiled call instead of a dozen numpy calls: a source without a compiled
    lane is submitted to from begin_step, which runs with the CPU's caches cold, where every numpy call is slow."""
    n = region.shape[0]
    out_region = np.empty(n, dtype=np.int32)
    out_page = np.empty(n, dtype=np.int64)
    out_buffer = np.empty(n, dtype=np.int32)
    n_regions = region_pages.shape[0]
    first = np.full(3, -1, dtype=np.int64)
    for i in range(n):
        r = region[i]
        p = page[i]
        b = buffer[i]
        out_region[i] = r
        out_page[i] = p
        out_buffer[i] = b
        if r < 0 or r >= n_regions:
            if first[BAD_REGION] < 0:
                first[BAD_REGION] = i
        elif (p < 0 or p >= region_pages[r]) and first[BAD_PAGE] < 0:
            first[BAD_PAGE] = i
        if (b < 0 or b >= capacity) and first[BAD_BUFFER] < 0:
            first[BAD_BUFFER] = i
    for what in range(3):
        if first[what] >= 0:
            return out_region, out_page, out_buffer, what, first[what]
    return out_region, out_page, out_buffer, -1, -1


class RegionSource(PageSource):
    """What every source over staged regions shares: the regions checked, the manifest's checksums, the ticket
    book, and the checks and errors that name layer, rank and page. `QueuedSource` adds workers; the
    disk tier (store/disk.py) submits to device queues instead."""

    #: names the tier's reads in error messages ("disk read: short read, ...")
    read_what: ClassVar[str] = "read"
    #: what moves the bytes (logged; a tier with several engines sets it per instance)
    engine_name: str = ""

    def __init__(self, regions: Sequence[Region], *, page_crc32c: Sequence[np.ndarray] | None = None,
                 verify_pages: bool = True) -> None:
        self.regions: tuple[Region, ...] = tuple(regions)
        if not self.regions:
            raise SlackTierError(ErrorKind.BAD_INPUT, "a page source needs at least one region",
                                 fix="pass the staged regions of the table")
        seen: set[tuple[int, int, bool]] = set()   # a (layer, rank) has a row region and may have a packed one
        for r in self.regions:
            if not isinstance(r, Region):
                raise SlackTierError(ErrorKind.BAD_INPUT, f"{type(r).__name__} given as a region",
                                     fix="pass slacktier.tables.regions.Region objects")
            if (r.layer, r.rank, r.packed) in seen:
                raise SlackTierError(ErrorKind.BAD_INPUT, "region given twice", layer=r.layer, rank=r.rank,
                                     fix="pass one region per (layer, rank)")
            seen.add((r.layer, r.rank, r.packed))
        self._region_pages = np.array([r.pages for r in self.regions], dtype=np.int64)    # [R]
        self._region_device = np.array([r.device for r in self.regions], dtype=np.int32)  # [R]
        self._region_base = np.zeros(len(self.regions), dtype=np.int64)  # [R] page 0's index in the concatenation
        self._region_base[1:] = np.cumsum(self._region_pages)[:-1]
        self._expected = self._checksums(page_crc32c)  # [total pages] uint32, or None: no verification
        #: check each read page against `_expected` (a tier that checked its pages once, at load, turns it off;
        #: a tier with `stored_crc32c` given the checksums with verify_pages=False compares only stored CRC32Cs)
        self._verify_pages = bool(verify_pages)
        self._check_each_read = self._expected is not None and self._verify_pages
        self._book = TicketBook(type(self).__name__)

    @property
    def verifies_reads(self) -> bool:
        """Whether the pages it serves are checked against the manifest's CRC32Cs (per read, or once at load)."""
        return self._expected is not None and self._verify_pages

    def _checksums(self, page_crc32c: Sequence[np.ndarray] | None) -> np.ndarray | None:
        if page_crc32c is None:
            return None
        if len(page_crc32c) != len(self.regions):
            raise SlackTierError(ErrorKind.BAD_INPUT, f"{len(page_crc32c)} CRC32C arrays for {len(self.regions)} "
                                 "regions", fix="pass page_crc32c from the staging manifest, one per region, in order")
        for r, sums in zip(self.regions, page_crc32c, strict=True):
            if np.asarray(sums).shape != (r.pages,):
                raise SlackTierError(ErrorKind.BAD_INPUT, f"{np.asarray(sums).shape} CRC32C values for {r.pages} "
                                     "pages", layer=r.layer, rank=r.rank,
                                     fix="pass the manifest's checksums for this region")
        return np.concatenate([np.asarray(s, dtype=np.uint32) for s in page_crc32c])

    # -- helpers --------------------------------------------------------------------------------

    def _warm(self) -> None:
        """Compile the kernels the workers will call; the checksum pass by default (a tier adds its own). The
        submit's check (taken_reads) too, so no first step pays a compile."""
        taken_reads(np.zeros(1, np.int32), np.zeros(1, np.int64), np.zeros(1, np.int32), np.ones(1, np.int64), 1)
        if self._check_each_read:
            pool_page_crcs(np.zeros((1, PAGE_BYTES), np.uint8), np.zeros(1, np.int32))

    def _check_reads(self, reads: PageReads, pool: PageBufferPool) -> None:
        """Refuse a batch whose regions, pages or buffers are out of range (nothing is read)."""
        n = len(reads)
        if reads.page.shape[0] != n or reads.buffer.shape[0] != n:
            raise SlackTierError(ErrorKind.BAD_INPUT, f"PageReads arrays differ in length: region {n}, page "
                                 f"{reads.page.shape[0]}, buffer {reads.buffer.shape[0]}",
                                 fix="build all three with n entries")
        if n == 0:
            return
        region = reads.region
        bad = np.flatnonzero((region < 0) | (region >= len(self.regions)))
        if bad.size:
            self._refuse_read(reads, pool, BAD_REGION, int(bad[0]))
        bad = np.flatnonzero((reads.page < 0) | (reads.page >= self._region_pages[region]))
        if bad.size:
            self._refuse_read(reads, pool, BAD_PAGE, int(bad[0]))
        bad = np.flatnonzero((reads.buffer < 0) | (reads.buffer >= pool.capacity))
        if bad.size:
            self._refuse_read(reads, pool, BAD_BUFFER, int(bad[0]))

    @staticmethod
    def _copied(reads: PageReads) -> PageReads:
        """The batch in arrays of its own, in the dtypes every source takes: callers may reuse theirs at once."""
        return PageReads(np.array(reads.region, dtype=np.int32), np.array(reads.page, dtype=np.int64),
                         np.array(reads.buffer, dtype=np.int32))

    def _refuse_read(self, reads: PageReads, pool: PageBufferPool, what: int, i: int) -> None:
        """Raise BAD_INPUT for read `i`, the batch's first out of range of kind `what` (BAD_*), naming it."""
        region = int(reads.region[i])
        if what == BAD_REGION:
            raise SlackTierError(ErrorKind.BAD_INPUT, f"read {i} names region {region} of {len(self.regions)}",
                                 fix="index the source's region list")
        if what == BAD_PAGE:
            raise SlackTierError(ErrorKind.BAD_INPUT, f"page outside its region of {self._region_pages[region]} "
                                 "pages", fix="ask only for pages the region holds",
                                 **self._where(region, int(reads.page[i])))
        raise SlackTierError(ErrorKind.BAD_INPUT, f"read {i} targets buffer {reads.buffer[i]} of a pool of "
                             f"{pool.capacity}", fix="size the pool to the pages of one step")

    def _where(self, region: int, page: int) -> dict[str, Any]:
        """Location keywords for SlackTierError: region index 2, page 7 -> layer, rank, page."""
        r = self.regions[region]
        return {"layer": r.layer, "rank": r.rank, "page": int(page)}

    def _results_error(self, res: np.ndarray, part: Part) -> SlackTierError | None:
        """For tiers whose read fills `res` ([n] int32, bytes read or -errno): the first read not a full page."""
        bad = np.flatnonzero(res != PAGE_BYTES)
        if not bad.size:
            return None
        i = int(bad[0])
        got = int(res[i])
        where = self._where(int(part.region[i]), int(part.page[i]))
        others = f"; {bad.size - 1} more reads of the batch failed" if bad.size > 1 else ""
        what = self.read_what
        if got == NOT_DONE:
            return SlackTierError(ErrorKind.IO, f"{what}: read never completed{others}", **where,
                                  fix="report this: the I/O engine lost a completion")
        if got < 0:
            return SlackTierError(ErrorKind.IO, f"{what}: read failed: {os.strerror(-got)}{others}", **where,
                                  fix="check the device and the region's file (dmesg, ls -l)")
        return SlackTierError(ErrorKind.IO, f"{what}: short read, {got} of {PAGE_BYTES} bytes{others}", **where,
                              fix="the region's file is shorter than its manifest says; stage it again")

    def _checksum_error(self, part: Part) -> SlackTierError | None:
        """Each read page's CRC32C against the manifest's; the first mismatch as an error, else None."""
        assert self._expected is not None
        want = self._expected[self._region_base[part.region] + part.page]  # [n] uint32
        got = pool_page_crcs(part.pool.pages, part.buffer)                   # [n] uint32
        bad = np.flatnonzero(got != want)
        if not bad.size:
            return None
        i = int(bad[0])
        others = f"; {bad.size - 1} more pages of the batch differ" if bad.size > 1 else ""
        return SlackTierError(ErrorKind.CHECKSUM, f"{self.read_what}: page CRC32C {int(got[i]):#010x}, manifest "
                              f"says {int(want[i]):#010x}{others}",
                              **self._where(int(part.region[i]), int(part.page[i])),
                              fix="the stored page is corrupt; stage the region again")


class QueuedSource(RegionSource, Generic[S]):
    """A page source whose reads run on workers; subclasses implement `_read` (see the module docstring)."""

    def __init__(self, regions: Sequence[Region], *, page_crc32c: Sequence[np.ndarray] | None = None,
                 verify_pages: bool = True) -> None:
        super().__init__(regions, page_crc32c=page_crc32c, verify_pages=verify_pages)
        self._submit_lock = threading.Lock()  # a batch is queued before close's stop markers, or refused
        self._workers: dict[int, list[Worker[S]]] = {}  # device (or ANY_DEVICE) -> its workers
        self._threads: list[threading.Thread] = []

    # -- workers --------------------------------------------------------------------------------

    def _start_workers(self, workers: int = 1, *, per_device: bool = False) -> None:
        """Start `workers` threads (for each device of the regions when `per_device`); raise the first setup error.

        Compiled kernels the workers use are compiled (or loaded from numba's cache) first, by `_warm`, so that
        no first read pays a compile inside a caller's bounded wait."""
        self._warm()
        devices = sorted({int(d) for d in self._region_device}) if per_device else [ANY_DEVICE]
        name = type(self).__name__.removesuffix("Source").lower()
        ready: list[tuple[threading.Event, list[BaseException]]] = []
        for device in devices:
            self._workers[device] = []
            for w in range(workers):
                worker: Worker[S] = Worker(sum(len(v) for v in self._workers.values()), device, queue.SimpleQueue())
                started: tuple[threading.Event, list[BaseException]] = (threading.Event(), [])
                label = f"d{device}-w{w}" if per_device else f"w{w}"
                thread = threading.Thread(target=self._worker_main, args=(worker, started), daemon=True,
                                          name=f"slacktier-{name}-{label}")
                thread.start()
                self._workers[device].append(worker)
                self._threads.append(thread)
                ready.append(started)
        failures = []
        for event, errors in ready:
            event.wait()
            failures.extend(errors)
        if failures:
            self.close()
            raise failures[0]

    def _worker_main(self, worker: Worker[S], started: tuple[threading.Event, list[BaseException]]) -> None:
        try:
            self._open_worker(worker)
        except BaseException as exc:  # reported to _start_workers, which raises it
            started[1].append(exc)
            started[0].set()
            return
        started[0].set()
        try:
            while True:
                part = worker.queue.get()
                if part is None:
                    return
                self._run_part(worker, part)
        finally:
            self._close_worker(worker)

    def _run_part(self, worker: Worker[S], part: Part) -> None:
        t0 = time.thread_time_ns()
        error: BaseException | None
        try:
            error = self._read(worker, part)
            if error is None and self._check_each_read:
                error = self._checksum_error(part)
        except BaseException as exc:  # never leave a ticket hanging; wait() re-raises it
            error = exc
        assert part.ticket is not None
        self._book.finish_part(part.ticket, time.thread_time_ns() - t0 + part.cpu_ns, error)

    # -- what a tier implements -----------------------------------------------------------------

    def _open_worker(self, worker: Worker[S]) -> None:
        """Per-worker setup, on the worker's thread (set `worker.state`); nothing by default."""

    def _close_worker(self, worker: Worker[S]) -> None:
        """Per-worker teardown, on the worker's thread, after its last batch; nothing by default."""

    @abc.abstractmethod
    def _read(self, worker: Worker[S], part: Part) -> SlackTierError | None:
        """Read the part's pages into `part.pool`; the first bad read's error, else None."""

    # -- the interface --------------------------------------------------------------------------

    def submit(self, reads: PageReads, pool: PageBufferPool) -> int:
        """Check and copy the batch, queue it on the workers; returns a ticket at once."""
        self._book.refuse_if_closed()
        region, page, buffer = reads.region, reads.page, reads.buffer
        if (type(region) is np.ndarray and type(page) is np.ndarray and type(buffer) is np.ndarray
                and region.dtype is _I32 and page.dtype is _I64 and buffer.dtype is _I32
                and region.ndim == 1 and region.shape == page.shape == buffer.shape):
            # the step engine's batches: copied and checked in one compiled call (taken_reads)
            region, page, buffer, what, i = taken_reads(region, page, buffer, self._region_pages, pool.capacity)
            reads = PageReads(region, page, buffer)   # ours: callers may reuse theirs at once
            if what >= 0:
                self._refuse_read(reads, pool, what, i)
        else:
            reads = self._copied(reads)
            self._check_reads(reads, pool)
        n = len(reads)
        parts = self._split(reads, pool) if n else []
        with self._submit_lock:
            ticket, t = self._book.open(len(parts), n, pool)
            for worker, part in parts:
                part.ticket = t
                worker.queue.put(part)
        return ticket

    def wait(self, ticket: int, timeout_s: float | None = None) -> ReadStats:
        """Block until the batch landed in the pool; raise SlackTierError naming layer/rank/page on a bad read."""
        return self._book.wait(ticket, timeout_s)

    def close(self) -> None:
        """Finish queued batches, stop the workers (running their teardown); later calls raise CLOSED. Idempotent."""
        with self._submit_lock:
            first = not self._book.closed
            self._book.close()
            if first:
                for workers in self._workers.values():
                    for worker in workers:
                        worker.queue.put(None)
        for thread in self._threads:
            thread.join()

    def _split(self, reads: PageReads, pool: PageBufferPool) -> list[tuple[Worker[S], Part]]:
        """One part per worker that gets reads: by device (per-device workers), then evenly over its workers."""
        region, page, buffer = reads.region, reads.page, reads.buffer
        if len(self._workers) == 1:
            groups: list[tuple[list[Worker[S]], np.ndarray | None]] = [(next(iter(self._workers.values())), None)]
        else:
            device = self._region_device[region]
            groups = [(workers, np.flatnonzero(device == d)) for d, workers in self._workers.items()]
            groups = [(workers, idx) for workers, idx in groups if idx is not None and idx.size]
        out = []
        for workers, idx in groups:
            n = region.shape[0] if idx is None else idx.shape[0]
            k = min(len(workers), n)
            if k <= 1 and idx is None:
                out.append((workers[0], Part(pool, region, page, buffer)))
                continue
            whole = np.arange(n) if idx is None else idx
            chunks = [whole] if k <= 1 else np.array_split(whole, k)
            out.extend((workers[w], Part(pool, region[c], page[c], buffer[c])) for w, c in enumerate(chunks))
        return out
