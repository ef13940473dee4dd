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

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("csrc") / "uring_read.c"
_CFLAGS = ("-O2", "-std=gnu11", "-shared", "-fPIC", "-Wall")
_build_lock = threading.Lock()

_I32P = np.ctypeslib.ndpointer(dtype=np.int32, flags="C_CONTIGUOUS")
_I64P = np.ctypeslib.ndpointer(dtype=np.int64, flags="C_CONTIGUOUS")
_U64P = np.ctypeslib.ndpointer(dtype=np.uint64, flags="C_CONTIGUOUS")


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
    source = _SOURCE.read_bytes()
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
def load_helper() -> ctypes.CDLL:
    """The loaded helper with its argument types declared (built on first call)."""
    lib = ctypes.CDLL(str(build_helper()))
    lib.st_ring_create.argtypes = [ctypes.c_uint, ctypes.POINTER(ctypes.c_int)]
    lib.st_ring_create.restype = ctypes.c_void_p
    lib.st_ring_destroy.argtypes = [ctypes.c_void_p]
    lib.st_ring_destroy.restype = None
    lib.st_ring_entries.argtypes = [ctypes.c_void_p]
    lib.st_ring_entries.restype = ctypes.c_uint
    lib.st_ring_flags.argtypes = [ctypes.c_void_p]
    lib.st_ring_flags.restype = ctypes.c_uint
    lib.st_ring_read.argtypes = [ctypes.c_void_p, ctypes.c_int, _I32P, _I64P, _U64P, ctypes.c_uint, ctypes.c_uint,
                                 ctypes.c_uint, _I32P]
    lib.st_ring_read.restype = ctypes.c_int
    lib.st_ring_register_files.argtypes = [ctypes.c_void_p, _I32P, ctypes.c_uint]
    lib.st_ring_register_files.restype = ctypes.c_int
    lib.st_ring_register_buffer.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint64]
    lib.st_ring_register_buffer.restype = ctypes.c_int
    return lib


class Ring:
    """One io_uring instance; use it from the thread that created it only."""

    def __init__(self, entries: int) -> None:
        self._lib = load_helper()
        err = ctypes.c_int(0)
        handle = self._lib.st_ring_create(entries, ctypes.byref(err))
        if not handle:
            raise SlackTierError(ErrorKind.UNAVAILABLE, f"io_uring_setup failed: {os.strerror(err.value)}",
                                 fix="use a kernel with io_uring enabled (sysctl kernel.io_uring_disabled=0) "
                                     "or choose engine='threads'")
        self._handle: int | None = handle
        self.entries = int(self._lib.st_ring_entries(handle))
        self.setup_flags = int(self._lib.st_ring_flags(handle))

    def read(self, fds: np.ndarray, offsets: np.ndarray, addrs: np.ndarray, nbytes: int, depth: int,
             wait_batch: int, res: np.ndarray) -> int:
        """Read `nbytes` at offsets[i] of fds[i] into addrs[i]; res[i] gets bytes or -errno. 0 or -errno.

        At most `depth` reads in flight; each wait for completions asks for `wait_batch` of them.
        """
        if self._handle is None:
            raise SlackTierError(ErrorKind.CLOSED, "io_uring ring is closed", fix="open a new source")
        return int(self._lib.st_ring_read(self._handle, fds.shape[0], fds, offsets, addrs, nbytes, depth,
                                          wait_batch, res))

    def register_files(self, fds: np.ndarray) -> int:
        """Register open files (int32 [n], n <= 64) so reads of them skip a lookup; 0 or -errno."""
        fds = np.ascontiguousarray(fds, dtype=np.int32)
        return int(self._lib.st_ring_register_files(self._handle, fds, fds.shape[0]))

    def register_buffer(self, addr: int, nbytes: int) -> int:
        """Register one buffer range (pinned once, not per read); replaces the last one. 0 or -errno."""
        return int(self._lib.st_ring_register_buffer(self._handle, addr, nbytes))

    def close(self) -> None:
        """Tear the ring down (idempotent)."""
        if self._handle is not None:
            self._lib.st_ring_destroy(self._handle)
            self._handle = None


def probe_io_uring() -> str | None:
    """None when the helper builds and a ring can be set up here, else the reason it cannot."""
    try:
        ring = Ring(8)
    except SlackTierError as exc:
        return str(exc)
    ring.close()
    return None
