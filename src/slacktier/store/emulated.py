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
steps the device (`EmulatedDevice.begin_step` / `start_rank`): every rank's
`begin_step` submits with times relative to its own start, the device
computes the step's completions once all ranks submitted, and each rank's
batches land relative to the moment that rank's timeline step starts. Out of
a step (prefill chunks warming the cache, checker steps) a batch lands
a + tau * pages after its submit, alone.

`queue_depth` is recorded with the model and refused at 0; the emulation
does not model a change of depth (the terms are the device's at that depth).
"""

from __future__ import annotations

import errno
import math
import threading
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Sequence

import numpy as np

from slacktier.config import DiskOptions, Options
from slacktier.errors import ErrorKind, SlackTierError
from slacktier.store._common import check_file_targets
from slacktier.store.base import PageBufferPool
from slacktier.store.devqueue import Device, DeviceQueue, Landed
from slacktier.store.disk import DiskSource
from slacktier.store.dram import copy_pages, load_region_pages
from slacktier.store.registry import register_tier
from slacktier.tables.layout import PAGE_BYTES
from slacktier.tables.regions import Region

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


def load_device_model(spec: str) -> DeviceModel:
    """A built-in model by name (`nvme-paper`, `rdma-paper`) or a TOML file with a [device] table (`this-disk`
    is written as one from a read fit by serve.whatif.this_disk_model)."""
    if spec in BUILTIN_MODELS:
        return BUILTIN_MODELS[spec]
    p = Path(spec)
    if not p.is_file():
        raise SlackTierError(ErrorKind.MISSING, f"device model {spec!r} is neither built in nor a file",
                             fix=f"use one of {', '.join(BUILTIN_MODELS)} or a TOML file with a [device] table")
    try:
        doc = tomllib.loads(p.read_text())
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
class _Job:
    queue: EmulatedQueue
    handle: int
    client: int
    region: np.ndarray
    page: np.ndarray
    buffer: np.ndarray
    pool: PageBufferPool
    res: np.ndarray
    submit_ns: int
    rel_submit_ns: int = -1      # stepped: ns after its rank's step began; -1 free-running
    land_ns: int = -1            # perf_counter_ns when it lands; -1 not known yet
    start_ns: int = -1           # the submit time as the step's clock maps it (read_us = land - start)
    copied: bool = False
    cpu_ns: int = 0


class EmulatedDevice:
    """One emulated device (a disk, a NIC) shared by the rank queues mapped to it; computes when batches land."""

    def __init__(self, name: str, model: DeviceModel) -> None:
        self.name = name
        self.model = model
        self._lock = threading.Condition()
        self._stepping = False
        self._step_start: dict[int, int] = {}     # rank -> perf_counter_ns its host pass began (pre-phase)
        self._release: dict[int, int] = {}        # rank -> perf_counter_ns its timeline step began
        self._step_jobs: list[_Job] = []
        self._rel_land: dict[int, float] | None = None   # id(job) -> ms after the rank's step start

    def begin_step(self) -> None:
        """A TP step begins: batches submitted from now until every rank started are timed together."""
        with self._lock:
            self._stepping = True
            self._step_start.clear()
            self._release.clear()
            self._step_jobs = []
            self._rel_land = None

    def rank_host_pass(self, rank: int, at_ns: int | None = None) -> None:
        """Rank `rank`'s host pass (begin_step) starts at `at_ns` (default now): its batches are timed from here."""
        with self._lock:
            self._step_start[rank] = time.perf_counter_ns() if at_ns is None else at_ns

    def start_rank(self, rank: int, at_ns: int | None = None) -> None:
        """Rank `rank`'s step started at `at_ns` (perf_counter_ns; default now): its batches land relative to it."""
        with self._lock:
            if self._rel_land is None:
                sims = [SimJob(id(j), j.queue.priority_of(j), int(j.region.shape[0]), j.rel_submit_ns / 1e6)
                        for j in self._step_jobs]
                self._rel_land = completions_ms(sims, self.model)
            now = time.perf_counter_ns() if at_ns is None else at_ns
            self._release[rank] = now
            for j in self._step_jobs:
                if j.queue.rank == rank:
                    j.start_ns = now + j.rel_submit_ns
                    j.land_ns = now + int(self._rel_land[id(j)] * 1e6)
            self._lock.notify_all()

    def end_step(self) -> None:
        """Back to free-running: batches land a + tau * pages after their submit."""
        with self._lock:
            self._stepping = False

    def add(self, job: _Job) -> None:
        """Time a new batch (under the queue's submit)."""
        with self._lock:
            rank = job.queue.rank
            if self._stepping and rank in self._step_start and rank not in self._release:
                job.rel_submit_ns = job.submit_ns - self._step_start[rank]
                self._step_jobs.append(job)
                return
            m = self.model
            alone = m.intercept_ms + m.page_us / m.ranks_in_fit / 1e3 * job.region.shape[0]
            job.start_ns = job.submit_ns
            job.land_ns = job.submit_ns + int(alone * 1e6) if job.region.shape[0] else job.submit_ns

    def wait_landing(self, job: _Job, deadline_ns: int | None) -> bool:
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


@dataclass(eq=False)
class _Client:
    pages: np.ndarray        # [total, 4096] uint8: the DRAM copy of the client's regions
    base: np.ndarray         # [R] int64 first page of each region in `pages`
    region_pages: np.ndarray  # [R] int64
    priority: np.ndarray     # [R] int32
    live: int = 0


class EmulatedQueue(DeviceQueue):
    """One rank's queue on an emulated device: real bytes from DRAM, landing when the device says."""

    engine_name: ClassVar[str] = "emulated"

    def __init__(self, device: Device, queue_depth: int, io_threads: int) -> None:
        super().__init__(device, queue_depth, io_threads)
        with _device_lock:
            self.emulated, self.rank = _rank_queues[device.number]
        self._lock = threading.Condition()
        self._clients: dict[int, _Client] = {}
        self._jobs: dict[int, _Job] = {}
        self._todo: list[_Job] = []
        self._next = 1
        self._stop = False
        self._held = False
        self._trace_cap = 0
        self._trace: list[tuple[int, int, int]] = []
        self._worker = threading.Thread(target=self._copy_loop, daemon=True, name=f"slacktier-emu-{device.name}")
        self._worker.start()

    def attach(self, fd: np.ndarray, offset_bytes: np.ndarray, pages: np.ndarray, priority: np.ndarray,
               io_class: str = "") -> int:
        """Copy the client's regions into DRAM from their files (buffered reads), once."""
        if io_class:
            raise SlackTierError(ErrorKind.UNAVAILABLE, f"io_class {io_class!r} on an emulated device",
                                 fix="leave io_class unset")
        pages = np.array(pages, np.int64)
        base = np.zeros(pages.shape[0], np.int64)
        base[1:] = np.cumsum(pages)[:-1]
        held = np.empty((int(pages.sum()), PAGE_BYTES), np.uint8)
        for i in range(pages.shape[0]):
            path = f"/proc/self/fd/{int(fd[i])}"
            region = Region(layer=0, rank=0, path=path, offset_bytes=int(offset_bytes[i]), pages=int(pages[i]))
            held[base[i]:base[i] + pages[i]] = load_region_pages(region)
        with self._lock:
            client = self._next
            self._next += 1
            self._clients[client] = _Client(held, base, pages, np.array(priority, np.int32))
        return client

    def detach(self, client: int) -> None:
        with self._lock:
            if self._clients[client].live:
                raise SlackTierError(ErrorKind.BAD_INPUT, "a client with jobs not yet released cannot detach",
                                     fix="wait for and release every job first")
            del self._clients[client]

    def priority_of(self, job: _Job) -> int:
        """The window priority of a job: the lowest of its regions' (the layer)."""
        c = self._clients[job.client]
        return int(c.priority[job.region].min()) if job.region.shape[0] else 0

    def submit(self, client: int, region: np.ndarray, page: np.ndarray, buffer: np.ndarray,
               pool: PageBufferPool) -> int:
        region, page, buffer = (np.array(region, np.int32), np.array(page, np.int64), np.array(buffer, np.int32))
        with self._lock:
            if self._stop:
                raise SlackTierError(ErrorKind.CLOSED, "the device queue is closed", fix="open a new source")
            c = self._clients[client]
            n = region.shape[0]
            if n:
                bad = np.flatnonzero((region < 0) | (region >= c.region_pages.shape[0]))
                if not bad.size:
                    bad = np.flatnonzero((page < 0) | (page >= c.region_pages[region]) | (buffer < 0)
                                         | (buffer >= pool.capacity))
                if bad.size:
                    return -(int(bad[0]) + 1)
            handle = self._next
            self._next += 1
            job = _Job(self, handle, client, region, page, buffer, pool, np.zeros(n, np.int32),
                       time.perf_counter_ns())
            self._jobs[handle] = job
            c.live += 1
            if len(self._trace) < self._trace_cap:
                self._trace.extend((client, int(region[i]), int(page[i])) for i in range(n))
            self.emulated.add(job)
            self._todo.append(job)
            self._lock.notify_all()
        return handle

    def _copy_loop(self) -> None:
        """Copy queued jobs' pages from DRAM into their pools, in window order (lowest layer first)."""
        while True:
            with self._lock:
                while (not self._todo or self._held) and not self._stop:
                    self._lock.wait()
                if not self._todo:
                    return
                self._todo.sort(key=lambda j: (self.priority_of(j), j.handle))
                job = self._todo.pop(0)
                c = self._clients[job.client]
            t0 = time.thread_time_ns()
            copy_pages(c.pages, c.base[job.region] + job.page, job.pool.pages, job.buffer)
            job.res[:] = PAGE_BYTES
            spent = time.thread_time_ns() - t0
            with self._lock:
                job.cpu_ns = spent
                job.copied = True
                self._lock.notify_all()

    def wait(self, job: int, timeout_s: float | None) -> Landed | None:
        j = self._jobs[job]
        deadline = None if timeout_s is None else time.perf_counter_ns() + int(timeout_s * 1e9)
        with self._lock:
            while not j.copied:
                left = None if deadline is None else (deadline - time.perf_counter_ns()) / 1e9
                if left is not None and left <= 0:
                    return None
                self._lock.wait(left)
        if not self.emulated.wait_landing(j, deadline):
            return None
        bad = np.flatnonzero(j.res != PAGE_BYTES)
        return Landed(j.start_ns, j.start_ns, max(j.land_ns, j.start_ns), j.cpu_ns, int(bad[0]) if bad.size else -1)

    def cancel(self, job: int) -> int:
        with self._lock:
            j = self._jobs[job]
            if j.copied:
                return 0
            self._todo = [t for t in self._todo if t is not j]
            j.res[:] = -errno.ECANCELED
            j.copied = True
            if j.land_ns < 0:
                j.start_ns = j.land_ns = j.submit_ns
            self._lock.notify_all()
            return int(j.region.shape[0])

    def reads(self, job: int, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        j = self._jobs[job]
        return j.region.copy(), j.page.copy(), j.buffer.copy(), j.res.copy()

    def release(self, job: int, pool: PageBufferPool | None = None) -> None:
        with self._lock:
            j = self._jobs.pop(job)
            self._clients[j.client].live -= 1

    def close(self) -> None:
        with self._lock:
            self._stop = True
            self._held = False
            self._lock.notify_all()
        self._worker.join()

    def hold(self, on: bool) -> None:
        with self._lock:
            self._held = on
            self._lock.notify_all()

    def trace(self, reads: int) -> None:
        with self._lock:
            self._trace_cap = reads
            self._trace = []

    def traced(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        with self._lock:
            arr = np.array(self._trace, dtype=np.int64).reshape(-1, 3)
        return arr[:, 0], arr[:, 1].astype(np.int32), arr[:, 2]


# ---- the tier ----------------------------------------------------------------------------------------------

class EmulatedOptions(Options, frozen=True):
    """`[table.emulated]`: which emulated device serves the table, and its model.

    `model`: nvme-paper, rdma-paper, or a TOML file with a [device] table; `device`: the emulated device's
    name (tables and ranks naming one device share it); `rank`: the TP rank whose queue this is.
    """

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


register_tier("emulated", EmulatedSource, EmulatedOptions)

__all__ = ["BUILTIN_MODELS", "DeviceModel", "EmulatedDevice", "EmulatedOptions", "EmulatedQueue", "EmulatedSource",
           "NVME_PAPER", "RDMA_PAPER", "SimJob", "completions_ms", "emulated_device", "emulated_devices",
           "forget_devices", "load_device_model", "model_from_dict"]

