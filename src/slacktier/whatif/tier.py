"""The `emulated` tier: a staged table's regions served from a DRAM copy, landing when a device model says.

This machine's disk reads a page in its own time; the paper's NVMe and RDMA
reads take theirs. To answer "what would my placement cost on *that* device"
here, the `emulated` tier serves a staged table's regions like the disk tier
(the same `DiskSource` code: the regions' files, one queue per device and
rank, window order), but its queue (`EmulatedQueue`, a thread queue) copies
each read from a DRAM copy of the pages (made from the files at attach, so
rows stay bit-exact and the checker runs) and hands the batch back only at
the completion time its emulated device gives (whatif.device, whatif.fluid).

The emulated medium's lane (`EmulatedLane`, store.base.Lane): compiled code
records begin_step's batches in the queue's lane table (whatif.lane), as it
hands a disk's to io_uring. The queue takes them out of the table when its
device seals a TP step, so the device times every rank's batches together
before any rank's step starts, or when the engine books them, whichever
comes first. While a TP step's host passes run the queue is
held: what it queues then is timed and copied at the seal, off the ranks'
clocks, as a disk's C engine works on its own threads.

The tier registers itself when `slacktier.whatif` is imported; `store/` does
not know it. `queue_depth` is recorded with the model; the emulation does not
model a change of depth (the terms are the device's at that depth).
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from typing import ClassVar, Sequence

import numpy as np

from slacktier.config import DiskOptions, Options
from slacktier.errors import ErrorKind, SlackTierError
from slacktier.store._common import check_file_targets
from slacktier.store.base import Lane, PageBufferPool
from slacktier.store.devqueue import Device, DeviceQueue, Landed
from slacktier.store.disk import DiskSource
from slacktier.store.dram import copy_pages, load_region_pages
from slacktier.store.pread_queue import PreadJob, PreadQueue
from slacktier.store.registry import register_tier
from slacktier.store.tickets import mint
from slacktier.tables.layout import PAGE_BYTES
from slacktier.tables.regions import Region
from slacktier.whatif.device import EmulatedDevice, Timing, current_session
from slacktier.whatif.lane import LaneTable, lane_submit_address
from slacktier.whatif.models import load_device_model


class EmulatedQueue(PreadQueue):
    """One rank's queue on an emulated device: the thread queue's admission (window order, strict), one worker
    copying each read from a DRAM copy of the pages, and a batch handed back when its device says it lands."""

    engine_name: ClassVar[str] = "emulated"
    #: pages copied per turn of the worker: its Python between turns needs the GIL, and a copy is short
    chunk_reads: ClassVar[int] = 256

    def __init__(self, device: Device, queue_depth: int, io_threads: int) -> None:
        self.emulated, self.rank = current_session().rank_of(device)
        self._held_pages: dict[int, tuple[np.ndarray, np.ndarray]] = {}   # client -> ([pages, 4096], [R] base)
        self._region_pages: dict[int, np.ndarray] = {}                    # client -> [R] page counts
        self._priority: dict[int, np.ndarray] = {}                        # client -> [R] admission priority
        self._timing: dict[int, Timing] = {}
        self._lanes: dict[int, EmulatedLane] = {}   # client -> its source's lane, once asked for
        self._deferred: list[tuple[int, PreadJob, int]] = []   # (job, batch, priority) taken, not yet queued
        self._lock = threading.Lock()          # our own state: lanes, deferred batches, counters
        self._flushing = threading.Lock()      # a wait() whose job another thread is flushing waits for it
        #: batches queued through the native lane ("lane") and through `submit` ("submit")
        self.batches: Counter[str] = Counter()
        super().__init__(device, queue_depth, io_threads)
        self.emulated.join(self)

    def thread_count(self) -> int:
        return 1   # a memcpy per read: one thread keeps up, and more would only take the host pass's cores

    def attach(self, fd: np.ndarray, offset_bytes: np.ndarray, pages: np.ndarray, priority: np.ndarray,
               io_class: str = "") -> int:
        """Attach as the thread queue does, and copy the client's regions into DRAM from their files, once."""
        client = super().attach(fd, offset_bytes, pages, priority, io_class)
        pages = np.array(pages, np.int64)
        base = np.zeros(pages.shape[0], np.int64)
        base[1:] = np.cumsum(pages)[:-1]
        held = np.empty((int(pages.sum()), PAGE_BYTES), np.uint8)
        for i in range(pages.shape[0]):
            region = Region(layer=0, rank=0, path=f"/proc/self/fd/{int(fd[i])}", offset_bytes=int(offset_bytes[i]),
                            pages=int(pages[i]))
            held[base[i]:base[i] + pages[i]] = load_region_pages(region)
        with self._lock:
            self._held_pages[client] = (held, base)
            self._region_pages[client] = pages
            self._priority[client] = np.array(priority, np.int32)
        return client

    def detach(self, client: int) -> None:
        super().detach(client)
        with self._lock:
            self._held_pages.pop(client, None)
            self._region_pages.pop(client, None)
            self._priority.pop(client, None)
            self._lanes.pop(client, None)

    def lane(self, client: int, source: DiskSource) -> EmulatedLane:
        """`source`'s lane over client `client`: compiled code records its batches in the client's lane table
        (whatif.lane). One per client: its table holds what the last call recorded until the queue takes it."""
        with self._lock:
            lane = self._lanes.get(client)
            if lane is None:
                table = LaneTable(client, self._region_pages[client], self._priority[client])
                lane = self._lanes[client] = EmulatedLane(source, client, self, table)
            return lane

    def _take_recorded(self) -> None:
        """Take the batches compiled code recorded in our lane tables since the last take, each as a job to queue
        at the next flush. Runs between compiled calls only: the engine books every job of a call before its next
        one, and the device seals after every rank's host pass returned."""
        with self._lock:
            lanes = list(self._lanes.values())
        for lane in lanes:
            for batch, priority in lane.table.take_new():
                job = mint()
                with self._lock:
                    lane.jobs.append(job)
                    self.batches["lane"] += 1
                    self._deferred.append((job, batch, priority))

    def claim(self, lane: EmulatedLane, job: int) -> int:
        """Our job for lane job `job` (taken from the table now if not yet), queued and timed now unless the
        queue is held (its device's step pre-phase: then at the seal)."""
        lane.table.check_job(job)
        if job > len(lane.jobs):
            self._take_recorded()
        queued = lane.jobs[job - 1]
        if not self.held:
            self.flush()
        return queued

    def flush(self) -> None:
        """Queue what the lanes recorded and booked, in recording order, and have the device time it."""
        with self._flushing:
            self._take_recorded()
            with self._lock:
                deferred, self._deferred = self._deferred, []
            for job, b, priority in deferred:
                self.enqueue(job, b, priority)
                t = self._timing[job] = Timing(self, priority, b.region.shape[0], b.submit_ns)
                self.emulated.add(t)

    def hold(self, on: bool) -> None:
        if not on:
            self.flush()
        super().hold(on)

    def copy_queued(self) -> None:
        """Let the worker copy every queued read into its pool, and return once all are there (the device's
        `seal`: the step's copies done before any rank's step starts)."""
        self.hold(False)
        self.drain()

    def close(self) -> None:
        self.flush()
        self.emulated.leave(self)
        super().close()

    def read_chunk(self, client: int, c, job: PreadJob, lo: int, hi: int) -> None:
        held, base = self._held_pages[client]
        copy_pages(held, base[job.region[lo:hi]] + job.page[lo:hi], job.pool.pages, job.buffer[lo:hi])
        job.res[lo:hi] = PAGE_BYTES

    def submit(self, client: int, region: np.ndarray, page: np.ndarray, buffer: np.ndarray,
               pool: PageBufferPool) -> int:
        job = super().submit(client, region, page, buffer, pool)
        if job > 0:
            region = np.asarray(region)
            n = int(region.shape[0])
            with self._lock:
                self.batches["submit"] += 1
                priority = int(self._priority[client][region].min()) if n else 0
            t = self._timing[job] = Timing(self, priority, n, self.submitted_ns(job))
            self.emulated.add(t)
        return job

    def wait(self, job: int, timeout_s: float | None) -> Landed | None:
        self.flush()
        deadline = None if timeout_s is None else time.perf_counter_ns() + int(timeout_s * 1e9)
        landed = super().wait(job, timeout_s)   # the bytes are in the pool (given up: see _give_up)
        if landed is None:
            return None
        t = self._timing[job]
        if not self.emulated.wait_landing(t, deadline):
            self._give_up(job)
            return None
        return Landed(t.start_ns, t.start_ns, max(t.land_ns, t.start_ns), landed.cpu_ns, landed.first_bad)

    def _give_up(self, job: int) -> int:
        self.flush()
        n = super()._give_up(job)
        self.emulated.cancel(self._timing[job])
        return n

    def release(self, job: int, pool: PageBufferPool | None = None) -> None:
        super().release(job, pool)
        self._timing.pop(job, None)


class EmulatedLane(Lane):
    """The emulated medium's lane: compiled code calls `_lane_submit` on the client's lane table (whatif.lane);
    each job it records becomes a job of the queue once taken (`EmulatedQueue.claim`)."""

    def __init__(self, source: DiskSource, client: int, queue: EmulatedQueue, table: LaneTable) -> None:
        super().__init__(source, client, lane_submit_address())
        self.queue = queue
        self.table = table
        self.jobs: list[int] = []            # the queue's job for each lane job since the last rearm

    def _client_word(self) -> int:
        """The lane table's address, emptied for this call (every job of the last call was booked)."""
        self.jobs = []
        return self.table.rearm()

    def _claim(self, job: int, pool: PageBufferPool) -> int:
        return self.queue.claim(self, job)


class EmulatedOptions(Options, frozen=True):
    """`[table.emulated]`: which emulated device serves the table, and its model.

    `model`: nvme-paper, rdma-paper, or a TOML file with a [device] table; `device`: the emulated device's
    name (tables and ranks naming one device share it); `rank`: the TP rank whose queue this is.
    """

    device_kind: ClassVar[str] = "model"   # a device model over a host copy (config.Options' facts)
    model: str = "nvme-paper"
    device: str = "emu0"
    rank: int = 0


class EmulatedSource(DiskSource):
    """A staged table served from a DRAM copy through an emulated device's rank queue (module docstring)."""

    read_what = "emulated read"
    verify_by_default = False

    def __init__(self, regions: Sequence[Region], options: EmulatedOptions | None = None, *,
                 page_crc32c: Sequence[np.ndarray] | None = None, identity=None) -> None:
        opts = options if options is not None else EmulatedOptions()
        if not isinstance(opts, EmulatedOptions):
            raise SlackTierError(ErrorKind.BAD_INPUT, f"emulated tier takes EmulatedOptions, got "
                                 f"{type(opts).__name__}", fix="pass EmulatedOptions or None")
        self.model = load_device_model(opts.model)
        self.session = current_session()
        self.emulated: EmulatedDevice = self.session.device(opts.device, self.model)
        self.emulated_options = opts
        super().__init__(regions, DiskOptions(engine="threads", queue_depth=self.model.queue_depth, io_threads=1),
                         page_crc32c=page_crc32c, identity=identity)

    @classmethod
    def verify_identity(cls, regions: Sequence[Region], options: EmulatedOptions | None, identity) -> None:
        """Each target file the DRAM copy is made from carries `identity`'s header, complete."""
        check_file_targets(regions, identity)

    def queue_engine(self) -> type[DeviceQueue]:
        return EmulatedQueue

    def device_of(self, fd: int) -> Device:
        return self.session.rank_queue_device(self.emulated, self.emulated_options.rank)


register_tier("emulated", EmulatedSource, EmulatedOptions)
