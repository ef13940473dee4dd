"""Emulated devices: a device queue whose reads land when a device model says, over real bytes (issue 31).

This VM's disk reads a page in about 12 us; the paper's NVMe in 3.05 us, an
RDMA read of 600-740 pages takes 0.21-0.25 ms. To answer "what would my
placement cost on *that* device" here, the `emulated` tier serves a staged
table's regions like the disk tier (the same `DiskSource` code: the regions'
files, one queue per device and rank, window order), but its queue
(`EmulatedQueue`, a `DeviceQueue`) copies each read from a DRAM copy of the
pages (made from the files at attach, so rows stay bit-exact and the checker
runs) and hands the batch back only at the completion time the device model
gives.

The device model (`DeviceModel`) is the planner's read model (plan.readmodel)
stated for a device: a fixed cost a per batch, a per-page cost b, a
contention cost c_behind per page of a later-window layer that arrives while
an earlier layer's reads are outstanding, the queue depth the terms hold at,
and `ranks_in_fit`, how many TP ranks shared the device when its terms were
measured (the paper's NVMe fit: four; a fit on this disk by `slacktier probe
--read-fit`: one). Built in: `nvme-paper`, `rdma-paper`, `this-disk` (from a
tiers file), or a user's TOML file (`load_device_model`).

How completions are computed (`completions_ms`, pure, tested with exact
numbers): one emulated device is a fluid server shared by every rank queue
mapped to it. A page costs the device tau = b / ranks_in_fit of its time, so
k ranks reading P pages each at once finish after k * tau * P, which for k =
ranks_in_fit is the fit's b * P. Pending work is served in window order
(lower layer first, the device queue's order); jobs of the same layer from
several ranks share the device equally. A job arriving while earlier-window
work is outstanding steals c_behind / ranks_in_fit of device time per page
(the paper's contention of layer 14 on layer 1). A batch lands a after its
last page was served. The ahead term c is not an input: a later layer waits
for the earlier layers' pages by the queue order itself, so it comes out as b
(issue 27 measured c ~ b on this disk). Worked example (nvme-paper, one disk,
four ranks each submitting 700 layer-1 then 700 layer-14 pages at 0): layer 1
lands at 0.30 + 4 * 0.7625 us * 700 + 4 * 0.0925 us * 700 = 2.694 ms, the
paper's T_1 = 0.30 + 3.05 us * 700 + 0.37 us * 700.

Clock: a TP step starts at the same moment on every rank, but one process
runs the four ranks' host passes one after another. So the what-if runner
steps the device (`EmulatedDevice.begin_step` / `seal` / `start_rank`):
every rank's `begin_step` submits with times relative to its own start; once
all ranks submitted, `seal` computes the step's completions and copies every
page of the step into the pools, before any rank's timeline step and off its
clock; each rank's batches then land relative to the moment that rank's
timeline step starts, with nothing of the emulator's left to run beside it. Out of
a step (prefill chunks warming the cache, checker steps) a batch lands
a + tau * pages after its submit, alone.

The native lane: the disk tier's io_uring client is called by address from the cache's compiled pass
(cache.compiled, `st_eng_submit`), so a disk rank's begin_step is one compiled call. The emulated queue offers
the same: `EmulatedSource.native_lane` hands the engine an `EmulatedLane` whose submit (`_lane_submit`, a numba
cfunc with st_eng_submit's C signature and error word) checks a batch against the client's regions and the
pool and copies its page lists, priority and submit time into a `LaneTable` the queue owns, without entering
Python; the source then books each job as a ticket (`EmulatedQueue.adopt`: one slice copied out of the table).
During a TP step's pre-phase the queue defers queuing and timing the booked jobs to the device's `seal`, once
every rank's host pass is done, so begin_step pays for what a disk rank's begin_step pays for and the
emulator's own bookkeeping stays off the ranks' clocks, as its page copies do. A batch the table has no room
for is refused (-ENOSPC) and goes through `submit`; the table then grows (logged, counted in
`LANE_REFUSALS`). Before the lane begin_step took 1.05-1.88 ms per rank at B = 128, much of it the thread
queue's Python submit (docs/bench-log/whatif.md, 14:55). The cfunc is compiled on first use (about 1 s;
numba cannot cache a function that calls clock_gettime through ctypes).

`queue_depth` is recorded with the model and refused at 0; the emulation
does not model a change of depth (the terms are the device's at that depth).
"""

from __future__ import annotations

import ctypes
import errno
import functools
import json
import logging
import math
import threading
import time
import tomllib
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Sequence

import numpy as np
from numba import carray, cfunc, types

from slacktier.config import DiskOptions, Options
from slacktier.errors import ErrorKind, SlackTierError
from slacktier.store._common import check_file_targets
from slacktier.store.base import PageBufferPool
from slacktier.store.devqueue import Device, DeviceQueue, Landed
from slacktier.store.pread_queue import PreadQueue
from slacktier.store.disk import DiskSource, NativeLane, _Ticket
from slacktier.store.dram import copy_pages, load_region_pages
from slacktier.store.registry import register_tier
from slacktier.tables.layout import PAGE_BYTES
from slacktier.tables.regions import Region
from slacktier.errors import read_text

# ---- device models -------------------------------------------------------------------------------------------

#: larger terms are typos (1000 s a read); plan.readmodel bounds its terms the same way
MAX_TERM_MS = 1e6
#: the TOML keys of a device model: [device] name, and these (per-page terms in us)
MODEL_KEYS = ("intercept_ms", "page_us", "behind_page_us", "queue_depth")


@dataclass(frozen=True)
class DeviceModel:
    """A device's read-time terms for emulation (module docstring), with where they came from."""

    name: str
    intercept_ms: float      # a: fixed cost of a batch
    page_us: float           # b: per page, with `ranks_in_fit` ranks sharing the device
    behind_page_us: float    # c_behind: per page of a later-window layer arriving while a batch is outstanding
    queue_depth: int         # the depth the terms hold at (recorded; not a timing input)
    ranks_in_fit: int = 1    # ranks that shared the device when the terms were measured
    origin: str = ""

    def __post_init__(self) -> None:
        for key in ("intercept_ms", "page_us", "behind_page_us"):
            v = getattr(self, key)
            if (not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v < 0
                    or v > MAX_TERM_MS):
                raise SlackTierError(ErrorKind.BAD_INPUT, f"device model {self.name}: {key} = {v!r}",
                                     fix=f"give {key} as a finite number >= 0")
        for key in ("queue_depth", "ranks_in_fit"):
            v = getattr(self, key)
            if not isinstance(v, int) or isinstance(v, bool) or not 1 <= v <= 4096:
                raise SlackTierError(ErrorKind.BAD_INPUT, f"device model {self.name}: {key} = {v!r}",
                                     fix=f"give {key} as an integer in 1..4096")

    def describe(self) -> str:
        """One line: the terms and their origin."""
        return (f"{self.name}: a = {self.intercept_ms:.3f} ms, b = {self.page_us:.3f} us/page, c_behind = "
                f"{self.behind_page_us:.3f} us/page at queue depth {self.queue_depth}, terms of a device shared by "
                f"{self.ranks_in_fit} rank(s) ({self.origin})")


#: the paper's NVMe fit (section 4.1), one disk shared by four TP ranks (plan.constants)
NVME_PAPER = DeviceModel("nvme-paper", 0.30, 3.05, 0.37, 128, 4,
                         "paper section 4.1: T1 = 0.30 ms + 3.05 us P1 + 0.37 us P14, one NVMe shared by four ranks")
#: the paper's RDMA reads (section 6.8): 600-740 pages per rank and layer in 0.21-0.25 ms; a line through the two
#: ends gives b = 0.04 ms / 140 pages = 0.286 us and a = 0.21 - 600 b = 0.039 ms. One NIC per rank (ranks_in_fit 1);
#: no contention term is stated (layer 14's reads are "fully hidden"), so c_behind = 0.
RDMA_PAPER = DeviceModel("rdma-paper", 0.21 - 600 * (0.04 / 140), 1e3 * 0.04 / 140, 0.0, 8, 1,
                         "paper section 6.8: 600-740 pages per rank and layer in 0.21-0.25 ms, one 400 Gb/s NIC "
                         "per rank, 4 threads x 2 queue pairs")
BUILTIN_MODELS = {"nvme-paper": NVME_PAPER, "rdma-paper": RDMA_PAPER}


def model_from_dict(doc: dict, where: str) -> DeviceModel:
    """A DeviceModel from a `[device]` table; refuses a missing, unknown or negative key by name."""
    dev = doc.get("device")
    if not isinstance(dev, dict):
        raise SlackTierError(ErrorKind.BAD_INPUT, f"device model {where}: no [device] table",
                             fix="write [device] with name, " + ", ".join(MODEL_KEYS))
    unknown = sorted(set(dev) - {"name", "ranks_in_fit", "origin", *MODEL_KEYS})
    if unknown:
        raise SlackTierError(ErrorKind.BAD_INPUT, f"device model {where}: unknown key {unknown[0]}",
                             fix="use name, " + ", ".join(MODEL_KEYS) + ", ranks_in_fit, origin")
    for key in MODEL_KEYS:
        if key not in dev:
            raise SlackTierError(ErrorKind.BAD_INPUT, f"device model {where}: {key} is missing",
                                 fix=f"give {key} in [device]")
    return DeviceModel(str(dev.get("name", Path(where).stem)), dev["intercept_ms"], dev["page_us"],
                       dev["behind_page_us"], dev["queue_depth"], dev.get("ranks_in_fit", 1),
                       str(dev.get("origin", where)))


def device_model_toml(m: DeviceModel) -> str:
    """`m` as a TOML file's text, a [device] table that `load_device_model` reads back equal."""
    # strings as JSON writes them: a TOML basic string with the same escapes; floats by repr, which reads back equal
    return (f"[device]\nname = {json.dumps(m.name)}\nintercept_ms = {m.intercept_ms!r}\npage_us = {m.page_us!r}\n"
            f"behind_page_us = {m.behind_page_us!r}\nqueue_depth = {m.queue_depth}\n"
            f"ranks_in_fit = {m.ranks_in_fit}\norigin = {json.dumps(m.origin)}\n")


def load_device_model(spec: str) -> DeviceModel:
    """A built-in model by name (`nvme-paper`, `rdma-paper`) or a TOML file with a [device] table (`this-disk`
    is written as one from a read fit by serve.whatif.this_disk_model)."""
    if spec in BUILTIN_MODELS:
        return BUILTIN_MODELS[spec]
    p = Path(spec)
    if not p.is_file():
        raise SlackTierError(ErrorKind.MISSING, f"device model {spec!r} is neither built in nor a file",
                             fix=f"use one of {', '.join(BUILTIN_MODELS)} or a TOML file with a [device] table")
    text = read_text(p, "device model", "TOML", "write a [device] table (store/emulated.py, device_model_toml)")
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise SlackTierError(ErrorKind.BAD_INPUT, f"device model {spec} is not TOML: {exc}",
                             fix="write a [device] table") from exc
    return model_from_dict(doc, spec)


# ---- the fluid server (pure) -----------------------------------------------------------------------------

@dataclass(frozen=True)
class SimJob:
    """One batch on an emulated device: its key, window priority (layer), pages, and submit time (ms)."""

    key: int
    priority: int
    pages: int
    submit_ms: float


def completions_ms(jobs: Sequence[SimJob], model: DeviceModel) -> dict[int, float]:
    """When each job lands (ms, same clock as submit_ms) on one device serving them all (module docstring).

    Worked example (nvme-paper): two ranks, each 100 pages of layer 1 at 0 -> tau = 0.7625 us; both share the
    device and finish their pages at 2 * 100 * tau = 0.1525 ms, landing at 0.4525 ms.
    """
    tau = model.page_us / model.ranks_in_fit / 1e3
    steal = model.behind_page_us / model.ranks_in_fit / 1e3
    pending = sorted(jobs, key=lambda j: (j.submit_ms, j.priority, j.key))
    left: dict[int, float] = {}
    prio: dict[int, int] = {}
    out: dict[int, float] = {}
    stolen = 0.0
    t = pending[0].submit_ms if pending else 0.0
    i = 0
    while i < len(pending) or left:
        while i < len(pending) and pending[i].submit_ms <= t + 1e-12:
            j = pending[i]
            i += 1
            if j.pages <= 0:
                out[j.key] = j.submit_ms
                continue
            if any(prio[k] < j.priority for k in left):
                stolen += steal * j.pages
            left[j.key] = tau * j.pages
            prio[j.key] = j.priority
        next_arrival = pending[i].submit_ms if i < len(pending) else math.inf
        if not left:
            t = next_arrival
            continue
        if stolen > 0:
            dt = min(stolen, next_arrival - t)
            stolen -= dt
            t += dt
            continue
        top = min(prio[k] for k in left)
        served = [k for k in left if prio[k] == top]
        share = len(served)
        finish = min(left[k] for k in served) * share
        dt = min(finish, next_arrival - t)
        for k in served:
            left[k] -= dt / share
        t += dt
        for k in served:
            if left[k] <= 1e-12:
                del left[k]
                out[k] = t + model.intercept_ms
    return out


# ---- the device and its rank queues ------------------------------------------------------------------------

@dataclass(eq=False)
class _Timing:
    """When one batch lands on its emulated device (perf_counter_ns)."""

    queue: EmulatedQueue
    priority: int
    pages: int
    submit_ns: int
    rel_submit_ns: int = -1      # stepped: ns after its rank's step began; -1 free-running
    land_ns: int = -1            # when it lands; -1 not known yet
    start_ns: int = -1           # its submit time as the step's clock maps it (read_us = land - start)


class EmulatedDevice:
    """One emulated device (a disk, a NIC) shared by the rank queues mapped to it; computes when batches land."""

    def __init__(self, name: str, model: DeviceModel) -> None:
        self.name = name
        self.model = model
        self._lock = threading.Condition()
        self._stepping = False
        self._step_start: dict[int, int] = {}     # rank -> perf_counter_ns its host pass began (pre-phase)
        self._release: dict[int, int] = {}        # rank -> perf_counter_ns its timeline step began
        self._step_jobs: list[_Timing] = []
        self._rel_land: dict[int, float] | None = None   # id(job) -> ms after the rank's step start
        self.queues: list[EmulatedQueue] = []   # the rank queues on this device (each registers itself)

    def begin_step(self) -> None:
        """A TP step begins: batches submitted from now until every rank started are timed together.

        The rank queues copy no page until the device is sealed (`seal`): a real device moves the bytes
        itself, so the copies that stand in for it must not take the CPU from the ranks' host passes, which run
        one after another in this process, nor from their timeline steps. Measured: with the copies running,
        four ranks' begin_step took 3.0-4.9 ms each at B = 128 on this 2-core VM, against 0.2-0.4 ms for one
        rank on the disk tier (docs/bench-log/whatif.md, 2026-12-03 14:37)."""
        with self._lock:
            self._stepping = True
            self._step_start.clear()
            self._release.clear()
            self._step_jobs = []
            self._rel_land = None
            queues = list(self.queues)
        for q in queues:
            q.hold(True)

    def rank_host_pass(self, rank: int, at_ns: int | None = None) -> None:
        """Rank `rank`'s host pass (begin_step) starts at `at_ns` (default now): its batches are timed from here."""
        with self._lock:
            self._step_start[rank] = time.perf_counter_ns() if at_ns is None else at_ns

    def seal(self) -> None:
        """Every rank's host pass of the step is done: queue the batches the ranks' native lanes booked
        (EmulatedQueue.adopt), compute when each lands, and copy every page of the step into its pool, all before
        any rank's step starts and so off every rank's clock. A rank's step then only waits for its batches'
        landing times, as it waits for a real device that moves the bytes itself.

        Before the copies moved here they ran from each rank's step start, in the queue's worker thread beside
        the timeline. Measured (chat B = 128, 2026-12-03, docs/bench-log/whatif.md): on `rdma-paper` a rank's 760
        pages were in the pool 1.8-2.1 ms (median) after the model's landing, and the worker's turns between
        copies took the interpreter from the rank's timeline, whose begin_step hold overran by 1.3-1.9 ms on
        about one step in five: the slowest rank's mean s of 0.9-2.8 ms against medians of 0.17 ms."""
        self._queue_booked()
        with self._lock:
            if self._stepping:
                self._landings()
            queues = list(self.queues)
        for q in queues:
            q.copy_queued()

    def _queue_booked(self) -> None:
        """Queue and time the batches the rank queues' lanes booked (their `flush`)."""
        with self._lock:
            queues = list(self.queues)
        for q in queues:
            q.flush()

    def _landings(self) -> dict[int, float]:
        """id(job) -> ms after its rank's step start, for every batch of the step: computed once, and again after
        `add` or `cancel` changed the step's batches (lock held)."""
        if self._rel_land is None:
            sims = [SimJob(id(j), j.priority, j.pages, j.rel_submit_ns / 1e6) for j in self._step_jobs]
            self._rel_land = completions_ms(sims, self.model)
        return self._rel_land

    def start_rank(self, rank: int, at_ns: int | None = None) -> None:
        """Rank `rank`'s step started at `at_ns` (perf_counter_ns; default now): its batches land relative to it.
        Without a `seal` first (a rank timed inline, beside this machine's disk) its batches are queued and timed
        here, and their pages are copied from now on, beside the rank's step."""
        self._queue_booked()
        with self._lock:
            rel_land = self._landings()
            now = time.perf_counter_ns() if at_ns is None else at_ns
            self._release[rank] = now
            for j in self._step_jobs:
                if j.queue.rank == rank:
                    j.start_ns = now + j.rel_submit_ns
                    j.land_ns = now + int(rel_land[id(j)] * 1e6)
            self._lock.notify_all()
            queues = [q for q in self.queues if q.rank == rank]
        for q in queues:
            q.hold(False)

    def cancel(self, job: _Timing) -> None:
        """Nobody waits for this batch (a timed-out wait): it lands now if its time is not known yet."""
        with self._lock:
            if job.land_ns < 0:
                job.start_ns = job.land_ns = job.submit_ns
                self._step_jobs = [j for j in self._step_jobs if j is not job]
                self._rel_land = None
            self._lock.notify_all()

    def end_step(self) -> None:
        """Back to free-running: batches land a + tau * pages after their submit."""
        with self._lock:
            self._stepping = False
            queues = list(self.queues)
        for q in queues:
            q.hold(False)

    def add(self, job: _Timing) -> None:
        """Time a new batch (under the queue's submit)."""
        with self._lock:
            rank = job.queue.rank
            if self._stepping and rank in self._step_start and rank not in self._release:
                job.rel_submit_ns = job.submit_ns - self._step_start[rank]
                self._step_jobs.append(job)
                self._rel_land = None
                return
            m = self.model
            alone = m.intercept_ms + m.page_us / m.ranks_in_fit / 1e3 * job.pages
            job.start_ns = job.submit_ns
            job.land_ns = job.submit_ns + int(alone * 1e6) if job.pages else job.submit_ns

    def wait_landing(self, job: _Timing, deadline_ns: int | None) -> bool:
        """Block until the job's landing time is known and reached (False when `deadline_ns` came first)."""
        while True:
            with self._lock:
                while job.land_ns < 0:
                    left = None if deadline_ns is None else (deadline_ns - time.perf_counter_ns()) / 1e9
                    if left is not None and left <= 0:
                        return False
                    self._lock.wait(left)
                land = job.land_ns
            now = time.perf_counter_ns()
            if now >= land:
                return True
            if deadline_ns is not None and deadline_ns < land:
                if now >= deadline_ns:
                    return False
                time.sleep((deadline_ns - now) / 1e9)
                return False
            if land - now > _SPIN_NS:
                time.sleep((land - now - _SPIN_NS) / 1e9)
            while time.perf_counter_ns() < land:
                pass
            return True


_SPIN_NS = 100_000   # sleep until this close to a landing, then spin (sleep overshoots by ~60 us here)

_devices: dict[str, EmulatedDevice] = {}
_device_lock = threading.Lock()
#: Device.number -> (device, rank) of the rank queues the emulated sources asked for (acquire_queue keys them)
_rank_queues: dict[int, tuple[EmulatedDevice, int]] = {}


def emulated_device(name: str, model: DeviceModel) -> EmulatedDevice:
    """The process's emulated device `name`, made with `model` on first use; another model for it is refused."""
    with _device_lock:
        dev = _devices.get(name)
        if dev is None:
            dev = _devices[name] = EmulatedDevice(name, model)
        elif dev.model != model:
            raise SlackTierError(ErrorKind.BAD_INPUT, f"emulated device {name!r} already runs model "
                                 f"{dev.model.name}, asked for {model.name}",
                                 fix="one device, one model: name another device for the other model")
        return dev


def emulated_devices() -> list[EmulatedDevice]:
    """The emulated devices of this process (the what-if runner steps them)."""
    with _device_lock:
        return list(_devices.values())


def forget_devices() -> None:
    """Drop every emulated device (between what-if placements; queues still open keep theirs)."""
    with _device_lock:
        _devices.clear()


def rank_queue_device(dev: EmulatedDevice, rank: int) -> Device:
    """The devqueue `Device` of rank `rank`'s queue on `dev`: one queue per (device, rank), as one per process."""
    number = -(1 + (hash((dev.name, rank)) & 0x7FFFFFFF))   # negative: never a real device number
    with _device_lock:
        _rank_queues[number] = (dev, rank)
    return Device(number, f"emulated:{dev.name}/rank{rank}")


# ---- the native lane: compiled code queues a batch without entering Python ---------------------------------

log = logging.getLogger(__name__)

#: a lane table's first room (jobs, reads); a batch that does not fit is refused to Python and the table grows
LANE_JOBS = 16
LANE_PAGES = 8192
#: batches the lane refused to Python for want of room in its table, by reason (each also logged at INFO)
LANE_REFUSALS: Counter[str] = Counter()

# A lane table is one int64 array: these header words, the client's regions (page counts, then admission
# priorities), a record per job (where its reads start, how many, its submit time, its priority), then the jobs'
# reads, each job's as one block of page, region and buffer lists (3 n words), so booking it copies one slice.
L_SELF = 0         # the table's own address (clock_gettime writes its timespec at L_TS)
L_TS = 1           # two words
L_REGIONS = 3
L_JOBS = 4         # job records it holds
L_WORDS = 5        # read words it holds (3 per read), all jobs together
L_USED_JOBS = 6    # recorded since the lane's handle() (the engine books each before it asks again)
L_USED_WORDS = 7
L_NEED_JOBS = 8    # the room a refused batch needed (rearm grows the table to twice that)
L_NEED_WORDS = 9
L_HEADER = 10
J_AT, J_N, J_SUBMIT_NS, J_PRIORITY = 0, 1, 2, 3
J_WORDS = 4

_libc_clock = ctypes.CDLL(None).clock_gettime
_libc_clock.argtypes = (ctypes.c_int, ctypes.c_int64)   # the timespec's address as a word: the same register
_libc_clock.restype = ctypes.c_int
_CLOCK_MONOTONIC = 1   # perf_counter_ns's clock on Linux
_ENOSPC = errno.ENOSPC
_NO_PRIORITY = 2**31 - 1

_LANE_SIG = types.int64(types.CPointer(types.int64), types.int32, types.CPointer(types.int32),
                        types.CPointer(types.int64), types.CPointer(types.int32), types.int64, types.int64,
                        types.CPointer(types.int64))


def _lane_submit(table, n, region, page, buffer, pool_addr, pool_buffers, err):
    """st_eng_submit's contract on a lane table: check every read against the regions and the pool (err = i + 1
    for read i out of range), copy the batch, its submit time and priority into the table, return its job
    (k + 1); 0 and err = -ENOSPC when the table has no room."""
    head = carray(table, L_HEADER)
    n_regions = head[L_REGIONS]
    jobs = head[L_JOBS]
    words = head[L_WORDS]
    jobs_at = L_HEADER + 2 * n_regions
    reads_at = jobs_at + J_WORDS * jobs
    w = carray(table, reads_at + words)
    reg = carray(region, n)
    pg = carray(page, n)
    buf = carray(buffer, n)
    priority = _NO_PRIORITY
    for i in range(n):
        g = reg[i]
        if g < 0 or g >= n_regions or pg[i] < 0 or pg[i] >= w[L_HEADER + g] or buf[i] < 0 or buf[i] >= pool_buffers:
            err[0] = i + 1
            return 0
        priority = min(priority, w[L_HEADER + n_regions + g])
    k = w[L_USED_JOBS]
    at = w[L_USED_WORDS]
    if k >= jobs or at + 3 * n > words:
        w[L_NEED_JOBS] = max(w[L_NEED_JOBS], k + 1)
        w[L_NEED_WORDS] = max(w[L_NEED_WORDS], at + 3 * n)
        err[0] = -_ENOSPC
        return 0
    b = reads_at + at
    for i in range(n):
        w[b + i] = pg[i]
        w[b + n + i] = reg[i]
        w[b + 2 * n + i] = buf[i]
    _libc_clock(_CLOCK_MONOTONIC, w[L_SELF] + 8 * L_TS)
    j = jobs_at + J_WORDS * k
    w[j + J_AT] = at
    w[j + J_N] = n
    w[j + J_SUBMIT_NS] = w[L_TS] * 1_000_000_000 + w[L_TS + 1]
    w[j + J_PRIORITY] = priority if n else 0
    w[L_USED_JOBS] = k + 1
    w[L_USED_WORDS] = at + 3 * n
    err[0] = 0
    return k + 1


@functools.cache
def lane_submit_address() -> int:
    """The address of `_lane_submit` compiled with st_eng_submit's C signature (compiled on first use)."""
    return cfunc(_LANE_SIG, nopython=True)(_lane_submit).address


@dataclass(frozen=True, slots=True)
class LaneJob:
    """A batch compiled code recorded: its reads as one block [page n | region n | buffer n] int64, when."""

    block: np.ndarray
    n: int
    submit_ns: int
    priority: int

    @property
    def page(self) -> np.ndarray:
        return self.block[:self.n]

    @property
    def region(self) -> np.ndarray:
        return self.block[self.n:2 * self.n]

    @property
    def buffer(self) -> np.ndarray:
        return self.block[2 * self.n:]


class LaneTable:
    """One client's batches as compiled code recorded them (`_lane_submit`), until its source books them.

    Guarded by the client's source lock (NativeLane.lock): compiled code records into it only inside a call made
    under that lock, and the source books (`take`s) every job the call returned before it releases it. Worked
    example: a batch of 3 reads then one of 2 -> jobs 1 and 2; job 2's reads are the 6 words after job 1's 9.
    """

    def __init__(self, region_pages: np.ndarray, region_priority: np.ndarray) -> None:
        self.regions = np.concatenate([np.asarray(region_pages, np.int64), np.asarray(region_priority, np.int64)])
        self._alloc(LANE_JOBS, 3 * LANE_PAGES)

    def _alloc(self, jobs: int, words: int) -> None:
        r2 = self.regions.shape[0]
        self.words = w = np.zeros(L_HEADER + r2 + J_WORDS * jobs + words, np.int64)
        w[L_SELF] = w.ctypes.data
        w[L_REGIONS], w[L_JOBS], w[L_WORDS] = r2 // 2, jobs, words
        w[L_HEADER:L_HEADER + r2] = self.regions
        self._jobs_at = L_HEADER + r2
        self._reads_at = L_HEADER + r2 + J_WORDS * jobs
        self._m = memoryview(w)

    def rearm(self) -> int:
        """Empty the table for the next compiled call (every job of the last one was taken), grown first when a
        batch was refused for room; its address, the handle compiled code passes `_lane_submit`."""
        m = self._m
        if m[L_NEED_JOBS] or m[L_NEED_WORDS]:
            jobs, words = max(2 * m[L_NEED_JOBS], m[L_JOBS]), max(2 * m[L_NEED_WORDS], m[L_WORDS])
            LANE_REFUSALS["room"] += 1
            log.info("emulated lane: a batch needed room for %d jobs and %d reads, the table held %d and %d; it went "
                     "through Python, and the table grows to %d and %d (refusal #%d in this process)",
                     m[L_NEED_JOBS], m[L_NEED_WORDS] // 3, m[L_JOBS], m[L_WORDS] // 3, jobs, words // 3,
                     sum(LANE_REFUSALS.values()))
            self._alloc(jobs, words)
            m = self._m
        m[L_USED_JOBS] = 0
        m[L_USED_WORDS] = 0
        return m[L_SELF]

    def take(self, job: int) -> LaneJob:
        """Job `job` as recorded (its reads copied out of the table)."""
        m = self._m
        if not 1 <= job <= m[L_USED_JOBS]:
            raise SlackTierError(ErrorKind.BAD_INPUT, f"the lane table holds no job {job}",
                                 fix="book only the jobs the compiled call returned, before the next call")
        j = self._jobs_at + J_WORDS * (job - 1)
        at, n = m[j + J_AT], m[j + J_N]
        lo = self._reads_at + at
        return LaneJob(self.words[lo:lo + 3 * n].copy(), n, m[j + J_SUBMIT_NS], m[j + J_PRIORITY])


class EmulatedLane(NativeLane):
    """An emulated source's native lane: compiled code calls `_lane_submit` on the client's lane table, and the
    source books each job as a ticket (`adopt`), as the disk tier books st_eng_submit's. The jobs are booked
    within begin_step (`book_in_pass`): the device queues and times a TP step's batches at `seal`, once every
    rank's host pass is done, and only booked jobs are there to time."""

    book_in_pass = True

    def __init__(self, source: EmulatedSource, lock: threading.Lock, table: LaneTable) -> None:
        super().__init__(source, lock, lane_submit_address(), 0)
        self.table = table

    def handle(self) -> int:
        """The lane table's address, emptied for this call, or 0 when the caller must use `submit` (lock held)."""
        return 0 if self.source.busy_or_closed() else self.table.rearm()


class EmulatedQueue(PreadQueue):
    """One rank's queue on an emulated device: the thread queue's admission (window order, strict), one worker
    copying each read from a DRAM copy of the pages, and a batch handed back when its device says it lands."""

    engine_name: ClassVar[str] = "emulated"
    #: pages copied per turn of the worker: its Python between turns needs the GIL. Measured on the RDMA row
    #: (chat B=128, 760 pages per rank and layer, 2026-12-03 17:22 UTC, quiet): the bytes were in the pool a median
    #: 3.4-4.0 ms after the model's landing with 4 per turn, 1.8-2.1 ms with 256 (docs/bench-log/whatif.md)
    chunk_reads: ClassVar[int] = 256

    def __init__(self, device: Device, queue_depth: int, io_threads: int) -> None:
        with _device_lock:
            self.emulated, self.rank = _rank_queues[device.number]
        self._held_pages: dict[int, tuple[np.ndarray, np.ndarray]] = {}   # client -> ([pages, 4096], [R] base)
        self._timing: dict[int, _Timing] = {}
        self._lanes: dict[int, LaneTable] = {}
        self._deferred: list[tuple[int, int, LaneJob, PageBufferPool]] = []   # (job, client, batch, pool)
        self._flushing = threading.Lock()
        #: batches queued through the native lane ("lane") and through `submit` ("submit")
        self.batches: Counter[str] = Counter()
        super().__init__(device, queue_depth, io_threads)
        with self.emulated._lock:
            self.emulated.queues.append(self)

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
        self._held_pages[client] = (held, base)
        self._lanes[client] = LaneTable(pages, priority)
        return client

    def detach(self, client: int) -> None:
        super().detach(client)
        self._held_pages.pop(client, None)
        self._lanes.pop(client, None)

    def lane_table(self, client: int) -> LaneTable:
        """The table where compiled code records the client's batches (`EmulatedSource.native_lane`)."""
        return self._lanes[client]

    def adopt(self, client: int, job: int, pool: PageBufferPool) -> int:
        """Book the batch compiled code recorded as `job` in the client's lane table as a job of this queue, timed
        from when it was recorded; its job here.

        While the queue is held (its device's step pre-phase: no rank's step has started), only the page lists
        are copied out of the table; the job is queued and timed at `flush`, which the device runs once every
        rank's host pass is done (`EmulatedDevice.seal`), so the emulator's own bookkeeping, like its page
        copies, is not charged to begin_step: a disk's C engine does it on its own threads."""
        batch = self._lanes[client].take(job)
        with self._work:
            if self._stop:
                raise SlackTierError(ErrorKind.CLOSED, "the device queue is closed", fix="open a new source")
            handle = self._next
            self._next += 1
            self.batches["lane"] += 1
            self._deferred.append((handle, client, batch, pool))
            held = self._held
        if not held:
            self.flush()
        return handle

    def flush(self) -> None:
        """Queue the lane's deferred jobs, in the order they were booked, and have the device time them."""
        with self._flushing:   # a wait() whose job another thread is flushing waits for that flush to end
            if not self._deferred:
                return
            with self._work:
                deferred, self._deferred = self._deferred, []
            for handle, client, b, pool in deferred:
                with self._work:
                    self._enqueue(client, b.region, b.page, b.buffer, pool, b.submit_ns, b.priority, handle)
                t = self._timing[handle] = _Timing(self, b.priority, b.n, b.submit_ns)
                self.emulated.add(t)

    def hold(self, on: bool) -> None:
        if not on:
            self.flush()
        super().hold(on)

    def copy_queued(self) -> None:
        """Let the worker copy every queued read into its pool, and return once all are there (the device's
        `seal`: the step's copies done before any rank's step starts)."""
        self.hold(False)
        with self._done:
            self._done.wait_for(lambda: self._stop or not (self._queue or self._active))

    def close(self) -> None:
        self.flush()
        with self.emulated._lock:
            if self in self.emulated.queues:
                self.emulated.queues.remove(self)
        super().close()

    def read_chunk(self, client: int, c, job, lo: int, hi: int) -> None:
        held, base = self._held_pages[client]
        copy_pages(held, base[job.region[lo:hi]] + job.page[lo:hi], job.pool.pages, job.buffer[lo:hi])
        job.res[lo:hi] = PAGE_BYTES

    def submit(self, client: int, region: np.ndarray, page: np.ndarray, buffer: np.ndarray,
               pool: PageBufferPool) -> int:
        handle = super().submit(client, region, page, buffer, pool)
        if handle > 0:
            with self._work:
                self.batches["submit"] += 1
            region = np.asarray(region)
            n = int(region.shape[0])
            priority = int(self._clients[client].priority[region].min()) if n else 0
            t = self._timing[handle] = _Timing(self, priority, n, self._jobs[handle].submit_ns)
            self.emulated.add(t)
        return handle

    def wait(self, job: int, timeout_s: float | None) -> Landed | None:
        self.flush()
        deadline = None if timeout_s is None else time.perf_counter_ns() + int(timeout_s * 1e9)
        landed = super().wait(job, timeout_s)   # the bytes are in the pool
        if landed is None:
            return None
        t = self._timing[job]
        if not self.emulated.wait_landing(t, deadline):
            return None
        return Landed(t.start_ns, t.start_ns, max(t.land_ns, t.start_ns), landed.cpu_ns, landed.first_bad)

    def cancel(self, job: int) -> int:
        self.flush()
        n = super().cancel(job)
        t = self._timing[job]
        self.emulated.cancel(t)
        return n

    def release(self, job: int, pool: PageBufferPool | None = None) -> None:
        super().release(job, pool)
        self._timing.pop(job, None)


# ---- the tier ----------------------------------------------------------------------------------------------

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
        self.emulated = emulated_device(opts.device, self.model)
        self.emulated_options = opts
        super().__init__(regions, DiskOptions(engine="threads", queue_depth=self.model.queue_depth, io_threads=1),
                         page_crc32c=page_crc32c, identity=identity)

    @classmethod
    def verify_identity(cls, regions: Sequence[Region], options: EmulatedOptions | None, identity) -> None:
        """Each target file the DRAM copy is made from carries `identity`'s header, complete."""
        check_file_targets(regions, identity)

    def _choose_engine(self, engine: str) -> str:
        return EmulatedQueue.engine_name

    def queue_engine(self) -> type[DeviceQueue]:
        return EmulatedQueue

    def device_of(self, fd: int) -> Device:
        return rank_queue_device(self.emulated, self.emulated_options.rank)

    def native_lane(self) -> NativeLane | None:
        """Capability: compiled code may record batches straight into our rank queue's lane table
        (`_lane_submit`), so begin_step runs as one compiled call as on the disk tier; None where every batch
        must go through `submit` (regions on several queues, or a subclass that overrides `submit`)."""
        att = self._direct
        if att is None or not isinstance(att.queue, EmulatedQueue) or type(self).submit is not DiskSource.submit:
            return None
        return EmulatedLane(self, self._lock, att.queue.lane_table(att.client))

    def book_native(self, job: int, pages: int, pool: PageBufferPool) -> int:
        """Queue and book a job compiled code recorded in our lane table (lock held); its ticket."""
        att = self._direct
        queued = att.queue.adopt(att.client, job, pool)
        return self._new_ticket(_Ticket([(att, queued, pages)], pool, pages))


register_tier("emulated", EmulatedSource, EmulatedOptions)

__all__ = ["BUILTIN_MODELS", "DeviceModel", "device_model_toml", "EmulatedDevice", "EmulatedLane", "EmulatedOptions", "EmulatedQueue",
           "EmulatedSource", "LANE_REFUSALS", "LaneJob", "LaneTable", "NVME_PAPER", "RDMA_PAPER", "SimJob",
           "completions_ms", "emulated_device", "emulated_devices", "forget_devices", "lane_submit_address",
           "load_device_model", "model_from_dict"]
