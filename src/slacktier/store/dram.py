"""Host DRAM tier: every region's pages held in one host array; a read is a memcpy on the DRAM queue's thread.

The pages live in one [total_pages, 4096] uint8 array (region i starts at row
`base[i]`). The source is the disk tier's code (store/disk.py) over host memory
instead of files: its regions are attached to the process's host-memory device
queue (store.devqueue.HOST_MEMORY) as host-memory regions, whose worker copies
each read into the pool. So a DRAM batch goes where a disk batch goes: compiled
code hands it over through the queue's lane (begin_step does not stop for it),
`submit` returns at once, the copy runs with no Python on its thread, and the
queue keeps window order across every DRAM table of the process (layer 1's
pages are copied before layer 14's). The worker needs the C helper but no
io_uring ring, so it serves where io_uring is refused too. Where the helper
cannot be built (no C compiler), the queue is `HostMemoryQueue`: one Python
thread that copies each chunk with a compiled loop (numba, GIL released);
begin_step then submits DRAM batches from Python, as it does for every tier
without a lane.

Neither this array nor the pool is pinned: the engine packs missed rows into
its own pinned staging tensor (see store/base.py, PageBufferPool).

Verification: the pages are read from the staged files once, at open. Given
the manifest's checksums, the source checks every page then, in one compiled
pass, and refuses to open on the first mismatch (CHECKSUM, naming layer, rank
and page); after that it serves without per-read checks, since the bytes
never leave host memory again. So `verify_by_default` is on: it costs one
CRC32C pass at load (compiled, over the bytes once) and nothing per read.
With an `identity`, every target file's header page is checked before the
pages are loaded.

Worked example: regions of 10 and 20 pages -> page 3 of region 1 is row 13.
"""

from __future__ import annotations

import ctypes
import logging
import os
from collections.abc import Sequence
from typing import ClassVar

import numpy as np
from numba import njit

from slacktier.config import DiskOptions, DramOptions
from slacktier.errors import ErrorKind, SlackTierError
from slacktier.store._common import check_file_targets
from slacktier.store._native import IoEngine, helper_missing
from slacktier.store.base import LaneOwner
from slacktier.store.devqueue import HOST_MEMORY, HOST_MEMORY_FD, Device, DeviceQueue
from slacktier.store.disk import DiskSource
from slacktier.store.pread_queue import PreadJob, PreadQueue
from slacktier.store.queued import typed_options
from slacktier.store.registry import register_tier
from slacktier.store.uring_queue import UringLane, UringQueue
from slacktier.tables.layout import PAGE_BYTES
from slacktier.tables.manifest import TableIdentity
from slacktier.tables.odirect import lock_target
from slacktier.tables.pagecrc import page_crcs
from slacktier.tables.regions import Region

log = logging.getLogger(__name__)


@njit(nogil=True, cache=True)
def copy_pages(src: np.ndarray, src_rows: np.ndarray, dst: np.ndarray, dst_rows: np.ndarray) -> None:
    """dst[dst_rows[i]] = src[src_rows[i]] for each i; src, dst C-contiguous [*, 4096] uint8.

    Each page moves as 512 eight-byte words in a plain loop, which the compiler vectorizes; a slice
    assignment of the byte rows compiles to a byte-at-a-time loop."""
    words = PAGE_BYTES // 8
    s64 = src.view(np.uint64).reshape(src.shape[0], words)
    d64 = dst.view(np.uint64).reshape(dst.shape[0], words)
    for i in range(src_rows.shape[0]):
        a = s64[src_rows[i]]
        b = d64[dst_rows[i]]
        for j in range(words):
            b[j] = a[j]


def load_region_pages(spec: Region) -> np.ndarray:
    """Read one region's pages from its file with buffered reads: -> [pages, 4096] uint8."""
    out = np.empty((spec.pages, PAGE_BYTES), dtype=np.uint8)
    try:
        fd = os.open(spec.path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError as exc:
        raise SlackTierError(ErrorKind.MISSING, f"region file {spec.path} does not exist", layer=spec.layer,
                             rank=spec.rank, fix="stage the table first, or fix the path") from exc
    except OSError as exc:
        raise SlackTierError(ErrorKind.IO, f"cannot open region file {spec.path}: {exc.strerror}",
                             layer=spec.layer, rank=spec.rank, fix="check the file's permissions") from None
    try:
        lock_target(fd, spec.path, exclusive=False)   # no stage writes it while it loads (released at close)
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


class _ClientMemory:
    """What both host-memory queues do beside reading: keep each client's page array referenced until the client
    detaches, so the memory a queued read copies from is never freed under it (a source dropped unclosed).
    Mixed in ahead of a device queue class."""

    def __init__(self, device: Device, queue_depth: int, io_threads: int) -> None:
        super().__init__(device, queue_depth, io_threads)   # type: ignore[call-arg]
        self._memory: dict[int, np.ndarray] = {}

    def keep_memory(self, client: int, pages: np.ndarray) -> None:
        self._memory[client] = pages

    def detach(self, client: int) -> None:
        super().detach(client)   # type: ignore[misc]
        self._memory.pop(client, None)


class HostMemoryUringQueue(_ClientMemory, UringQueue):
    """The C device queue over host memory: its worker copies each read, with no ring (a copy needs none, so
    the queue serves where io_uring is refused, as in a container's default seccomp profile).

    The worker runs as an ordinary thread, not a batch-class one as a disk's
    does: a copy is CPU work that must run while the caller keeps its core busy
    with the model, and a batch-class thread waits for the caller's time slice
    to end. So that it does not take the caller's core during begin_step
    instead, its lane defers the copies of the batches a compiled pass queues
    until the pass is done (`HostMemoryLane`)."""

    reads_with: ClassVar[str] = "memcpy on a C worker"

    def __init__(self, device: Device, queue_depth: int, io_threads: int) -> None:
        super().__init__(device, queue_depth, io_threads)
        self.engine.batch_class(False)

    def _start_engine(self) -> IoEngine:
        """`io_threads` workers without a ring, each copying up to `queue_depth` reads per turn of the lock."""
        return IoEngine(0, self.queue_depth, 1, PAGE_BYTES, self.io_threads)

    def lane(self, client: int, source: LaneOwner) -> HostMemoryLane:
        return HostMemoryLane(source, client, self)


class HostMemoryLane(UringLane):
    """The host-memory queue's lane: the C engine's, with the queue's work deferred around a compiled call."""

    defers = True

    def defer(self, on: bool) -> None:
        self.queue.engine.defer(on)


class HostMemoryQueue(_ClientMemory, PreadQueue):
    """The host-memory queue where the C helper cannot be built: the thread queue's admission (window order,
    strict) with `io_threads` threads copying each chunk of reads with a compiled loop."""

    #: pages copied per turn of a thread: its Python between turns needs the GIL, and a copy is short
    chunk_reads: ClassVar[int] = 256
    reads_with: ClassVar[str] = "memcpy on a Python thread"

    def __init__(self, device: Device, queue_depth: int, io_threads: int) -> None:
        super().__init__(device, queue_depth, io_threads)
        self._views: dict[int, list[np.ndarray]] = {}   # client -> its regions' pages, [pages, 4096] each

    def thread_count(self) -> int:
        """One thread per io_thread: a copy needs no depth to hide a device's latency."""
        return self.io_threads

    def attach(self, fd: np.ndarray, offset_bytes: np.ndarray, pages: np.ndarray, priority: np.ndarray,
               io_class: str = "") -> int:
        if np.any(np.asarray(fd) != HOST_MEMORY_FD):
            raise SlackTierError(ErrorKind.BAD_INPUT, "the host-memory queue reads host memory only",
                                 fix="attach files to their device's queue (store.devqueue.acquire_queue)")
        client = super().attach(fd, offset_bytes, pages, priority, io_class)
        with self._work:
            self._views[client] = [np.ctypeslib.as_array((ctypes.c_uint8 * (int(n) * PAGE_BYTES)).from_address(
                int(a))).reshape(int(n), PAGE_BYTES) for a, n in zip(offset_bytes, pages)]
        return client

    def detach(self, client: int) -> None:
        super().detach(client)
        with self._work:
            self._views.pop(client, None)

    def read_chunk(self, client: int, c, job: PreadJob, lo: int, hi: int) -> None:
        """Copy the job's reads lo..hi-1 into its pool, a region at a time; each result is a whole page."""
        views = self._views[client]
        region = job.region[lo:hi]
        for g in np.unique(region):
            at = lo + np.flatnonzero(region == g)
            copy_pages(views[int(g)], job.page[at], job.pool.pages, job.buffer[at])
        job.res[lo:hi] = PAGE_BYTES


class DramSource(DiskSource):
    """Pages held in host memory: loaded from the regions' files, or given as arrays (`pages`, one per region)."""

    read_what = "dram read"
    #: pages are checked once, at load (see the module docstring), so verification costs nothing per read
    verify_by_default = True
    tier_key = "dram"
    fallback_says = "a Python thread copies DRAM pages and begin_step submits them from Python"

    @classmethod
    def _engine_missing(cls) -> str | None:
        """Why the C engine cannot copy here (None: it can): host memory needs the helper, not a ring."""
        return helper_missing()

    def __init__(self, regions: Sequence[Region], options: DramOptions | None = None, *,
                 page_crc32c: Sequence[np.ndarray] | None = None, identity: TableIdentity | None = None,
                 pages: Sequence[np.ndarray] | None = None) -> None:
        opts = typed_options(options, DramOptions)
        if identity is not None:
            self.verify_identity(regions, opts, identity)
        self._given = pages
        # The queue's settings (the disk tier checks the engine's name): the C worker copies up to
        # `queue_depth` reads per turn of its lock; the fallback's one thread copies a chunk per turn.
        disk = DiskOptions(engine=opts.engine, queue_depth=128, io_threads=1)
        super().__init__(regions, disk, page_crc32c=page_crc32c)
        self.engine_name = f"memcpy ({self.engine_name})"

    @classmethod
    def verify_identity(cls, regions: Sequence[Region], options: DramOptions | None,
                        identity: TableIdentity) -> None:
        """Each target file the pages are loaded from carries `identity`'s header, complete."""
        typed_options(options, DramOptions)
        check_file_targets(regions, identity)

    def _open_files(self) -> None:
        """Load every region's pages into the host array (from its file, or as given) and check them."""
        pages, self._given = self._given, None
        if pages is not None and len(pages) != len(self.regions):
            raise SlackTierError(ErrorKind.BAD_INPUT, f"{len(pages)} page arrays for {len(self.regions)} "
                                 "regions", fix="pass one [pages, 4096] uint8 array per region, in order")
        self._pages = np.empty((int(self._region_pages.sum()), PAGE_BYTES), dtype=np.uint8)  # [total_pages, 4096]
        for i, region in enumerate(self.regions):
            lo = int(self._region_base[i])
            if pages is None:
                self._pages[lo:lo + region.pages] = load_region_pages(region)
                continue
            given = np.asarray(pages[i])
            if given.dtype != np.uint8 or given.shape != (region.pages, PAGE_BYTES):
                raise SlackTierError(ErrorKind.BAD_INPUT, f"page array is {given.shape} {given.dtype}, want "
                                     f"({region.pages}, {PAGE_BYTES}) uint8", layer=region.layer, rank=region.rank,
                                     fix="pack rows with slacktier.tables.layout.pack_rows_into_pages")
            self._pages[lo:lo + region.pages] = given
        self._verify_loaded_pages()
        self._check_each_read = False  # checked once above; host memory does not change underneath
        self.nbytes = self._pages.nbytes
        log.info("DramSource: %d regions, %.1f MiB in host memory", len(self.regions), self.nbytes / 2**20)

    def _verify_loaded_pages(self) -> None:
        """Every held page against the manifest's CRC32C (when given); raise CHECKSUM naming the first bad one."""
        if self._expected is None:
            return
        bad = np.flatnonzero(page_crcs(self._pages) != self._expected)
        if not bad.size:
            return
        first = int(bad[0])
        region = int(np.searchsorted(self._region_base, first, side="right")) - 1
        page = first - int(self._region_base[region])
        r = self.regions[region]
        others = f"; {bad.size - 1} more pages differ" if bad.size > 1 else ""
        raise SlackTierError(ErrorKind.CHECKSUM, f"{self.read_what}: a page held for {r.path} does not match its "
                             f"manifest CRC32C at load{others}", layer=r.layer, rank=r.rank, page=page,
                             fix="the staged page is corrupt; stage the region again")

    def _attach(self) -> None:
        super()._attach()
        for att in self._attached:
            att.queue.keep_memory(att.client, self._pages)

    def _target(self, i: int) -> tuple[Device, int, int]:
        """Region i is host memory: the address of its page 0 in the held array."""
        return HOST_MEMORY, HOST_MEMORY_FD, self._pages.ctypes.data + int(self._region_base[i]) * PAGE_BYTES

    @classmethod
    def _queue_class(cls, engine_name: str) -> type[DeviceQueue]:
        return HostMemoryQueue if engine_name == "threads" else HostMemoryUringQueue

    def _warm(self) -> None:
        super()._warm()
        one = np.zeros((1, PAGE_BYTES), np.uint8)
        copy_pages(one, np.zeros(1, np.int64), one.copy(), np.zeros(1, np.int32))


register_tier("dram", DramSource, DramOptions)
