"""Tickets: the one place ids are minted, and the one book of a source's submitted batches.

Every number the store hands out comes from `mint`: a source's tickets, a
thread queue's clients and jobs, an emulated rank queue's device number. One
process-wide counter, so no two of them are ever equal, whatever hands them
out (the C engine's jobs and clients are its own addresses, and a lane
table's jobs are positions in the table, not ids).

A `Ticket` is one batch a source accepted, from `submit` (or a lane's `book`,
store.base.Lane) until `wait` or `close` forgets it. The queued base
(store/queued.py) splits it into parts, one per worker, and it completes
when its last part finishes; the disk tier (store/disk.py) records the
device-queue jobs it went to, and waits for those. `TicketBook` keeps a
source's tickets: it mints them, answers `wait` for the queued base, and
refuses new ones once closed.

Worked example: a DRAM source and a disk source in one process each submit a
batch -> tickets 7 and 8 (or 8 and 7), never two tickets 1.
"""

from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from slacktier.errors import ErrorKind, SlackTierError
from slacktier.store.base import PageBufferPool, ReadStats

_ids = itertools.count(1)


def mint() -> int:
    """A new id (> 0), never handed out before in this process (thread-safe: one C-level step of a counter)."""
    return next(_ids)


@dataclass(eq=False, slots=True)
class Ticket:
    """One batch a source accepted: how many pages, into which pool, and how it is going."""

    pages: int
    pool: PageBufferPool | None           # kept referenced until the reads land
    submit_ns: int = 0                    # perf_counter_ns
    parts_left: int = 0                   # queued base: worker parts not yet finished
    jobs: list[tuple[Any, int, int]] = field(default_factory=list)   # disk: (device group, queue job, reads)
    done: threading.Event | None = None   # queued base: set when its last part finished
    cpu_ns: int = 0
    end_ns: int = 0
    error: BaseException | None = None


class TicketBook:
    """A source's tickets: mints them, collects the queued base's part completions, answers `wait`; thread-safe."""

    def __init__(self, source_name: str) -> None:
        self._name = source_name
        self._lock = threading.Lock()
        self._tickets: dict[int, Ticket] = {}
        self.closed = False

    def refuse_if_closed(self) -> None:
        """Raise CLOSED once the source was closed."""
        if self.closed:
            raise SlackTierError(ErrorKind.CLOSED, f"{self._name} is closed",
                                 fix="open a new source; a closed one takes no more work")

    def add(self, t: Ticket) -> int:
        """Keep `t` under a new ticket number; refuses (CLOSED) once closed."""
        ticket = mint()
        with self._lock:
            self.refuse_if_closed()
            self._tickets[ticket] = t
        return ticket

    def open(self, parts: int, pages: int, pool: PageBufferPool | None = None) -> tuple[int, Ticket]:
        """A new ticket for a queued batch of `pages` pages done in `parts` worker parts (0 parts: done now)."""
        t = Ticket(pages, pool, time.perf_counter_ns(), parts_left=parts, done=threading.Event())
        ticket = self.add(t)
        if parts == 0:
            t.end_ns = t.submit_ns
            t.done.set()
        return ticket, t

    def finish_part(self, t: Ticket, cpu_ns: int, error: BaseException | None) -> None:
        """Record one part's end; the ticket completes with its last part."""
        with self._lock:
            t.cpu_ns += cpu_ns
            if error is not None and t.error is None:
                t.error = error
            t.parts_left -= 1
            last = t.parts_left == 0
            if last:
                t.end_ns = time.perf_counter_ns()
        if last:
            assert t.done is not None
            t.done.set()

    def get(self, ticket: int) -> Ticket:
        """The batch under `ticket`; refuses CLOSED once closed, BAD_INPUT for a ticket it does not hold."""
        with self._lock:
            self.refuse_if_closed()
            t = self._tickets.get(ticket)
        if t is None:
            raise SlackTierError(ErrorKind.BAD_INPUT, f"{self._name} has no ticket {ticket}",
                                 fix="wait once on a ticket that submit returned")
        return t

    def forget(self, ticket: int) -> None:
        """Drop `ticket` (waited for, or set aside after a timeout)."""
        with self._lock:
            self._tickets.pop(ticket, None)

    def wait(self, ticket: int, timeout_s: float | None) -> ReadStats:
        """Block until a queued batch completed; raise its error, else return its stats (a timeout keeps it)."""
        t = self.get(ticket)
        assert t.done is not None
        if not t.done.wait(timeout_s):
            raise timeout_error(self._name, ticket, t.pages, timeout_s)
        self.forget(ticket)
        if t.error is not None:
            raise t.error
        return ReadStats(pages=t.pages, read_us=(t.end_ns - t.submit_ns) / 1e3, cpu_us=t.cpu_ns / 1e3)

    def close(self) -> list[Ticket]:
        """Refuse new tickets from now on; the batches not yet waited for, forgotten here."""
        with self._lock:
            self.closed = True
            left = list(self._tickets.values())
            self._tickets.clear()
        return left


def timeout_error(source_name: str, ticket: int, pages: int, timeout_s: float | None) -> SlackTierError:
    """The TIMEOUT a source raises for a batch still not done after `timeout_s`."""
    return SlackTierError(ErrorKind.TIMEOUT, f"{source_name}: ticket {ticket} ({pages} pages) not done after "
                          f"{timeout_s} s; its reads may still land in their buffers",
                          fix="check the device or server; do not reuse the batch's buffers until it completes "
                              "(the step engine retires its pool)")
