"""Issue 11 in the store: each tier refuses a medium holding another table, bounds its waits, masks secrets,
and verifies reads by default where it has no end-to-end checksum. Real staged files and a real redis-server."""

from __future__ import annotations

import logging
import os
import shutil

import crc32c
import numpy as np
import pytest
import redis
from hypothesis import given, settings
from hypothesis import strategies as st

import tier_memfile  # noqa: F401  (registers "memfile")
from slacktier.config import RedisOptions
from slacktier.errors import ErrorKind, SlackTierError
from slacktier.store import PageBufferPool, PageReads, get_tier, open_source, tiers
from slacktier.store._common import pool_page_crcs
from slacktier.store.disk import DiskSource
from slacktier.store.dram import DramSource
from slacktier.store.redis.keys import identity_key, page_key
from slacktier.store.redis.loader import load_manifest
from slacktier.store.redis.source import RedisSource
from slacktier.store.registry import verify_identity
from slacktier.testing.store import RedisServer, stage_synthetic
from slacktier.tables.layout import PAGE_BYTES
from slacktier.tables.manifest import TableIdentity, header_page

FILE_TIERS = ["dram", "disk", "memfile"]


def _reads(pairs: list[tuple[int, int]]) -> PageReads:
    region, page = zip(*pairs, strict=True)
    return PageReads(np.array(region, np.int32), np.array(page, np.int64), np.arange(len(pairs), dtype=np.int32))


def _read_all(src, staged) -> None:
    pairs = [(r, p) for r, spec in enumerate(staged.specs) for p in range(spec.pages)]
    pool = PageBufferPool(len(pairs))
    src.wait(src.submit(_reads(pairs), pool))
    np.testing.assert_array_equal(pool.pages, np.concatenate(staged.pages))


# -- file tiers: the target's header page -----------------------------------------------------------------------


@pytest.mark.parametrize("name", FILE_TIERS)
def test_a_file_tier_opens_its_own_table_and_refuses_one_restaged_over_it(name, o_direct_dir):
    a = stage_synthetic(o_direct_dir, layers=(1,), ranks=2, rows=100, devices=2, seed=1)
    ident = a.manifest.identity
    src = open_source(name, a.specs, identity=ident)
    try:
        _read_all(src, a)
        verify_identity(name, a.specs, None, ident)  # a kept source re-checked, nothing reopened
        if name == "disk":   # it reads the targets while open: they are locked against a stage
            with pytest.raises(SlackTierError, match="is in use"):
                stage_synthetic(o_direct_dir, layers=(1,), ranks=2, rows=100, devices=2, seed=2, overwrite=True)
            src.close()
        # Another table restaged over the same targets: the old manifest's identity no longer matches.
        b = stage_synthetic(o_direct_dir, layers=(1,), ranks=2, rows=100, devices=2, seed=2, overwrite=True)
        assert b.manifest.identity.source_digest != ident.source_digest
        with pytest.raises(SlackTierError) as info:
            verify_identity(name, a.specs, None, ident)
        assert info.value.kind is ErrorKind.TARGET and "another table" in str(info.value)
    finally:
        src.close()
    with pytest.raises(SlackTierError) as info:
        open_source(name, a.specs, identity=ident)
    assert info.value.kind is ErrorKind.TARGET
    # The same table staged again keeps its content-derived stage id: both manifests open it (the same bytes).
    c = stage_synthetic(o_direct_dir, layers=(1,), ranks=2, rows=100, devices=2, seed=2, overwrite=True)
    assert c.manifest.identity == b.manifest.identity
    open_source(name, b.specs, identity=b.manifest.identity).close()
    open_source(name, c.specs, identity=c.manifest.identity).close()


@pytest.mark.parametrize("name", FILE_TIERS)
def test_a_file_tier_refuses_a_half_written_or_foreign_target(name, o_direct_dir):
    a = stage_synthetic(o_direct_dir, layers=(1,), ranks=2, rows=100, devices=2, seed=3)
    ident = a.manifest.identity
    target = a.manifest.targets[1]
    with open(target, "r+b") as f:
        original = f.read(PAGE_BYTES)
        # What a restage leaves while it writes: the header says "staging" until the last fsync.
        f.seek(0)
        f.write(header_page(ident.source_digest, 1, 2, "staging", ident.stage_id).tobytes())
    with pytest.raises(SlackTierError, match="did not finish") as info:
        open_source(name, a.specs, identity=ident)
    assert info.value.kind is ErrorKind.TARGET
    with open(target, "r+b") as f:
        f.write(bytes(PAGE_BYTES))  # not a SlackTier target at all
    with pytest.raises(SlackTierError, match="no SlackTier header") as info:
        open_source(name, a.specs, identity=ident)
    with open(target, "r+b") as f:
        f.write(original)
    open_source(name, a.specs, identity=ident).close()
    # Without an identity nothing is checked (callers that have no manifest, e.g. given page arrays).
    open_source(name, a.specs).close()


# -- Redis: the loader's identity key -----------------------------------------------------------------------------


@pytest.fixture
def server(tmp_path):
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server binary not found (apt-get install -y redis-server; scripts/test.sh does)")
    (tmp_path / "redis").mkdir()
    srv = RedisServer(tmp_path / "redis")
    yield srv
    srv.stop()


def test_redis_refuses_a_prefix_of_another_table_an_unfinished_load_or_none(server, tmp_path):
    a = stage_synthetic(tmp_path / "a", layers=(1,), ranks=2, rows=100, seed=1)
    b = stage_synthetic(tmp_path / "b", layers=(1,), ranks=2, rows=100, seed=2)
    opts = RedisOptions(url=server.url, prefix="t")
    specs = a.specs
    load_manifest(opts, a.manifest)
    src = RedisSource(specs, opts, identity=a.manifest.identity)
    try:
        _read_all(src, a)
        verify_identity("redis", specs, opts, a.manifest.identity)
    finally:
        src.close()
    # Another table loaded under the same prefix: refused at open and on a re-check.
    load_manifest(opts, b.manifest)
    for check in (lambda: RedisSource(specs, opts, identity=a.manifest.identity),
                  lambda: verify_identity("redis", specs, opts, a.manifest.identity)):
        with pytest.raises(SlackTierError, match="another table") as info:
            check()
        assert info.value.kind is ErrorKind.TARGET
    # Another staging run of the same rows.
    restaged = TableIdentity(b.manifest.identity.source_digest, "0" * 32)
    with pytest.raises(SlackTierError, match="another staging run"):
        RedisSource(specs, opts, identity=restaged)
    # A load that did not finish: the key says "loading" until the last page group is in.
    client = redis.Redis.from_url(server.url)
    try:
        client.set(identity_key("t"), client.get(identity_key("t")).replace(b'"complete"', b'"loading"'))
        with pytest.raises(SlackTierError, match="did not finish") as info:
            RedisSource(specs, opts, identity=b.manifest.identity)
        assert info.value.kind is ErrorKind.TARGET
        client.delete(identity_key("t"))
    finally:
        client.close()
    with pytest.raises(SlackTierError, match="holds no table under prefix 't'") as info:
        RedisSource(specs, opts, identity=a.manifest.identity)
    assert info.value.kind is ErrorKind.MISSING and "slacktier load" in info.value.fix


def test_the_loader_marks_the_identity_loading_before_the_pages_and_complete_after_them(server, tmp_path):
    staged = stage_synthetic(tmp_path / "t", layers=(1,), ranks=1, rows=45)   # 3 pages
    watcher = redis.Redis.from_url(server.url)
    try:
        with watcher.monitor() as monitor:   # every command the server runs, in the order it ran them
            load_manifest(RedisOptions(url=server.url, prefix="one"), staged.manifest, tag_buckets=2, workers=1)
            redis.Redis.from_url(server.url).echo("end of load")
            commands = []
            for event in monitor.listen():
                if "end of load" in event["command"]:
                    break
                commands.append(event["command"])
    finally:
        watcher.close()
    writes = [i for i, c in enumerate(commands) if c.startswith("MSET") and "{one:1:0:" in c]
    gens = [i for i, c in enumerate(commands) if c.startswith("SET") and ":gen" in c]
    marks = [(i, "loading" in c) for i, c in enumerate(commands) if c.startswith("SET") and "{one}:identity" in c]
    assert len(writes) == 2 and len(gens) == 2   # 3 pages in 2 groups: one MSET and one gen key per group
    # the identity is marked loading before any page lands and complete only after the last group's gen key
    assert [loading for _, loading in marks] == [True, False]
    assert marks[0][0] < writes[0] and writes[-1] < gens[-1] < marks[1][0]
    src = RedisSource(staged.specs, RedisOptions(url=server.url, prefix="one"), identity=staged.manifest.identity)
    try:
        pool = PageBufferPool(3)
        src.wait(src.submit(_reads([(0, 0), (0, 1), (0, 2)]), pool), timeout_s=5)
        np.testing.assert_array_equal(pool.pages, staged.pages[0])
    finally:
        src.close()


def test_a_paused_redis_server_fails_the_batch_within_the_socket_timeout(server, tmp_path):
    staged = stage_synthetic(tmp_path / "t", layers=(1,), ranks=1, rows=30)
    opts = RedisOptions(url=server.url, prefix="p", socket_timeout_ms=300)
    load_manifest(opts, staged.manifest)
    src = RedisSource(staged.specs, opts, identity=staged.manifest.identity)
    try:
        server.pause()  # connections stay open, nothing answers: without a socket timeout this blocks forever
        ticket = src.submit(_reads([(0, 1)]), PageBufferPool(1))
        with pytest.raises(SlackTierError) as info:
            src.wait(ticket, timeout_s=30)
        # the socket timeout ended the batch (IO, naming it), not the 30 s wait (that would be a TIMEOUT)
        assert info.value.kind is ErrorKind.IO and "unread after 300 ms" in str(info.value)
        assert (info.value.layer, info.value.rank, info.value.page) == (1, 0, 1)
        server.resume()
        pool = PageBufferPool(1)
        src.wait(src.submit(_reads([(0, 0)]), pool), timeout_s=5)  # the source recovers with the server
        np.testing.assert_array_equal(pool.pages[0], staged.pages[0][0])
    finally:
        server.resume()
        src.close()
    # Opening against a paused server is bounded too.
    server.pause()
    try:
        with pytest.raises(SlackTierError) as info:   # without the socket timeout the open's PING never returns
            RedisSource(staged.specs, opts, identity=staged.manifest.identity)
        assert info.value.kind is ErrorKind.UNAVAILABLE and "timeout" in str(info.value).lower(), info.value
    finally:
        server.resume()


def test_a_redis_password_never_appears_in_errors_or_logs(tmp_path, caplog, monkeypatch):
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server binary not found")
    secret = "s3cr3t-pw"
    srv = RedisServer(tmp_path, password=secret)
    caplog.set_level(logging.DEBUG, logger="slacktier")
    monkeypatch.setenv("ST_TEST_REDIS_PW", secret)
    monkeypatch.setenv("ST_TEST_REDIS_WRONG", "wrong-" + secret)
    messages = []
    try:
        staged = stage_synthetic(tmp_path / "t", layers=(1,), ranks=1, rows=30)
        opts = RedisOptions(url=srv.url, prefix="pw", socket_timeout_ms=300, password_env="ST_TEST_REDIS_PW")
        specs = staged.specs
        load_manifest(opts, staged.manifest)
        assert secret not in repr(opts)
        src = RedisSource(specs, opts, identity=staged.manifest.identity)
        try:
            srv.pause()
            with pytest.raises(SlackTierError) as info:
                src.wait(src.submit(_reads([(0, 0)]), PageBufferPool(1)), timeout_s=30)
            messages.append(info.value)
        finally:
            srv.resume()
            src.close()
        wrong = RedisOptions(url=srv.url, prefix="pw", password_env="ST_TEST_REDIS_WRONG")
        none = RedisOptions(url=srv.url, prefix="pw")
        for make in (lambda: RedisSource(specs, wrong, identity=staged.manifest.identity),
                     lambda: load_manifest(wrong, staged.manifest),
                     lambda: verify_identity("redis", specs, wrong, staged.manifest.identity),
                     lambda: RedisSource(specs, none, identity=staged.manifest.identity)):
            with pytest.raises(SlackTierError) as info:
                make()
            assert info.value.kind is ErrorKind.UNAVAILABLE
            messages.append(info.value)
        srv.stop()
        with pytest.raises(SlackTierError) as info:
            RedisSource(specs, opts)
        messages.append(info.value)
    finally:
        srv.stop()
    assert len(messages) == 6
    for exc in messages:
        text = f"{exc} {exc!r} {exc.fix}"
        assert secret not in text, text
        assert exc.__cause__ is None or secret not in repr(exc.__cause__)
    assert "credentials" in str(messages[1]) or "auth" in str(messages[1]).lower()
    for record in caplog.records:
        assert secret not in record.getMessage()


def test_redis_auth_failures_say_so_naming_the_user_never_the_password(tmp_path, monkeypatch):
    """Issue 34: a wrong password is "refused the credentials of user ...", none is "wants credentials"."""
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server binary not found")
    secret = "an0ther-s3cret"
    srv = RedisServer(tmp_path, password=secret)
    monkeypatch.setenv("ST_TEST_REDIS_WRONG", "wrong-" + secret)
    try:
        staged = stage_synthetic(tmp_path / "t", layers=(1,), ranks=1, rows=30)
        wrong = RedisOptions(url=srv.url, password_env="ST_TEST_REDIS_WRONG")
        for options, said in ((wrong, "refused the credentials of user 'default'"),
                              (RedisOptions(url=srv.url), "wants credentials (user 'default' sent no password)")):
            with pytest.raises(SlackTierError) as info:
                RedisSource(staged.specs, options, identity=staged.manifest.identity)
            assert info.value.kind is ErrorKind.UNAVAILABLE and f"Redis at {srv.url} {said}: " in info.value.message
            assert secret not in f"{info.value} {info.value.fix}" and "ACL user" in info.value.fix
    finally:
        srv.stop()


def test_a_password_in_the_redis_url_is_refused_and_secrets_come_from_env_or_file(tmp_path, monkeypatch):
    for url in ("redis://user:pw@127.0.0.1:6379", "redis://127.0.0.1:6379/0?password=pw"):
        with pytest.raises(SlackTierError, match="carries a password") as info:
            RedisOptions(url=url)
        assert "pw" not in info.value.fix
    with pytest.raises(SlackTierError, match="both"):
        RedisOptions(password_env="A", password_file="b")
    monkeypatch.delenv("ST_UNSET_PW", raising=False)
    with pytest.raises(SlackTierError, match="ST_UNSET_PW") as info:
        RedisOptions(password_env="ST_UNSET_PW").password()
    assert info.value.kind is ErrorKind.UNAVAILABLE
    secret_file = tmp_path / "pw"
    secret_file.write_text("from-a-file\n")
    assert RedisOptions(password_file=str(secret_file)).password() == "from-a-file"
    monkeypatch.setenv("ST_SET_PW", "from-env")
    assert RedisOptions(password_env="ST_SET_PW").password() == "from-env"


# -- verification by default ---------------------------------------------------------------------------------------


def test_each_tier_says_whether_it_verifies_by_default():
    assert RedisSource.verify_by_default is True    # remote memory, no end-to-end checksum
    assert DramSource.verify_by_default is True     # checked once at load, free per read
    assert DiskSource.verify_by_default is False    # measured: BENCHMARKS.md, read verification cost
    for name in tiers():
        assert isinstance(get_tier(name).source_cls.verify_by_default, bool), name


@pytest.mark.parametrize("name", ["dram", "disk", "redis"])
def test_a_corrupted_page_under_the_default_setting(name, o_direct_dir, request):
    """What `verify_reads = "auto"` gives (the engine passes checksums exactly when the tier verifies by default):
    DRAM refuses the corrupt page at open, Redis at the read, disk serves it (its default is off, by measurement)."""
    staged = stage_synthetic(o_direct_dir / "t", layers=(1,), ranks=2, rows=200)
    bad = staged.specs[1]
    tier = get_tier(name)
    every = staged.manifest.checksums()
    sums = ([every[r.crc_first_page:r.crc_first_page + r.pages] for r in staged.manifest.regions]
            if tier.source_cls.verify_by_default else None)
    regions, options = staged.specs, None
    if name == "redis":
        server = request.getfixturevalue("server")
        options = RedisOptions(url=server.url, prefix="c")
        load_manifest(options, staged.manifest, tag_buckets=4)
        client = redis.Redis.from_url(server.url)
        key = page_key("c", bad.layer, bad.rank, 5, 4)
        value = client.get(key)   # the page's bytes changed, its stored CRC32C kept: only the page check sees it
        client.set(key, value[:100] + bytes([value[100] ^ 1]) + value[101:])
        client.close()
    else:
        with open(bad.path, "r+b") as f:
            f.seek(bad.offset_bytes + 5 * PAGE_BYTES + 100)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 1]))
    if name == "dram":
        with pytest.raises(SlackTierError) as info:
            open_source(name, regions, options, page_crc32c=sums, identity=staged.manifest.identity)
        assert info.value.kind is ErrorKind.CHECKSUM
        assert (info.value.layer, info.value.rank, info.value.page) == (bad.layer, bad.rank, 5)
        return
    src = open_source(name, regions, options, page_crc32c=sums, identity=staged.manifest.identity)
    try:
        pool = PageBufferPool(2)
        ticket = src.submit(_reads([(0, 3), (1, 5)]), pool)
        if name == "disk":
            src.wait(ticket)
            assert not np.array_equal(pool.pages[1], staged.pages[1][5])  # served: the measured trade-off
            return
        with pytest.raises(SlackTierError) as info:
            src.wait(ticket)
        assert info.value.kind is ErrorKind.CHECKSUM
        assert (info.value.layer, info.value.rank, info.value.page) == (bad.layer, bad.rank, 5)
    finally:
        src.close()


@settings(max_examples=40, deadline=None)
@given(capacity=st.integers(1, 40), data=st.data())
def test_the_compiled_pool_check_matches_crc32c(capacity, data):
    seed = data.draw(st.integers(0, 2**32 - 1))
    pages = np.random.default_rng(seed).integers(0, 256, (capacity, PAGE_BYTES), dtype=np.uint8)
    buffers = np.array(data.draw(st.lists(st.integers(0, capacity - 1), max_size=60)), dtype=np.int32)
    got = pool_page_crcs(pages, buffers)
    assert got.dtype == np.uint32
    assert got.tolist() == [crc32c.crc32c(pages[b]) for b in buffers]
