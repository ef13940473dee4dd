"""The thread device queue: Python threads issuing os.preadv, fed from one (priority, arrival) queue.

The "threads" engine where the C helper cannot be built (no compiler); with
it, "threads" is the C device queue without rings (store.uring_queue
.PreadThreadsQueue). min(queue_depth, PREAD_THREADS_MAX) threads per `io_threads` each
take up to `CHUNK_READS` reads at a time from the head of the queue, so at
most that many reads per thread run out of window order. Order is strict, as
on the io_uring queue: a job's first read waits while an earlier-priority job
has reads in flight.
"""

from __future__ import annotations

import errno
import heapq
import os
import threading
import time
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from slacktier.errors import ErrorKind, SlackTierError
from slacktier.store._common import NOT_DONE
from slacktier.store.base import PageBufferPool
from slacktier.store.devqueue import Device, DeviceQueue, Landed
from slacktier.store.tickets import mint
from slacktier.tables.layout import PAGE_BYTES

#: most threads per io_thread: measured, 128 threads spent more CPU per page than 32 for no more IOPS
PREAD_THREADS_MAX = 32
#: reads one thread takes from the queue at a time: fewer lock round trips, little reordering
CHUNK_READS = 4


@dataclass(eq=False)
class _Client:
    fd: np.ndarray          # [R] int32
    offset_bytes: np.ndarray  # [R] int64
    pages: np.ndarray       # [R] int64
    priority: np.ndarray    # [R] int32
    live: int = 0


@dataclass(eq=False)
class PreadJob:
    """One queued batch, as `read_chunk` gets it: the client's region, page and buffer of each read, the pool it
    reads into (anything with its `pages` [capacity, 4096] uint8), and `res`, where each read's result goes
    (bytes, or -errno)."""

    client: int
    region: np.ndarray
    page: np.ndarray
    buffer: np.ndarray
    pool: PageBufferPool
    res: np.ndarray
    submit_ns: int
    admitted: int = 0
    landed: int = 0
    first_ns: int = 0
    end_ns: int = 0
    cpu_ns: int = 0
    done: bool = False
    first_bad: int = -1     # the first read whose result is not a whole page, found once it is done (-1: none)


class PreadQueue(DeviceQueue):
    """A device's reads through os.preadv threads, one admission order."""

    engine_name: ClassVar[str] = "threads"
    reads_with: ClassVar[str] = "os.preadv on Python threads"
    #: reads a thread takes from the queue at a time (a subclass whose reads are memory copies may take more)
    chunk_reads: ClassVar[int] = CHUNK_READS

    def __init__(self, device: Device, queue_depth: int, io_threads: int) -> None:
        super().__init__(device, queue_depth, io_threads)
        lock = threading.Lock()
        self._work = threading.Condition(lock)
        self._done = threading.Condition(lock)
        self._queue: list[tuple[int, int, PreadJob]] = []   # heap of (priority, arrival, job)
        self._active: list[tuple[int, PreadJob]] = []         # jobs with reads handed out, not all landed
        self._jobs: dict[int, PreadJob] = {}
        self._clients: dict[int, _Client] = {}
        self._stop = False
        self._held = False
        self._trace_cap = 0
        self._trace: list[tuple[int, int, int]] = []
        self._threads = [threading.Thread(target=self._worker, daemon=True, name=f"slacktier-pread-{device.name}-{i}")
                         for i in range(self.thread_count())]
        for t in self._threads:
            t.start()

    def thread_count(self) -> int:
        """Worker threads: min(queue_depth, PREAD_THREADS_MAX) per io_thread."""
        return min(self.queue_depth, PREAD_THREADS_MAX) * self.io_threads

    def attach(self, fd: np.ndarray, offset_bytes: np.ndarray, pages: np.ndarray, priority: np.ndarray,
               io_class: str = "") -> int:
        if io_class:
            # the threads read for every client: a per-read class would need ioprio_set around each read
            raise SlackTierError(ErrorKind.UNAVAILABLE, f"io_class {io_class!r} on the threads engine",
                                 fix="use the io_uring engine, which sets the class per read")
        client = mint()
        with self._work:
            self._clients[client] = _Client(np.array(fd, np.int32), np.array(offset_bytes, np.int64),
                                            np.array(pages, np.int64), np.array(priority, np.int32))
        return client

    def detach(self, client: int) -> None:
        with self._work:
            if self._clients[client].live:
                raise SlackTierError(ErrorKind.BAD_INPUT, "a client with jobs not yet released cannot detach",
                                     fix="wait for and release every job first")
            del self._clients[client]

    def submit(self, client: int, region: np.ndarray, page: np.ndarray, buffer: np.ndarray,
               pool: PageBufferPool) -> int:
        region, page, buffer = (np.array(region, np.int32), np.array(page, np.int64), np.array(buffer, np.int32))
        with self._work:
            if self._stop:
                raise SlackTierError(ErrorKind.CLOSED, "the device queue is closed", fix="open a new source")
            c = self._clients[client]
            n = region.shape[0]
            if n:
                bad = np.flatnonzero((region < 0) | (region >= c.pages.shape[0]))
                if not bad.size:
                    bad = np.flatnonzero((page < 0) | (page >= c.pages[region]) | (buffer < 0) |
                                         (buffer >= pool.capacity))
                if bad.size:
                    return -(int(bad[0]) + 1)
            job = mint()
            self._queue_job(job, PreadJob(client, region, page, buffer, pool, np.full(n, NOT_DONE, np.int32),
                                          time.perf_counter_ns()), int(c.priority[region].min()) if n else 0)
            return job

    def enqueue(self, job: int, batch: PreadJob, priority: int) -> None:
        """Queue a batch already checked against its client's regions and its pool (arrays the queue may keep),
        with admission `priority`, as job `job` (a number from store.tickets.mint): a batch checked and timed
        elsewhere, such as one compiled code recorded. Raises CLOSED once the queue is closed."""
        with self._work:
            if self._stop:
                raise SlackTierError(ErrorKind.CLOSED, "the device queue is closed", fix="open a new source")
            self._queue_job(job, batch, priority)

    def _queue_job(self, job: int, j: PreadJob, priority: int) -> None:
        """Queue batch `j` as job `job` at admission `priority` (lock held)."""
        self._jobs[job] = j
        self._clients[j.client].live += 1
        if j.region.shape[0] == 0:
            j.done = True
            j.first_ns = j.end_ns = j.submit_ns
        else:
            heapq.heappush(self._queue, (priority, job, j))
            if not self._held:   # a held queue's workers would wake only to wait again (hold(False) wakes them)
                # As many threads as the batch has chunks: each thread woken takes the interpreter from whoever
                # runs next, and a thread that finds nothing to take only waits again. Busy threads go on to the
                # next chunk without a wake-up.
                self._work.notify(-(-j.region.shape[0] // self.chunk_reads))

    def submitted_ns(self, job: int) -> int:
        """When job `job` was queued (perf_counter_ns)."""
        with self._work:
            return self._jobs[job].submit_ns

    @property
    def held(self) -> bool:
        """Whether the queue is held (`hold`): it admits no read."""
        return self._held

    def drain(self) -> None:
        """Block until no read is queued or in flight (a held queue's reads wait for its release), or it closed."""
        with self._done:
            self._done.wait_for(lambda: self._stop or not (self._queue or self._active))

    def _worker(self) -> None:
        while True:
            with self._work:
                while (not self._queue and not self._stop or (self._held and not self._stop)
                       or (self._queue and self._blocked(self._queue[0]))):
                    self._work.wait()
                if not self._queue:
                    return
                job = self._queue[0][2]
                lo = job.admitted
                hi = min(job.region.shape[0], lo + self.chunk_reads)
                job.admitted = hi
                if lo == 0:
                    job.first_ns = time.perf_counter_ns()
                    self._active.append((self._queue[0][0], job))
                if hi == job.region.shape[0]:
                    heapq.heappop(self._queue)
                c = self._clients[job.client]
                if len(self._trace) < self._trace_cap:
                    self._trace.extend((job.client, int(job.region[i]), int(job.page[i])) for i in range(lo, hi))
            t0 = time.thread_time_ns()
            self.read_chunk(job.client, c, job, lo, hi)
            spent = time.thread_time_ns() - t0
            with self._work:
                job.cpu_ns += spent
                job.landed += hi - lo
                if job.landed == job.region.shape[0]:
                    self._land(job)
                    if self._queue:   # a job held back behind it may start (none queued: nobody to wake)
                        self._work.notify_all()

    def _land(self, job: PreadJob) -> None:
        """Every read of `job` has its result: mark it done and find its first bad read once, here rather than in
        each wait (lock held)."""
        bad = np.flatnonzero(job.res != PAGE_BYTES)
        job.first_bad = int(bad[0]) if bad.size else -1
        job.end_ns = time.perf_counter_ns()
        job.done = True
        self._active = [(p, j) for p, j in self._active if j is not job]
        self._done.notify_all()

    def read_chunk(self, client: int, c: _Client, job: PreadJob, lo: int, hi: int) -> None:
        """Read the job's reads lo..hi-1 into its pool, each result in job.res (bytes or -errno); no lock held."""
        pages = job.pool.pages
        for i in range(lo, hi):
            g = job.region[i]
            try:
                job.res[i] = os.preadv(int(c.fd[g]), [pages[job.buffer[i]]],
                                       int(c.offset_bytes[g] + job.page[i] * PAGE_BYTES))
            except OSError as exc:
                job.res[i] = -(exc.errno or 5)

    def _blocked(self, head: tuple[int, int, PreadJob]) -> bool:
        """Strict window order, as the io_uring queue keeps it: a job's first read waits while a job of an
        earlier priority has reads in flight (lock held)."""
        priority, _, job = head
        if job.admitted or self._stop:
            return False
        return any(j.admitted > j.landed and p < priority for p, j in self._active)

    def wait(self, job: int, timeout_s: float | None) -> Landed | None:
        with self._done:
            j = self._jobs[job]
            landed = self._done.wait_for(lambda: j.done, timeout_s)
        if not landed:
            self._give_up(job)
            return None
        return Landed(j.submit_ns, j.first_ns, j.end_ns, j.cpu_ns, j.first_bad)

    def _give_up(self, job: int) -> int:
        """Drop the job's reads not yet handed out (nobody will wait for them); they land at once as -ECANCELED,
        and the job is done when its reads in flight land. How many were dropped."""
        with self._work:
            j = self._jobs[job]
            n = j.region.shape[0] - j.admitted
            if j.done or n <= 0:
                return 0
            self._queue = [e for e in self._queue if e[2] is not j]
            heapq.heapify(self._queue)
            j.res[j.admitted:] = -errno.ECANCELED
            j.admitted = j.region.shape[0]
            j.landed += n
            if j.landed == j.region.shape[0]:
                self._land(j)
            self._work.notify_all()
            return n

    def reads(self, job: int, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        j = self._jobs[job]
        return j.region.copy(), j.page.copy(), j.buffer.copy(), j.res.copy()

    def release(self, job: int, pool: PageBufferPool | None = None) -> None:
        with self._work:
            j = self._jobs.pop(job)
            self._clients[j.client].live -= 1

    def close(self) -> None:
        with self._work:
            self._stop = True
            self._held = False
            self._work.notify_all()
        for t in self._threads:
            t.join()

    # -- store.devqueue.QueueProbe: for tests and benchmarks (the emulated device holds its rank queues too)

    def hold(self, on: bool) -> None:
        """Admit no read while held, so a batch can land late for real (tests)."""
        with self._work:
            self._held = on
            # Wake the threads only when a release leaves them reads to take: a waiting thread has nothing to do
            # with a hold, and each one woken takes the interpreter from whoever runs next (a caller that holds
            # and releases a queue around every step, right before a host pass, pays for each one).
            if not on and self._queue:
                self._work.notify_all()

    def trace(self, reads: int) -> None:
        """Record the next `reads` reads in the order the queue hands them to the device (0: stop)."""
        with self._work:
            self._trace_cap = reads
            self._trace = []

    def traced(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The reads handed to the device since `trace`, in that order: client id, region, page."""
        with self._work:
            t = list(self._trace)
        arr = np.array(t, dtype=np.int64).reshape(-1, 3)
        return arr[:, 0], arr[:, 1].astype(np.int32), arr[:, 2]
