"""Page sources: host DRAM, local disk (O_DIRECT, io_uring), Redis; one small interface (base.py)."""

from slacktier.store.base import PageBufferPool, PageReads, PageSource, ReadStats, RegionSpec
from slacktier.store.factory import SOURCE_KINDS, open_source

__all__ = ["SOURCE_KINDS", "PageBufferPool", "PageReads", "PageSource", "ReadStats", "RegionSpec", "open_source"]
