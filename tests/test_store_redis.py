"""The Redis tier in standalone mode against a real redis-server started by the test: the same keys, loader,
identity and generation checks as a cluster (test_store_redis_cluster.py), one copy read by several sources."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import redis

from slacktier.config import RedisOptions
from slacktier.errors import ErrorKind, SlackTierError
from slacktier.tables.layout import binary_bytes
from slacktier.store import PageBufferPool, PageReads
from slacktier.store.redis.keys import gen_key, page_key
from slacktier.store.redis.loader import load_manifest
from slacktier.store.redis.source import RedisSource
from slacktier.testing.store import RedisServer, stage_synthetic
from slacktier.tables.regions import Region


@pytest.fixture
def server(tmp_path):
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server binary not found (apt-get install -y redis-server; scripts/test.sh does)")
    srv = RedisServer(tmp_path)
    yield srv
    srv.stop()


@pytest.fixture
def staged(tmp_path):
    return stage_synthetic(tmp_path / "regions", layers=(1, 14), ranks=2, rows=150)


def _reads(pairs: list[tuple[int, int]]) -> PageReads:
    region, page = zip(*pairs, strict=True)
    return PageReads(np.array(region, np.int32), np.array(page, np.int64), np.arange(len(pairs), dtype=np.int32))


def _open(server, staged, prefix: str, **kw) -> RedisSource:
    return RedisSource(staged.specs, RedisOptions(url=server.url, prefix=prefix, **kw),
                       page_crc32c=staged.manifest.region_checksums(), identity=staged.manifest.identity)


def test_two_instances_read_one_copy_exactly(server, staged):
    report = load_manifest(RedisOptions(url=server.url), staged.manifest, prefix="shared", tag_buckets=4)
    client = redis.Redis.from_url(server.url)
    keys_once = client.dbsize()
    pages = sum(s.pages for s in staged.specs)
    assert keys_once == pages + report.groups + 1   # one copy of every page, a gen key per group, the identity
    a, b = _open(server, staged, "shared"), _open(server, staged, "shared")
    try:
        pairs = [(r, p) for r, spec in enumerate(staged.specs) for p in range(spec.pages)]
        pool_a, pool_b = PageBufferPool(len(pairs)), PageBufferPool(len(pairs))
        ta, tb = a.submit(_reads(pairs), pool_a), b.submit(_reads(pairs), pool_b)
        a.wait(ta)
        b.wait(tb)
        want = np.stack([staged.pages[r][p] for r, p in pairs])
        np.testing.assert_array_equal(pool_a.pages, want)
        np.testing.assert_array_equal(pool_b.pages, want)
        assert client.dbsize() == keys_once
        assert client.exists(page_key("shared", 1, 0, 5, 4))   # the cluster's hash-tagged keys, on one server
    finally:
        a.close()
        b.close()
        client.close()


def test_the_default_prefix_is_the_stage_id_and_a_region_not_loaded_is_refused(server, staged, tmp_path):
    load_manifest(RedisOptions(url=server.url), staged.manifest)   # prefix "st-<stage id>", what a source looks for
    src = RedisSource(staged.specs, RedisOptions(url=server.url), identity=staged.manifest.identity)
    src.close()
    ghost = Region(layer=14, rank=5, path="x", offset_bytes=0, pages=3)
    with pytest.raises(SlackTierError) as info:
        RedisSource([*staged.specs, ghost], RedisOptions(url=server.url), identity=staged.manifest.identity)
    assert info.value.kind is ErrorKind.TARGET and (info.value.layer, info.value.rank) == (14, 5)
    with pytest.raises(SlackTierError) as info:   # no prefix and no identity to derive one from
        RedisSource(staged.specs, RedisOptions(url=server.url))
    assert info.value.kind is ErrorKind.BAD_INPUT and "prefix" in info.value.fix


def test_a_lost_key_or_a_short_value_names_the_key_and_node(server, staged):
    load_manifest(RedisOptions(url=server.url), staged.manifest, prefix="p", tag_buckets=2)
    src = _open(server, staged, "p")
    client = redis.Redis.from_url(server.url)
    node = server.url.split("//")[1].split("/")[0]
    r = staged.specs[1]
    try:
        client.delete(page_key("p", r.layer, r.rank, 3, 2))
        with pytest.raises(SlackTierError) as info:
            src.wait(src.submit(_reads([(1, 1), (1, 3)]), PageBufferPool(2)))
        assert info.value.kind is ErrorKind.MISSING and (info.value.layer, info.value.rank, info.value.page) == \
            (r.layer, r.rank, 3)
        assert repr(page_key("p", r.layer, r.rank, 3, 2)) in info.value.message and node in info.value.message
        client.set(page_key("p", r.layer, r.rank, 2, 2), b"x" * 100)
        with pytest.raises(SlackTierError) as info:
            src.wait(src.submit(_reads([(1, 2)]), PageBufferPool(1)))
        assert info.value.kind is ErrorKind.IO and "holds 100 bytes" in info.value.message and info.value.page == 2
        client.delete(gen_key("p", r.layer, r.rank, 1))   # a group's generation gone (a flush, a restart)
        with pytest.raises(SlackTierError) as info:
            _open(server, staged, "p")
        assert info.value.kind is ErrorKind.TARGET and "incomplete" in info.value.message and node in \
            info.value.message
    finally:
        src.close()
        client.close()


def test_a_changed_page_fails_its_checksum(server, staged):
    load_manifest(RedisOptions(url=server.url), staged.manifest, prefix="c", tag_buckets=2)
    src = _open(server, staged, "c")
    client = redis.Redis.from_url(server.url)
    key = page_key("c", staged.specs[0].layer, staged.specs[0].rank, 2, 2)
    try:
        good = client.get(key)
        client.set(key, bytes([good[0] ^ 1]) + good[1:])
        with pytest.raises(SlackTierError) as info:
            src.wait(src.submit(_reads([(0, 0), (0, 2)]), PageBufferPool(2)))
        assert info.value.kind is ErrorKind.CHECKSUM and info.value.page == 2
    finally:
        src.close()
        client.close()


def test_a_server_that_went_away_is_an_io_error(server, staged):
    load_manifest(RedisOptions(url=server.url), staged.manifest, prefix="g")
    src = _open(server, staged, "g", socket_timeout_ms=300)
    try:
        server.stop()
        with pytest.raises(SlackTierError) as info:
            src.wait(src.submit(_reads([(0, 1)]), PageBufferPool(1)))
        assert info.value.kind is ErrorKind.IO and (info.value.layer, info.value.rank) == (1, 0)
    finally:
        src.close()


def test_no_server_is_unavailable_and_a_cluster_mode_against_one_server_is_refused(server, staged):
    with pytest.raises(SlackTierError) as info:
        RedisSource(staged.specs, RedisOptions(url="redis://127.0.0.1:1/0"), identity=staged.manifest.identity)
    assert info.value.kind is ErrorKind.UNAVAILABLE
    with pytest.raises(SlackTierError) as info:
        RedisSource(staged.specs, RedisOptions(url=server.url, mode="cluster"), identity=staged.manifest.identity)
    assert info.value.kind is ErrorKind.BAD_INPUT and 'mode = "standalone"' in info.value.fix


def test_a_wait_that_times_out_can_be_waited_again(server, staged):
    load_manifest(RedisOptions(url=server.url), staged.manifest, prefix="slow")
    src = _open(server, staged, "slow")
    client = redis.Redis.from_url(server.url)
    try:
        client.execute_command("CLIENT", "PAUSE", 1500, "ALL")  # the server answers nobody for 1.5 s
        pool = PageBufferPool(3)
        ticket = src.submit(_reads([(0, 2), (0, 0), (0, 1)]), pool)
        with pytest.raises(SlackTierError, match="not done after") as exc:
            src.wait(ticket, timeout_s=0.2)
        assert exc.value.kind is ErrorKind.TIMEOUT
        src.wait(ticket)
        np.testing.assert_array_equal(pool.pages, np.stack([staged.pages[0][p] for p in (2, 0, 1)]))
    finally:
        src.close()
        client.close()


def test_the_load_verb_loads_a_standalone_server(server, staged, capsys):
    from slacktier.cli import main
    argv = ["load", str(staged.manifest.path), "--url", server.url, "--prefix", "verb", "--no-progress"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "loaded" in out and 'mode = "standalone"' in out
    assert main(argv) == 0 and "already complete" in capsys.readouterr().out
    _open(server, staged, "verb").close()


def test_a_server_on_a_unix_socket_is_loaded_and_read(tmp_path, staged):
    """A unix-socket url (standalone only): the loader's client and the tier's own sockets both reach it."""
    import subprocess
    import time

    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server binary not found (apt-get install -y redis-server; scripts/test.sh does)")
    path = tmp_path / "redis.sock"
    proc = subprocess.Popen([binary, "--port", "0", "--unixsocket", str(path), "--save", "", "--appendonly", "no",
                             "--dir", str(tmp_path)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10   # a bound on a server that never comes up, not a speed check
        while not path.exists():
            assert proc.poll() is None and time.monotonic() < deadline, "redis-server did not open its socket"
            time.sleep(0.02)
        options = RedisOptions(url=f"unix://{path}", prefix="u")
        load_manifest(options, staged.manifest, tag_buckets=4)
        src = RedisSource(staged.specs, options, page_crc32c=staged.manifest.region_checksums(),
                          identity=staged.manifest.identity)
        try:
            pairs = [(r, p) for r, spec in enumerate(staged.specs) for p in range(spec.pages)]
            pool = PageBufferPool(len(pairs))
            src.wait(src.submit(_reads(pairs), pool))
            np.testing.assert_array_equal(pool.pages, np.stack([staged.pages[r][p] for r, p in pairs]))
        finally:
            src.close()
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_loaded_tables_are_listed_replaced_and_removed_without_a_second_copy(server, staged, tmp_path, capsys):
    """An identical restage keeps its prefix (the load is a no-op), a changed table replaces the old one with
    --replace, a load over another table's prefix says what it replaces and leaves none of its keys, and
    --list / --remove show and delete tables with their sizes and generations."""
    from slacktier.cli import main
    from slacktier.store.redis.keys import default_prefix

    from slacktier.testing.store import stage_synthetic as stage

    client = redis.Redis.from_url(server.url)
    url = ["--url", server.url, "--no-progress"]
    one_copy = sum(s.pages for s in staged.specs)
    try:
        assert main(["load", str(staged.manifest.path), *url, "--tag-buckets", "4"]) == 0
        keys = client.dbsize()
        assert keys == one_copy + 4 * len(staged.specs) + 1
        same = stage(tmp_path / "same", layers=(1, 14), ranks=2, rows=150)       # the same source, staged again
        assert same.manifest.identity == staged.manifest.identity
        capsys.readouterr()
        assert main(["load", str(same.manifest.path), *url, "--tag-buckets", "4"]) == 0
        assert "already complete" in capsys.readouterr().out and client.dbsize() == keys
        changed = stage(tmp_path / "changed", layers=(1, 14), ranks=2, rows=150, seed=8)
        old = default_prefix(staged.manifest.identity)
        assert main(["load", str(changed.manifest.path), *url, "--tag-buckets", "4", "--replace", old]) == 0
        out = capsys.readouterr().out
        assert f"removed {old!r}: table {staged.manifest.source_digest}" in out and client.dbsize() == keys
        assert main(["load", "--list", *url]) == 0
        out = capsys.readouterr().out
        new = default_prefix(changed.manifest.identity)
        assert f"{new!r}: table {changed.manifest.source_digest}" in out and old not in out
        assert f"{one_copy} pages, {binary_bytes(one_copy * 4100)}" in out and "1 tables" in out
        # Another table loaded over this prefix, with fewer page groups: said, and no key of the old one left.
        assert main(["load", str(staged.manifest.path), *url, "--prefix", new, "--tag-buckets", "2"]) == 0
        out = capsys.readouterr().out
        assert f"replaced in place: {new!r}: table {changed.manifest.source_digest}" in out
        assert client.dbsize() == one_copy + 2 * len(staged.specs) + 1
        _open(server, staged, new).close()
        assert main(["load", "--remove", new, *url]) == 0
        assert client.dbsize() == 0
        assert main(["load", "--remove", new, *url]) == 2   # nothing there any more
        assert "holds no table under prefix" in capsys.readouterr().err
    finally:
        client.close()
