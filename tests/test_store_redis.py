"""The Redis tier against a real redis-server started by the test: one copy, several readers."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import redis

from slacktier.config import RedisOptions
from slacktier.errors import ErrorKind, SlackTierError
from slacktier.store import PageBufferPool, PageReads
from slacktier.store._common import page_crc32c
from slacktier.store.redis_source import RedisSource, load_regions_into_redis, page_key, store_region_pages
from slacktier.store.testing import RedisServer, stage_synthetic
from slacktier.tables.regions import Region


@pytest.fixture
def server(tmp_path):
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server binary not found (apt-get install -y redis-server; scripts/test.sh does)")
    srv = RedisServer(tmp_path)
    yield srv
    srv.stop()


def _reads(pairs: list[tuple[int, int]]) -> PageReads:
    region, page = zip(*pairs, strict=True)
    return PageReads(np.array(region, np.int32), np.array(page, np.int64), np.arange(len(pairs), dtype=np.int32))


def test_key_layout():
    assert page_key("t0", 1, 3, 12) == b"t0:1:3:12"


def test_two_instances_read_one_copy(server, tmp_path):
    staged = stage_synthetic(tmp_path / "regions", layers=(1, 14), ranks=2, rows=150)
    specs = load_regions_into_redis(server.url, staged.specs, prefix="shared")
    client = redis.Redis.from_url(server.url)
    keys_once = client.dbsize()
    assert keys_once == sum(s.pages for s in staged.specs)  # exactly one copy of every page
    a, b = RedisSource(specs, RedisOptions(url=server.url)), RedisSource(specs, RedisOptions(url=server.url))
    try:
        pairs = [(r, p) for r, spec in enumerate(specs) for p in range(spec.pages)]
        pool_a, pool_b = PageBufferPool(len(pairs)), PageBufferPool(len(pairs))
        ta, tb = a.submit(_reads(pairs), pool_a), b.submit(_reads(pairs), pool_b)
        a.wait(ta)
        b.wait(tb)
        want = np.stack([staged.pages[r][p] for r, p in pairs])
        np.testing.assert_array_equal(pool_a.pages, want)
        np.testing.assert_array_equal(pool_b.pages, want)
        assert client.dbsize() == keys_once
    finally:
        a.close()
        b.close()
        client.close()


def test_the_prefix_option_replaces_the_regions_paths(server):
    pages = np.random.default_rng(2).integers(0, 256, (3, 4096), dtype=np.uint8)
    spec = store_region_pages(server.url, "kept-here", 1, 0, pages)
    staged_path = Region(layer=1, rank=0, path="/staged/t.bin", offset_bytes=4096, pages=3)
    src = RedisSource([staged_path], RedisOptions(url=server.url, prefix=spec.path))
    try:
        pool = PageBufferPool(3)
        src.wait(src.submit(_reads([(0, 2), (0, 0), (0, 1)]), pool))
        np.testing.assert_array_equal(pool.pages, pages[[2, 0, 1]])
    finally:
        src.close()
    with pytest.raises(SlackTierError) as info:  # without the prefix the keys are looked up under the path
        RedisSource([staged_path], RedisOptions(url=server.url))
    assert info.value.kind is ErrorKind.MISSING


def test_a_region_never_loaded_is_missing_at_construction(server, tmp_path):
    spec = store_region_pages(server.url, "p", 1, 0, np.ones((3, 4096), np.uint8))
    ghost = Region(layer=14, rank=2, path="p", offset_bytes=0, pages=3)
    with pytest.raises(SlackTierError) as info:
        RedisSource([spec, ghost], RedisOptions(url=server.url))
    assert info.value.kind is ErrorKind.MISSING and (info.value.layer, info.value.rank, info.value.page) == (14, 2, 0)


def test_a_lost_key_or_a_short_value_names_the_page(server):
    spec = store_region_pages(server.url, "p", 1, 2, np.full((5, 4096), 9, np.uint8))
    src = RedisSource([spec], RedisOptions(url=server.url))
    client = redis.Redis.from_url(server.url)
    try:
        client.delete(page_key("p", 1, 2, 3))
        with pytest.raises(SlackTierError) as info:
            src.wait(src.submit(_reads([(0, 1), (0, 3)]), PageBufferPool(2)))
        assert info.value.kind is ErrorKind.MISSING and (info.value.layer, info.value.rank, info.value.page) == (1, 2, 3)
        client.set(page_key("p", 1, 2, 2), b"x" * 100)
        with pytest.raises(SlackTierError) as info:
            src.wait(src.submit(_reads([(0, 2)]), PageBufferPool(1)))
        assert info.value.kind is ErrorKind.IO and "100 of 4096" in str(info.value) and info.value.page == 2
    finally:
        src.close()
        client.close()


def test_a_changed_page_fails_its_checksum(server):
    pages = np.random.default_rng(0).integers(0, 256, (4, 4096), dtype=np.uint8)
    spec = store_region_pages(server.url, "c", 1, 0, pages)
    src = RedisSource([spec], RedisOptions(url=server.url), page_crc32c=[page_crc32c(pages)])
    client = redis.Redis.from_url(server.url)
    try:
        changed = pages[2].copy()
        changed[0] ^= 1
        client.set(page_key("c", 1, 0, 2), changed.tobytes())
        with pytest.raises(SlackTierError) as info:
            src.wait(src.submit(_reads([(0, 0), (0, 2)]), PageBufferPool(2)))
        assert info.value.kind is ErrorKind.CHECKSUM and info.value.page == 2
    finally:
        src.close()
        client.close()


def test_a_server_that_went_away_is_an_io_error(server):
    spec = store_region_pages(server.url, "g", 1, 0, np.ones((2, 4096), np.uint8))
    src = RedisSource([spec], RedisOptions(url=server.url))
    try:
        server.stop()
        with pytest.raises(SlackTierError) as info:
            src.wait(src.submit(_reads([(0, 1)]), PageBufferPool(1)))
        assert info.value.kind is ErrorKind.IO and (info.value.layer, info.value.rank) == (1, 0)
    finally:
        src.close()


def test_no_server_is_unavailable():
    spec = Region(layer=1, rank=0, path="x", offset_bytes=0, pages=1)
    with pytest.raises(SlackTierError) as info:
        RedisSource([spec], RedisOptions(url="redis://127.0.0.1:1/0"))
    assert info.value.kind is ErrorKind.UNAVAILABLE


def test_a_wait_that_times_out_can_be_waited_again(server):
    pages = np.random.default_rng(1).integers(0, 256, (3, 4096), dtype=np.uint8)
    spec = store_region_pages(server.url, "slow", 1, 0, pages)
    src = RedisSource([spec], RedisOptions(url=server.url))
    client = redis.Redis.from_url(server.url)
    try:
        client.execute_command("CLIENT", "PAUSE", 1500, "ALL")  # the server answers nobody for 1.5 s
        pool = PageBufferPool(3)
        ticket = src.submit(_reads([(0, 2), (0, 0), (0, 1)]), pool)
        with pytest.raises(SlackTierError, match="not done after") as exc:
            src.wait(ticket, timeout_s=0.2)
        assert exc.value.kind is ErrorKind.TIMEOUT
        src.wait(ticket)
        np.testing.assert_array_equal(pool.pages, pages[[2, 0, 1]])
    finally:
        src.close()
        client.close()
