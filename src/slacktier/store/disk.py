"""Local disk tier: O_DIRECT page reads of staged regions through one queue per physical device.

Each region's file (or raw block device) is opened once with O_DIRECT. The
regions are grouped by the physical device behind them, and each group is
attached to that device's queue (store/devqueue.py), which this source shares
with every other table of the process on the same device: reads are admitted
in (window, arrival) order, so a later layer's reads only fill the depth an
earlier layer's leave. Two engines drive a queue:

- ``io_uring``: C worker threads owning a ring each (store/uring_queue.py,
  csrc/uring_read.c, raw syscalls; region files and the page pool registered
  with the rings). `submit` hands a whole batch over in one compiled call: C
  checks every read against the regions and the pool, copies the batch,
  queues it and wakes a worker, so no Python runs per batch on the I/O side.
  `wait` blocks in C with the GIL released.
- ``threads``: blocking reads on threads, the fallback where io_uring cannot
  be set up (a container's default seccomp profile, a kernel that disables
  it). Where the helper builds it is the same C queue without rings
  (`PreadThreadsQueue`: queue_depth worker threads calling pread, the same
  admission and lane); without a compiler, Python threads issuing
  ``os.preadv`` (store/pread_queue.py). Choosing it under ``engine="auto"`` is
  logged (at WARNING the first time per reason in a process, then at INFO) and
  counted in `ENGINE_FALLBACKS`.

Compiled code queues batches through the source's lane (`lane()`, store.base.Lane:
the io_uring medium's `UringLane`, or a queue of a tier built on this one),
booked as tickets of the source (store/tickets.py, which mints every ticket).

A batch whose wait times out is given up: its reads not yet handed to the
device are dropped from the queue (nobody will wait for them; the step engine
retires the pool), its ticket is set aside and released once the reads
already in flight land, and the queue keeps every page pool a ring may have
registered mapped until then, so the kernel never writes into memory that
was handed to someone else. Retired pools so come back after a few steps,
however many reads time out (tests/test_store_devqueue.py).

Which engine runs is in `DiskSource.engine_name` and logged at INFO.

Worked example: page 7 of a region at offset 1 MiB -> byte 1048576 + 7 * 4096.
"""

from __future__ import annotations

import logging
import os
import stat
import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from slacktier.config import DiskOptions
from slacktier.errors import ErrorKind, SlackTierError
from slacktier.store._common import check_file_targets
from slacktier.store._native import helper_builds, probe_io_uring
from slacktier.store.base import Lane, PageBufferPool, PageReads, ReadStats
from slacktier.store.devqueue import Device, DeviceQueue, acquire_queue, physical_device, release_queue
from slacktier.store.pread_queue import PreadQueue
from slacktier.store.queued import Part, RegionSource, typed_options
from slacktier.store.registry import register_tier
from slacktier.store.tickets import Ticket, timeout_error
from slacktier.store.uring_queue import (REGISTRATION_SKIPS, PreadThreadsQueue,  # noqa: F401 (counted there)
                                         UringQueue)
from slacktier.tables.layout import PAGE_BYTES
from slacktier.tables.manifest import TARGET_HEADER_BYTES, TableIdentity, parse_header
from slacktier.tables.odirect import lock_target
from slacktier.tables.regions import Region

log = logging.getLogger(__name__)

ENGINES = ("auto", "io_uring", "threads")
#: how often `engine="auto"` fell back to the threads engine in this process, by reason
ENGINE_FALLBACKS: Counter[str] = Counter()
_QUEUES: dict[str, type[DeviceQueue]] = {"io_uring": UringQueue, "threads": PreadQueue}


@dataclass(eq=False)
class _Attached:
    """This source's regions on one device: the device's queue, our client on it, and which regions."""

    queue: DeviceQueue
    client: int
    regions: np.ndarray   # [k] int32, our region indices on this device, in client order


class DiskSource(RegionSource):
    """Pages of staged regions read with O_DIRECT from local files or block devices, through device queues."""

    read_what = "disk read"
    #: off, by measurement (BENCHMARKS.md, "Reads from one disk"): checking each page's CRC32C costs more host
    #: CPU per page than the disk tier's budget and lowers its IOPS. The device's own sector ECC guards the
    #: medium; set verify_reads = true to check anyway.
    verify_by_default = False
    #: the control file's options table of the tier, and what its thread engine is, for the fallback's messages
    #: (a tier built on this one says its own)
    tier_key: ClassVar[str] = "disk"
    fallback_says: ClassVar[str] = "falling back to blocking reads on threads (engine 'threads')"

    def __init__(self, regions: Sequence[Region], options: DiskOptions | None = None, *,
                 page_crc32c: Sequence[np.ndarray] | None = None, identity: TableIdentity | None = None) -> None:
        super().__init__(regions, page_crc32c=page_crc32c)
        self.options = opts = typed_options(options, DiskOptions)
        # DiskOptions is a msgspec struct: its bounds hold when parsed from a control file, not when built in code.
        if opts.engine not in ENGINES:
            raise SlackTierError(ErrorKind.BAD_INPUT, f"unknown {self.tier_key} engine {opts.engine!r}",
                                 fix=f"choose one of {', '.join(ENGINES)}")
        if not 1 <= opts.queue_depth <= 4096 or not 1 <= opts.io_threads <= 64:
            raise SlackTierError(ErrorKind.BAD_INPUT, f"queue_depth {opts.queue_depth}, io_threads "
                                 f"{opts.io_threads}", fix="use 1 <= queue_depth <= 4096 and 1 <= io_threads <= 64")
        self.queue_depth = opts.queue_depth
        self._fds: dict[str, int] = {}
        self._head_fds: dict[str, int] = {}              # per target: a buffered fd holding its shared lock
        self._heads: list[tuple[str, int, bytes]] = []   # per target: path, that fd, its header page at open
        self._attached: list[_Attached] = []
        #: held around a submit, a close, and a lane's arm, compiled call and book (store.base.Lane)
        self.lock = threading.Lock()
        self._abandoned: list[Ticket] = []   # timed out: their jobs are released once they land
        self._lane: Lane | None = None
        try:
            self._open_files()
            if identity is not None:   # under the targets' shared locks: no stage changes them from here on
                self.verify_identity(self.regions, opts, identity)
            self._read_heads()
            self.engine_name = self._choose_engine(opts.engine)
            self._warm()
            self._attach()
        except BaseException:
            self._detach()
            self._close_files()
            raise
        # [R] where each region goes: its device group, and its index in that group's client
        self._region_group = np.zeros(len(self.regions), np.int32)
        self._region_local = np.zeros(len(self.regions), np.int32)
        for g, att in enumerate(self._attached):
            self._region_group[att.regions] = g
            self._region_local[att.regions] = np.arange(att.regions.shape[0], dtype=np.int32)
        # one device holds all our regions, in order (its client's region i is ours): a batch goes over as it is
        self._direct = self._attached[0] if len(self._attached) == 1 else None
        self.devices = [att.queue.device.name for att in self._attached]
        self.engine_name = self._attached[0].queue.engine_name   # what moves the bytes: the queues' engine
        log.info("%s: engine %s, %d regions on device(s) %s, queue depth %d, %d worker(s) per device",
                 type(self).__name__, self.engine_name, len(self.regions), ", ".join(self.devices),
                 self._attached[0].queue.queue_depth, self._attached[0].queue.io_threads)

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
                # A buffered descriptor holds the target's shared lock and re-reads its header page; the O_DIRECT
                # one reads pages. Not the same one: an io_uring ring that registered the O_DIRECT file keeps it
                # open until the ring next idles, and the lock would outlive close() by that long.
                head_fd = self._open(spec, os.O_RDONLY | os.O_CLOEXEC, "")
                self._head_fds[spec.path] = head_fd
                try:
                    lock_target(head_fd, spec.path, exclusive=False)
                except SlackTierError as exc:
                    raise SlackTierError(exc.kind, exc.message, layer=spec.layer, rank=spec.rank,
                                         fix=exc.fix) from None
                self._fds[spec.path] = self._open(spec, os.O_RDONLY | os.O_DIRECT | os.O_CLOEXEC, " with O_DIRECT")
            fd = self._fds[spec.path]
            st = os.fstat(fd)
            size = os.lseek(fd, 0, os.SEEK_END) if stat.S_ISBLK(st.st_mode) else st.st_size
            end = spec.offset_bytes + spec.pages * PAGE_BYTES
            if size < end:
                first_missing = max(0, (size - spec.offset_bytes) // PAGE_BYTES)
                raise SlackTierError(ErrorKind.IO, f"{spec.path} holds {size} bytes, region ends at {end}",
                                     layer=spec.layer, rank=spec.rank, page=first_missing,
                                     fix="the file is truncated; stage the region again")

    @staticmethod
    def _open(spec: Region, flags: int, how: str) -> int:
        try:
            return os.open(spec.path, flags)
        except FileNotFoundError as exc:
            raise SlackTierError(ErrorKind.MISSING, f"region file {spec.path} does not exist",
                                 layer=spec.layer, rank=spec.rank,
                                 fix="stage the table first, or fix the path in the manifest") from exc
        except OSError as exc:
            fix = ("put regions on a filesystem that supports O_DIRECT (not tmpfs)"
                   if exc.errno == 22 else "check the file's permissions")
            raise SlackTierError(ErrorKind.IO, f"cannot open {spec.path}{how}: {exc.strerror}",
                                 layer=spec.layer, rank=spec.rank, fix=fix) from None

    def _read_heads(self) -> None:
        """Each target's header page as it is now (under its shared lock), for `_header_changed` to compare."""
        self._heads = [(path, fd, os.pread(fd, TARGET_HEADER_BYTES, 0)) for path, fd in self._head_fds.items()]

    def _header_changed(self) -> SlackTierError | None:
        """The TARGET error for the first target whose header page changed since this source opened it, or None.

        A stage writes every target's header ("staging", a new stage id) and syncs it before it writes any
        row, so a batch that landed before this re-read and finds the header unchanged read no restaged row,
        even from a stage that ignored the targets' locks. One buffered 4 KiB pread per target (a page-cache
        hit; an O_DIRECT write drops the cached page, so the re-read sees it). The error says which change it
        was: the target truncated (its header page short or gone), its header overwritten by something that
        is not a stage (damaged), or staged again."""
        for path, fd, head in self._heads:
            now = os.pread(fd, TARGET_HEADER_BYTES, 0)
            if now == head:
                continue
            layer = self.regions[0].layer
            if len(now) < TARGET_HEADER_BYTES:
                size = os.lseek(fd, 0, os.SEEK_END)
                return SlackTierError(ErrorKind.TARGET, f"target {path} was truncated under this engine (now {size} "
                                      "bytes, its header page gone); none of this batch's rows is served",
                                      layer=layer, fix="restage the table onto the target and apply a control file "
                                      "naming the manifest that stage writes; find what truncated it")
            if parse_header(now) is None:
                return SlackTierError(ErrorKind.TARGET, f"target {path} is damaged: its header page was overwritten "
                                      "under this engine by something other than a stage; none of this batch's "
                                      "rows is served", layer=layer, fix="restage the table onto the target and "
                                      "apply a control file naming the manifest that stage writes; find what "
                                      "wrote to it")
            return SlackTierError(ErrorKind.TARGET, f"target {path} was staged again under this engine (its header "
                                  "page changed since it was opened); none of this batch's rows is served",
                                  layer=layer, fix="serve the new table: apply a control file naming the manifest "
                                  "that stage wrote (a stage refuses a target an engine holds locked, so another "
                                  "process ignored the lock)")
        return None

    @classmethod
    def _engine_missing(cls) -> str | None:
        """Why the "io_uring" engine cannot serve here (None: it can): the disk's needs a ring."""
        return probe_io_uring()

    @classmethod
    def engine_choice(cls, engine: str) -> tuple[str, str | None, str]:
        """What `engine = <engine>` reads through on this host, without opening anything: the engine's name,
        why "io_uring" cannot serve here (None: it can), and how the queue that would run reads, in words
        (`slacktier inspect`)."""
        reason = None if engine == "threads" else cls._engine_missing()
        name = "io_uring" if engine != "threads" and reason is None else "threads"
        return name, reason, cls._queue_class(name).reads_with

    @classmethod
    def _queue_class(cls, engine_name: str) -> type[DeviceQueue]:
        if engine_name == "threads" and helper_builds():
            return PreadThreadsQueue
        return _QUEUES[engine_name]

    def _choose_engine(self, engine: str) -> str:
        name, reason, _ = self.engine_choice(engine)
        if reason is None:   # as asked: io_uring serves, or "threads" was asked for
            return name
        if engine == "io_uring":
            raise SlackTierError(ErrorKind.UNAVAILABLE, f"io_uring engine asked for but unavailable: {reason}",
                                 fix=f"choose [table.{self.tier_key}] engine = 'threads' or 'auto'")
        ENGINE_FALLBACKS[reason] += 1
        hint = (" In a container, the default seccomp profile refuses io_uring: a profile that allows "
                "io_uring_setup, io_uring_enter and io_uring_register gives it back (docker run --security-opt "
                "seccomp=PROFILE)." if "not permitted" in reason else "")
        # Once per reason and process at WARNING (an engine opens a source per table and reload): the rest at INFO.
        log.log(logging.WARNING if ENGINE_FALLBACKS[reason] == 1 else logging.INFO,
                "%s: io_uring engine unavailable (%s); %s (fallback #%d in this process).%s",
                type(self).__name__, reason, self.fallback_says, sum(ENGINE_FALLBACKS.values()), hint)
        return "threads"

    def _attach(self) -> None:
        """Attach our regions to their devices' queues, one client per device, priority = the region's layer."""
        groups: dict[int, tuple] = {}
        targets = [self._target(i) for i in range(len(self.regions))]
        for i, (device, _, _) in enumerate(targets):
            groups.setdefault(device.number, (device, []))[1].append(i)
        engine = self.queue_engine()
        o = self.options
        for device, members in groups.values():
            idx = np.array(members, dtype=np.int32)
            who = f"layer {self.regions[members[0]].layer}"
            q = acquire_queue(engine, device, o.queue_depth, o.io_threads, who=who)
            try:
                fd = np.array([targets[i][1] for i in members], np.int32)
                offset = np.array([targets[i][2] for i in members], np.int64)
                pages = self._region_pages[idx]
                # Window order: a layer's window grows with its depth, so the lower layer id is read first.
                priority = np.array([self.regions[i].layer for i in members], np.int32)
                client = q.attach(fd, offset, pages, priority)
            except BaseException:
                release_queue(q)
                raise
            self._attached.append(_Attached(q, client, idx))

    def _target(self, i: int) -> tuple[Device, int, int]:
        """Where region i's pages are read: the device whose queue reads them, the fd, and the byte offset of
        its page 0 in that file (a tier built on this one may read from elsewhere, as host memory)."""
        fd = self._fds[self.regions[i].path]
        return self.device_of(fd), fd, self.regions[i].offset_bytes

    def queue_settings_kept(self) -> list[tuple[str, int, int, str]]:
        """(key, asked, kept, device) for each queue setting the options ask for that a device queue this source
        reads through does not run with (another table opened the queue first): `queue_depth` 8 asked on a
        queue opened at 64 -> [("queue_depth", 8, 64, "sda")]."""
        o = self.options
        return [(key, asked, kept, att.queue.device.name) for att in self._attached
                for key, asked, kept in (("queue_depth", o.queue_depth, att.queue.queue_depth),
                                         ("io_threads", o.io_threads, att.queue.io_threads)) if asked != kept]

    def queue_engine(self) -> type[DeviceQueue]:
        """The device-queue class of the chosen engine (a tier built on this one may serve its own): for
        "threads", the C engine's pread threads where the helper builds, else the Python thread queue."""
        return self._queue_class(self.engine_name)

    def device_of(self, fd: int) -> Device:
        """The device whose queue serves a region file (its physical device; a tier built on this one may name
        its own)."""
        return physical_device(fd)

    def _detach(self) -> None:
        for att in self._attached:
            try:
                att.queue.detach(att.client)
            finally:
                release_queue(att.queue)
        self._attached = []

    # -- reads ----------------------------------------------------------------------------------

    def submit(self, reads: PageReads, pool: PageBufferPool) -> int:
        """Queue the batch on its devices' queues; a ticket at once. The queue checks every read against the
        regions and the pool and copies the batch, so the caller may reuse its arrays at once and no read is
        queued from a bad batch."""
        with self.lock:
            self._book.refuse_if_closed()
            if self._abandoned:
                self._reap_abandoned()
            region, page, buffer = reads.region, reads.page, reads.buffer
            n = region.shape[0]
            att = self._direct
            if (att is not None and page.shape[0] == n and buffer.shape[0] == n and _native_ok(region, _I32)
                    and _native_ok(page, _I64) and _native_ok(buffer, _I32)):
                parts = [(att, region, page, buffer)]
            else:
                copied = self._copied(reads)
                self._check_reads(copied, pool)
                parts = []
                group = self._region_group[copied.region]
                for g, att in enumerate(self._attached):
                    sel = np.flatnonzero(group == g) if len(self._attached) > 1 else slice(None)
                    local = np.ascontiguousarray(self._region_local[copied.region[sel]])
                    if local.shape[0]:
                        parts.append((att, local, np.ascontiguousarray(copied.page[sel]),
                                      np.ascontiguousarray(copied.buffer[sel])))
            jobs = []
            for att, r, p, b in parts:
                job = att.queue.submit(att.client, r, p, b, pool)
                if job < 0:   # a read out of range: nothing of this part was queued
                    if jobs:
                        self._abandoned.append(Ticket(0, pool, jobs=jobs))
                    # the whole batch as given (its region ids are the source's): raises, naming the first bad read
                    self._check_reads(self._copied(reads), pool)
                    raise SlackTierError(ErrorKind.BAD_INPUT, f"read {-job - 1} is out of range",
                                         fix="ask only for pages the regions hold, into buffers of the pool")
                jobs.append((att, job, r.shape[0]))
            return self._book.add(Ticket(n, pool, jobs=jobs))

    def busy_or_closed(self) -> bool:
        """Whether batches must go through `submit` now: closed, or timed-out jobs wait to be reaped (lock held)."""
        return self._book.closed or bool(self._abandoned)

    def book(self, job: int, pages: int, pool: PageBufferPool) -> int:
        """A ticket for a queue job that compiled code queued on our one client through our lane (lock held)."""
        return self._book.add(Ticket(pages, pool, jobs=[(self._direct, job, pages)]))

    def lane(self) -> Lane | None:
        """Capability: compiled code may queue batches straight on this source's one queue client
        (cache.compiled), where that queue offers a lane (io_uring's does, store.base.Lane); None when every batch
        must go through `submit` (the thread engine, regions on several devices, or a subclass that overrides
        `submit`, such as a test's fault injector, which must see every batch)."""
        att = self._direct
        if att is None or type(self).submit is not DiskSource.submit:
            return None
        if self._lane is None:
            self._lane = att.queue.lane(att.client, self)
        return self._lane

    def wait(self, ticket: int, timeout_s: float | None = None) -> ReadStats:
        """Block until the batch landed in the pool (GIL released); raise naming layer/rank/page on a bad read."""
        t = self._book.get(ticket)
        deadline = None if timeout_s is None else time.perf_counter_ns() + int(timeout_s * 1e9)
        first_ns = end_ns = None
        cpu_ns = 0
        error: SlackTierError | None = None
        for att, job, n in t.jobs:
            left = None if deadline is None else max(0, deadline - time.perf_counter_ns()) / 1e9
            landed = att.queue.wait(job, left)
            if landed is None:
                with self.lock:
                    self._book.forget(ticket)
                    self._abandoned.append(t)
                # Nobody waits for this batch any more (the step engine retires its pool): the queue gave this
                # job up, dropping its reads not yet handed to the device, and a wait of no time gives up the
                # others, so a device that fell behind catches up and the pool and its memory go back once the
                # reads in flight land (otherwise retired pools pile up while the device lags).
                for a, j, _ in t.jobs:
                    a.queue.wait(j, 0)
                raise timeout_error(type(self).__name__, ticket, t.pages, timeout_s)
            first_ns = landed.submit_ns if first_ns is None else min(first_ns, landed.submit_ns)
            end_ns = landed.end_ns if end_ns is None else max(end_ns, landed.end_ns)
            cpu_ns += landed.cpu_ns
            if error is None and (landed.first_bad >= 0 or self._check_each_read):
                c0 = time.thread_time_ns()
                local, page, buffer, res = att.queue.reads(job, n)
                part = Part(t.pool, att.regions[local], page, buffer)
                error = self._results_error(res, part) if landed.first_bad >= 0 else self._checksum_error(part)
                cpu_ns += time.thread_time_ns() - c0
        with self.lock:
            self._book.forget(ticket)
            for att, job, _ in t.jobs:
                att.queue.release(job, t.pool)
        changed = self._header_changed()
        if changed is not None:
            raise changed
        if error is not None:
            raise error
        read_us = 0.0 if first_ns is None else (end_ns - first_ns) / 1e3
        return ReadStats(pages=t.pages, read_us=read_us, cpu_us=cpu_ns / 1e3)

    def _reap_abandoned(self) -> None:
        """Release the jobs of timed-out tickets that have landed since (under the lock)."""
        keep = []
        for t in self._abandoned:
            if all(att.queue.wait(job, 0) is not None for att, job, _ in t.jobs):
                for att, job, _ in t.jobs:
                    att.queue.release(job, t.pool)
            else:
                keep.append(t)
        self._abandoned = keep

    def hold(self, on: bool) -> None:
        """Capability for tests: hold (admit no read) or release the queues of this source's devices, which
        holds every table on those devices, as a stalled device would."""
        for att in self._attached:
            att.queue.hold(on)   # both engines' queues answer store.devqueue.QueueProbe

    def close(self) -> None:
        """Let queued batches land, leave the device queues (the last user closes one), close the files; later
        calls raise CLOSED. Idempotent."""
        with self.lock:
            first = not self._book.closed
            pending = self._book.close() + self._abandoned
            self._abandoned = []
        if first:
            for t in pending:   # our jobs must land before our files close and our client leaves
                for att, job, _ in t.jobs:
                    att.queue.wait(job, None)
                    att.queue.release(job, t.pool)
            self._detach()
        self._close_files()

    def _close_files(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        for fd in self._head_fds.values():
            os.close(fd)   # drops the target's shared lock
        self._head_fds.clear()
        self._heads = []


_I32 = np.dtype(np.int32)
_I64 = np.dtype(np.int64)


def _native_ok(a: np.ndarray, dtype: np.dtype) -> bool:
    """`a` can go to the C engine as it is: a C-contiguous ndarray of `dtype` (the engine's scratch views)."""
    return type(a) is np.ndarray and a.dtype is dtype and a.flags.c_contiguous


register_tier("disk", DiskSource, DiskOptions)
