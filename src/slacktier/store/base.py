"""The page-source interface every tier implements: submit, wait, close, capabilities.

Control plane (which pages, into which buffers) lives in the engine; a source
only moves bytes. A source is built over a list of regions (one per
(layer, rank) shard) and reads whole 4 KiB pages of them into a caller-owned,
page-aligned buffer pool.
"""

from __future__ import annotations

import abc
import mmap
from dataclasses import dataclass, field

import numpy as np

from slacktier.errors import ErrorKind, SlackTierError
from slacktier.tables.layout import PAGE_BYTES


@dataclass(frozen=True)
class RegionSpec:
    """Where one (layer, rank) region lives on its medium.

    `path` is a file or raw block device (disk tier), a key prefix (Redis tier)
    or unused (DRAM tier). `offset_bytes` is 4 KiB aligned. `device` is the
    index of the disk/device the region maps to (ranks map round-robin).
    """

    layer: int
    rank: int
    path: str
    offset_bytes: int
    pages: int
    device: int = 0

    def __post_init__(self) -> None:
        if self.offset_bytes % PAGE_BYTES:
            raise SlackTierError(ErrorKind.BAD_INPUT, f"region offset {self.offset_bytes} is not 4 KiB aligned",
                                 fix="stage regions on page boundaries", layer=self.layer, rank=self.rank)


class PageBufferPool:
    """`capacity` page-aligned 4 KiB buffers in one anonymous mapping (O_DIRECT-safe).

    `pages` is a [capacity, 4096] uint8 view. On CUDA the engine registers the
    mapping as pinned memory (cudaHostRegister) so copies are asynchronous.
    """

    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise SlackTierError(ErrorKind.BAD_INPUT, f"pool capacity must be positive, got {capacity}",
                                 fix="size the pool to the most pages one step can read")
        self.capacity = capacity
        self._map = mmap.mmap(-1, capacity * PAGE_BYTES)
        self.pages = np.frombuffer(self._map, dtype=np.uint8).reshape(capacity, PAGE_BYTES)

    def address(self, index: int) -> int:
        """Virtual address of buffer `index` (for syscalls that take pointers)."""
        return self.pages.ctypes.data + index * PAGE_BYTES


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
    extra: dict[str, float] = field(default_factory=dict)


class PageSource(abc.ABC):
    """A tier that reads pages. At most four methods; everything else is built on top."""

    #: capability names, e.g. {"local", "odirect", "remote", "shared"}
    capabilities: frozenset[str] = frozenset()

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
