"""The page-source interface every tier implements: submit, wait, close, and the lane capability.

Control plane (which pages, into which buffers) lives in the engine; a source
only moves bytes. A source is built over a list of runtime regions
(`slacktier.tables.regions.Region`, one per (layer, rank) shard) and reads
whole 4 KiB pages of them into a caller-owned, page-aligned buffer pool.

There is no `capabilities` set: nothing ever consulted it (the engine and
RedKnot treat every tier alike). A capability
comes back beside the optional operation that needs it, not before.

Most tiers build on `slacktier.store.queued.QueuedSource`, which owns the
workers, queues, tickets, checks, checksums and close, and register
themselves by name in `slacktier.store.registry`.

Two class-level facts sit beside the three methods, so the engine can ask
them without an instance:

- `verify_by_default`: whether reads are CRC32C-checked against the
  manifest when the control file says `verify_reads = "auto"`; on wherever
  the tier has no end-to-end checksum of its own.
- `stored_crc32c`: whether each stored page carries its CRC32C, compared
  with the manifest's on every read whatever `verify_reads` says (Redis: a
  value loaded from another table under the same keys is never served).
- `verify_identity(regions, options, identity)`: refuse (SlackTierError
  TARGET, or MISSING) a medium that does not hold the manifest's table. A
  registered tier's constructor calls it when given an `identity`; the
  engine calls it again (through the registry) on a source it keeps across
  a reload, without reopening it.
"""

from __future__ import annotations

import abc
import mmap
from collections.abc import Sequence
from dataclasses import dataclass
import threading
from typing import TYPE_CHECKING, ClassVar, Protocol

import numpy as np

from slacktier.errors import ErrorKind, SlackTierError
from slacktier.tables.layout import PAGE_BYTES
from slacktier.tables.regions import Region

if TYPE_CHECKING:
    from slacktier.config import Options
    from slacktier.tables.manifest import TableIdentity


class PageBufferPool:
    """`capacity` page-aligned 4 KiB buffers in one anonymous mapping (O_DIRECT-safe).

    `pages` is a [capacity, 4096] uint8 view. The mapping is ordinary pageable
    memory: the engine does not register it with CUDA. On a GPU it packs the
    missed rows (264 of each page's 4,096 bytes) into its own pinned staging
    tensor and copies from there (engine/configure.py, `set_pool`). The disk tier's
    io_uring engine may register the pool with its ring, which makes the
    kernel pin it for the ring's lifetime (see store/disk.py).
    """

    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise SlackTierError(ErrorKind.BAD_INPUT, f"pool capacity must be positive, got {capacity}",
                                 fix="size the pool to the most pages one step can read")
        self.capacity = capacity
        self._map = mmap.mmap(-1, capacity * PAGE_BYTES)
        self.pages = np.frombuffer(self._map, dtype=np.uint8).reshape(capacity, PAGE_BYTES)
        self.base = self.pages.ctypes.data   # once: numpy's ctypes accessor costs microseconds per call

    def address(self, index: int) -> int:
        """Virtual address of buffer `index` (for syscalls that take pointers)."""
        return self.base + index * PAGE_BYTES


@dataclass
class PageReads:
    """One batch of page reads: read page `page[i]` of region `region[i]` into buffer `buffer[i]`."""

    region: np.ndarray  # [n] int32, index into the source's regions
    page: np.ndarray    # [n] int64, page inside that region
    buffer: np.ndarray  # [n] int32, destination buffer in the pool

    def __len__(self) -> int:
        return int(self.region.shape[0])


@dataclass
class ReadStats:
    """What one completed batch cost."""

    pages: int = 0
    read_us: float = 0.0          # submit -> last completion, wall clock
    cpu_us: float = 0.0           # CPU time the source spent on it, where measurable


class PageSource(abc.ABC):
    """A tier that reads pages: three methods and one capability (`lane`); everything else is built on top."""

    #: check reads against the manifest's CRC32Cs under `verify_reads = "auto"`; a tier that says nothing
    #: is taken to have no end-to-end checksum of its own, so on
    verify_by_default: ClassVar[bool] = True
    #: the medium keeps each page's CRC32C beside the page (written at load, one value with it), so comparing
    #: the stored CRC32C with the manifest's tells on every read which table the value belongs to, for the cost
    #: of a compare: such a tier is always given the manifest's CRC32Cs, and `verify_pages` says whether the page
    #: bytes are checked too (`verify_reads`)
    stored_crc32c: ClassVar[bool] = False

    @classmethod
    def verify_identity(cls, regions: Sequence[Region], options: Options | None, identity: TableIdentity) -> None:
        """Refuse (TARGET, or MISSING) a medium whose regions do not hold table `identity`; a tier overrides it.

        This default refuses every check, so an unregistered source that never
        learnt to check is never taken for one that did (`register_tier`
        refuses a tier that does not override it).
        """
        raise SlackTierError(ErrorKind.UNAVAILABLE, f"{cls.__name__} cannot check which table its medium holds",
                             fix="implement the classmethod verify_identity for this tier")

    @abc.abstractmethod
    def submit(self, reads: PageReads, pool: PageBufferPool) -> int:
        """Start reading; return a ticket. Must not block on the reads themselves."""

    @abc.abstractmethod
    def wait(self, ticket: int, timeout_s: float | None = None) -> ReadStats:
        """Block until every read of `ticket` completed; raise SlackTierError (naming
        layer, rank and page) on any failed or short read. Never returns with a
        buffer unfilled."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release files, threads and rings; later submits raise SlackTierError(CLOSED)."""

    def lane(self) -> Lane | None:
        """Capability: the way compiled code hands this source batches without Python (`Lane`), or None where
        every batch goes through `submit` (the default)."""
        return None


# -- the lane ----------------------------------------------------------------------------------------------------


class LaneOwner(Protocol):
    """What a lane needs of the source it belongs to (the disk tier, store/disk.py)."""

    lock: threading.Lock

    def busy_or_closed(self) -> bool:
        """Whether batches must go through `submit` now (lock held)."""

    def book(self, job: int, pages: int, pool: PageBufferPool) -> int:
        """A ticket for a job of its queue client that compiled code queued (lock held)."""


class Lane(abc.ABC):
    """How compiled code hands a source's batches to its medium without entering Python.

    A source whose medium can take a batch from compiled code offers a lane
    (`PageSource.lane()`; every other source answers None and takes each
    batch through `submit`). The protocol is three members:

    - `address`: a function of `slacktier.tables.native.SUBMIT`'s signature, which
      the step's compiled pass (cache/compiled.py) calls by address;
    - `arm()`: the word that call passes it as its client, or 0 when batches
      must go through the source's `submit` now (the source is closed, or
      batches it gave up on still wait to be reaped);
    - `book(job, pages, pool)`: a ticket of `source` (store/tickets.py) for a
      job the call returned, waited for with `source.wait` like one from
      `submit`.

    and, optionally, `defers` and `defer(on)`, for a medium whose work starts on
    the CPU the moment a batch is queued (the DRAM tier's host-memory copy).

    Hold `lock` (the source's) around `arm`, the compiled call and `book`, so
    a concurrent submit or close cannot interleave with them. Until it is
    booked a job is the medium's alone, so a caller books every job a call
    returned before it arms the lane again, waits for the step's reads, or
    closes the source (the step engine: at its first gather, end_step or
    abort).

    One class per medium, each in its medium's file: `UringLane` (the io_uring
    engine, store/uring_queue.py: C checks, copies and queues each batch
    itself), `HostMemoryLane` (store/dram.py: the same engine over host memory,
    deferred) and `EmulatedLane` (whatif/tier.py: a numba function records each
    batch in a table the emulated queue takes them from). A medium writes
    two methods: `_client_word`, and `_claim`, which makes a job the call
    returned a job of its queue.

    Worked example: a disk source on one io_uring device queue, a step of two
    layers -> arm() gives the client, the call returns two jobs, book gives
    tickets 41 and 42, gather waits for them.
    """

    #: the medium starts a batch's work on the CPU the moment it is queued (a host-memory copy): a caller that
    #: queues several layers' batches in one compiled call defers it around the call (`defer`), so that work
    #: does not take the caller's core while the call runs
    defers: ClassVar[bool] = False

    def __init__(self, source: LaneOwner, client: int, address: int) -> None:
        self.source = source
        self.lock: threading.Lock = source.lock
        self.client = client
        self.address = address   # called by address: slacktier.tables.native.SUBMIT

    def arm(self) -> int:
        """The word for the next compiled call, or 0 when the caller must use the source's `submit` (lock held)."""
        return 0 if self.source.busy_or_closed() else self._client_word()

    def defer(self, on: bool) -> None:
        """Open (True) or end (False) a deferral of the medium's work, where `defers`: batches queued while one
        is open start when the last one ends. Not under the lock."""

    def book(self, job: int, pages: int, pool: PageBufferPool) -> int:
        """A ticket of `source` for job `job` of `pages` reads into `pool` that the last armed call returned
        (lock held)."""
        return self.source.book(self._claim(job, pool), pages, pool)

    @abc.abstractmethod
    def _client_word(self) -> int:
        """The word `address` takes as its client for the next call."""

    @abc.abstractmethod
    def _claim(self, job: int, pool: PageBufferPool) -> int:
        """The queue's job for job `job` the last call returned into `pool` (from then on the queue's to wait on
        and release like one from its `submit`)."""
