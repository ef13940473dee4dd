"""The emulated device (a disk, a NIC) shared by its rank queues, and the TP step's clock it keeps.

Clock: a TP step starts at the same moment on every rank, but one process
runs the ranks' host passes one after another. So the what-if run steps the
device (`EmulatedDevice.begin_step` / `rank_host_pass` / `seal` /
`start_rank`): every rank's batches are timed relative to its own host pass;
once all ranks ran theirs, `seal` queues the step's batches, computes their
landings (whatif.fluid) and copies every page of the step into the pools,
before any rank's timeline step and off its clock; each rank's batches then
land relative to the moment that rank's timeline step starts, with nothing of
the emulator's left to run beside it. Out of a step (prefill chunks warming
the cache, checker steps) a batch lands a + tau * pages after its submit,
alone.

Devices live in a `DeviceSession`: the what-if opens one per placement run
(`device_session()`), and tests open their own, so no device outlives its
run. A control file that names the emulated tier outside any session gets
the process's default session (`current_session`), since the engine that
opens such a source has no session to hand it.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

from slacktier.errors import ErrorKind, SlackTierError
from slacktier.store.devqueue import Device
from slacktier.store.tickets import mint
from slacktier.whatif.fluid import SimJob, alone_ms, completions_ms
from slacktier.whatif.models import DeviceModel

class RankQueue(Protocol):
    """What the device needs of a rank queue on it (whatif.tier.EmulatedQueue)."""

    rank: int

    def hold(self, on: bool) -> None:
        """Admit no read while held."""

    def flush(self) -> None:
        """Queue and time what the rank's lanes recorded."""

    def copy_queued(self) -> None:
        """Copy every queued read into its pool, and return once all are there."""


@dataclass(eq=False)
class Timing:
    """When one batch lands on its emulated device (perf_counter_ns)."""

    queue: RankQueue
    priority: int
    pages: int
    submit_ns: int
    rel_submit_ns: int = -1      # stepped: ns after its rank's step began; -1 free-running
    land_ns: int = -1            # when it lands; -1 not known yet
    start_ns: int = -1           # its submit time as the step's clock maps it (read_us = land - start)


class EmulatedDevice:
    """One emulated device shared by the rank queues mapped to it; computes when batches land."""

    def __init__(self, name: str, model: DeviceModel) -> None:
        self.name = name
        self.model = model
        self._lock = threading.Condition()
        self._stepping = False
        self._step_start: dict[int, int] = {}     # rank -> perf_counter_ns its host pass began (pre-phase)
        self._release: dict[int, int] = {}        # rank -> perf_counter_ns its timeline step began
        self._step_jobs: list[Timing] = []
        self._rel_land: dict[int, float] | None = None   # id(job) -> ms after the rank's step start
        self._queues: list[RankQueue] = []   # the rank queues on this device (each registers itself)

    def join(self, queue: RankQueue) -> None:
        """A rank queue on this device opened."""
        with self._lock:
            self._queues.append(queue)

    def leave(self, queue: RankQueue) -> None:
        """A rank queue on this device closed."""
        with self._lock:
            if queue in self._queues:
                self._queues.remove(queue)

    def queues(self) -> list[RankQueue]:
        """The rank queues open on this device."""
        with self._lock:
            return list(self._queues)

    def begin_step(self) -> None:
        """A TP step begins: batches submitted from now until every rank started are timed together.

        The rank queues copy no page until the device is sealed (`seal`): a real device moves the bytes itself,
        so the copies that stand in for it must not take the CPU from the ranks' host passes, which run one after
        another in this process, nor from their timeline steps."""
        with self._lock:
            self._stepping = True
            self._step_start.clear()
            self._release.clear()
            self._step_jobs = []
            self._rel_land = None
            queues = list(self._queues)
        for q in queues:
            q.hold(True)

    def rank_host_pass(self, rank: int, at_ns: int | None = None) -> None:
        """Rank `rank`'s host pass (begin_step) starts at `at_ns` (default now): its batches are timed from here."""
        with self._lock:
            self._step_start[rank] = time.perf_counter_ns() if at_ns is None else at_ns

    def seal(self) -> None:
        """Every rank's host pass of the step is done: queue the batches the ranks recorded, compute when each
        lands, and copy every page of the step into its pool, all before any rank's step starts and so off every
        rank's clock. A rank's step then only waits for its batches' landing times, as it waits for a real
        device that moves the bytes itself (module docstring)."""
        self._queue_recorded()
        with self._lock:
            if self._stepping:
                self._landings()
            queues = list(self._queues)
        for q in queues:
            q.copy_queued()

    def _queue_recorded(self) -> None:
        """Queue and time the batches the rank queues hold recorded or booked (their `flush`)."""
        for q in self.queues():
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
        self._queue_recorded()
        with self._lock:
            rel_land = self._landings()
            now = time.perf_counter_ns() if at_ns is None else at_ns
            self._release[rank] = now
            for j in self._step_jobs:
                if j.queue.rank == rank:
                    j.start_ns = now + j.rel_submit_ns
                    j.land_ns = now + int(rel_land[id(j)] * 1e6)
            self._lock.notify_all()
            queues = [q for q in self._queues if q.rank == rank]
        for q in queues:
            q.hold(False)

    def cancel(self, job: Timing) -> None:
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
            queues = list(self._queues)
        for q in queues:
            q.hold(False)

    def add(self, job: Timing) -> None:
        """Time a new batch (under the queue's submit)."""
        with self._lock:
            rank = job.queue.rank
            if self._stepping and rank in self._step_start and rank not in self._release:
                job.rel_submit_ns = job.submit_ns - self._step_start[rank]
                self._step_jobs.append(job)
                self._rel_land = None
                return
            job.start_ns = job.submit_ns
            job.land_ns = job.submit_ns + int(alone_ms(self.model, job.pages) * 1e6)

    def wait_landing(self, job: Timing, deadline_ns: int | None) -> bool:
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


_SPIN_NS = 100_000   # sleep until this close to a landing, then spin (sleep overshoots by tens of us)


class DeviceSession:
    """The emulated devices of one what-if run (or one test), by name, and the rank queues' devqueue devices."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._devices: dict[str, EmulatedDevice] = {}
        self._rank_queues: dict[int, tuple[EmulatedDevice, int]] = {}   # Device.number -> (device, rank)
        self._numbered: dict[tuple[str, int], int] = {}

    def device(self, name: str, model: DeviceModel) -> EmulatedDevice:
        """Device `name`, made with `model` on first use; another model for it is refused."""
        with self._lock:
            dev = self._devices.get(name)
            if dev is None:
                dev = self._devices[name] = EmulatedDevice(name, model)
            elif dev.model != model:
                raise SlackTierError(ErrorKind.BAD_INPUT, f"emulated device {name!r} already runs model "
                                     f"{dev.model.name}, asked for {model.name}",
                                     fix="one device, one model: name another device for the other model")
            return dev

    def devices(self) -> list[EmulatedDevice]:
        """The session's devices (the what-if run steps them)."""
        with self._lock:
            return list(self._devices.values())

    def rank_queue_device(self, dev: EmulatedDevice, rank: int) -> Device:
        """The devqueue `Device` of rank `rank`'s queue on `dev`: one queue per (device, rank), as one per
        process on a TP node; a negative number, never a real device's."""
        with self._lock:
            key = (dev.name, rank)
            if key not in self._numbered or self._rank_queues[self._numbered[key]][0] is not dev:
                self._numbered[key] = -mint()   # process-wide: devqueue keys its queues by device number
            number = self._numbered[key]
            self._rank_queues[number] = (dev, rank)
        return Device(number, f"emulated:{dev.name}/rank{rank}")

    def rank_of(self, device: Device) -> tuple[EmulatedDevice, int]:
        """The emulated device and rank behind a rank queue's devqueue `Device`."""
        with self._lock:
            return self._rank_queues[device.number]


#: the session open now (`device_session`), else the process's default one (module docstring)
_default = DeviceSession()
_current: DeviceSession | None = None
_session_lock = threading.Lock()


def current_session() -> DeviceSession:
    """The session sources open their devices in: the one `device_session` opened, else the default one."""
    with _session_lock:
        return _current if _current is not None else _default


@contextlib.contextmanager
def device_session() -> Iterator[DeviceSession]:
    """Open a session for a what-if run or a test: every emulated source opened inside it gets its devices from
    it, and they are forgotten when it closes (queues still open keep theirs). Sessions do not nest."""
    global _current
    session = DeviceSession()
    with _session_lock:
        if _current is not None:
            raise SlackTierError(ErrorKind.BAD_INPUT, "an emulated device session is already open",
                                 fix="close it first: one what-if run at a time in a process")
        _current = session
    try:
        yield session
    finally:
        with _session_lock:
            _current = None
