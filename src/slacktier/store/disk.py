"""Local disk tier: O_DIRECT page reads of staged regions, `io_threads` I/O workers per device.

Each region's file (or raw block device) is opened once with O_DIRECT. A batch
is split by `Region.device`; each device has its own `io_threads` worker lanes
(store/queued.py) that drive the reads at up to `queue_depth` in flight with
one of two engines:

- ``io_uring``: a small C helper (csrc/uring_read.c, raw syscalls) queues the
  whole sub-batch and reaps completions with the GIL released.
- ``threads``: a pool of min(queue_depth, PREAD_THREADS_MAX) threads issuing
  ``os.preadv``; the fallback where io_uring cannot be set up (no compiler,
  kernel without io_uring). Choosing it under ``engine="auto"`` is logged at
  WARNING and counted in `ENGINE_FALLBACKS`.

Which engine runs is in `DiskSource.engine_name` and logged at INFO.

Worked example: page 7 of a region at offset 1 MiB -> byte 1048576 + 7 * 4096.
"""

from __future__ import annotations

import logging
import os
import stat
import time
import weakref
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from slacktier.config import DiskOptions
from slacktier.errors import ErrorKind, SlackTierError
from slacktier.store._common import NOT_DONE, check_file_targets
from slacktier.store._native import Ring, probe_io_uring
from slacktier.store.base import PageBufferPool
from slacktier.store.queued import Lane, Part, QueuedSource, typed_options
from slacktier.store.registry import register_tier
from slacktier.tables.layout import PAGE_BYTES
from slacktier.tables.manifest import TableIdentity
from slacktier.tables.regions import Region

log = logging.getLogger(__name__)

ENGINES = ("auto", "io_uring", "threads")
#: how often `engine="auto"` fell back to the thread pool in this process, by reason
ENGINE_FALLBACKS: Counter[str] = Counter()
#: io_uring file/buffer registrations the kernel refused (reads then run unregistered), by kind
REGISTRATION_SKIPS: Counter[str] = Counter()
#: most threads the `threads` engine runs per lane: BENCHMARKS.md ("Disk engine: random 4 KiB reads vs fio")
#: measured 32 threads at 9-11 us CPU per page against 20-30 us for 128, at no lower IOPS
PREAD_THREADS_MAX = 32


@dataclass(slots=True)
class _DiskPart:
    """A part's reads as the engines take them: file, byte offset and destination address of each."""

    pool: PageBufferPool  # kept referenced until the reads land
    buffer: np.ndarray    # [n] int32
    fds: np.ndarray       # [n] int32
    offsets: np.ndarray   # [n] int64, bytes
    addrs: np.ndarray     # [n] uint64, destination addresses


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

    def read(self, part: _DiskPart, res: np.ndarray) -> int:
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
    def _chunk(part: _DiskPart, lo: int, hi: int, res: np.ndarray) -> int:
        t0 = time.thread_time_ns()
        pages = part.pool.pages
        for i in range(lo, hi):
            try:
                res[i] = os.preadv(int(part.fds[i]), [pages[part.buffer[i]]], int(part.offsets[i]))
            except OSError as exc:
                res[i] = -(exc.errno or 5)
        return time.thread_time_ns() - t0

    def read(self, part: _DiskPart, res: np.ndarray) -> int:
        """Fill res with each read's bytes or -errno; returns the pool threads' CPU ns."""
        n = res.shape[0]
        k = min(self._threads, n)
        bounds = [n * j // k for j in range(k + 1)]
        futures = [self._executor.submit(self._chunk, part, bounds[j], bounds[j + 1], res) for j in range(k)]
        return sum(f.result() for f in futures)

    def close(self) -> None:
        self._executor.shutdown(wait=True)


class DiskSource(QueuedSource[_UringEngine | _ThreadEngine]):
    """Pages of staged regions read with O_DIRECT from local files or block devices."""

    read_what = "disk read"
    #: off, by measurement (BENCHMARKS.md, "Read verification cost on the disk tier"): checking each page's
    #: CRC32C added a median 0.91 us CPU per page (0.43-1.35 over 8 rounds) to 2.79 us, and cut IOPS 10%, in
    #: 700-page io_uring batches: over the 0.5 us budget. The device's own sector ECC guards the medium; set
    #: verify_reads = true to check anyway (the disk tier's cost is then that figure).
    verify_by_default = False

    def __init__(self, regions: Sequence[Region], options: DiskOptions | None = None, *,
                 page_crc32c: Sequence[np.ndarray] | None = None, identity: TableIdentity | None = None) -> None:
        super().__init__(regions, page_crc32c=page_crc32c)
        self.options = opts = typed_options(options, DiskOptions)
        if identity is not None:
            self.verify_identity(self.regions, opts, identity)
        # DiskOptions is a msgspec struct: its bounds hold when parsed from a control file, not when built in code.
        if opts.engine not in ENGINES:
            raise SlackTierError(ErrorKind.BAD_INPUT, f"unknown disk engine {opts.engine!r}",
                                 fix=f"choose one of {', '.join(ENGINES)}")
        if not 1 <= opts.queue_depth <= 4096 or not 1 <= opts.io_threads <= 64:
            raise SlackTierError(ErrorKind.BAD_INPUT, f"queue_depth {opts.queue_depth}, io_threads "
                                 f"{opts.io_threads}", fix="use 1 <= queue_depth <= 4096 and 1 <= io_threads <= 64")
        self.queue_depth = opts.queue_depth
        self._fds: dict[str, int] = {}
        try:
            self._open_files()
            self.engine_name = self._choose_engine(opts.engine)
        except BaseException:
            self._close_files()
            raise
        self.devices = sorted({int(d) for d in self._region_device})
        self._region_fd = np.array([self._fds[r.path] for r in self.regions], dtype=np.int32)         # [R]
        self._region_offset = np.array([r.offset_bytes for r in self.regions], dtype=np.int64)  # [R] bytes
        self._start_lanes(opts.io_threads, per_device=True)
        log.info("DiskSource: engine %s, %d regions on %d devices, queue depth %d, %d worker(s) per device",
                 self.engine_name, len(self.regions), len(self.devices), opts.queue_depth, opts.io_threads)

    @classmethod
    def verify_identity(cls, regions: Sequence[Region], options: DiskOptions | None,
                        identity: TableIdentity) -> None:
        """Each target file or device of `regions` carries `identity`'s header, complete (one 4 KiB read each)."""
        typed_options(options, DiskOptions)
        check_file_targets(regions, identity)

    # -- construction ---------------------------------------------------------------------------

    def _open_files(self) -> None:
        for spec in self.regions:
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

    # -- the lanes ------------------------------------------------------------------------------

    def _open_lane(self, lane: Lane[_UringEngine | _ThreadEngine]) -> None:
        # The ring is created on the lane's thread: with IORING_SETUP_SINGLE_ISSUER only it may submit.
        lane.state = (_UringEngine(self.queue_depth, list(self._fds.values())) if self.engine_name == "io_uring"
                      else _ThreadEngine(min(PREAD_THREADS_MAX, self.queue_depth)))

    def _close_lane(self, lane: Lane[_UringEngine | _ThreadEngine]) -> None:
        if lane.state is not None:
            lane.state.close()

    def _read(self, lane: Lane[_UringEngine | _ThreadEngine], part: Part) -> None | SlackTierError:
        assert lane.state is not None
        region, buffer = part.region, part.buffer
        pool = part.pool
        io = _DiskPart(pool, buffer, self._region_fd[region], self._region_offset[region] + part.page * PAGE_BYTES,
                       np.uint64(pool.address(0)) + buffer.astype(np.uint64) * np.uint64(PAGE_BYTES))
        res = np.full(region.shape[0], NOT_DONE, dtype=np.int32)
        part.cpu_ns += lane.state.read(io, res)
        return self._results_error(res, part)

    def close(self) -> None:
        """Finish queued batches, stop the workers, close rings and files; later calls raise CLOSED."""
        super().close()
        self._close_files()

    def _close_files(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


register_tier("disk", DiskSource, DiskOptions)
