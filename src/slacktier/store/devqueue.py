"""One read queue per physical device, shared by every table of the process that reads from it.

The paper's mechanism (section 4): every lookup of a step is issued when the
step starts, and on a shared device layer 1's reads go ahead of layer 14's,
so layer 14 slows layer 1 only through contention. A queue per table cannot
do that: two tables on one disk each keep `queue_depth` reads in flight and
share the device as equals, and layer 1 waits for both (measured: far longer
than alone).

A `DeviceQueue` serves one physical device. Each table's source attaches its
regions on that device as a client; every batch enters one queue kept in
(priority, arrival) order, where a batch's priority is its layer's window
rank (the layer id: a deeper layer has a longer window), and the workers keep
the device `queue_depth` deep from the head of that order. So layer 14's
reads only fill the depth that layer 1's leave, however many tables, layers
and ranks one process serves.

Three queues implement it (`store/uring_queue.py`: C threads with an io_uring
ring each, or, for the "threads" engine, C threads calling pread without a
ring; `store/pread_queue.py`: Python threads calling os.preadv, where the C
helper cannot be built). The disk tier (`store/disk.py`) gets its queues from
`acquire_queue` and gives them back with `release_queue`; the last table to
leave a device closes its queue.

Settings: `queue_depth` and `io_threads` belong to the device, not to a
table. The first table to open a device's queue sets them; a later table on
the same device that asks for other values is served by the queue as it is,
and that is logged at WARNING and counted in `QUEUE_SETTING_CONFLICTS`
(docs: README, "Disk tier"). Tables that choose different engines on one
device get one queue per engine, and the ordering then holds within each
engine only: also logged at WARNING.

A region attached with fd `HOST_MEMORY_FD` is host memory whose offset is the
address of its page 0: the queue's worker copies its pages (the DRAM tier's
queue, `HOST_MEMORY`), so compiled code hands a DRAM layer's batch over as it
hands a disk's.

Which device: a block device's own number; for a file, the block device of
its filesystem, with a partition mapped to its whole disk through sysfs
(`/sys/dev/block/MAJ:MIN/partition`), since partitions share the disk's
queue. Worked example: a region in /data/t.bin on /dev/nvme0n1p2 (259:2) ->
device 259:0 "nvme0n1", the queue that every table on nvme0n1 shares.
"""

from __future__ import annotations

import abc
import logging
import os
import stat
import threading
from collections import Counter
from dataclasses import dataclass
from typing import ClassVar, Protocol

import numpy as np

from slacktier.store.base import Lane, LaneOwner, PageBufferPool

log = logging.getLogger(__name__)

#: a later table on a device asking for other queue settings than the device queue has, by setting
QUEUE_SETTING_CONFLICTS: Counter[str] = Counter()


@dataclass(frozen=True)
class Device:
    """A physical device: its number (whole disk) and a name for logs ("vda", or "0:52" without sysfs)."""

    number: int
    name: str


#: the queue of the process's host-memory regions (the DRAM tier): no disk has a negative number
HOST_MEMORY = Device(-1, "host memory")
#: the fd a region attached as host memory gives: its offset is then the address of its page 0
HOST_MEMORY_FD = -1


def physical_device(fd: int) -> Device:
    """The whole block device behind an open file or block device (module docstring: worked example)."""
    st = os.fstat(fd)
    number = st.st_rdev if stat.S_ISBLK(st.st_mode) else st.st_dev
    major, minor = os.major(number), os.minor(number)
    sysfs = f"/sys/dev/block/{major}:{minor}"
    try:
        real = os.path.realpath(sysfs)
        if os.path.exists(os.path.join(real, "partition")):   # a partition shares its disk's queue
            real = os.path.dirname(real)
            with open(os.path.join(real, "dev")) as f:
                ma, mi = (int(x) for x in f.read().split(":"))
            number = os.makedev(ma, mi)
        name = os.path.basename(real) if os.path.exists(real) else f"{major}:{minor}"
    except (OSError, ValueError):
        name = f"{major}:{minor}"
    return Device(number, name)


@dataclass(frozen=True)
class Landed:
    """A finished batch: clock readings (CLOCK_MONOTONIC ns, perf_counter_ns's clock) and CPU spent."""

    submit_ns: int
    first_ns: int        # its first read handed to the kernel (time spent queued behind earlier batches before)
    end_ns: int          # its last read landed
    cpu_ns: int          # the queue's worker CPU charged to it
    first_bad: int       # index of its first read that is not a whole page, -1 when none


class DeviceQueue(abc.ABC):
    """One physical device's reads for every table on it, admitted in (priority, arrival) order.

    A client (one table's regions on this device) is attached once; a batch of
    a client's reads is a job. Region indices in a job are the client's own.
    Seven methods and one capability (`lane`); what tests and benchmarks ask
    of a queue is apart, in `QueueProbe`, and what only one engine needs stays
    in it (the io_uring queue's pool registrations and strict order, the
    thread queue's hooks for the emulated queue built on it).
    """

    #: what moves the bytes ("io_uring" or "threads")
    engine_name: ClassVar[str]
    #: how its reads are done, for a person (`slacktier inspect`)
    reads_with: ClassVar[str] = ""

    def __init__(self, device: Device, queue_depth: int, io_threads: int) -> None:
        self.device = device
        self.queue_depth = queue_depth
        self.io_threads = io_threads
        self.users = 0   # sources holding it (acquire_queue / release_queue)

    @abc.abstractmethod
    def attach(self, fd: np.ndarray, offset_bytes: np.ndarray, pages: np.ndarray, priority: np.ndarray,
               io_class: str = "") -> int:
        """Attach a client's regions (file, byte offset, page count and admission priority of each), their reads
        in block-layer I/O priority class `io_class` ("" the process's own: what the disk tier uses, since a
        class measured no gain, see slacktier.config.DiskOptions); the client's id."""

    @abc.abstractmethod
    def detach(self, client: int) -> None:
        """Forget a client whose every job was released."""

    @abc.abstractmethod
    def submit(self, client: int, region: np.ndarray, page: np.ndarray, buffer: np.ndarray,
               pool: PageBufferPool) -> int:
        """Queue reads (int32 region, int64 page, int32 buffer; copied); the job (> 0) at once, or -(i + 1) for
        read i out of range (nothing queued). Raises SlackTierError(CLOSED) once the queue is closed."""

    @abc.abstractmethod
    def wait(self, job: int, timeout_s: float | None) -> Landed | None:
        """Block until the job's reads landed. When `timeout_s` passes first the job is given up (nobody will
        wait for it): its reads not yet handed to the device land at once as -ECANCELED, the job is done when
        its reads in flight land, and None is returned (a later wait polls it: None until then)."""

    @abc.abstractmethod
    def reads(self, job: int, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """A landed job's n reads as submitted and their results: region, page, buffer, bytes read or -errno."""

    @abc.abstractmethod
    def release(self, job: int, pool: PageBufferPool | None = None) -> None:
        """Forget a landed job (that read into `pool`, which the queue may then stop keeping mapped)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Finish queued jobs and stop the workers (idempotent)."""

    def lane(self, client: int, source: LaneOwner) -> Lane | None:
        """Capability: `source`'s lane over its client `client` (store.base.Lane), or None where every batch goes
        through `submit`."""
        return None


class QueueProbe(Protocol):
    """What tests and benchmarks ask of a device queue beyond its interface; both engines' queues answer it."""

    def hold(self, on: bool) -> None:
        """Admit no read while held, so a batch can land late for real (tests)."""

    def trace(self, reads: int) -> None:
        """Record the next `reads` reads in the order the queue hands them to the device (0: stop)."""

    def traced(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The reads handed to the device since `trace`, in that order: client id, region, page."""


#: the ioprio value of each class, level 0 (linux/ioprio.h: class << 13)
IO_CLASSES = {"": 0, "rt": 1 << 13, "be": 2 << 13, "idle": 3 << 13}

#: the process's queue per (engine, device): global because the device is, and every table of the process that
#: reads it must share its one admission order
_queues: dict[tuple[str, int], DeviceQueue] = {}
_lock = threading.Lock()


def acquire_queue(engine: type[DeviceQueue], device: Device, queue_depth: int, io_threads: int,
                  *, who: str) -> DeviceQueue:
    """The process's queue of `engine` on `device`, opened with these settings when it is the first user."""
    with _lock:
        q = _queues.get((engine.engine_name, device.number))
        if q is None:
            others = [k for k in _queues if k[1] == device.number]
            if others:
                log.warning("device %s: %s reads through the %s engine while another table reads it through %s; "
                            "window order holds within each engine only: choose one [table.disk] engine per device",
                            device.name, who, engine.engine_name, others[0][0])
            q = _queues[(engine.engine_name, device.number)] = engine(device, queue_depth, io_threads)
        else:
            for key, asked, kept in (("queue_depth", queue_depth, q.queue_depth),
                                     ("io_threads", io_threads, q.io_threads)):
                if asked != kept:
                    QUEUE_SETTING_CONFLICTS[key] += 1
                    log.warning("device %s: %s asks for %s = %d; the device's queue keeps %d, set by the table that "
                                "opened it (settings are per device: give every table on it the same value)",
                                device.name, who, key, asked, kept)
        q.users += 1
        return q


def release_queue(q: DeviceQueue) -> None:
    """Give back a queue from `acquire_queue`; the last user closes it."""
    with _lock:
        q.users -= 1
        last = q.users == 0
        if last:
            _queues.pop((q.engine_name, q.device.number), None)
    if last:
        q.close()


def open_queues() -> list[DeviceQueue]:
    """The device queues open in this process now (inspect, tests)."""
    with _lock:
        return list(_queues.values())
