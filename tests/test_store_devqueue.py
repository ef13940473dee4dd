"""One queue per physical device (issue 27): every table on a device shares it, and the device receives the
short-window layer's reads first. The tests read the order in which the queue hands reads to the kernel (its
admission trace), never a time."""

from __future__ import annotations

import logging
from unittest import mock

import numpy as np
import pytest

from slacktier.cache import RowCache
from slacktier.config import DiskOptions
from slacktier.engine.checker import ArrayRowReader
from slacktier.engine.step import StepEngine
from slacktier.engine.tables import TableSpec
from slacktier.errors import ErrorKind, SlackTierError
from slacktier.store import PageBufferPool, PageReads
from slacktier.store import _native
from slacktier.store.devqueue import HOST_MEMORY, QUEUE_SETTING_CONFLICTS, open_queues
from slacktier.store.disk import DiskSource
from slacktier.store.pread_queue import PreadQueue
from slacktier.testing.store import stage_synthetic
from slacktier.tables.codec import synthetic_rows
from slacktier.tables.synthetic_source import layer_seed

_URING_MISSING = _native.probe_io_uring()
ENGINES = [pytest.param("io_uring", marks=pytest.mark.skipif(_URING_MISSING is not None,
                                                             reason=f"io_uring unavailable: {_URING_MISSING}")),
           "threads",
           "threads-python"]   # the threads engine where the C helper cannot be built: Python's thread queue


def _two_tables(directory, engine: str, rows: int = 3000, **options):
    """Layers 1 and 14 staged in two files of one directory (one device), a DiskSource each."""
    one = stage_synthetic(directory / "l1", layers=(1,), ranks=1, rows=rows)
    fourteen = stage_synthetic(directory / "l14", layers=(14,), ranks=1, rows=rows)
    opts = DiskOptions(engine=engine.removesuffix("-python"), **options)
    with mock.patch("slacktier.store.disk.helper_builds", return_value=not engine.endswith("-python")):
        return one, fourteen, DiskSource(one.specs, opts), DiskSource(fourteen.specs, opts)


def _queue(engine: str):
    """The one open disk queue of `engine` (a DRAM table another test left open has a host-memory queue)."""
    name = engine.removesuffix("-python")
    [q] = [q for q in open_queues() if q.engine_name == name and q.device != HOST_MEMORY]
    assert (type(q) is PreadQueue) == engine.endswith("-python")
    return q


def _all_pages(n: int) -> PageReads:
    return PageReads(np.zeros(n, np.int32), np.arange(n, dtype=np.int64), np.arange(n, dtype=np.int32))


@pytest.mark.parametrize("engine", ENGINES)
def test_two_tables_on_one_device_share_one_queue_that_admits_layer_1_first(o_direct_dir, engine):
    before = {(q.engine_name, q.device): q.users for q in open_queues()}
    one, fourteen, s1, s14 = _two_tables(o_direct_dir, engine, queue_depth=8)
    try:
        q = _queue(engine)
        assert q.users == before.get((q.engine_name, q.device), 0) + 2   # one queue for both tables
        n1, n14 = one.specs[0].pages, fourteen.specs[0].pages
        p1, p14 = PageBufferPool(n1), PageBufferPool(n14)
        q.trace(n1 + n14)
        s1.hold(True)                                # nothing reaches the device until both are queued
        t14 = s14.submit(_all_pages(n14), p14)       # layer 14 arrives first ...
        t1 = s1.submit(_all_pages(n1), p1)           # ... and layer 1 still goes ahead of every read of it
        s1.hold(False)
        s14.wait(t14)
        s1.wait(t1)
        client, region, page = q.traced()
        assert client.shape[0] == n1 + n14
        layer = np.where(client == client[0], 1, 14)
        assert (layer[:n1] == 1).all() and (layer[n1:] == 14).all(), "layer 14 was admitted ahead of layer 1"
        assert sorted(page[:n1].tolist()) == list(range(n1))
        for pool, staged, n in ((p1, one, n1), (p14, fourteen, n14)):
            assert np.array_equal(pool.pages[:n], staged.pages[0][:n])
    finally:
        s1.close()
        s14.close()
    users = before.get((q.engine_name, q.device), 0)   # the last table to leave closes the device's queue
    assert [x.users for x in open_queues() if x is q] == ([users] if users else [])


@pytest.mark.parametrize("engine", ENGINES)
def test_a_step_hands_the_device_every_layer_1_read_before_any_layer_14_read(o_direct_dir, engine):
    one, fourteen, s1, s14 = _two_tables(o_direct_dir, engine, rows=6000, queue_depth=16)
    raws = {layer: synthetic_rows(int(layer_seed(7, layer)), 0, 6000) for layer in (1, 14)}
    tables = [TableSpec(layer=layer, row_start=0, rows=6000, regions=tuple(staged.specs), source=src,
                        cache_share=0.5, reference=ArrayRowReader(raws[layer]))
              for layer, staged, src in ((1, one, s1), (14, fourteen, s14))]
    engine_ = StepEngine(tables, RowCache(2000), check=True, check_raise=True, owned_sources=[s1, s14])
    try:
        q = _queue(engine)
        rng = np.random.default_rng(5)
        for step in range(3):
            ids = rng.integers(0, 6000, size=(32, 2, 24), dtype=np.int64)
            q.trace(4000)
            s1.hold(True)          # both layers' pages are queued before the device takes any
            engine_.begin_step(ids)
            s1.hold(False)
            engine_.gather(1)
            engine_.gather(14)
            counters = engine_.end_step()
            client, _, _ = q.traced()
            pages = {layer: counters.layers[layer].pages_read for layer in (1, 14)}
            assert client.shape[0] == pages[1] + pages[14] and pages[1] > 0 and pages[14] > 0
            first = client[:pages[1]]
            assert (first == first[0]).all() and (client[pages[1]:] != first[0]).all(), \
                f"step {step}: a layer-14 read reached the device before layer 1's last"
    finally:
        engine_.close()


def test_a_second_table_asking_other_queue_settings_is_served_by_the_device_queue_and_logged(o_direct_dir, caplog):
    one = stage_synthetic(o_direct_dir / "a", layers=(1,), ranks=1)
    two = stage_synthetic(o_direct_dir / "b", layers=(14,), ranks=1)
    before = QUEUE_SETTING_CONFLICTS["queue_depth"]
    a = DiskSource(one.specs, DiskOptions(engine="threads", queue_depth=8))
    try:
        with caplog.at_level(logging.WARNING, logger="slacktier.store.devqueue"):
            b = DiskSource(two.specs, DiskOptions(engine="threads", queue_depth=64))
        try:
            assert QUEUE_SETTING_CONFLICTS["queue_depth"] == before + 1
            assert any("queue_depth = 64" in r.getMessage() and "keeps 8" in r.getMessage() for r in caplog.records)
            assert _queue("threads").queue_depth == 8
            pool = PageBufferPool(3)
            b.wait(b.submit(_all_pages(3), pool))
            assert np.array_equal(pool.pages, two.pages[0][:3])
        finally:
            b.close()
    finally:
        a.close()


@pytest.mark.parametrize("engine", ENGINES)
def test_a_failing_table_fails_only_its_own_reads_on_a_shared_device(o_direct_dir, engine):
    one, fourteen, s1, s14 = _two_tables(o_direct_dir, engine, rows=300)
    try:
        n14 = fourteen.specs[0].pages
        with open(fourteen.specs[0].path, "r+b") as f:   # layer 14's file loses its last pages under the engine
            f.truncate(fourteen.specs[0].offset_bytes + (n14 - 2) * 4096)
        p1, p14 = PageBufferPool(one.specs[0].pages), PageBufferPool(n14)
        t14 = s14.submit(_all_pages(n14), p14)
        t1 = s1.submit(_all_pages(one.specs[0].pages), p1)
        with pytest.raises(SlackTierError) as info:
            s14.wait(t14)
        assert info.value.kind is ErrorKind.IO and info.value.layer == 14 and info.value.page == n14 - 2
        s1.wait(t1)
        assert np.array_equal(p1.pages, one.pages[0])
        s1.wait(s1.submit(_all_pages(2), p1))          # the device queue goes on serving
    finally:
        s1.close()
        s14.close()


@pytest.mark.skipif(_URING_MISSING is not None, reason=f"io_uring unavailable: {_URING_MISSING}")
def test_pools_retired_by_timeouts_are_given_back_when_their_reads_land(o_direct_dir):
    # Every step's wait times out (0.1 us), so the engine retires its page pool each step. The reads nobody
    # waits for any more are dropped from the device queue, so the retired pools' memory comes back instead
    # of piling up behind a device that fell behind (issue 33: 13.8 GB after 300 such steps).
    staged = stage_synthetic(o_direct_dir, layers=(1, 14), ranks=1, rows=20_000)
    sources = {r.layer: DiskSource([r], DiskOptions(engine="io_uring")) for r in staged.specs}   # one per table
    raws = {layer: synthetic_rows(int(layer_seed(7, layer)), 0, 20_000) for layer in (1, 14)}
    tables = [TableSpec(layer=r.layer, row_start=0, rows=20_000, regions=(r,), source=sources[r.layer],
                        cache_share=0.5, reference=ArrayRowReader(raws[r.layer])) for r in staged.specs]
    engine = StepEngine(tables, RowCache(100), max_tokens=64, owned_sources=list(sources.values()),
                        wait_timeout_s=1e-7, check=True)
    queue = _queue("io_uring")
    before = queue.pools_held()
    rng = np.random.default_rng(3)
    try:
        for _ in range(120):
            engine.begin_step(rng.integers(0, 20_000, (64, 2, 24)))
            try:
                engine.gather(1)
                engine.gather(14)
            except SlackTierError as exc:
                assert exc.kind is ErrorKind.TIMEOUT
            try:
                engine.end_step()
            except SlackTierError as exc:
                assert exc.kind is ErrorKind.TIMEOUT
        assert engine.retired_pools >= 60
        assert queue.pools_held() - before <= 8     # the pools of the last few steps, not one per timeout
        engine.wait_timeout_s = 30.0   # taken up with the next fresh pool: after at most one more timeout
        served = 0
        for _ in range(3):
            engine.begin_step(rng.integers(0, 20_000, (64, 2, 24)))
            try:
                rows = [engine.gather(layer) for layer in (1, 14)]
                engine.end_step()
            except SlackTierError as exc:
                assert exc.kind is ErrorKind.TIMEOUT
                try:
                    engine.end_step()   # the step's other layer may time out too
                except SlackTierError as late:
                    assert late.kind is ErrorKind.TIMEOUT
                continue
            assert all(r.shape == (64, 24, 256) for r in rows)
            served += 1
        assert served >= 2
    finally:
        engine.close()
