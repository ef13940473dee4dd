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
from slacktier.store.pread_queue import PreadQueue
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

        The rank queues copy no page until their rank's step starts (`start_rank`): a real device moves the
        bytes itself, so the copies that stand in for it must not take the CPU from the ranks' host passes,
        which run one after another in this process. Measured: with the copies running, four ranks' begin_step
        took 3.0-4.9 ms each at B = 128 on this 2-core VM, against 0.2-0.4 ms for one rank on the disk tier
        (docs/bench-log/whatif.md, 2026-12-03 14:37)."""
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

    def start_rank(self, rank: int, at_ns: int | None = None) -> None:
        """Rank `rank`'s step started at `at_ns` (perf_counter_ns; default now): its batches land relative to it."""
        with self._lock:
            if self._rel_land is None:
                sims = [SimJob(id(j), j.priority, j.pages, j.rel_submit_ns / 1e6) for j in self._step_jobs]
                self._rel_land = completions_ms(sims, self.model)
            now = time.perf_counter_ns() if at_ns is None else at_ns
            self._release[rank] = now
            for j in self._step_jobs:
                if j.queue.rank == rank:
                    j.start_ns = now + j.rel_submit_ns
                    j.land_ns = now + int(self._rel_land[id(j)] * 1e6)
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


class EmulatedQueue(PreadQueue):
    """One rank's queue on an emulated device: the thread queue's admission (window order, strict), one worker
    copying each read from a DRAM copy of the pages, and a batch handed back when its device says it lands."""

    engine_name: ClassVar[str] = "emulated"

    def __init__(self, device: Device, queue_depth: int, io_threads: int) -> None:
        with _device_lock:
            self.emulated, self.rank = _rank_queues[device.number]
        self._held_pages: dict[int, tuple[np.ndarray, np.ndarray]] = {}   # client -> ([pages, 4096], [R] base)
        self._timing: dict[int, _Timing] = {}
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
        return client

    def detach(self, client: int) -> None:
        super().detach(client)
        self._held_pages.pop(client, None)

    def close(self) -> None:
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
            n = int(np.asarray(region).shape[0])
            priority = int(self._clients[client].priority[np.asarray(region)].min()) if n else 0
            t = self._timing[handle] = _Timing(self, priority, n, self._jobs[handle].submit_ns)
            self.emulated.add(t)
        return handle

    def wait(self, job: int, timeout_s: float | None) -> Landed | None:
        deadline = None if timeout_s is None else time.perf_counter_ns() + int(timeout_s * 1e9)
        landed = super().wait(job, timeout_s)   # the bytes are in the pool
        if landed is None:
            return None
        t = self._timing[job]
        if not self.emulated.wait_landing(t, deadline):
            return None
        return Landed(t.start_ns, t.start_ns, max(t.land_ns, t.start_ns), landed.cpu_ns, landed.first_bad)

    def cancel(self, job: int) -> int:
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


register_tier("emulated", EmulatedSource, EmulatedOptions)

__all__ = ["BUILTIN_MODELS", "DeviceModel", "EmulatedDevice", "EmulatedOptions", "EmulatedQueue", "EmulatedSource",
           "NVME_PAPER", "RDMA_PAPER", "SimJob", "completions_ms", "emulated_device", "emulated_devices",
           "forget_devices", "load_device_model", "model_from_dict"]

