"""Tickets, page checksums and target checks, shared by the queued base (queued.py), the tiers and tests.

A ticket is one submitted batch, split into parts (one per worker lane). It
completes when its last part finishes; `wait` then raises the first part's
error, so a caller never sees buffers of a batch that had a failed read.

Per-read verification checksums the pool's pages in one compiled pass
(`pool_page_crcs`, the SSE4.2 kernel of tables/pagecrc.py), not one Python
call per page.

Worked example: buffer 5 of a pool -> words 5 * 512 .. 5 * 512 + 511 of the
pool's uint64 view, whose CRC32C is compared with the manifest's entry of the
page read into it.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from collections.abc import Sequence

import numpy as np
from numba import njit

from slacktier.errors import ErrorKind, SlackTierError
from slacktier.store.base import ReadStats
from slacktier.tables.layout import PAGE_BYTES, PAGE_WORDS
from slacktier.tables.manifest import TableIdentity, check_target_header
from slacktier.tables.pagecrc import HW_CRC32C, crc_page_words, page_crcs, page_crcs_package
from slacktier.tables.regions import Region

NOT_DONE = np.iinfo(np.int32).min  # a read result slot no completion has written


@dataclass
class _Pending:
    parts_left: int
    pages: int
    submit_ns: int
    done: threading.Event = field(default_factory=threading.Event)
    cpu_ns: int = 0
    end_ns: int = 0
    error: BaseException | None = None


class TicketBook:
    """Hands out tickets, collects part completions, and answers `wait`; thread-safe."""

    def __init__(self, source_name: str) -> None:
        self._name = source_name
        self._lock = threading.Lock()
        self._pending: dict[int, _Pending] = {}
        self._next = 1
        self.closed = False

    def refuse_if_closed(self) -> None:
        """Raise CLOSED once the source was closed."""
        if self.closed:
            raise SlackTierError(ErrorKind.CLOSED, f"{self._name} is closed",
                                 fix="open a new source; a closed one takes no more work")

    def open(self, parts: int, pages: int) -> tuple[int, _Pending]:
        """A new ticket for a batch of `pages` pages done in `parts` parts (0 parts: done now)."""
        with self._lock:
            self.refuse_if_closed()
            ticket = self._next
            self._next += 1
            pending = _Pending(parts_left=parts, pages=pages, submit_ns=time.perf_counter_ns())
            self._pending[ticket] = pending
        if parts == 0:
            pending.end_ns = pending.submit_ns
            pending.done.set()
        return ticket, pending

    def finish_part(self, pending: _Pending, cpu_ns: int, error: BaseException | None) -> None:
        """Record one part's end; the ticket completes with its last part."""
        with self._lock:
            pending.cpu_ns += cpu_ns
            if error is not None and pending.error is None:
                pending.error = error
            pending.parts_left -= 1
            last = pending.parts_left == 0
            if last:
                pending.end_ns = time.perf_counter_ns()
        if last:
            pending.done.set()

    def wait(self, ticket: int, timeout_s: float | None) -> ReadStats:
        """Block until `ticket` completed; raise its error, else return its stats."""
        with self._lock:
            self.refuse_if_closed()
            pending = self._pending.get(ticket)
        if pending is None:
            raise SlackTierError(ErrorKind.BAD_INPUT, f"{self._name} has no ticket {ticket}",
                                 fix="wait once on a ticket that submit returned")
        if not pending.done.wait(timeout_s):
            raise timeout_error(self._name, ticket, pending.pages, timeout_s)
        with self._lock:
            self._pending.pop(ticket, None)
        if pending.error is not None:
            raise pending.error
        return ReadStats(pages=pending.pages, read_us=(pending.end_ns - pending.submit_ns) / 1e3,
                         cpu_us=pending.cpu_ns / 1e3)

    def close(self) -> None:
        """Refuse new tickets from now on."""
        with self._lock:
            self.closed = True


def timeout_error(source_name: str, ticket: int, pages: int, timeout_s: float | None) -> SlackTierError:
    """The TIMEOUT a source raises for a batch still not done after `timeout_s`."""
    return SlackTierError(ErrorKind.TIMEOUT, f"{source_name}: ticket {ticket} ({pages} pages) not done after "
                          f"{timeout_s} s; its reads may still land in their buffers",
                          fix="check the device or server; do not reuse the batch's buffers until it completes "
                              "(the step engine retires its pool)")


def page_crc32c(pages: np.ndarray) -> np.ndarray:
    """CRC32C (Castagnoli, as `crc32c.crc32c`) of each whole 4 KiB page: [P, 4096] uint8 -> [P] uint32."""
    return page_crcs(np.ascontiguousarray(pages, dtype=np.uint8))


@njit(nogil=True, cache=True)
def _pool_page_crcs_hw(words64: np.ndarray, buffers: np.ndarray, out: np.ndarray) -> None:
    # words64: [capacity * 512] uint64 (the pool); buffers: [n] int32; out: [n] uint32
    for i in range(buffers.shape[0]):
        out[i] = crc_page_words(words64, np.int64(buffers[i]) * PAGE_WORDS)


def pool_page_crcs(pages: np.ndarray, buffers: np.ndarray) -> np.ndarray:
    """CRC32C of the pool pages `buffers` names: pages [capacity, 4096] uint8 (C-contiguous), [n] -> [n] uint32."""
    out = np.empty(buffers.shape[0], dtype=np.uint32)
    if not HW_CRC32C:  # logged once by tables/pagecrc.py at import
        return page_crcs_package(pages[buffers], out)
    _pool_page_crcs_hw(pages.reshape(-1).view(np.uint64), np.ascontiguousarray(buffers, dtype=np.int32), out)
    return out


def check_file_targets(regions: Sequence[Region], identity: TableIdentity) -> None:
    """Each distinct target file (or device) of `regions` holds `identity`, complete and long enough.

    One header page read per target (`tables.manifest.check_target_header`),
    with the device index and the bytes the regions need on it: regions at
    4096 + 34 pages and at 143360 + 34 pages of dev0.bin -> one check of
    dev0.bin, device 0, 282624 bytes.
    """
    need: dict[tuple[str, int], int] = {}
    for r in regions:
        key = (r.path, r.device)
        need[key] = max(need.get(key, 0), r.offset_bytes + r.pages * PAGE_BYTES)
    for (path, device), need_bytes in need.items():
        check_target_header(path, device, identity, need_bytes=need_bytes)
