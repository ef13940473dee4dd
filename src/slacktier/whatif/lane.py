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
import numba
from numba import carray, cfunc, types
from numba.core import cgutils
from numba.core.extending import intrinsic

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

# A lane table is one int64 array: a header (`LANE_HEADER`), the client's regions (page counts, then admission
# priorities), a record per job (`LANE_JOB`), then the jobs' reads, each job's as one block of page, region and
# buffer lists (3 n words), so taking it copies one slice. Both sides, the cfunc and Python, read the header and
# the job records through these two dtypes (as numba records and numpy structured views), so a field's place is
# stated once, here.
_I64 = np.int64
LANE_HEADER = np.dtype([
    ("ts", _I64, (2,)),     # clock_gettime writes its timespec here (seconds, nanoseconds)
    ("regions", _I64),      # the client's regions
    ("jobs", _I64),         # job records the table holds
    ("words", _I64),        # read words it holds (3 per read), all jobs together
    ("used_jobs", _I64),    # recorded since the lane was armed (every one is taken before it is armed again)
    ("used_words", _I64),
    ("need_jobs", _I64),    # the room a refused batch needed (rearm grows the table to twice that)
    ("need_words", _I64),
])
LANE_JOB = np.dtype([
    ("at", _I64),           # where its reads start among the read words
    ("n", _I64),            # how many reads
    ("submit_ns", _I64),    # perf_counter_ns's clock when it was recorded
    ("priority", _I64),     # the most urgent admission priority among its regions (0 for an empty batch)
    ("pool", _I64),         # the address of the page pool it reads into
    ("pool_buffers", _I64),
])
_WORD = np.dtype(_I64).itemsize
_HEADER_WORDS = LANE_HEADER.itemsize // _WORD
_JOB_WORDS = LANE_JOB.itemsize // _WORD
_HEADER_BYTES = LANE_HEADER.itemsize
_JOB_BYTES = LANE_JOB.itemsize
_TS_BYTE = LANE_HEADER.fields["ts"][1]

_libc_clock = ctypes.CDLL(None).clock_gettime
_libc_clock.argtypes = (ctypes.c_int, ctypes.c_void_p)
_libc_clock.restype = ctypes.c_int
_CLOCK_MONOTONIC = 1   # perf_counter_ns's clock on Linux
_ENOSPC = errno.ENOSPC
_NO_PRIORITY = 2**31 - 1

_LANE_SIG = submit_numba_signature(numba.from_dtype(LANE_HEADER))   # the C submit's, the client word the table


@intrinsic
def _at(typingctx, base, offset):
    """The address `offset` bytes past the pointer `base`, as void* (for carray of the table's later parts)."""
    def codegen(context, builder, sig, args):
        start = builder.ptrtoint(args[0], args[1].type)
        return builder.inttoptr(builder.add(start, args[1]), cgutils.voidptr_t)
    return types.voidptr(base, offset), codegen


def _lane_submit(table, n, region, page, buffer, pool_addr, pool_buffers, err):
    """st_eng_submit's contract on a lane table: check every read against the regions and the pool (err = i + 1
    for read i out of range), copy the batch, its submit time, priority and pool into the table, return its job
    (k + 1); 0 and err = -ENOSPC when the table has no room."""
    head = carray(table, 1)[0]
    n_regions = head.regions
    jobs = head.jobs
    words = head.words
    regions = carray(_at(table, _HEADER_BYTES), 2 * n_regions, dtype=_I64)
    jobs_at = _HEADER_BYTES + 2 * n_regions * _WORD
    records = carray(_at(table, jobs_at), jobs, dtype=LANE_JOB)
    reads = carray(_at(table, jobs_at + jobs * _JOB_BYTES), words, dtype=_I64)
    reg = carray(region, n)
    pg = carray(page, n)
    buf = carray(buffer, n)
    priority = _NO_PRIORITY
    for i in range(n):
        g = reg[i]
        if g < 0 or g >= n_regions or pg[i] < 0 or pg[i] >= regions[g] or buf[i] < 0 or buf[i] >= pool_buffers:
            err[0] = i + 1
            return 0
        priority = min(priority, regions[n_regions + g])
    k = head.used_jobs
    at = head.used_words
    if k >= jobs or at + 3 * n > words:
        head.need_jobs = max(head.need_jobs, k + 1)
        head.need_words = max(head.need_words, at + 3 * n)
        err[0] = -_ENOSPC
        return 0
    for i in range(n):
        reads[at + i] = pg[i]
        reads[at + n + i] = reg[i]
        reads[at + 2 * n + i] = buf[i]
    _libc_clock(_CLOCK_MONOTONIC, _at(table, _TS_BYTE))
    job = records[k]
    job.at = at
    job.n = n
    job.submit_ns = head.ts[0] * 1_000_000_000 + head.ts[1]
    job.priority = priority if n else 0
    job.pool = pool_addr
    job.pool_buffers = pool_buffers
    head.used_jobs = k + 1
    head.used_words = at + 3 * n
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
        jobs_at = _HEADER_WORDS + r2
        reads_at = jobs_at + _JOB_WORDS * jobs
        self.words = w = np.zeros(reads_at + words, np.int64)
        self._address = w.ctypes.data
        self._head = h = w[:_HEADER_WORDS].view(LANE_HEADER)[0]
        h["regions"], h["jobs"], h["words"] = r2 // 2, jobs, words
        w[_HEADER_WORDS:jobs_at] = self.regions
        self._jobs = w[jobs_at:reads_at].view(LANE_JOB)
        self._reads = w[reads_at:]
        self._taken = 0

    def rearm(self) -> int:
        """Empty the table for the next compiled call (every job of the last one was taken), grown first when a
        batch was refused for room; its address, the client word compiled code passes `_lane_submit`."""
        h = self._head
        if h["need_jobs"] or h["need_words"]:
            need_jobs, need_words, held_jobs, held_words = (int(h[f]) for f in ("need_jobs", "need_words", "jobs", "words"))
            jobs, words = max(2 * need_jobs, held_jobs), max(2 * need_words, held_words)
            LANE_REFUSALS["room"] += 1
            log.info("emulated lane: a batch needed room for %d jobs and %d reads, the table held %d and %d; it went "
                     "through Python, and the table grows to %d and %d (refusal #%d in this process)",
                     need_jobs, need_words // 3, held_jobs, held_words // 3, jobs, words // 3,
                     sum(LANE_REFUSALS.values()))
            self._alloc(jobs, words)
            h = self._head
        h["used_jobs"] = 0
        h["used_words"] = 0
        self._taken = 0
        return self._address

    def take_new(self) -> list[tuple[PreadJob, int]]:
        """The jobs recorded since the last take, in recording order: each as a batch of the thread queue (its reads
        copied out of the table as one block [page n | region n | buffer n] int64) and its admission priority."""
        used, first = int(self._head["used_jobs"]), self._taken
        self._taken = used
        return [self._job(k) for k in range(first, used)]

    def _job(self, k: int) -> tuple[PreadJob, int]:
        rec = self._jobs[k]
        at, n = int(rec["at"]), int(rec["n"])
        base, buffers = int(rec["pool"]), int(rec["pool_buffers"])
        if self._pool is None or self._pool.base != base or self._pool.capacity != buffers:
            self._pool = PoolPages(base, buffers)
        block = self._reads[at:at + 3 * n].copy()
        batch = PreadJob(self.client, block[n:2 * n], block[:n], block[2 * n:], self._pool,
                         np.full(n, NOT_DONE, np.int32), int(rec["submit_ns"]))
        return batch, int(rec["priority"])

    def recorded(self) -> int:
        """Jobs recorded since the last `rearm` (job numbers 1..this)."""
        return int(self._head["used_jobs"])

    def check_job(self, job: int) -> None:
        """Refuse a job number the last compiled call did not return."""
        if not 1 <= job <= self._head["used_jobs"]:
            raise SlackTierError(ErrorKind.BAD_INPUT, f"the lane table holds no job {job}",
                                 fix="book only the jobs the compiled call returned, before the next call")
