"""Page sources: host DRAM, local disk (O_DIRECT, io_uring), Redis; one small interface (base.py).

Importing this package registers the three built-in tiers (each registers
itself at the bottom of its own module); see registry.py for adding one.
"""

from slacktier.store.base import PageBufferPool, PageReads, PageSource, ReadStats
from slacktier.store.registry import get_tier, open_source, register_tier, tiers

from slacktier.store import disk, dram  # noqa: E402,F401  (registers the tiers)
from slacktier.store.redis import source as _redis  # noqa: E402,F401  (registers tier "redis")

__all__ = ["PageBufferPool", "PageReads", "PageSource", "ReadStats", "get_tier", "open_source",
           "register_tier", "tiers"]
