"""Host DRAM tier: every region's pages held in one host array; a read is a memcpy.

The pages live in one [total_pages, 4096] uint8 array (region i starts at row
`base[i]`); a worker thread copies a batch into the pool with a compiled loop
(numba, GIL released), so `submit` returns at once like the other tiers.
Neither this array nor the pool is pinned: the engine packs missed rows into
its own pinned staging tensor (see store/base.py, PageBufferPool).

Verification: the pages are read from the staged files once, at open. Given
the manifest's checksums, the source checks every page then, in one compiled
pass, and refuses to open on the first mismatch (CHECKSUM, naming layer, rank
and page); after that it serves without per-read checks, since the bytes
never leave host memory again. So `verify_by_default` is on: it costs one
CRC32C pass at load (compiled, over the bytes once) and nothing per read.
With an `identity`, every target file's header page is checked before the
pages are loaded.

Worked example: regions of 10 and 20 pages -> page 3 of region 1 is row 13.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence

import numpy as np
from numba import njit

from slacktier.config import DramOptions
from slacktier.errors import ErrorKind, SlackTierError
from slacktier.store._common import check_file_targets
from slacktier.store.queued import Part, QueuedSource, Worker, typed_options
from slacktier.store.registry import register_tier
from slacktier.tables.layout import PAGE_BYTES
from slacktier.tables.manifest import TableIdentity
from slacktier.tables.odirect import lock_target
from slacktier.tables.pagecrc import page_crcs
from slacktier.tables.regions import Region

log = logging.getLogger(__name__)


@njit(nogil=True, cache=True)
def copy_pages(src: np.ndarray, src_rows: np.ndarray, dst: np.ndarray, dst_rows: np.ndarray) -> None:
    """dst[dst_rows[i]] = src[src_rows[i]] for each i; src, dst C-contiguous [*, 4096] uint8.

    Each page moves as 512 eight-byte words in a plain loop, which the compiler vectorizes; a slice
    assignment of the byte rows compiles to a byte-at-a-time loop."""
    words = PAGE_BYTES // 8
    s64 = src.view(np.uint64).reshape(src.shape[0], words)
    d64 = dst.view(np.uint64).reshape(dst.shape[0], words)
    for i in range(src_rows.shape[0]):
        a = s64[src_rows[i]]
        b = d64[dst_rows[i]]
        for j in range(words):
            b[j] = a[j]


def load_region_pages(spec: Region) -> np.ndarray:
    """Read one region's pages from its file with buffered reads: -> [pages, 4096] uint8."""
    out = np.empty((spec.pages, PAGE_BYTES), dtype=np.uint8)
    try:
        fd = os.open(spec.path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError as exc:
        raise SlackTierError(ErrorKind.MISSING, f"region file {spec.path} does not exist", layer=spec.layer,
                             rank=spec.rank, fix="stage the table first, or fix the path") from exc
    except OSError as exc:
        raise SlackTierError(ErrorKind.IO, f"cannot open region file {spec.path}: {exc.strerror}",
                             layer=spec.layer, rank=spec.rank, fix="check the file's permissions") from None
    try:
        lock_target(fd, spec.path, exclusive=False)   # no stage writes it while it loads (released at close)
        view = memoryview(out).cast("B")
        done = 0
        while done < out.nbytes:
            got = os.preadv(fd, [view[done:]], spec.offset_bytes + done)
            if got == 0:
                raise SlackTierError(ErrorKind.IO, f"{spec.path} ends {out.nbytes - done} bytes before the region",
                                     layer=spec.layer, rank=spec.rank, page=done // PAGE_BYTES,
                                     fix="the file is truncated; stage the region again")
            done += got
    finally:
        os.close(fd)
    return out


class DramSource(QueuedSource[None]):
    """Pages held in host memory: loaded from the regions' files, or given as arrays (`pages`, one per region)."""

    read_what = "dram read"
    engine_name = "memcpy"
    #: pages are checked once, at load (see the module docstring), so verification costs nothing per read
    verify_by_default = True

    def __init__(self, regions: Sequence[Region], options: DramOptions | None = None, *,
                 page_crc32c: Sequence[np.ndarray] | None = None, identity: TableIdentity | None = None,
                 pages: Sequence[np.ndarray] | None = None) -> None:
        super().__init__(regions, page_crc32c=page_crc32c)
        self.options = typed_options(options, DramOptions)
        if identity is not None:
            self.verify_identity(self.regions, self.options, identity)
        if pages is not None and len(pages) != len(self.regions):
            raise SlackTierError(ErrorKind.BAD_INPUT, f"{len(pages)} page arrays for {len(self.regions)} "
                                 "regions", fix="pass one [pages, 4096] uint8 array per region, in order")
        self._pages = np.empty((int(self._region_pages.sum()), PAGE_BYTES), dtype=np.uint8)  # [total_pages, 4096]
        for i, region in enumerate(self.regions):
            lo = int(self._region_base[i])
            if pages is None:
                self._pages[lo:lo + region.pages] = load_region_pages(region)
                continue
            given = np.asarray(pages[i])
            if given.dtype != np.uint8 or given.shape != (region.pages, PAGE_BYTES):
                raise SlackTierError(ErrorKind.BAD_INPUT, f"page array is {given.shape} {given.dtype}, want "
                                     f"({region.pages}, {PAGE_BYTES}) uint8", layer=region.layer, rank=region.rank,
                                     fix="pack rows with slacktier.tables.layout.pack_rows_into_pages")
            self._pages[lo:lo + region.pages] = given
        self._verify_loaded_pages()
        self._check_each_read = False  # checked once above; host memory does not change underneath
        self.nbytes = self._pages.nbytes
        self._start_workers(1)
        log.info("DramSource: engine %s, %d regions, %.1f MiB in host memory", self.engine_name,
                 len(self.regions), self.nbytes / 2**20)

    @classmethod
    def verify_identity(cls, regions: Sequence[Region], options: DramOptions | None,
                        identity: TableIdentity) -> None:
        """Each target file the pages are loaded from carries `identity`'s header, complete."""
        typed_options(options, DramOptions)
        check_file_targets(regions, identity)

    def _verify_loaded_pages(self) -> None:
        """Every held page against the manifest's CRC32C (when given); raise CHECKSUM naming the first bad one."""
        if self._expected is None:
            return
        bad = np.flatnonzero(page_crcs(self._pages) != self._expected)
        if not bad.size:
            return
        first = int(bad[0])
        region = int(np.searchsorted(self._region_base, first, side="right")) - 1
        page = first - int(self._region_base[region])
        r = self.regions[region]
        others = f"; {bad.size - 1} more pages differ" if bad.size > 1 else ""
        raise SlackTierError(ErrorKind.CHECKSUM, f"{self.read_what}: a page held for {r.path} does not match its "
                             f"manifest CRC32C at load{others}", layer=r.layer, rank=r.rank, page=page,
                             fix="the staged page is corrupt; stage the region again")

    def _warm(self) -> None:
        super()._warm()
        one = np.zeros((1, PAGE_BYTES), np.uint8)
        copy_pages(one, np.zeros(1, np.int64), one.copy(), np.zeros(1, np.int32))

    def _read(self, worker: Worker[None], part: Part) -> SlackTierError | None:
        copy_pages(self._pages, self._region_base[part.region] + part.page, part.pool.pages, part.buffer)
        return None


register_tier("dram", DramSource, DramOptions)
