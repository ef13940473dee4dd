"""Build and load the io_uring read helper (csrc/uring_read.c) with the system C compiler.

The helper is compiled on first use into a cache directory keyed by a hash of
its source and flags, then loaded with ctypes (which releases the GIL during
each call). Deployment switches, both optional:

- ``SLACKTIER_CACHE_DIR``: where the compiled helper goes (default
  ``$XDG_CACHE_HOME/slacktier`` or ``~/.cache/slacktier``).
- ``CC``: the C compiler to run (default ``cc``).
"""

from __future__ import annotations

import ctypes
import errno
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import numpy as np

from slacktier.errors import ErrorKind, SlackTierError
from slacktier.tables.native import HEADER, WaitInfo, declare, submit_prototype

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("csrc") / "uring_read.c"
_CFLAGS = ("-O2", "-std=gnu11", "-shared", "-fPIC", "-Wall", "-pthread", f"-I{HEADER.parent}")
_build_lock = threading.Lock()



def cache_dir() -> Path:
    """Directory for compiled helpers (see the module docstring for the switches)."""
    if os.environ.get("SLACKTIER_CACHE_DIR"):
        return Path(os.environ["SLACKTIER_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "slacktier"


def _compiler() -> str:
    cc = os.environ.get("CC", "cc")
    if shutil.which(cc) is None:
        raise SlackTierError(ErrorKind.UNAVAILABLE, f"C compiler {cc!r} not found, cannot build the io_uring helper",
                             fix="install a C compiler (apt-get install gcc) or choose engine='threads'")
    return cc


def build_helper() -> Path:
    """Compile the helper if this source and these flags were never built; return the .so path."""
    source = _SOURCE.read_bytes() + HEADER.read_bytes()
    cc = _compiler()
    key = hashlib.sha256(source + cc.encode() + " ".join(_CFLAGS).encode()).hexdigest()[:16]
    out_dir = cache_dir()
    target = out_dir / f"uring_read-{key}.so"
    with _build_lock:
        if target.exists():
            return target
        try:
            out_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise SlackTierError(ErrorKind.UNAVAILABLE, f"cannot create helper cache dir {out_dir}: {exc}",
                                 fix="set SLACKTIER_CACHE_DIR to a writable directory") from exc
        # Build into a private name, then rename: processes racing on a cold cache never load half a file.
        fd, tmp = tempfile.mkstemp(prefix=target.stem, suffix=".so.tmp", dir=out_dir)
        os.close(fd)
        try:
            proc = subprocess.run([cc, *_CFLAGS, "-o", tmp, str(_SOURCE)], capture_output=True, text=True,
                                  check=False)
            if proc.returncode != 0:
                raise SlackTierError(ErrorKind.UNAVAILABLE, f"compiling {_SOURCE.name} failed: "
                                     f"{proc.stderr.strip()[-800:]}",
                                     fix="install linux-libc-dev (for linux/io_uring.h) or choose engine='threads'")
            os.replace(tmp, target)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        log.info("built io_uring helper %s", target)
    return target


@functools.cache
def _submit_kernel():
    """st_eng_submit called from compiled code: numba hands over the arrays' addresses directly, where
    Python's ctypes takes microseconds per array (`arr.ctypes.data`) on this path that runs every step."""
    from numba import njit

    fn = submit_prototype(ctypes.CDLL(str(build_helper())).st_eng_submit)   # a CDLL of its own for numba

    @njit(nogil=True)
    def submit(client, region, page, buffer, pool_addr, pool_buffers, err):   # pragma: no cover - compiled
        return fn(client, region.shape[0], region.ctypes.data, page.ctypes.data, buffer.ctypes.data, pool_addr,
                  pool_buffers, err.ctypes.data)

    return submit


@functools.cache
def submit_address() -> int:
    """Address of st_eng_submit, for compiled code that calls it by address (cache.compiled)."""
    return ctypes.cast(ctypes.CDLL(str(build_helper())).st_eng_submit, ctypes.c_void_p).value


@functools.cache
def load_helper() -> ctypes.CDLL:
    """The loaded helper with its argument types declared (built on first call); st_eng_submit is called from
    compiled code instead (`_submit_kernel`)."""
    return declare(ctypes.CDLL(str(build_helper())))




class IoEngine:
    """A C device queue (csrc/uring_read.c `st_eng_*`): worker pthreads owning one io_uring ring each, taking
    reads from one queue kept in (priority, arrival) order; with `entries` 0 they own no ring and each reads
    `depth` reads at a time with pread (or copies host memory).

    Clients attach their regions (`attach`: region i is region_pages[i] pages of `page_bytes` at byte
    region_offset[i] of file region_fd[i], admitted in region_prio[i] order). A batch of one client goes
    over in one call: `submit` passes the addresses of the region, page and buffer arrays; C checks every
    read against the client's regions and copies the batch, and returns the job at once. `wait`
    blocks with the GIL released. No Python runs on the I/O side.
    """

    def __init__(self, entries: int, depth: int, wait_batch: int, page_bytes: int, threads: int) -> None:
        self._lib = load_helper()
        err = ctypes.c_int(0)
        engine = self._lib.st_eng_create(entries, depth, wait_batch, page_bytes, threads, ctypes.byref(err))
        if not engine and entries == 0:
            raise SlackTierError(ErrorKind.UNAVAILABLE, f"cannot start {threads} C read threads: "
                                 f"{os.strerror(err.value)}", fix="lower queue_depth or io_threads")
        if not engine:
            raise SlackTierError(ErrorKind.UNAVAILABLE, f"cannot start the io_uring I/O engine: "
                                 f"{os.strerror(err.value)}",
                                 fix="use a kernel with io_uring enabled (sysctl kernel.io_uring_disabled=0) "
                                     "or choose engine='threads'")
        self._engine: int | None = engine   # the C engine's address
        self.threads = threads
        self._err = np.zeros(1, dtype=np.int64)
        self._submit = _submit_kernel()

    def attach(self, region_fd: np.ndarray, region_offset: np.ndarray, region_pages: np.ndarray,
               region_prio: np.ndarray, region_ioprio: np.ndarray) -> int:
        """Attach a client's regions; its id (what `submit` and compiled code take)."""
        if self._engine is None:
            raise SlackTierError(ErrorKind.CLOSED, "the io_uring I/O engine is closed", fix="open a new source")
        arrays = [np.ascontiguousarray(region_fd, dtype=np.int32), np.ascontiguousarray(region_offset, np.int64),
                  np.ascontiguousarray(region_pages, np.int64), np.ascontiguousarray(region_prio, np.int32),
                  np.ascontiguousarray(region_ioprio, np.int32)]
        err = ctypes.c_int(0)
        client = self._lib.st_eng_attach(self._engine, arrays[0].shape[0], *(a.ctypes.data for a in arrays),
                                         ctypes.byref(err))
        if not client:
            raise SlackTierError(ErrorKind.IO, f"cannot attach regions: {os.strerror(err.value)}", fix="free memory")
        # An empty batch compiles the submit kernel now (or loads it), not inside a caller's first step.
        none = np.zeros(0, dtype=np.int64)
        self.release(self.submit(client, none.astype(np.int32), none, none.astype(np.int32), 0, 0))
        return client

    def detach(self, client: int) -> bool:
        """Forget a client whose every job was released; False while one is not."""
        return self._engine is None or self._lib.st_eng_detach(self._engine, client) == 0

    def submit(self, client: int, region: np.ndarray, page: np.ndarray, buffer: np.ndarray, pool_addr: int,
               pool_buffers: int) -> int:
        """Queue reads (int32, int64, int32 C-contiguous arrays of one length); the job (> 0), or
        -(i + 1) for read i naming a region, page or buffer out of range (nothing queued). CLOSED once closed."""
        if self._engine is None:
            raise SlackTierError(ErrorKind.CLOSED, "the io_uring I/O engine is closed", fix="open a new source")
        job = self._submit(client, region, page, buffer, pool_addr, pool_buffers, self._err)
        if job:
            return job
        err = int(self._err[0])
        if err > 0:
            return -err
        if err == -errno.ESHUTDOWN:
            raise SlackTierError(ErrorKind.CLOSED, "the io_uring I/O engine is stopping", fix="open a new source")
        raise SlackTierError(ErrorKind.IO, f"cannot queue reads: {os.strerror(-err)}", fix="free memory")

    def wait(self, job: int, timeout_ns: int, info: WaitInfo) -> bool:
        """Block until `job` is done, at most `timeout_ns` (< 0: no limit); True and `info` filled when done."""
        return self._lib.st_eng_wait(self._engine, job, timeout_ns, ctypes.byref(info)) == 0

    def reads(self, job: int, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """A done job's n reads as submitted, and its results: region, page, buffer, and bytes read or -errno."""
        region, page, buffer, res = (np.empty(n, np.int32), np.empty(n, np.int64), np.empty(n, np.int32),
                                     np.empty(n, np.int32))
        self._lib.st_eng_reads(job, region.ctypes.data, page.ctypes.data, buffer.ctypes.data, res.ctypes.data)
        return region, page, buffer, res

    def hold(self, on: bool) -> None:
        """Admit no read while held (tests: a batch that lands late for real); close releases it."""
        self._lib.st_eng_hold(self._engine, int(on))

    def cancel(self, job: int) -> int:
        """Cancel the job's reads not yet handed to the kernel (they land as -ECANCELED); how many."""
        return self._lib.st_eng_cancel(self._engine, job) if self._engine is not None else 0

    def strict(self, on: bool) -> None:
        """Strict order (the default): a batch's first read waits until no earlier-priority read is in flight
        (off: a later batch fills the depth an earlier one leaves)."""
        self._lib.st_eng_strict(self._engine, int(on))

    def defer(self, on: bool) -> None:
        """Open (True) or end (False) a deferral: while one is open the workers admit no read (counted)."""
        if self._engine is not None:
            self._lib.st_eng_defer(self._engine, int(on))

    def batch_class(self, on: bool) -> None:
        """Workers as batch-class threads (the default: a woken worker does not preempt the caller that queued
        the batch) or ordinary ones (for a queue whose reads are host-memory copies); logged when refused."""
        rc = self._lib.st_eng_batch(self._engine, int(on))
        if rc:
            log.info("io_uring engine: scheduling class %s refused: %s", "batch" if on else "normal",
                     os.strerror(rc))

    def release(self, job: int) -> None:
        """Free a done job."""
        if self._engine is not None:
            self._lib.st_eng_release(self._engine, job)

    def registered(self) -> set[int]:
        """Addresses of the pools the rings have registered now (they must stay mapped)."""
        out = np.zeros(64, dtype=np.uint64)
        n = self._lib.st_eng_registered(self._engine, out.ctypes.data)
        return {int(a) for a in out[:n] if a}

    def trace(self, cap: int) -> None:
        """Record the next `cap` admitted reads (0: stop and forget)."""
        if self._lib.st_eng_trace(self._engine, cap) != 0:
            raise SlackTierError(ErrorKind.IO, "cannot allocate the admission trace", fix="ask for fewer reads")

    def traced(self, cap: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The reads admitted since `trace`, in admission order: client id, region, page."""
        client, region, page = np.empty(cap, np.int32), np.empty(cap, np.int32), np.empty(cap, np.int64)
        n = self._lib.st_eng_trace_read(self._engine, client.ctypes.data, region.ctypes.data, page.ctypes.data,
                                        cap)
        return client[:n], region[:n], page[:n]

    def close(self) -> None:
        """Finish queued batches, stop the threads, free the rings and every job (idempotent)."""
        if self._engine is not None:
            self._lib.st_eng_destroy(self._engine)
            self._engine = None


#: most worker threads a C device queue starts (csrc/uring_read.c ST_MAX_THREADS)
MAX_ENGINE_THREADS = 64


def helper_missing() -> str | None:
    """None when the C helper builds and loads here (a compiler and linux/io_uring.h; io_uring itself may still
    be refused), else the reason it cannot."""
    try:
        load_helper()
    except SlackTierError as exc:
        return str(exc)
    return None


def helper_builds() -> bool:
    """Whether the C helper builds and loads here, io_uring or not."""
    return helper_missing() is None


def probe_io_uring() -> str | None:
    """None when the helper builds and a ring can be set up here, else the reason it cannot."""
    reason = helper_missing()
    if reason is not None:
        return reason
    lib = load_helper()
    err = ctypes.c_int(0)
    ring = lib.st_ring_create(8, ctypes.byref(err))
    if not ring:
        return f"io_uring_setup failed: {os.strerror(err.value)}"
    lib.st_ring_destroy(ring)
    return None
