"""Local disk tier: O_DIRECT page reads of staged regions, `io_threads` I/O workers per device.

Each region's file (or raw block device) is opened once with O_DIRECT. A batch
is split by `Region.device`; each device has `io_threads` workers that drive
the reads at up to `queue_depth` in flight with one of two engines:

- ``io_uring``: each worker is a C thread owning one ring (csrc/uring_read.c,
  `st_eng_*`, raw syscalls; region files and the page pool registered with
  the ring). `submit` hands a whole batch over in one compiled call: C checks
  every read against the regions and the pool, copies the batch, queues it
  and wakes the worker, so no Python runs per batch on the I/O side and the
  caller's cost does not grow with the GIL's other users (issue 14). `wait`
  blocks in C with the GIL released.
- ``threads``: worker lanes (store/queued.py), each with a pool of
  min(queue_depth, PREAD_THREADS_MAX) threads issuing ``os.preadv``; the
  fallback where io_uring cannot be set up (no compiler, kernel without
  io_uring). Choosing it under ``engine="auto"`` is logged at WARNING and
  counted in `ENGINE_FALLBACKS`.

A read that times out stays with its worker: its ticket is set aside and
released once the worker finishes it, and every page pool the worker may have
registered stays mapped until then, so the kernel never writes into memory
that was handed to someone else.

Which engine runs is in `DiskSource.engine_name` and logged at INFO.

Worked example: page 7 of a region at offset 1 MiB -> byte 1048576 + 7 * 4096.
"""

from __future__ import annotations

import logging
import os
import stat
import time
import threading
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from slacktier.config import DiskOptions
from slacktier.errors import ErrorKind, SlackTierError
from slacktier.store._common import NOT_DONE, check_file_targets, timeout_error
from slacktier.store._native import (INFO_BUFFERS_REFUSED, INFO_CPU_NS, INFO_END_NS, INFO_FILES_REFUSED,
                                     INFO_FIRST_BAD, INFO_SUBMIT_NS, IoEngine, probe_io_uring, submit_address)
from slacktier.store.base import PageBufferPool, PageReads, ReadStats
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
    """A part's reads as the thread engine takes them: file, byte offset and destination address of each."""

    pool: PageBufferPool  # kept referenced until the reads land
    buffer: np.ndarray    # [n] int32
    fds: np.ndarray       # [n] int32
    offsets: np.ndarray   # [n] int64, bytes
    addrs: np.ndarray     # [n] uint64, destination addresses


@dataclass(eq=False, slots=True)
class _Job:
    """One part of a batch on one C I/O engine."""

    lane: Lane
    handle: int
    n: int                 # reads
    seq: int               # the engine's job count at submit: jobs of one engine finish in this order


@dataclass(eq=False, slots=True)
class _Ticket:
    jobs: list[_Job]
    pool: PageBufferPool   # kept referenced until the reads land
    pages: int
    submit_ns: int


@dataclass(eq=False)
class _EngineState:
    """A lane of the io_uring path: its C engine and the pools it may still have registered."""

    engine: IoEngine
    seq: int = 0
    # [pool, seq of its last job]: the pools the engine's thread may have registered with the ring, kept
    # mapped here so the kernel never reads into a new mapping at an old pool's address
    held: list = field(default_factory=list)
    refusals: tuple[int, int] = (0, 0)   # (buffer, file) registrations the kernel refused, as last counted

    def note_submit(self, pool: PageBufferPool) -> int:
        self.seq += 1
        if self.held and self.held[-1][0] is pool:
            self.held[-1][1] = self.seq
        else:
            self.held.append([pool, self.seq])
        return self.seq

    def note_done(self, pool: PageBufferPool, seq: int) -> None:
        """Job `seq` (into `pool`) is done, so every earlier job is: no pool before it is registered any more."""
        self.held = [h for h in self.held if h[1] >= seq or h[0] is pool]


class NativeLane:
    """A DiskSource's one C engine, for compiled code that queues batches on it (`DiskSource.native_lane`).

    Hold `lock` (the source's) around the compiled call: `handle()` is then the engine's address, or 0 when
    batches must go through `submit` (the source is closed and its engine freed, or timed-out jobs wait to be
    reaped), and `adopt` books each job the call queued as a ticket of the source. Holding the lock until then
    keeps a concurrent submit or close from interleaving with the call.
    """

    def __init__(self, source: DiskSource, lock: threading.Lock, submit_address: int, engine: int) -> None:
        self.source = source
        self.lock = lock
        self.submit_address = submit_address   # st_eng_submit's, called by address
        self._engine = engine

    def handle(self) -> int:
        """The engine's address, or 0 when the caller must use `submit` (lock held)."""
        src = self.source
        return 0 if src._book.closed or src._abandoned else self._engine

    def adopt(self, job: int, pages: int, pool: PageBufferPool, submit_ns: int) -> int:
        """Book a job compiled code queued on this engine (lock held); its ticket for `DiskSource.wait`."""
        src = self.source
        lane = src._single
        ticket = src._next_ticket
        src._next_ticket += 1
        src._tickets[ticket] = _Ticket([_Job(lane, job, pages, lane.state.note_submit(pool))], pool, pages,
                                       submit_ns)
        return ticket


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


class DiskSource(QueuedSource[_EngineState | _ThreadEngine]):
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
        self._tickets: dict[int, _Ticket] = {}
        self._next_ticket = 1
        self._abandoned: list[_Ticket] = []   # timed out: their jobs are released once they finish
        if self.engine_name == "io_uring":
            self._start_engines(opts.io_threads)
        else:
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

    # -- io_uring: C I/O engines, a batch handed over in one call ---------------------------------

    def _start_engines(self, per_device: int) -> None:
        """`per_device` C engines (a pthread and a ring each) per device; lanes hold them, no Python thread."""
        self._warm()
        files = np.array(list(self._fds.values()), dtype=np.int32)
        if files.shape[0] > 64:
            files = files[:0]
            REGISTRATION_SKIPS["files"] += 1
        try:
            for device in self.devices:
                self._lanes[device] = []
                for _ in range(per_device):
                    engine = IoEngine(self.queue_depth, self.queue_depth, max(1, self.queue_depth // 8), PAGE_BYTES,
                                      self._region_fd, self._region_offset, self._region_pages, files)
                    lane: Lane[_EngineState] = Lane(sum(len(v) for v in self._lanes.values()), device, None,
                                                    _EngineState(engine))
                    self._lanes[device].append(lane)
        except BaseException:
            self._close_engines()
            raise
        self._lock = threading.Lock()
        self._single = next(iter(self._lanes.values()))[0] if len(self._lanes) == 1 and per_device == 1 else None

    def _close_engines(self) -> None:
        for lanes in self._lanes.values():
            for lane in lanes:
                lane.state.engine.close()   # finishes queued batches first

    def submit(self, reads: PageReads, pool: PageBufferPool) -> int:
        """Queue the batch on the device engines (io_uring), or the worker lanes (threads); a ticket at once.

        io_uring: the C engine checks every read against the regions and the pool and copies the batch in
        the call, so the caller may reuse its arrays at once and no read is queued from a bad batch."""
        if self.engine_name != "io_uring":
            return super().submit(reads, pool)
        with self._lock:
            self._book.refuse_if_closed()
            region, page, buffer = reads.region, reads.page, reads.buffer
            n = region.shape[0]
            if self._abandoned:
                self._reap_abandoned()
            if (self._single is not None and page.shape[0] == n and buffer.shape[0] == n and _native_ok(region, _I32)
                    and _native_ok(page, _I64) and _native_ok(buffer, _I32)):
                parts = [(self._single, region, page, buffer)]
            else:
                copied = PageReads(np.array(region, dtype=np.int32), np.array(page, dtype=np.int64),
                                   np.array(buffer, dtype=np.int32))
                self._check_reads(copied, pool)
                parts = [(lane, p.region, p.page, p.buffer) for lane, p in self._split(copied, pool)] if n else []
            jobs = []
            addr = pool.base
            for lane, r, p, b in parts:
                state = lane.state
                handle = state.engine.submit(r, p, b, addr, pool.capacity)
                if handle < 0:   # a read out of range: nothing of this part was queued
                    if jobs:
                        self._abandoned.append(_Ticket(jobs, pool, 0, 0))
                    self._check_reads(PageReads(r, p, b), pool)   # raises, naming the read
                    raise SlackTierError(ErrorKind.BAD_INPUT, f"read {-handle - 1} is out of range",
                                         fix="ask only for pages the regions hold, into buffers of the pool")
                jobs.append(_Job(lane, handle, r.shape[0], state.note_submit(pool)))
            ticket = self._next_ticket
            self._next_ticket += 1
            self._tickets[ticket] = _Ticket(jobs, pool, n, time.perf_counter_ns())
        return ticket

    def native_lane(self) -> NativeLane | None:
        """Capability: compiled code may queue batches straight on this source's C engine (engine.steppass);
        None when every batch must go through `submit` (the thread engine, several engines per device, or a
        subclass that overrides `submit`, such as a test's fault injector, which must see every batch)."""
        if self.engine_name != "io_uring" or self._single is None or type(self).submit is not DiskSource.submit:
            return None
        return NativeLane(self, self._lock, submit_address(), self._single.state.engine.handle)

    def wait(self, ticket: int, timeout_s: float | None = None) -> ReadStats:
        """Block until the batch landed in the pool (GIL released); raise naming layer/rank/page on a bad read."""
        if self.engine_name != "io_uring":
            return super().wait(ticket, timeout_s)
        with self._lock:
            self._book.refuse_if_closed()
            t = self._tickets.get(ticket)
        if t is None:
            raise SlackTierError(ErrorKind.BAD_INPUT, f"{type(self).__name__} has no ticket {ticket}",
                                 fix="wait once on a ticket that submit returned")
        info = np.empty(6, dtype=np.int64)
        deadline = None if timeout_s is None else time.perf_counter_ns() + int(timeout_s * 1e9)
        first_ns, end_ns, cpu_ns = t.submit_ns, t.submit_ns, 0
        error: SlackTierError | None = None
        for job in t.jobs:
            left = -1 if deadline is None else max(0, deadline - time.perf_counter_ns())
            engine = job.lane.state.engine
            if not engine.wait(job.handle, left, info):
                with self._lock:
                    self._tickets.pop(ticket, None)
                    self._abandoned.append(t)
                raise timeout_error(type(self).__name__, ticket, t.pages, timeout_s)
            first_ns = min(first_ns, int(info[INFO_SUBMIT_NS]))
            end_ns = max(end_ns, int(info[INFO_END_NS]))
            cpu_ns += int(info[INFO_CPU_NS])
            self._count_refusals(job.lane.state, info)
            if error is None and (info[INFO_FIRST_BAD] >= 0 or self._check_each_read):
                c0 = time.thread_time_ns()
                region, page, buffer, res = engine.reads(job.handle, job.n)
                part = Part(t.pool, region, page, buffer)
                error = self._results_error(res, part) if info[INFO_FIRST_BAD] >= 0 else self._checksum_error(part)
                cpu_ns += time.thread_time_ns() - c0
        with self._lock:
            self._tickets.pop(ticket, None)
            for job in t.jobs:
                job.lane.state.note_done(t.pool, job.seq)
                job.lane.state.engine.release(job.handle)
        if error is not None:
            raise error
        return ReadStats(pages=t.pages, read_us=(end_ns - first_ns) / 1e3, cpu_us=cpu_ns / 1e3)

    @staticmethod
    def _count_refusals(state: _EngineState, info: np.ndarray) -> None:
        seen = state.refusals
        now = (int(info[INFO_BUFFERS_REFUSED]), int(info[INFO_FILES_REFUSED]))
        if now != seen:
            REGISTRATION_SKIPS["buffers"] += now[0] - seen[0]
            REGISTRATION_SKIPS["files"] += now[1] - seen[1]
            log.info("io_uring: the kernel refused to register %s; reads of them run unregistered",
                     "the page buffer pool" if now[0] != seen[0] else "the region files")
            state.refusals = now

    def _reap_abandoned(self) -> None:
        """Release the jobs of timed-out tickets that have finished since (under the lock)."""
        info = np.zeros(6, dtype=np.int64)
        keep = []
        for t in self._abandoned:
            if all(job.lane.state.engine.wait(job.handle, 0, info) for job in t.jobs):
                for job in t.jobs:
                    job.lane.state.note_done(t.pool, job.seq)
                    job.lane.state.engine.release(job.handle)
            else:
                keep.append(t)
        self._abandoned = keep

    # -- threads: Python worker lanes -------------------------------------------------------------

    def _open_lane(self, lane: Lane[_ThreadEngine]) -> None:
        lane.state = _ThreadEngine(min(PREAD_THREADS_MAX, self.queue_depth))

    def _close_lane(self, lane: Lane[_ThreadEngine]) -> None:
        if lane.state is not None:
            lane.state.close()

    def _read(self, lane: Lane[_ThreadEngine], part: Part) -> None | SlackTierError:
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
        if self.engine_name == "io_uring":
            with self._lock:
                first = not self._book.closed
                self._book.close()
            if first:
                self._close_engines()   # joins each engine's thread after its queued batches
                self._tickets.clear()
                self._abandoned.clear()
        else:
            super().close()
        self._close_files()

    def _close_files(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


_I32 = np.dtype(np.int32)
_I64 = np.dtype(np.int64)


def _native_ok(a: np.ndarray, dtype: np.dtype) -> bool:
    """`a` can go to the C engine as it is: a C-contiguous ndarray of `dtype` (the engine's scratch views)."""
    return type(a) is np.ndarray and a.dtype is dtype and a.flags.c_contiguous


register_tier("disk", DiskSource, DiskOptions)
