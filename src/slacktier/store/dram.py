"""Host DRAM tier: every region's pages held in one host array; a read is a memcpy.

The pages live in one [total_pages, 4096] uint8 array (region i starts at row
`base[i]`); a worker thread copies a batch into the pool with a compiled loop
(numba, GIL released), so `submit` returns at once like the other tiers.
Neither this array nor the pool is pinned: the engine packs missed rows into
its own pinned staging tensor (see store/base.py, PageBufferPool).

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
from slacktier.store.queued import Lane, Part, QueuedSource, typed_options
from slacktier.store.registry import register_tier
from slacktier.tables.layout import PAGE_BYTES
from slacktier.tables.regions import Region

log = logging.getLogger(__name__)


@njit(nogil=True, cache=True)
def copy_pages(src: np.ndarray, src_rows: np.ndarray, dst: np.ndarray, dst_rows: np.ndarray) -> None:
    """dst[dst_rows[i]] = src[src_rows[i]] for each i; src, dst [*, 4096] uint8."""
    for i in range(src_rows.shape[0]):
        dst[dst_rows[i], :] = src[src_rows[i], :]


def load_region_pages(spec: Region) -> np.ndarray:
    """Read one region's pages from its file with buffered reads: -> [pages, 4096] uint8."""
    out = np.empty((spec.pages, PAGE_BYTES), dtype=np.uint8)
    try:
        fd = os.open(spec.path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError as exc:
        raise SlackTierError(ErrorKind.MISSING, f"region file {spec.path} does not exist", layer=spec.layer,
                             rank=spec.rank, fix="stage the table first, or fix the path") from exc
    try:
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

    def __init__(self, regions: Sequence[Region], options: DramOptions | None = None, *,
                 page_crc32c: Sequence[np.ndarray] | None = None, pages: Sequence[np.ndarray] | None = None) -> None:
        super().__init__(regions, page_crc32c=page_crc32c)
        self.options = typed_options(options, DramOptions)
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
        self.nbytes = self._pages.nbytes
        self._start_lanes(1)
        log.info("DramSource: engine %s, %d regions, %.1f MiB in host memory", self.engine_name,
                 len(self.regions), self.nbytes / 2**20)

    def _read(self, lane: Lane[None], part: Part) -> SlackTierError | None:
        copy_pages(self._pages, self._region_base[part.region] + part.page, part.pool.pages, part.buffer)
        return None


register_tier("dram", DramSource, DramOptions)
