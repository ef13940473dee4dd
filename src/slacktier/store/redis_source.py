"""Remote memory tier: pages in a Redis server, one copy shared by many serving instances.

Layout: one key per page, ``{prefix}:{layer}:{rank}:{page}`` holding the 4096
raw bytes (the region's `RegionSpec.path` is the prefix). Why not pack a region
into large values and read with GETRANGE: GETRANGE reads one range per command,
so a batch of 3,000 scattered pages is 3,000 commands either way, while MGET
fetches hundreds of pages per command with one round trip; a key per page
costs ~2% extra server memory (about 70 B of key and object header per 4 KiB),
and a page can be rewritten or checked alone.

A worker thread sends one pipeline of MGETs (`keys_per_mget` keys each) per
batch and copies the replies into the pool.

Worked example: page 12 of layer 1, rank 3 under prefix "t0" -> key "t0:1:3:12".
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import redis

from slacktier.errors import ErrorKind, SlackTierError
from slacktier.store._common import (RegionTable, TicketBook, _Pending, check_reads, checksum_error,
                                     expected_checksums, own_reads, stop_workers)
from slacktier.store.base import PageBufferPool, PageReads, PageSource, ReadStats, RegionSpec
from slacktier.store.dram import load_region_pages
from slacktier.tables.layout import PAGE_BYTES

log = logging.getLogger(__name__)


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
                       pages_per_command: int = 256) -> RegionSpec:
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
    return RegionSpec(layer=layer, rank=rank, path=prefix, offset_bytes=0, pages=int(pages.shape[0]), device=device)


def load_regions_into_redis(url: str, regions: Sequence[RegionSpec], prefix: str) -> list[RegionSpec]:
    """Copy staged regions (files) into Redis under `prefix`; return the Redis region specs, same order."""
    out = []
    for spec in regions:
        out.append(store_region_pages(url, prefix, spec.layer, spec.rank, load_region_pages(spec),
                                      device=spec.device))
    log.info("loaded %d regions (%d pages) into Redis at %s under %r", len(regions),
             sum(s.pages for s in regions), url, prefix)
    return out


@dataclass
class _Part:
    pending: _Pending | None
    pool: PageBufferPool
    region: np.ndarray  # [n] int32
    page: np.ndarray    # [n] int64
    buffer: np.ndarray  # [n] int32


class RedisSource(PageSource):
    """Pages read from a shared Redis server with pipelined MGET."""

    capabilities = frozenset({"remote", "shared", "redis"})
    engine_name = "redis-mget"

    def __init__(self, regions: Sequence[RegionSpec], *, url: str = "redis://127.0.0.1:6379/0",
                 keys_per_mget: int = 256, verify_reads: bool = False,
                 page_crc32c: Sequence[np.ndarray] | None = None) -> None:
        if keys_per_mget < 1:
            raise SlackTierError(ErrorKind.BAD_INPUT, f"keys_per_mget {keys_per_mget}", fix="use at least 1")
        self._table = RegionTable.build(regions)
        self._expected = expected_checksums(self._table, page_crc32c, verify_reads)
        self.verify_reads = verify_reads
        if verify_reads:
            self.capabilities = self.capabilities | {"verify"}
        self.url = url
        self._keys_per_mget = keys_per_mget
        self._client = _connect(url)
        self._check_regions_present()
        self._book = TicketBook("RedisSource")
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._submit_lock = threading.Lock()  # a batch is queued before close's stop marker, or refused
        self._thread = threading.Thread(target=self._worker, daemon=True, name="slacktier-redis")
        self._thread.start()
        log.info("RedisSource: engine %s, %d regions at %s", self.engine_name, len(self._table.regions), url)

    def _check_regions_present(self) -> None:
        # The first and last page of each region: catches a region never loaded or loaded short.
        keys = []
        for spec in self._table.regions:
            keys += [page_key(spec.path, spec.layer, spec.rank, 0),
                     page_key(spec.path, spec.layer, spec.rank, spec.pages - 1)]
        pipe = self._client.pipeline(transaction=False)
        for key in keys:
            pipe.exists(key)
        found = pipe.execute()
        for i, spec in enumerate(self._table.regions):
            for j, page in enumerate((0, spec.pages - 1)):
                if not found[2 * i + j]:
                    self._client.close()
                    raise SlackTierError(ErrorKind.MISSING, f"Redis at {self.url} has no key {keys[2 * i + j]!r}",
                                         layer=spec.layer, rank=spec.rank, page=page,
                                         fix="load the region with load_regions_into_redis")

    def _worker(self) -> None:
        while True:
            part = self._queue.get()
            if part is None:
                self._client.close()
                return
            t0 = time.thread_time_ns()
            error: BaseException | None = None
            try:
                error = self._read(part)
            except redis.RedisError as exc:  # named by the batch's first page
                error = SlackTierError(ErrorKind.IO, f"Redis read of {part.region.shape[0]} pages failed: {exc}",
                                       **self._table.where(int(part.region[0]), int(part.page[0])),
                                       fix="check the Redis server")
            except BaseException as exc:  # wait() re-raises it
                error = exc
            self._book.finish_part(part.pending, time.thread_time_ns() - t0, error)

    def _read(self, part: _Part) -> SlackTierError | None:
        regions = self._table.regions
        keys = [page_key(regions[r].path, regions[r].layer, regions[r].rank, p)
                for r, p in zip(part.region.tolist(), part.page.tolist(), strict=True)]
        pipe = self._client.pipeline(transaction=False)
        for lo in range(0, len(keys), self._keys_per_mget):
            pipe.mget(keys[lo:lo + self._keys_per_mget])
        values = [v for reply in pipe.execute() for v in reply]
        for i, value in enumerate(values):
            if value is None or len(value) != PAGE_BYTES:
                where = self._table.where(int(part.region[i]), int(part.page[i]))
                if value is None:
                    return SlackTierError(ErrorKind.MISSING, f"Redis has no key {keys[i]!r}", **where,
                                          fix="load the region again with load_regions_into_redis")
                return SlackTierError(ErrorKind.IO, f"short read: key {keys[i]!r} holds {len(value)} of "
                                      f"{PAGE_BYTES} bytes", **where, fix="load the region again")
        got = np.frombuffer(b"".join(values), dtype=np.uint8).reshape(len(values), PAGE_BYTES)
        part.pool.pages[part.buffer] = got
        if self._expected is not None:
            return checksum_error(part.pool, part.region, part.page, part.buffer, self._table, self._expected,
                                  "redis read")
        return None

    def submit(self, reads: PageReads, pool: PageBufferPool) -> int:
        """Queue the batch on the Redis worker; returns a ticket at once."""
        self._book.refuse_if_closed()
        reads = own_reads(reads)
        check_reads(reads, self._table, pool)
        n = len(reads)
        part = _Part(None, pool, reads.region, reads.page, reads.buffer)
        with self._submit_lock:
            ticket, part.pending = self._book.open(1 if n else 0, n)
            if n:
                self._queue.put(part)
        return ticket

    def wait(self, ticket: int, timeout_s: float | None = None) -> ReadStats:
        """Block until the batch landed; raise SlackTierError naming layer/rank/page on a missing or bad page."""
        return self._book.wait(ticket, timeout_s)

    def close(self) -> None:
        """Finish queued batches, stop the worker and drop the connection; later calls raise CLOSED."""
        stop_workers(self._book, self._submit_lock, [self._queue], [self._thread])


