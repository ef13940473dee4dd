"""The emulated queue's native lane: compiled code records a batch without entering Python.

The disk tier's io_uring client is called by address from the cache's
compiled pass (cache.compiled, `st_eng_submit`), so a disk rank's begin_step
is one compiled call. The emulated queue offers the same through its lane
(store.base.Lane, whatif.tier.EmulatedLane): `_lane_submit`, a numba
cfunc with st_eng_submit's C signature and error word, checks a batch against
the client's regions and the pool and copies its page lists, priority, submit
time and pool into a `LaneTable` the queue owns. The queue then takes each
recorded job out of the table (one slice copied) when its device seals a TP
step, or when the engine books it, whichever comes first
(whatif.tier.EmulatedQueue). A batch the table has no room for is refused
(-ENOSPC) and goes through `submit`; the table then grows (logged, counted in
`LANE_REFUSALS`). The cfunc is compiled on first use (about 1 s; numba cannot
cache a function that calls clock_gettime through ctypes).
"""

from __future__ import annotations

import ctypes
import errno
import functools
import logging
from collections import Counter

import numpy as np
from numba import carray, cfunc, types

from slacktier.errors import ErrorKind, SlackTierError
from slacktier.tables.native import submit_numba_signature
from slacktier.store._common import NOT_DONE
from slacktier.store.pread_queue import PreadJob
from slacktier.tables.layout import PAGE_BYTES

log = logging.getLogger(__name__)

#: a lane table's first room (jobs, reads); a batch that does not fit is refused to Python and the table grows
LANE_JOBS = 16
LANE_PAGES = 8192
#: batches the lane refused to Python for want of room in its table, by reason (each also logged at INFO);
#: process-wide, as the log lines it counts
LANE_REFUSALS: Counter[str] = Counter()

# A lane table is one int64 array: these header words, the client's regions (page counts, then admission
# priorities), a record per job (where its reads start, how many, its submit time, its priority, the pool it
# reads into), then the jobs' reads, each job's as one block of page, region and buffer lists (3 n words), so
# taking it copies one slice.
L_SELF = 0         # the table's own address (clock_gettime writes its timespec at L_TS)
L_TS = 1           # two words
L_REGIONS = 3
L_JOBS = 4         # job records it holds
L_WORDS = 5        # read words it holds (3 per read), all jobs together
L_USED_JOBS = 6    # recorded since the lane was armed (every one is taken before it is armed again)
L_USED_WORDS = 7
L_NEED_JOBS = 8    # the room a refused batch needed (rearm grows the table to twice that)
L_NEED_WORDS = 9
L_HEADER = 10
J_AT, J_N, J_SUBMIT_NS, J_PRIORITY, J_POOL, J_POOL_BUFFERS = 0, 1, 2, 3, 4, 5
J_WORDS = 6

_libc_clock = ctypes.CDLL(None).clock_gettime
_libc_clock.argtypes = (ctypes.c_int, ctypes.c_int64)   # the timespec's address as a word: the same register
_libc_clock.restype = ctypes.c_int
_CLOCK_MONOTONIC = 1   # perf_counter_ns's clock on Linux
_ENOSPC = errno.ENOSPC
_NO_PRIORITY = 2**31 - 1

_LANE_SIG = submit_numba_signature(types.int64)   # the C submit's, the client word being the lane table


def _lane_submit(table, n, region, page, buffer, pool_addr, pool_buffers, err):
    """st_eng_submit's contract on a lane table: check every read against the regions and the pool (err = i + 1
    for read i out of range), copy the batch, its submit time, priority and pool into the table, return its job
    (k + 1); 0 and err = -ENOSPC when the table has no room."""
    head = carray(table, L_HEADER)
    n_regions = head[L_REGIONS]
    jobs = head[L_JOBS]
    words = head[L_WORDS]
    jobs_at = L_HEADER + 2 * n_regions
    reads_at = jobs_at + J_WORDS * jobs
    w = carray(table, reads_at + words)
    reg = carray(region, n)
    pg = carray(page, n)
    buf = carray(buffer, n)
    priority = _NO_PRIORITY
    for i in range(n):
        g = reg[i]
        if g < 0 or g >= n_regions or pg[i] < 0 or pg[i] >= w[L_HEADER + g] or buf[i] < 0 or buf[i] >= pool_buffers:
            err[0] = i + 1
            return 0
        priority = min(priority, w[L_HEADER + n_regions + g])
    k = w[L_USED_JOBS]
    at = w[L_USED_WORDS]
    if k >= jobs or at + 3 * n > words:
        w[L_NEED_JOBS] = max(w[L_NEED_JOBS], k + 1)
        w[L_NEED_WORDS] = max(w[L_NEED_WORDS], at + 3 * n)
        err[0] = -_ENOSPC
        return 0
    b = reads_at + at
    for i in range(n):
        w[b + i] = pg[i]
        w[b + n + i] = reg[i]
        w[b + 2 * n + i] = buf[i]
    _libc_clock(_CLOCK_MONOTONIC, w[L_SELF] + 8 * L_TS)
    j = jobs_at + J_WORDS * k
    w[j + J_AT] = at
    w[j + J_N] = n
    w[j + J_SUBMIT_NS] = w[L_TS] * 1_000_000_000 + w[L_TS + 1]
    w[j + J_PRIORITY] = priority if n else 0
    w[j + J_POOL] = pool_addr
    w[j + J_POOL_BUFFERS] = pool_buffers
    w[L_USED_JOBS] = k + 1
    w[L_USED_WORDS] = at + 3 * n
    err[0] = 0
    return k + 1


@functools.cache
def lane_submit_address() -> int:
    """The address of `_lane_submit` compiled with st_eng_submit's C signature (compiled on first use)."""
    return cfunc(_LANE_SIG, nopython=True)(_lane_submit).address


class PoolPages:
    """The page buffers a recorded batch reads into, seen from the address compiled code was given.

    The engine's page pool (store.base.PageBufferPool) stays mapped while a step's batches are outstanding: the
    engine holds it through the step, and the ticket of every batch it books holds it until the batch lands.
    So a view made from its address while the step runs is valid for the copies the queue makes then."""

    __slots__ = ("base", "capacity", "pages")

    def __init__(self, base: int, capacity: int) -> None:
        self.base = base
        self.capacity = capacity
        buf = (ctypes.c_uint8 * (capacity * PAGE_BYTES)).from_address(base)
        self.pages = np.frombuffer(buf, np.uint8).reshape(capacity, PAGE_BYTES)


class LaneTable:
    """One client's batches as compiled code recorded them (`_lane_submit`), until its queue takes them.

    Compiled code records into it only inside a call made under the client's source lock, and every job of a
    call is taken (`take_new`) before the lane is armed for the next call (`rearm`). Worked example: a batch of 3
    reads then one of 2 -> jobs 1 and 2; job 2's reads are the 6 words after job 1's 9.
    """

    def __init__(self, client: int, region_pages: np.ndarray, region_priority: np.ndarray) -> None:
        self.client = client
        self.regions = np.concatenate([np.asarray(region_pages, np.int64), np.asarray(region_priority, np.int64)])
        self._pool: PoolPages | None = None
        self._alloc(LANE_JOBS, 3 * LANE_PAGES)

    def _alloc(self, jobs: int, words: int) -> None:
        r2 = self.regions.shape[0]
        self.words = w = np.zeros(L_HEADER + r2 + J_WORDS * jobs + words, np.int64)
        w[L_SELF] = w.ctypes.data
        w[L_REGIONS], w[L_JOBS], w[L_WORDS] = r2 // 2, jobs, words
        w[L_HEADER:L_HEADER + r2] = self.regions
        self._jobs_at = L_HEADER + r2
        self._reads_at = L_HEADER + r2 + J_WORDS * jobs
        self._m = memoryview(w)
        self._taken = 0

    def rearm(self) -> int:
        """Empty the table for the next compiled call (every job of the last one was taken), grown first when a
        batch was refused for room; its address, the client word compiled code passes `_lane_submit`."""
        m = self._m
        if m[L_NEED_JOBS] or m[L_NEED_WORDS]:
            jobs, words = max(2 * m[L_NEED_JOBS], m[L_JOBS]), max(2 * m[L_NEED_WORDS], m[L_WORDS])
            LANE_REFUSALS["room"] += 1
            log.info("emulated lane: a batch needed room for %d jobs and %d reads, the table held %d and %d; it went "
                     "through Python, and the table grows to %d and %d (refusal #%d in this process)",
                     m[L_NEED_JOBS], m[L_NEED_WORDS] // 3, m[L_JOBS], m[L_WORDS] // 3, jobs, words // 3,
                     sum(LANE_REFUSALS.values()))
            self._alloc(jobs, words)
            m = self._m
        m[L_USED_JOBS] = 0
        m[L_USED_WORDS] = 0
        self._taken = 0
        return m[L_SELF]

    def take_new(self) -> list[tuple[PreadJob, int]]:
        """The jobs recorded since the last take, in recording order: each as a batch of the thread queue (its reads
        copied out of the table as one block [page n | region n | buffer n] int64) and its admission priority."""
        m = self._m
        used, first = m[L_USED_JOBS], self._taken
        self._taken = used
        return [self._job(k) for k in range(first, used)]

    def _job(self, k: int) -> tuple[PreadJob, int]:
        m = self._m
        j = self._jobs_at + J_WORDS * k
        at, n = m[j + J_AT], m[j + J_N]
        base, buffers = m[j + J_POOL], m[j + J_POOL_BUFFERS]
        if self._pool is None or self._pool.base != base or self._pool.capacity != buffers:
            self._pool = PoolPages(base, buffers)
        lo = self._reads_at + at
        block = self.words[lo:lo + 3 * n].copy()
        batch = PreadJob(self.client, block[n:2 * n], block[:n], block[2 * n:], self._pool,
                         np.full(n, NOT_DONE, np.int32), m[j + J_SUBMIT_NS])
        return batch, m[j + J_PRIORITY]

    def recorded(self) -> int:
        """Jobs recorded since the last `rearm` (job numbers 1..this)."""
        return self._m[L_USED_JOBS]

    def check_job(self, job: int) -> None:
        """Refuse a job number the last compiled call did not return."""
        if not 1 <= job <= self._m[L_USED_JOBS]:
            raise SlackTierError(ErrorKind.BAD_INPUT, f"the lane table holds no job {job}",
                                 fix="book only the jobs the compiled call returned, before the next call")
