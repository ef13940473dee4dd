"""The disk tier on real files with O_DIRECT: both engines, several devices, and every error path."""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import subprocess
import sys

import numpy as np
import pytest

from slacktier.config import DiskOptions
from slacktier.errors import ErrorKind, SlackTierError
from slacktier.store import PageBufferPool, PageReads
from slacktier.store import _native
from slacktier.store._common import page_crc32c
from slacktier.store.devqueue import HOST_MEMORY, open_queues
from slacktier.store.disk import ENGINE_FALLBACKS, REGISTRATION_SKIPS, DiskSource
from slacktier.store.pread_queue import PreadQueue
from slacktier.store.uring_queue import PreadThreadsQueue
from slacktier.testing.store import stage_synthetic
from slacktier.tables.layout import PAGE_BYTES
from slacktier.tables.regions import Region

_URING_MISSING = _native.probe_io_uring()
ENGINES = [pytest.param("io_uring", marks=pytest.mark.skipif(_URING_MISSING is not None,
                                                             reason=f"io_uring unavailable: {_URING_MISSING}")),
           "threads"]


def _reads(pairs: list[tuple[int, int]]) -> PageReads:
    region, page = zip(*pairs, strict=True)
    return PageReads(np.array(region, np.int32), np.array(page, np.int64), np.arange(len(pairs), dtype=np.int32))


def _where(err: SlackTierError) -> tuple:
    return err.layer, err.rank, err.page


@pytest.mark.parametrize("engine", ENGINES)
def test_four_devices_many_workers_read_every_page_exactly(o_direct_dir, engine):
    staged = stage_synthetic(o_direct_dir, layers=(1, 14), ranks=4, rows=150, devices=4)
    assert len({s.path for s in staged.specs}) == 4
    src = DiskSource(staged.specs, DiskOptions(engine=engine, queue_depth=16, io_threads=2))
    try:
        # four target files on one filesystem are one physical device: one device queue serves them
        assert src.engine_name == engine and len(src.devices) == 1
        pairs = [(r, p) for r, spec in enumerate(staged.specs) for p in range(spec.pages)]
        order = np.random.default_rng(1).permutation(len(pairs))
        reads = _reads([pairs[i] for i in order])
        pool = PageBufferPool(len(pairs))
        pool.pages[:] = 0xEE
        stats = src.wait(src.submit(reads, pool))
        assert stats.pages == len(pairs)
        for i, (r, p) in enumerate(pairs[j] for j in order):
            assert np.array_equal(pool.pages[i], staged.pages[r][p])
    finally:
        src.close()


def test_the_engine_that_runs_is_logged(o_direct_dir, caplog):
    staged = stage_synthetic(o_direct_dir, ranks=1)
    with caplog.at_level(logging.INFO, logger="slacktier.store.disk"):
        src = DiskSource(staged.specs, DiskOptions(engine="auto"))
    src.close()
    assert src.engine_name == ("io_uring" if _URING_MISSING is None else "threads")
    assert any(f"engine {src.engine_name}" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("engine", ENGINES)
def test_read_past_the_end_of_a_truncated_file_names_the_page(o_direct_dir, engine):
    staged = stage_synthetic(o_direct_dir, ranks=2, rows=150)  # 10 pages per region, both in dev0.bin
    src = DiskSource(staged.specs, DiskOptions(engine=engine))
    try:
        last = staged.specs[1]
        # Cut region 1 in the middle of page 6: page 6 reads short, page 8 lies past the end.
        os.truncate(last.path, last.offset_bytes + 6 * PAGE_BYTES + 100)
        pool = PageBufferPool(4)
        with pytest.raises(SlackTierError) as info:
            src.wait(src.submit(_reads([(0, 3), (1, 6)]), pool))
        assert info.value.kind is ErrorKind.IO and "short read, 100 of 4096" in str(info.value)
        assert _where(info.value) == (last.layer, last.rank, 6)
        with pytest.raises(SlackTierError) as info:
            src.wait(src.submit(_reads([(1, 8)]), pool))
        assert "short read, 0 of 4096" in str(info.value) and _where(info.value) == (last.layer, last.rank, 8)
        # Intact pages of the same source still read fine afterwards.
        src.wait(src.submit(_reads([(0, 9), (1, 5)]), pool))
        assert np.array_equal(pool.pages[0], staged.pages[0][9]) and np.array_equal(pool.pages[1], staged.pages[1][5])
    finally:
        src.close()


@pytest.mark.parametrize("engine", ENGINES)
def test_an_io_error_names_layer_rank_and_page(o_direct_dir, engine):
    # A read-only destination page makes the kernel fail the O_DIRECT read with EFAULT: a real errno.
    staged = stage_synthetic(o_direct_dir, layers=(1, 14), ranks=2)
    src = DiskSource(staged.specs, DiskOptions(engine=engine))
    pool = PageBufferPool(3)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    assert libc.mprotect(pool.address(1), PAGE_BYTES, mmap.PROT_READ) == 0
    skips = REGISTRATION_SKIPS["buffers"]
    try:
        with pytest.raises(SlackTierError) as info:
            src.wait(src.submit(_reads([(0, 2), (3, 5), (1, 1)]), pool))
        assert info.value.kind is ErrorKind.IO and "Bad address" in str(info.value)
        assert _where(info.value) == (14, 1, 5)
        if engine == "io_uring":  # the kernel would not pin a read-only pool either: counted, reads ran unregistered
            assert REGISTRATION_SKIPS["buffers"] == skips + 1
    finally:
        libc.mprotect(pool.address(1), PAGE_BYTES, mmap.PROT_READ | mmap.PROT_WRITE)
        src.close()


def test_a_missing_region_file_is_refused_at_construction(o_direct_dir):
    staged = stage_synthetic(o_direct_dir, ranks=1)
    os.unlink(staged.specs[0].path)
    with pytest.raises(SlackTierError) as info:
        DiskSource(staged.specs)
    assert info.value.kind is ErrorKind.MISSING and (info.value.layer, info.value.rank) == (1, 0)


def test_a_region_past_the_end_of_its_file_is_refused_at_construction(o_direct_dir):
    staged = stage_synthetic(o_direct_dir, ranks=1, rows=150)
    spec = staged.specs[0]
    longer = Region(spec.layer, spec.rank, spec.path, spec.offset_bytes, spec.pages + 3)
    with pytest.raises(SlackTierError) as info:
        DiskSource([longer])
    assert info.value.kind is ErrorKind.IO and info.value.page == spec.pages


@pytest.mark.parametrize("engine", ENGINES)
def test_a_corrupt_page_fails_its_checksum_when_verification_is_on(o_direct_dir, engine):
    staged = stage_synthetic(o_direct_dir, ranks=2)
    sums = [page_crc32c(p) for p in staged.pages]
    spec = staged.specs[1]
    with open(spec.path, "r+b") as f:  # flip one byte of page 4 of region 1, after the checksums were taken
        f.seek(spec.offset_bytes + 4 * PAGE_BYTES + 77)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x10]))
    checked = DiskSource(staged.specs, DiskOptions(engine=engine), page_crc32c=sums)
    unchecked = DiskSource(staged.specs, DiskOptions(engine=engine))
    try:
        with pytest.raises(SlackTierError) as info:
            checked.wait(checked.submit(_reads([(0, 4), (1, 4)]), PageBufferPool(2)))
        assert info.value.kind is ErrorKind.CHECKSUM and _where(info.value) == (spec.layer, spec.rank, 4)
        # Without verification the corrupt bytes come back as stored: the check is what catches them.
        pool = PageBufferPool(1)
        unchecked.wait(unchecked.submit(_reads([(1, 4)]), pool))
        assert not np.array_equal(pool.pages[0], staged.pages[1][4])
    finally:
        checked.close()
        unchecked.close()


def test_unknown_engine_and_bad_depth_are_refused(o_direct_dir):
    staged = stage_synthetic(o_direct_dir, ranks=1)
    with pytest.raises(SlackTierError, match="unknown disk engine"):
        DiskSource(staged.specs, DiskOptions(engine="aio"))  # type: ignore[arg-type]
    with pytest.raises(SlackTierError, match="queue_depth"):
        DiskSource(staged.specs, DiskOptions(queue_depth=0))


@pytest.fixture
def no_compiler(monkeypatch, tmp_path):
    """A process where the helper is not built yet and no C compiler exists."""
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("SLACKTIER_CACHE_DIR", str(tmp_path / "cache"))
    _native.load_helper.cache_clear()
    yield
    _native.load_helper.cache_clear()


def test_without_a_compiler_auto_falls_back_loudly_and_counts_it(o_direct_dir, no_compiler, caplog):
    staged = stage_synthetic(o_direct_dir, ranks=1)
    before = sum(ENGINE_FALLBACKS.values())
    with caplog.at_level(logging.WARNING, logger="slacktier.store.disk"):
        src = DiskSource(staged.specs, DiskOptions(engine="auto"))
    try:
        assert src.engine_name == "threads"
        assert sum(ENGINE_FALLBACKS.values()) == before + 1
        assert any(r.levelno == logging.WARNING and "falling back" in r.getMessage() for r in caplog.records)
        pool = PageBufferPool(2)
        src.wait(src.submit(_reads([(0, 0), (0, 5)]), pool))
        assert np.array_equal(pool.pages[1], staged.pages[0][5])
    finally:
        src.close()


def test_where_io_uring_is_refused_the_c_engine_reads_with_pread_threads(o_direct_dir, monkeypatch, caplog):
    """A container's default seccomp profile refuses io_uring_setup: "auto" falls back to the threads engine,
    which, with the helper built, is the C device queue without rings (its lane takes compiled code's batches),
    and the warning says what to allow."""
    monkeypatch.setattr("slacktier.store.disk.probe_io_uring",
                        lambda: "io_uring_setup failed: Operation not permitted")
    staged = stage_synthetic(o_direct_dir, layers=(1, 14), ranks=2, rows=300)
    with caplog.at_level(logging.INFO, logger="slacktier.store.disk"):
        src = DiskSource(staged.specs, DiskOptions(engine="auto", queue_depth=8))
        DiskSource(staged.specs[:1], DiskOptions(engine="auto", queue_depth=8)).close()
    try:
        assert src.engine_name == "threads"
        said = [r for r in caplog.records if "seccomp" in r.getMessage() and "io_uring_setup" in r.getMessage()]
        assert len(said) == 2 and said[1].levelno == logging.INFO   # once per reason at WARNING, then at INFO
        [queue] = [q for q in open_queues() if q.engine_name == "threads" and q.device != HOST_MEMORY]
        assert isinstance(queue, PreadThreadsQueue) and queue.engine.threads == 8
        assert src.lane() is not None
        pairs = [(r, p) for r, spec in enumerate(staged.specs) for p in range(spec.pages)]
        order = np.random.default_rng(2).permutation(len(pairs))
        pool = PageBufferPool(len(pairs))
        pool.pages[:] = 0xEE
        src.wait(src.submit(_reads([pairs[i] for i in order]), pool))
        for i, j in enumerate(order):
            r, p = pairs[j]
            assert np.array_equal(pool.pages[i], staged.pages[r][p])
    finally:
        src.close()


def test_the_threads_engine_without_the_helper_is_the_python_thread_queue(o_direct_dir, no_compiler):
    staged = stage_synthetic(o_direct_dir, ranks=1)
    src = DiskSource(staged.specs, DiskOptions(engine="threads"))
    try:
        [queue] = [q for q in open_queues() if q.engine_name == "threads" and q.device != HOST_MEMORY]
        assert type(queue) is PreadQueue and src.lane() is None
        pool = PageBufferPool(1)
        src.wait(src.submit(_reads([(0, 3)]), pool))
        assert np.array_equal(pool.pages[0], staged.pages[0][3])
    finally:
        src.close()


def test_without_a_compiler_an_explicit_io_uring_request_fails(o_direct_dir, no_compiler):
    staged = stage_synthetic(o_direct_dir, ranks=1)
    with pytest.raises(SlackTierError) as info:
        DiskSource(staged.specs, DiskOptions(engine="io_uring"))
    assert info.value.kind is ErrorKind.UNAVAILABLE and "not found" in str(info.value)


def test_the_helper_is_built_once_per_source_hash(tmp_path, monkeypatch):
    monkeypatch.setenv("SLACKTIER_CACHE_DIR", str(tmp_path / "cache"))
    first = _native.build_helper()
    mtime = first.stat().st_mtime_ns
    assert _native.build_helper() == first and first.stat().st_mtime_ns == mtime
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [first.name]


@pytest.mark.skipif(_URING_MISSING is not None, reason=f"io_uring unavailable: {_URING_MISSING}")
def test_a_batch_that_times_out_is_dropped_and_its_pool_given_back(o_direct_dir):
    # A held device queue makes a real late batch: the wait times out, and the reads nobody waits for any
    # more are dropped from the queue (none had reached the device), so nothing is written into the pool it
    # was given, the queue gives that pool back, and the next batch, into a new pool, is exact.
    staged = stage_synthetic(o_direct_dir, layers=(1, 14), ranks=2)
    src = DiskSource(staged.specs, DiskOptions(engine="io_uring"))
    [queue] = [q for q in open_queues() if q.engine_name == "io_uring" and q.device != HOST_MEMORY]
    old, new = PageBufferPool(4), PageBufferPool(4)
    try:
        src.hold(True)
        late = src.submit(_reads([(0, 3), (2, 7)]), old)
        with pytest.raises(SlackTierError) as info:
            src.wait(late, timeout_s=0.05)
        assert info.value.kind is ErrorKind.TIMEOUT and "may still land" in str(info.value)
        with pytest.raises(SlackTierError) as info:   # a timed-out ticket is not waited twice
            src.wait(late)
        assert info.value.kind is ErrorKind.BAD_INPUT
        assert src.busy_or_closed()                   # compiled code must not queue past a ticket set aside
        src.hold(False)
        src.wait(src.submit(_reads([(1, 2), (3, 4)]), new))   # reaps the late ticket
        assert np.array_equal(new.pages[0], staged.pages[1][2]) and np.array_equal(new.pages[1], staged.pages[3][4])
        assert not old.pages.any()                    # the dropped reads never wrote into it
        assert not src.busy_or_closed()
        assert not queue.holds(old)                   # given back: no job and no ring holds it
    finally:
        src.close()


@pytest.mark.skipif(_URING_MISSING is not None, reason=f"io_uring unavailable: {_URING_MISSING}")
def test_the_c_worker_refuses_a_bad_read_and_queues_nothing_of_its_batch(o_direct_dir):
    staged = stage_synthetic(o_direct_dir, layers=(1,), ranks=1)
    src = DiskSource(staged.specs, DiskOptions(engine="io_uring"))
    pool = PageBufferPool(2)
    try:
        lane = src.lane()   # compiled code's way in: C checks the reads itself
        bad = _reads([(0, 1), (0, staged.specs[0].pages)])
        [queue] = [q for q in open_queues() if q.engine_name == "io_uring" and q.device != HOST_MEMORY]
        assert queue.submit(lane.arm(), bad.region, bad.page, bad.buffer, pool) == -2
        with pytest.raises(SlackTierError) as info:
            src.submit(bad, pool)
        assert info.value.kind is ErrorKind.BAD_INPUT and info.value.page == staged.specs[0].pages
        over = PageReads(np.zeros(1, np.int32), np.zeros(1, np.int64), np.array([2], np.int32))
        with pytest.raises(SlackTierError) as info:
            src.submit(over, pool)
        assert info.value.kind is ErrorKind.BAD_INPUT and "buffer 2" in str(info.value)
        assert not pool.pages.any() and not src.busy_or_closed()
        src.wait(src.submit(_reads([(0, 5)]), pool))
        assert np.array_equal(pool.pages[0], staged.pages[0][5])
    finally:
        src.close()


@pytest.mark.skipif(_URING_MISSING is not None, reason=f"io_uring unavailable: {_URING_MISSING}")
def test_a_job_queued_through_the_lane_is_booked_as_a_ticket_of_the_source(o_direct_dir):
    # What the step's compiled pass does, from Python: arm the lane, queue a batch with the C submit on the client
    # word it gives (C checks and copies it), book the job; the source waits for that ticket like one from submit.
    staged = stage_synthetic(o_direct_dir, layers=(1,), ranks=2)
    src = DiskSource(staged.specs, DiskOptions(engine="io_uring"))
    [queue] = [q for q in open_queues() if q.engine_name == "io_uring" and q.device != HOST_MEMORY]
    pool = PageBufferPool(2)
    try:
        lane = src.lane()
        assert lane is src.lane() and lane.source is src and lane.lock is src.lock
        reads = _reads([(1, 4), (0, 2)])
        with lane.lock:
            job = queue.engine.submit(lane.arm(), reads.region, reads.page, reads.buffer, pool.base, pool.capacity)
            assert job > 0 and not queue.holds(pool)  # the C engine's alone until booked
            ticket = lane.book(job, len(reads), pool)
        assert queue.holds(pool)                      # booked: the queue keeps the pool mapped until release
        stats = src.wait(ticket)
        assert stats.pages == 2
        assert np.array_equal(pool.pages[0], staged.pages[1][4]) and np.array_equal(pool.pages[1], staged.pages[0][2])
        with pytest.raises(SlackTierError, match="no ticket"):
            src.wait(ticket)
    finally:
        src.close()
    assert lane.arm() == 0                           # closed: every batch must go through submit, which refuses


def _worker_threads() -> dict[int, int]:
    """This process's C engine worker threads (named st-uring): thread id -> scheduling class."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if f.read().strip() == "st-uring":
                    out[int(tid)] = os.sched_getscheduler(int(tid))
        except (FileNotFoundError, ProcessLookupError):
            continue
    return out


def _batch_class_allowed() -> bool:
    """Whether this system lets a process enter the batch class (a seccomp profile may refuse it)."""
    code = "import os; os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))"
    return subprocess.run([sys.executable, "-c", code], capture_output=True).returncode == 0


@pytest.mark.skipif(_URING_MISSING is not None, reason=f"io_uring unavailable: {_URING_MISSING}")
def test_the_c_worker_runs_in_the_batch_class_so_its_wakeup_does_not_preempt_the_caller(o_direct_dir):
    if not _batch_class_allowed():
        pytest.skip("this system refuses the batch scheduling class (the worker then keeps the normal one)")
    staged = stage_synthetic(o_direct_dir, layers=(1,), ranks=1)
    src = DiskSource(staged.specs, DiskOptions(engine="io_uring"))
    try:
        src.wait(src.submit(_reads([(0, 1)]), PageBufferPool(1)))
        # the device's queue may have been opened by another table of this process: every worker is checked
        workers = _worker_threads()
        assert workers and set(workers.values()) == {os.SCHED_BATCH}
    finally:
        src.close()
