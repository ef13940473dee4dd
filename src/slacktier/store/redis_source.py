"""Remote memory tier: pages in a Redis server, one copy shared by many serving instances.

Layout: one key per page, ``{prefix}:{layer}:{rank}:{page}`` holding the 4096
raw bytes (the prefix is `RedisOptions.prefix`, else the region's `Region.path`). Why not pack a region
into large values and read with GETRANGE: GETRANGE reads one range per command,
so a batch of 3,000 scattered pages is 3,000 commands either way, while MGET
fetches hundreds of pages per command with one round trip; a key per page
costs ~2% extra server memory (about 70 B of key and object header per 4 KiB),
and a page can be rewritten or checked alone.

One worker lane (store/queued.py) sends one pipeline of MGETs
(`KEYS_PER_MGET` keys each) per batch and copies the replies into the pool.

Worked example: page 12 of layer 1, rank 3 under prefix "t0" -> key "t0:1:3:12".
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np
import redis

from slacktier.config import RedisOptions
from slacktier.errors import ErrorKind, SlackTierError
from slacktier.store.dram import load_region_pages
from slacktier.store.queued import Lane, Part, QueuedSource, typed_options
from slacktier.store.registry import register_tier
from slacktier.tables.layout import PAGE_BYTES
from slacktier.tables.regions import Region

log = logging.getLogger(__name__)

#: keys per MGET command: one round trip fetches up to 1 MiB of pages, small enough not to stall the server
KEYS_PER_MGET = 256


def page_key(prefix: str, layer: int, rank: int, page: int) -> bytes:
    """Redis key of one page: ("t0", 1, 3, 12) -> b"t0:1:3:12"."""
    return f"{prefix}:{layer}:{rank}:{page}".encode()


def _connect(url: str) -> redis.Redis:
    client = redis.Redis.from_url(url, decode_responses=False)
    try:
        client.ping()
    except redis.RedisError as exc:
        raise SlackTierError(ErrorKind.UNAVAILABLE, f"cannot reach Redis at {url}: {exc}",
                             fix="start redis-server there or pass the right url") from exc
    return client


def store_region_pages(url: str, prefix: str, layer: int, rank: int, pages: np.ndarray, *, device: int = 0,
                       pages_per_command: int = 256) -> Region:
    """Write one region's pages [P, 4096] uint8 under `prefix`; return the Redis region spec."""
    if pages.dtype != np.uint8 or pages.ndim != 2 or pages.shape[1] != PAGE_BYTES or pages.shape[0] == 0:
        raise SlackTierError(ErrorKind.BAD_INPUT, f"pages must be [P>0, {PAGE_BYTES}] uint8, got {pages.shape} "
                             f"{pages.dtype}", layer=layer, rank=rank, fix="pack rows into pages first")
    client = _connect(url)
    try:
        pipe = client.pipeline(transaction=False)
        for lo in range(0, pages.shape[0], pages_per_command):
            hi = min(lo + pages_per_command, pages.shape[0])
            pipe.mset({page_key(prefix, layer, rank, p): pages[p].tobytes() for p in range(lo, hi)})
        pipe.execute()
    finally:
        client.close()
    return Region(layer=layer, rank=rank, path=prefix, offset_bytes=0, pages=int(pages.shape[0]), device=device)


def load_regions_into_redis(url: str, regions: Sequence[Region], prefix: str) -> list[Region]:
    """Copy staged regions (files) into Redis under `prefix`; return the Redis region specs, same order."""
    out = []
    for spec in regions:
        out.append(store_region_pages(url, prefix, spec.layer, spec.rank, load_region_pages(spec),
                                      device=spec.device))
    log.info("loaded %d regions (%d pages) into Redis at %s under %r", len(regions),
             sum(s.pages for s in regions), url, prefix)
    return out


class RedisSource(QueuedSource[None]):
    """Pages read from a shared Redis server with pipelined MGET."""

    read_what = "redis read"
    engine_name = "redis-mget"

    def __init__(self, regions: Sequence[Region], options: RedisOptions | None = None, *,
                 page_crc32c: Sequence[np.ndarray] | None = None) -> None:
        super().__init__(regions, page_crc32c=page_crc32c)
        self.options = typed_options(options, RedisOptions)
        self.url = self.options.url
        self._prefix = [self.options.prefix or r.path for r in self.regions]  # [R] key prefix of each region
        self._client = _connect(self.url)
        self._check_regions_present()
        self._start_lanes(1)
        log.info("RedisSource: engine %s, %d regions at %s", self.engine_name, len(self.regions), self.url)

    def _key(self, region: int, page: int) -> bytes:
        r = self.regions[region]
        return page_key(self._prefix[region], r.layer, r.rank, page)

    def _check_regions_present(self) -> None:
        # The first and last page of each region: catches a region never loaded or loaded short.
        keys = [self._key(i, page) for i, r in enumerate(self.regions) for page in (0, r.pages - 1)]
        pipe = self._client.pipeline(transaction=False)
        for key in keys:
            pipe.exists(key)
        found = pipe.execute()
        for i, r in enumerate(self.regions):
            for j, page in enumerate((0, r.pages - 1)):
                if not found[2 * i + j]:
                    self._client.close()
                    raise SlackTierError(ErrorKind.MISSING, f"Redis at {self.url} has no key {keys[2 * i + j]!r}",
                                         layer=r.layer, rank=r.rank, page=page,
                                         fix="load the region with load_regions_into_redis")

    def _close_lane(self, lane: Lane[None]) -> None:
        self._client.close()

    def _read(self, lane: Lane[None], part: Part) -> SlackTierError | None:
        keys = [self._key(r, p) for r, p in zip(part.region.tolist(), part.page.tolist(), strict=True)]
        try:
            pipe = self._client.pipeline(transaction=False)
            for lo in range(0, len(keys), KEYS_PER_MGET):
                pipe.mget(keys[lo:lo + KEYS_PER_MGET])
            values = [v for reply in pipe.execute() for v in reply]
        except redis.RedisError as exc:  # named by the batch's first page
            return SlackTierError(ErrorKind.IO, f"Redis read of {len(keys)} pages failed: {exc}",
                                  **self._where(int(part.region[0]), int(part.page[0])), fix="check the Redis server")
        for i, value in enumerate(values):
            if value is None or len(value) != PAGE_BYTES:
                where = self._where(int(part.region[i]), int(part.page[i]))
                if value is None:
                    return SlackTierError(ErrorKind.MISSING, f"Redis has no key {keys[i]!r}", **where,
                                          fix="load the region again with load_regions_into_redis")
                return SlackTierError(ErrorKind.IO, f"short read: key {keys[i]!r} holds {len(value)} of "
                                      f"{PAGE_BYTES} bytes", **where, fix="load the region again")
        part.pool.pages[part.buffer] = np.frombuffer(b"".join(values), dtype=np.uint8).reshape(len(values), PAGE_BYTES)
        return None


register_tier("redis", RedisSource, RedisOptions)
