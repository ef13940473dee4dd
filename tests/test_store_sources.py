"""Every page source (DRAM, disk with each engine, Redis) against the same real staged files."""

from __future__ import annotations

import inspect
import logging
import shutil
import time
from unittest import mock

import msgspec
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from slacktier.config import DiskOptions, DramOptions, RedisOptions, load_control
from slacktier.errors import ErrorKind, SlackTierError
from slacktier.store import PageBufferPool, PageReads, PageSource, ReadStats, open_source
from slacktier.store._common import page_crc32c
from slacktier.store import _native
from slacktier.store._native import probe_io_uring
from slacktier.store.disk import ENGINE_FALLBACKS
from slacktier.store.dram import DramSource
from slacktier.store.redis.loader import load_manifest
from slacktier.testing.store import stage_synthetic

_URING_MISSING = probe_io_uring()
KINDS = ["dram", "dram-threads", "disk-io_uring", "disk-threads", "disk-threads-python", "redis"]
# every kind at once: the two threads kinds share one device queue, so the Python one is left out
AVAILABLE = [k for k in KINDS if (k != "disk-io_uring" or _URING_MISSING is None) and k != "disk-threads-python"]
needs_uring = pytest.mark.skipif(_URING_MISSING is not None, reason=f"io_uring unavailable here: {_URING_MISSING}")


@pytest.fixture(scope="module")
def staged(o_direct_module_dir):
    # 2 layers x 3 ranks on 2 devices (files), 200 rows = 14 pages per region.
    return stage_synthetic(o_direct_module_dir, layers=(1, 14), ranks=3, rows=200, devices=2)


def _open_disk(kind: str, specs, options: DiskOptions, **kw) -> PageSource:
    """A disk source of `kind` ("disk-<engine>", or "disk-threads-python": the threads engine where the C
    helper cannot be built, Python's thread queue)."""
    engine = kind.removeprefix("disk-").removesuffix("-python")
    with mock.patch("slacktier.store.disk.helper_builds", return_value=not kind.endswith("-python")):
        return open_source("disk", specs, msgspec.structs.replace(options, engine=engine), **kw)


def _open(kind: str, staged, redis_server_factory) -> PageSource:
    if kind == "disk-io_uring" and _URING_MISSING is not None:
        pytest.skip(f"io_uring unavailable here: {_URING_MISSING}")
    if kind == "dram":
        return open_source("dram", staged.specs)
    if kind == "dram-threads":   # what serves where io_uring cannot be set up: the copying thread
        src = open_source("dram", staged.specs, DramOptions(engine="threads"))
        assert "threads" in src.engine_name and src.lane() is None   # begin_step submits its batches from Python
        return src
    if kind.startswith("disk-"):
        src = _open_disk(kind, staged.specs, DiskOptions(io_threads=2))
        # the C device queue, with or without rings, takes compiled code's batches; Python's thread queue does
        # not (begin_step then submits them from Python)
        assert (src.lane() is None) == kind.endswith("-python")
        return src
    server = redis_server_factory()
    options = RedisOptions(url=server.url, prefix="t-sources")
    load_manifest(options, staged.manifest)
    return open_source("redis", staged.specs, options)


@pytest.fixture(params=KINDS)
def source(request, staged):
    src = _open(request.param, staged, lambda: request.getfixturevalue("redis_server"))
    yield src
    src.close()


def _random_reads(staged, rng: np.random.Generator, n: int) -> PageReads:
    region = rng.integers(0, len(staged.specs), n).astype(np.int32)
    page = np.array([rng.integers(0, staged.specs[r].pages) for r in region], dtype=np.int64)
    buffer = rng.permutation(n).astype(np.int32)
    return PageReads(region, page, buffer)


def _expected(staged, reads: PageReads) -> np.ndarray:
    return np.stack([staged.pages[r][p] for r, p in zip(reads.region, reads.page, strict=True)])


def _check_random_batch(src: PageSource, staged, n: int, seed: int) -> None:
    """Read n random staged pages through `src` and compare them with the staged bytes."""
    pool = PageBufferPool(n)
    reads = _random_reads(staged, np.random.default_rng(seed), n)
    src.wait(src.submit(reads, pool))
    np.testing.assert_array_equal(pool.pages[reads.buffer], _expected(staged, reads))


def test_every_source_implements_the_whole_interface(source):
    assert isinstance(source, PageSource)
    assert not inspect.isabstract(type(source))
    for name in ("submit", "wait", "close"):
        assert getattr(type(source), name) is not getattr(PageSource, name)
    assert isinstance(source.engine_name, str) and source.engine_name


def test_pages_read_are_bit_identical_to_the_staged_bytes(source, staged):
    rng = np.random.default_rng(3)
    pool = PageBufferPool(300)
    pool.pages[:] = 0xA5  # a stale pattern that must be overwritten everywhere a read lands
    reads = _random_reads(staged, rng, 300)
    stats = source.wait(source.submit(reads, pool))
    assert isinstance(stats, ReadStats) and stats.pages == 300 and stats.read_us > 0
    np.testing.assert_array_equal(pool.pages[reads.buffer], _expected(staged, reads))


def test_several_batches_in_flight_complete_independently(source, staged):
    rng = np.random.default_rng(4)
    pool = PageBufferPool(400)
    first = _random_reads(staged, rng, 200)
    second = _random_reads(staged, rng, 200)
    second.buffer = second.buffer + 200
    t1, t2 = source.submit(first, pool), source.submit(second, pool)
    assert t1 != t2
    source.wait(t2)
    source.wait(t1)
    np.testing.assert_array_equal(pool.pages[first.buffer], _expected(staged, first))
    np.testing.assert_array_equal(pool.pages[second.buffer], _expected(staged, second))


def test_the_caller_may_reuse_its_arrays_right_after_submit(source, staged):
    rng = np.random.default_rng(10)
    pool = PageBufferPool(200)
    reads = _random_reads(staged, rng, 200)
    want = _expected(staged, reads)
    scratch = PageReads(reads.region.copy(), reads.page.copy(), reads.buffer.copy())
    ticket = source.submit(scratch, pool)
    scratch.region[:] = 0  # the engine's scratch arrays get the next layer's reads at once
    scratch.page[:] = 0
    scratch.buffer[:] = 0
    source.wait(ticket)
    np.testing.assert_array_equal(pool.pages[reads.buffer], want)


def test_an_empty_batch_completes(source):
    pool = PageBufferPool(1)
    empty = PageReads(np.zeros(0, np.int32), np.zeros(0, np.int64), np.zeros(0, np.int32))
    assert source.wait(source.submit(empty, pool)).pages == 0


def test_out_of_range_reads_are_refused_naming_the_region(source, staged):
    pool = PageBufferPool(4)
    spec = staged.specs[2]
    bad_page = PageReads(np.array([2], np.int32), np.array([spec.pages], np.int64), np.array([0], np.int32))
    with pytest.raises(SlackTierError) as info:
        source.submit(bad_page, pool)
    assert info.value.kind is ErrorKind.BAD_INPUT
    assert (info.value.layer, info.value.rank, info.value.page) == (spec.layer, spec.rank, spec.pages)
    bad_buffer = PageReads(np.array([0], np.int32), np.array([0], np.int64), np.array([4], np.int32))
    with pytest.raises(SlackTierError, match="buffer"):
        source.submit(bad_buffer, pool)


def test_a_batch_in_the_engines_dtypes_is_refused_as_any_other_is(source, staged):
    """A batch of the step engine's dtypes (int32, int64, int32 arrays) is copied and checked in one compiled
    call, any other batch with numpy: each bad batch is refused the same way by both, the first bad region
    before any bad page, and any bad page before any bad buffer."""
    pool = PageBufferPool(4)
    spec = staged.specs[2]
    regions = len(staged.specs)
    cases = [([0, 2, regions], [0, spec.pages, 0], [0, 1, 2]),   # a bad region after a bad page: the region
             ([0, 2, 1], [0, spec.pages, 0], [9, 1, 2]),         # a bad page after a bad buffer: the page
             ([0, 1, 1], [0, 0, -1], [0, 1, 2]),
             ([0, 1, 1], [0, 0, 0], [0, -1, 7]),
             ([-1, 0, 0], [0, 0, 0], [0, 0, 0])]
    for region, page, buffer in cases:
        refused = []
        for reads in (PageReads(np.array(region, np.int32), np.array(page, np.int64), np.array(buffer, np.int32)),
                      PageReads(np.array(region), np.array(page), np.array(buffer))):   # int64 everywhere
            with pytest.raises(SlackTierError) as info:
                source.submit(reads, pool)
            refused.append((info.value.kind, str(info.value), info.value.layer, info.value.page))
        assert refused[0] == refused[1], (region, page, buffer)
        assert refused[0][0] is ErrorKind.BAD_INPUT


def test_a_ticket_is_waited_once(source, staged):
    pool = PageBufferPool(8)
    ticket = source.submit(_random_reads(staged, np.random.default_rng(5), 8), pool)
    source.wait(ticket)
    with pytest.raises(SlackTierError, match="no ticket"):
        source.wait(ticket)


def test_tickets_of_every_tier_come_from_one_counter(staged, redis_server):
    """Sources of different tiers in one process never hand out the same ticket: one component mints them all."""
    sources = [_open(kind, staged, lambda: redis_server) for kind in AVAILABLE]
    try:
        pool = PageBufferPool(4)
        rng = np.random.default_rng(11)
        tickets = []
        for _ in range(3):
            for src in sources:
                ticket = src.submit(_random_reads(staged, rng, 4), pool)
                src.wait(ticket)
                tickets.append(ticket)
        assert len(set(tickets)) == len(tickets)
    finally:
        for src in sources:
            src.close()


def test_a_closed_source_refuses_work(source, staged):
    pool = PageBufferPool(8)
    reads = _random_reads(staged, np.random.default_rng(6), 8)
    ticket = source.submit(reads, pool)
    source.close()
    # close() finished the queued batch: its pages are in the pool even though wait is now refused.
    np.testing.assert_array_equal(pool.pages[reads.buffer], _expected(staged, reads))
    with pytest.raises(SlackTierError) as info:
        source.submit(reads, pool)
    assert info.value.kind is ErrorKind.CLOSED
    with pytest.raises(SlackTierError) as info:
        source.wait(ticket)
    assert info.value.kind is ErrorKind.CLOSED
    source.close()  # idempotent


@pytest.mark.parametrize("kind", KINDS)
def test_checksum_verification_passes_on_intact_pages(kind, staged, request):
    if kind == "disk-io_uring" and _URING_MISSING is not None:
        pytest.skip(f"io_uring unavailable here: {_URING_MISSING}")
    sums = [page_crc32c(p) for p in staged.pages]
    if kind == "dram":
        src = open_source("dram", staged.specs, page_crc32c=sums)
    elif kind.startswith("disk-"):
        src = _open_disk(kind, staged.specs, DiskOptions(), page_crc32c=sums)
    else:
        server = request.getfixturevalue("redis_server")
        options = RedisOptions(url=server.url, prefix="t-verify")
        load_manifest(options, staged.manifest)
        src = open_source("redis", staged.specs, options, page_crc32c=sums)
    try:
        assert src.verifies_reads
        _check_random_batch(src, staged, 100, seed=8)
    finally:
        src.close()


def test_checksums_must_cover_every_region(staged):
    sums = [page_crc32c(p) for p in staged.pages]
    with pytest.raises(SlackTierError, match="CRC32C arrays for"):
        DramSource(staged.specs, page_crc32c=sums[:-1])
    with pytest.raises(SlackTierError, match="CRC32C values for") as info:
        DramSource(staged.specs, page_crc32c=sums[:2] + [sums[2][:-1]] + sums[3:])
    assert (info.value.layer, info.value.rank) == (staged.specs[2].layer, staged.specs[2].rank)


def test_dram_source_takes_given_arrays(staged):
    src = DramSource(staged.specs, pages=staged.pages)
    try:
        _check_random_batch(src, staged, 50, seed=9)
    finally:
        src.close()


def test_where_io_uring_is_refused_dram_keeps_the_c_worker(staged, monkeypatch, caplog):
    """A copy needs the C helper, not a ring: with io_uring refused (a container's seccomp profile), "auto"
    still serves through the C worker and its lane, with no fallback logged."""
    monkeypatch.setattr("slacktier.store.disk.probe_io_uring", lambda: "io_uring_setup failed: Operation not permitted")
    before = sum(ENGINE_FALLBACKS.values())
    with caplog.at_level(logging.WARNING, logger="slacktier.store.disk"):
        src = DramSource(staged.specs, DramOptions(engine="auto"))
    try:
        assert "io_uring" in src.engine_name and src.lane() is not None   # the option's name: the C worker
        assert sum(ENGINE_FALLBACKS.values()) == before and not caplog.records
        _check_random_batch(src, staged, 40, seed=15)
    finally:
        src.close()


def test_without_a_compiler_dram_falls_back_to_a_copying_thread_loudly(staged, monkeypatch, tmp_path, caplog):
    """No C compiler (so no helper, so no C queue): "auto" serves through the copying thread, logged at
    WARNING and counted; "io_uring" (the C worker) refuses to open, naming the way out."""
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("SLACKTIER_CACHE_DIR", str(tmp_path / "cache"))
    _native.load_helper.cache_clear()
    try:
        before = sum(ENGINE_FALLBACKS.values())
        with caplog.at_level(logging.WARNING, logger="slacktier.store.disk"):
            src = DramSource(staged.specs, DramOptions(engine="auto"))
        try:
            assert "threads" in src.engine_name and src.lane() is None
            assert sum(ENGINE_FALLBACKS.values()) == before + 1
            assert any(r.levelno == logging.WARNING and "engine unavailable" in r.getMessage()
                       for r in caplog.records)
            _check_random_batch(src, staged, 40, seed=14)
        finally:
            src.close()
        with pytest.raises(SlackTierError) as info:
            DramSource(staged.specs, DramOptions(engine="io_uring"))
        assert info.value.kind is ErrorKind.UNAVAILABLE and "threads" in info.value.fix
    finally:
        _native.load_helper.cache_clear()


@needs_uring
def test_a_dram_batch_queued_while_its_queue_is_deferred_is_copied_when_the_last_deferral_ends(staged):
    """A step engine defers the host-memory queue around its compiled pass (HostMemoryLane): nothing is copied
    while any deferral is open, deferrals nest, and the batch lands whole once the last one ends."""
    src = DramSource(staged.specs, pages=staged.pages)
    try:
        lane = src.lane()
        assert lane is not None and lane.defers and "io_uring" in src.engine_name
        queue = lane.queue
        pool = PageBufferPool(100)
        reads = _random_reads(staged, np.random.default_rng(12), 100)
        queue.trace(100)
        lane.defer(True)
        lane.defer(True)
        ticket = src.submit(reads, pool)
        time.sleep(0.05)
        assert queue.traced()[1].size == 0            # deferred: no read admitted
        lane.defer(False)
        time.sleep(0.05)
        assert queue.traced()[1].size == 0            # one deferral still open
        lane.defer(False)
        src.wait(ticket, timeout_s=30)
        assert queue.traced()[1].size == 100
        np.testing.assert_array_equal(pool.pages[reads.buffer], _expected(staged, reads))
        lane.defer(False)                             # ending more deferrals than were opened is a no-op
        _check_random_batch(src, staged, 20, seed=13)
    finally:
        src.close()


@needs_uring
def test_dram_tables_share_one_queue_in_window_order(staged):
    """Two DRAM tables of one process share the host-memory queue: a batch of the deeper layer queued first is
    copied after the shallower layer's, as on a disk."""
    deep = DramSource([r for r in staged.specs if r.layer == 14])
    shallow = DramSource([r for r in staged.specs if r.layer == 1])
    try:
        queue = deep.lane().queue
        assert shallow.lane().queue is queue
        pool = PageBufferPool(40)
        first = PageReads(np.zeros(20, np.int32), np.arange(20, dtype=np.int64) % 14, np.arange(20, dtype=np.int32))
        second = PageReads(np.zeros(20, np.int32), np.arange(20, dtype=np.int64) % 14,
                           np.arange(20, 40, dtype=np.int32))
        queue.trace(40)
        deep.hold(True)                               # both batches queued before the queue admits any
        t14, t1 = deep.submit(first, pool), shallow.submit(second, pool)
        deep.hold(False)
        deep.wait(t14, timeout_s=30)
        shallow.wait(t1, timeout_s=30)
        clients, _, _ = queue.traced()
        assert clients.size == 40 and len(set(clients[:20].tolist())) == 1 and clients[0] != clients[-1]
        assert clients[0] == shallow.lane().client
    finally:
        deep.close()
        shallow.close()


def test_dram_checks_its_pages_once_at_load_and_names_the_bad_one(staged):
    """DRAM verifies every page against the manifest when it loads them (issue 11), then serves without checks."""
    sums = [page_crc32c(p) for p in staged.pages]
    sums[4] = sums[4].copy()
    sums[4][9] ^= 1
    with pytest.raises(SlackTierError) as info:
        DramSource(staged.specs, pages=staged.pages, page_crc32c=sums)
    spec = staged.specs[4]
    assert info.value.kind is ErrorKind.CHECKSUM
    assert (info.value.layer, info.value.rank, info.value.page) == (spec.layer, spec.rank, 9)


def test_unknown_kind_is_refused(staged):
    with pytest.raises(SlackTierError, match="unknown page source kind"):
        open_source("tape", staged.specs)


def test_options_of_another_tier_are_refused(staged):
    with pytest.raises(SlackTierError, match="takes DramOptions") as info:
        open_source("dram", staged.specs, DiskOptions())
    assert info.value.kind is ErrorKind.BAD_INPUT


def test_an_unknown_dram_engine_is_refused_in_code_and_in_a_control_file(staged, tmp_path):
    with pytest.raises(SlackTierError, match="unknown dram engine") as info:
        DramSource(staged.specs, DramOptions(engine="dma"))   # type: ignore[arg-type]
    assert info.value.kind is ErrorKind.BAD_INPUT and "threads" in info.value.fix
    path = tmp_path / "control.toml"
    path.write_text('[engine]\ndevice = "cpu"\ncache_rows = 100\n\n[[table]]\nlayer = 1\nmanifest = "m.json"\n'
                    'source = "dram"\n\n[table.dram]\nengine = "dma"\n')
    with pytest.raises(SlackTierError) as info:
        load_control(path)
    assert info.value.kind is ErrorKind.BAD_INPUT and "engine" in str(info.value)


@pytest.fixture(scope="module")
def all_sources(staged, request):
    sources = {kind: _open(kind, staged, lambda: request.getfixturevalue("redis_server")) for kind in AVAILABLE
               if kind != "redis" or shutil.which("redis-server")}
    yield sources
    for src in sources.values():
        src.close()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_batch_reads_the_same_bytes_from_every_source(all_sources, staged, data):
    n = data.draw(st.integers(1, 64))
    region = data.draw(st.lists(st.integers(0, len(staged.specs) - 1), min_size=n, max_size=n))
    page = [data.draw(st.integers(0, staged.specs[r].pages - 1)) for r in region]
    buffer = data.draw(st.permutations(list(range(n))))
    reads = PageReads(np.array(region, np.int32), np.array(page, np.int64), np.array(buffer, np.int32))
    want = _expected(staged, reads)
    for kind, src in all_sources.items():
        pool = PageBufferPool(n)
        src.wait(src.submit(reads, pool))
        assert np.array_equal(pool.pages[reads.buffer], want), kind


