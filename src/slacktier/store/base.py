"""The page-source interface every tier implements: submit, wait, close.

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
from typing import TYPE_CHECKING, ClassVar

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
    tensor and copies from there (engine/step.py, `_pin_pool`). The disk tier's
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
    """A tier that reads pages: three methods; everything else is built on top."""

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
