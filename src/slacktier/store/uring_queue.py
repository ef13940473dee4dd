"""The io_uring device queue: C worker threads with a ring each, fed from one (priority, arrival) queue.

The C side (csrc/uring_read.c, `st_eng_*`) keeps the queue, the rings and
the jobs; Python attaches clients, counts each job's page pool and keeps
pools mapped while a ring may have them registered: the kernel pins a
registered pool's pages, and a new pool mapped at a freed pool's address
would otherwise be written through the old registration.

The io_uring medium's lane (`UringLane`, store.base.Lane): compiled code
(cache/compiled.py) queues a batch straight on a client with `st_eng_submit`,
by address, passing the client's id; the C engine checks, copies and queues
it, and claiming the job only counts its pool.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from typing import ClassVar

import numpy as np

from slacktier.errors import ErrorKind, SlackTierError
from slacktier.tables.native import WaitInfo
from slacktier.store._native import MAX_ENGINE_THREADS, IoEngine, submit_address
from slacktier.store.base import Lane, LaneOwner, PageBufferPool
from slacktier.store.devqueue import IO_CLASSES, Device, DeviceQueue, Landed
from slacktier.tables.layout import PAGE_BYTES

log = logging.getLogger(__name__)

#: io_uring file/buffer registrations the kernel refused (reads then run unregistered), by kind
REGISTRATION_SKIPS: Counter[str] = Counter()


class UringQueue(DeviceQueue):
    """A device's reads through io_uring: `io_threads` rings of `queue_depth` each, one admission order."""

    engine_name: ClassVar[str] = "io_uring"
    reads_with: ClassVar[str] = "io_uring on C threads"

    def __init__(self, device: Device, queue_depth: int, io_threads: int) -> None:
        super().__init__(device, queue_depth, io_threads)
        self.engine = self._start_engine()
        self._lock = threading.Lock()
        self._pools: dict[int, list] = {}   # pool address -> [pool, live jobs into it]
        #: (buffer, file) registrations the kernel refused, as last counted (reads then run unregistered)
        self.refusals = (0, 0)
        self._traced = 0
        self._client_of_id: list[int] = []
        self.submit_address = submit_address()   # st_eng_submit's, for compiled code

    def _start_engine(self) -> IoEngine:
        """`io_threads` workers with a ring of `queue_depth` each."""
        return IoEngine(self.queue_depth, self.queue_depth, max(1, self.queue_depth // 8), PAGE_BYTES, self.io_threads)

    def attach(self, fd: np.ndarray, offset_bytes: np.ndarray, pages: np.ndarray, priority: np.ndarray,
               io_class: str = "") -> int:
        ioprio = np.full(len(fd), IO_CLASSES[io_class], np.int32)
        with self._lock:   # the C side numbers clients in attach order; the trace names them by that number
            client = self.engine.attach(fd, offset_bytes, pages, priority, ioprio)
            self._client_of_id.append(client)
        return client

    def detach(self, client: int) -> None:
        if not self.engine.detach(client):
            raise SlackTierError(ErrorKind.BAD_INPUT, "a client with jobs not yet released cannot detach",
                                 fix="wait for and release every job first")

    def _keep_mapped(self, pool: PageBufferPool) -> None:
        """Count a job queued into `pool` (by `submit`, or by compiled code through `st_eng_submit`): the pool stays
        referenced, so mapped, until its last job is released and no ring has it registered."""
        with self._lock:
            held = self._pools.get(pool.base)
            if held is None or held[0] is not pool:
                # a new pool at an address still held would be a mapping over a registered one: never, since
                # a held pool is referenced here and so not unmapped
                self._pools[pool.base] = [pool, 1]
            else:
                held[1] += 1

    def lane(self, client: int, source: LaneOwner) -> UringLane:
        """`source`'s lane over client `client`: compiled code calls st_eng_submit with the client's id."""
        return UringLane(source, client, self)

    def submit(self, client: int, region: np.ndarray, page: np.ndarray, buffer: np.ndarray,
               pool: PageBufferPool) -> int:
        job = self.engine.submit(client, region, page, buffer, pool.base, pool.capacity)
        if job > 0:
            self._keep_mapped(pool)
        return job

    def wait(self, job: int, timeout_s: float | None) -> Landed | None:
        info = WaitInfo()
        timeout_ns = -1 if timeout_s is None else max(0, int(timeout_s * 1e9))
        if not self.engine.wait(job, timeout_ns, info):
            self.engine.cancel(job)   # given up: its reads not yet handed to the kernel land as -ECANCELED
            return None
        now = (info.buffers_refused, info.files_refused)
        if now != self.refusals:
            REGISTRATION_SKIPS["buffers"] += now[0] - self.refusals[0]
            REGISTRATION_SKIPS["files"] += now[1] - self.refusals[1]
            log.info("io_uring: the kernel refused to register %s; reads of them run unregistered",
                     "the page buffer pool" if now[0] != self.refusals[0] else "the region files")
            self.refusals = now
        return Landed(info.submit_ns, info.first_ns, info.end_ns, info.cpu_ns, info.first_bad)

    def reads(self, job: int, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        return self.engine.reads(job, n)

    def release(self, job: int, pool: PageBufferPool | None = None) -> None:
        self.engine.release(job)
        if pool is None:
            return
        with self._lock:
            held = self._pools.get(pool.base)
            if held is None:
                return
            held[1] -= 1
            if held[1] > 0:
                return
            # No job of ours reads into it any more: drop every idle pool no ring has registered now.
            registered = self.engine.registered()
            for addr in [a for a, (p, live) in self._pools.items() if live <= 0 and a not in registered]:
                del self._pools[addr]

    def pools_held(self) -> int:
        """Page pools kept mapped for this queue's jobs or ring registrations (every table on the device)."""
        with self._lock:
            return len(self._pools)

    def holds(self, pool: PageBufferPool) -> bool:
        """Whether `pool` is kept mapped for this queue's jobs or a ring's registration."""
        with self._lock:
            held = self._pools.get(pool.base)
            return held is not None and held[0] is pool

    def close(self) -> None:
        self.engine.close()
        with self._lock:
            self._pools.clear()

    # -- store.devqueue.QueueProbe: for tests and benchmarks ---------------------------------------------

    def hold(self, on: bool) -> None:
        """Admit no read while held, so a batch can land late for real (tests)."""
        self.engine.hold(on)

    def strict_order(self, on: bool) -> None:
        """Capability (benchmarks): strict order on (the default: a later layer's first read waits until no
        earlier layer's read is in flight) or off (a later layer's reads fill the depth the earlier one leaves)."""
        self.engine.strict(on)

    def trace(self, reads: int) -> None:
        """Record the next `reads` reads in the order the queue hands them to the device (0: stop)."""
        self.engine.trace(reads)
        self._traced = reads

    def traced(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The reads handed to the device since `trace`, in that order: client id, region, page."""
        ids, region, page = self.engine.traced(self._traced)
        with self._lock:
            clients = np.array(self._client_of_id, dtype=np.int64)
        return clients[ids], region, page


class UringLane(Lane):
    """The io_uring medium's lane: the C engine checks, copies and queues each batch itself (st_eng_submit)."""

    def __init__(self, source: LaneOwner, client: int, queue: UringQueue) -> None:
        super().__init__(source, client, queue.submit_address)
        self.queue = queue

    def _client_word(self) -> int:
        return self.client

    def _claim(self, job: int, pool: PageBufferPool) -> int:
        self.queue._keep_mapped(pool)
        return job


class PreadThreadsQueue(UringQueue):
    """The C device queue without rings: worker threads reading with pread, one read at a time each.

    What the "threads" engine runs where the helper builds: io_uring may still be refused (a container's
    default seccomp profile, `kernel.io_uring_disabled`), and blocking reads on C threads keep the queue's
    order, its lane for compiled code and a worker's wake-up out of the interpreter. queue_depth threads per
    io_thread, at most MAX_ENGINE_THREADS in all: the reads in flight are the threads'. Without the helper,
    the Python thread queue (store.pread_queue) serves instead."""

    engine_name: ClassVar[str] = "threads"
    reads_with: ClassVar[str] = "pread on C threads"

    def _start_engine(self) -> IoEngine:
        return IoEngine(0, 1, 1, PAGE_BYTES, self.thread_count())

    def thread_count(self) -> int:
        """Worker threads: queue_depth per io_thread, at most MAX_ENGINE_THREADS."""
        return min(self.queue_depth * self.io_threads, MAX_ENGINE_THREADS)
