"""Local disk tier: O_DIRECT page reads of staged regions, one I/O worker per device.

Each region's file (or raw block device) is opened once with O_DIRECT. A batch
is split by `RegionSpec.device`; each device has its own worker thread(s) that
drive the reads at up to `queue_depth` in flight with one of two engines:

- ``io_uring``: a small C helper (csrc/uring_read.c, raw syscalls) queues the
  whole sub-batch and reaps completions with the GIL released.
- ``threads``: a thread pool issuing ``os.preadv``; the fallback where io_uring
  cannot be set up (no compiler, kernel without io_uring). Choosing it under
  ``engine="auto"`` is logged at WARNING and counted in `ENGINE_FALLBACKS`.

Which engine runs is in `DiskSource.engine_name` and logged at INFO.

Worked example: page 7 of a region at offset 1 MiB -> byte 1048576 + 7 * 4096.
"""

from __future__ import annotations

import logging
import os
import queue
import stat
import threading
import time
import weakref
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from slacktier.errors import ErrorKind, SlackTierError
from slacktier.store._common import (NOT_DONE, RegionTable, TicketBook, _Pending, check_reads, checksum_error,
                                     expected_checksums, own_reads, results_error, stop_workers)
from slacktier.store._native import Ring, probe_io_uring
from slacktier.store.base import PageBufferPool, PageReads, PageSource, ReadStats, RegionSpec
from slacktier.tables.layout import PAGE_BYTES

log = logging.getLogger(__name__)

ENGINES = ("auto", "io_uring", "threads")
#: how often `engine="auto"` fell back to the thread pool in this process, by reason
ENGINE_FALLBACKS: Counter[str] = Counter()
#: io_uring file/buffer registrations the kernel refused (reads then run unregistered), by kind
REGISTRATION_SKIPS: Counter[str] = Counter()


@dataclass
class _Part:
    """The reads of one batch that one worker performs."""

    pending: _Pending | None  # set under the submit lock, before the part is queued
    pool: PageBufferPool   # kept referenced until the reads land
    region: np.ndarray     # [n] int32
    page: np.ndarray       # [n] int64
    buffer: np.ndarray     # [n] int32
    fds: np.ndarray        # [n] int32
    offsets: np.ndarray    # [n] int64, bytes
    addrs: np.ndarray      # [n] uint64, destination addresses


class _UringEngine:
    """Reads through one io_uring ring owned by the calling worker thread.

    The source's files are registered once and each pool's memory when first
    seen, so the kernel skips a file lookup and a page pinning per read. Where
    registration is refused (e.g. RLIMIT_MEMLOCK below the pool size) reads
    still run, unregistered; that is logged and counted in `REGISTRATION_SKIPS`.
    """

    name = "io_uring"

    def __init__(self, queue_depth: int, fds: list[int]) -> None:
        self._depth = queue_depth
        self._wait_batch = max(1, queue_depth // 8)
        self._ring = Ring(queue_depth)
        self._pool: PageBufferPool | None = None  # held while registered: its pages stay pinned by the ring
        self._refused: weakref.WeakSet[PageBufferPool] = weakref.WeakSet()  # pools the kernel would not register
        if len(fds) <= 64:
            self._registration("files", self._ring.register_files(np.array(fds, dtype=np.int32)))

    @staticmethod
    def _registration(what: str, rc: int) -> bool:
        if rc == 0:
            return True
        REGISTRATION_SKIPS[what] += 1
        log.info("io_uring: registering %s refused (%s); reads of them run unregistered", what, os.strerror(-rc))
        return False

    def read(self, part: _Part, res: np.ndarray) -> int:
        """Fill res with each read's bytes or -errno; returns CPU ns spent off this thread (none here)."""
        pool = part.pool
        if pool is not self._pool and pool not in self._refused:
            if self._registration("buffers", self._ring.register_buffer(pool.address(0), pool.capacity * PAGE_BYTES)):
                self._pool = pool
            else:
                self._pool = None
                self._refused.add(pool)
        rc = self._ring.read(part.fds, part.offsets, part.addrs, PAGE_BYTES, self._depth, self._wait_batch, res)
        if rc < 0:  # the unsubmitted reads carry -errno in res, so the ticket fails naming one of them
            log.error("io_uring_enter failed: %s", os.strerror(-rc))
        return 0

    def close(self) -> None:
        self._ring.close()
        self._pool = None


class _ThreadEngine:
    """Reads with `threads` threads, each issuing blocking os.preadv calls (GIL released in the call)."""

    name = "threads"

    def __init__(self, threads: int) -> None:
        self._threads = threads
        self._executor = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="slacktier-pread")

    @staticmethod
    def _chunk(part: _Part, lo: int, hi: int, res: np.ndarray) -> int:
        t0 = time.thread_time_ns()
        pages = part.pool.pages
        for i in range(lo, hi):
            try:
                res[i] = os.preadv(int(part.fds[i]), [pages[part.buffer[i]]], int(part.offsets[i]))
            except OSError as exc:
                res[i] = -(exc.errno or 5)
        return time.thread_time_ns() - t0

    def read(self, part: _Part, res: np.ndarray) -> int:
        """Fill res with each read's bytes or -errno; returns the pool threads' CPU ns."""
        n = res.shape[0]
        k = min(self._threads, n)
        bounds = [n * j // k for j in range(k + 1)]
        futures = [self._executor.submit(self._chunk, part, bounds[j], bounds[j + 1], res) for j in range(k)]
        return sum(f.result() for f in futures)

    def close(self) -> None:
        self._executor.shutdown(wait=True)


class DiskSource(PageSource):
    """Pages of staged regions read with O_DIRECT from local files or block devices."""

    capabilities = frozenset({"local", "disk", "odirect"})

    def __init__(self, regions: Sequence[RegionSpec], *, engine: str = "auto", queue_depth: int = 128,
                 workers_per_device: int = 1, pool_threads: int = 32, verify_reads: bool = False,
                 page_crc32c: Sequence[np.ndarray] | None = None) -> None:
        if engine not in ENGINES:
            raise SlackTierError(ErrorKind.BAD_INPUT, f"unknown disk engine {engine!r}",
                                 fix=f"choose one of {', '.join(ENGINES)}")
        if not 1 <= queue_depth <= 4096 or workers_per_device < 1 or pool_threads < 1:
            raise SlackTierError(ErrorKind.BAD_INPUT, f"queue_depth {queue_depth}, workers_per_device "
                                 f"{workers_per_device}, pool_threads {pool_threads}",
                                 fix="use 1 <= queue_depth <= 4096 and at least one worker and thread")
        self._table = RegionTable.build(regions)
        self._expected = expected_checksums(self._table, page_crc32c, verify_reads)
        self.verify_reads = verify_reads
        self.queue_depth = queue_depth
        self._fds: dict[str, int] = {}
        try:
            self._open_files()
            self.engine_name = self._choose_engine(engine)
        except BaseException:
            self._close_files()
            raise
        if verify_reads:
            self.capabilities = self.capabilities | {"verify"}
        self._book = TicketBook("DiskSource")
        self._submit_lock = threading.Lock()  # a batch is queued before close's stop markers, or refused
        self.devices = sorted({int(d) for d in self._table.device})
        self._region_fd = np.array([self._fds[s.path] for s in self._table.regions], dtype=np.int32)
        self._region_offset = np.array([s.offset_bytes for s in self._table.regions], dtype=np.int64)
        self._queues: dict[int, list[queue.SimpleQueue]] = {}
        self._threads: list[threading.Thread] = []
        self._start_workers(workers_per_device, pool_threads)
        log.info("DiskSource: engine %s, %d regions on %d devices, queue depth %d, %d worker(s) per device",
                 self.engine_name, len(self._table.regions), len(self.devices), queue_depth, workers_per_device)

    # -- construction ---------------------------------------------------------------------------

    def _open_files(self) -> None:
        for spec in self._table.regions:
            if spec.path not in self._fds:
                try:
                    self._fds[spec.path] = os.open(spec.path, os.O_RDONLY | os.O_DIRECT | os.O_CLOEXEC)
                except FileNotFoundError as exc:
                    raise SlackTierError(ErrorKind.MISSING, f"region file {spec.path} does not exist",
                                         layer=spec.layer, rank=spec.rank,
                                         fix="stage the table first, or fix the path in the manifest") from exc
                except OSError as exc:
                    fix = ("put regions on a filesystem that supports O_DIRECT (not tmpfs)"
                           if exc.errno == 22 else "check the file's permissions")
                    raise SlackTierError(ErrorKind.IO, f"cannot open {spec.path} with O_DIRECT: {exc.strerror}",
                                         layer=spec.layer, rank=spec.rank, fix=fix) from exc
            fd = self._fds[spec.path]
            st = os.fstat(fd)
            size = os.lseek(fd, 0, os.SEEK_END) if stat.S_ISBLK(st.st_mode) else st.st_size
            end = spec.offset_bytes + spec.pages * PAGE_BYTES
            if size < end:
                first_missing = max(0, (size - spec.offset_bytes) // PAGE_BYTES)
                raise SlackTierError(ErrorKind.IO, f"{spec.path} holds {size} bytes, region ends at {end}",
                                     layer=spec.layer, rank=spec.rank, page=first_missing,
                                     fix="the file is truncated; stage the region again")

    def _choose_engine(self, engine: str) -> str:
        if engine == "threads":
            return "threads"
        reason = probe_io_uring()
        if reason is None:
            return "io_uring"
        if engine == "io_uring":
            raise SlackTierError(ErrorKind.UNAVAILABLE, f"io_uring engine asked for but unavailable: {reason}",
                                 fix="choose engine='threads' or 'auto'")
        ENGINE_FALLBACKS[reason] += 1
        log.warning("DiskSource: io_uring unavailable (%s); falling back to the os.preadv thread pool "
                    "(fallback #%d in this process)", reason, sum(ENGINE_FALLBACKS.values()))
        return "threads"

    def _start_workers(self, workers_per_device: int, pool_threads: int) -> None:
        ready: list[tuple[threading.Event, list[BaseException]]] = []
        for device in self.devices:
            self._queues[device] = []
            for w in range(workers_per_device):
                q: queue.SimpleQueue = queue.SimpleQueue()
                started = (threading.Event(), [])
                thread = threading.Thread(target=self._worker, args=(q, started, pool_threads), daemon=True,
                                          name=f"slacktier-disk-d{device}-w{w}")
                thread.start()
                self._queues[device].append(q)
                self._threads.append(thread)
                ready.append(started)
        failures = []
        for event, errors in ready:
            event.wait()
            failures.extend(errors)
        if failures:
            self.close()
            raise failures[0]

    # -- the I/O workers ------------------------------------------------------------------------

    def _worker(self, q: queue.SimpleQueue, started: tuple[threading.Event, list[BaseException]],
                pool_threads: int) -> None:
        try:
            # The ring is created here: with IORING_SETUP_SINGLE_ISSUER only this thread may submit.
            io: _UringEngine | _ThreadEngine = (_UringEngine(self.queue_depth, list(self._fds.values()))
                                                if self.engine_name == "io_uring"
                                                else _ThreadEngine(min(pool_threads, self.queue_depth)))
        except BaseException as exc:  # reported to the constructor, which raises it
            started[1].append(exc)
            started[0].set()
            return
        started[0].set()
        try:
            while True:
                part = q.get()
                if part is None:
                    return
                self._run_part(io, part)
        finally:
            io.close()

    def _run_part(self, io: _UringEngine | _ThreadEngine, part: _Part) -> None:
        t0 = time.thread_time_ns()
        error: BaseException | None = None
        extra_cpu = 0
        try:
            res = np.full(part.region.shape[0], NOT_DONE, dtype=np.int32)
            extra_cpu = io.read(part, res)
            error = results_error(res, part.region, part.page, self._table, "disk read")
            if error is None and self._expected is not None:
                error = checksum_error(part.pool, part.region, part.page, part.buffer, self._table,
                                       self._expected, "disk read")
        except BaseException as exc:  # never leave a ticket hanging; wait() re-raises it
            error = exc
        self._book.finish_part(part.pending, time.thread_time_ns() - t0 + extra_cpu, error)

    # -- the interface --------------------------------------------------------------------------

    def submit(self, reads: PageReads, pool: PageBufferPool) -> int:
        """Queue the batch on the device workers; returns a ticket at once."""
        self._book.refuse_if_closed()
        reads = own_reads(reads)
        check_reads(reads, self._table, pool)
        region, page, buffer = reads.region, reads.page, reads.buffer
        fds = self._region_fd[region]
        offsets = self._region_offset[region] + page * PAGE_BYTES
        addrs = np.uint64(pool.address(0)) + buffer.astype(np.uint64) * np.uint64(PAGE_BYTES)
        if len(self.devices) == 1:
            groups = [(self.devices[0], None)]
        else:
            device = self._table.device[region]
            groups = [(d, np.flatnonzero(device == d)) for d in self.devices]
            groups = [(d, idx) for d, idx in groups if idx.size]
        parts: list[tuple[int, int, np.ndarray | None]] = []  # (device, worker, read indices or all)
        for d, idx in groups:
            n = region.shape[0] if idx is None else idx.shape[0]
            k = min(len(self._queues[d]), n)
            if k <= 1:
                parts.append((d, 0, idx))
            else:
                whole = np.arange(n) if idx is None else idx
                parts.extend((d, w, chunk) for w, chunk in enumerate(np.array_split(whole, k)))
        if not region.shape[0]:
            return self._book.open(0, 0)[0]
        batch = []
        for d, w, idx in parts:
            if idx is None:
                part = _Part(None, pool, region, page, buffer, fds, offsets, addrs)
            else:
                part = _Part(None, pool, region[idx], page[idx], buffer[idx], fds[idx], offsets[idx], addrs[idx])
            batch.append((self._queues[d][w], part))
        with self._submit_lock:
            ticket, pending = self._book.open(len(batch), int(region.shape[0]))
            for q, part in batch:
                part.pending = pending
                q.put(part)
        return ticket

    def wait(self, ticket: int, timeout_s: float | None = None) -> ReadStats:
        """Block until the batch landed in the pool; raise SlackTierError naming layer/rank/page on a bad read."""
        return self._book.wait(ticket, timeout_s)

    def close(self) -> None:
        """Finish queued batches, stop the workers, close rings and files; later calls raise CLOSED."""
        stop_workers(self._book, self._submit_lock, [q for qs in self._queues.values() for q in qs], self._threads)
        self._threads.clear()
        self._close_files()

    def _close_files(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
