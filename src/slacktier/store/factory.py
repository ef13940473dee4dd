"""Open a page source by kind name: the one place that maps "dram" / "disk" / "redis" to a class."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from slacktier.errors import ErrorKind, SlackTierError
from slacktier.store.base import PageSource, RegionSpec

SOURCE_KINDS = ("dram", "disk", "redis")


def open_source(kind: str, regions: Sequence[RegionSpec], **opts: Any) -> PageSource:
    """A page source of `kind` over `regions`; `opts` go to that source's constructor."""
    if kind == "dram":
        from slacktier.store.dram import DramSource
        return DramSource(regions, **opts)
    if kind == "disk":
        from slacktier.store.disk import DiskSource
        return DiskSource(regions, **opts)
    if kind == "redis":
        from slacktier.store.redis_source import RedisSource
        return RedisSource(regions, **opts)
    raise SlackTierError(ErrorKind.BAD_INPUT, f"unknown page source kind {kind!r}",
                         fix=f"choose one of {', '.join(SOURCE_KINDS)}")
