"""Page checksums and target checks, shared by the queued base (queued.py), the tiers and tests.

Tickets live in store/tickets.py. Per-read verification checksums the pool's pages in one compiled pass
(`pool_page_crcs`, the SSE4.2 kernel of tables/pagecrc.py), not one Python
call per page.

Worked example: buffer 5 of a pool -> words 5 * 512 .. 5 * 512 + 511 of the
pool's uint64 view, whose CRC32C is compared with the manifest's entry of the
page read into it.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numba import njit

from slacktier.tables.layout import PAGE_BYTES, PAGE_WORDS
from slacktier.tables.manifest import TableIdentity, check_target_header
from slacktier.tables.pagecrc import HW_CRC32C, crc_page_words, page_crcs, page_crcs_package
from slacktier.tables.regions import Region

NOT_DONE = np.iinfo(np.int32).min  # a read result slot no completion has written


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
