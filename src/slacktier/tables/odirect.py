"""Aligned direct I/O on a file or raw block device: page-aligned buffers, O_DIRECT pread/pwrite.

O_DIRECT needs the buffer address, the file offset and the length all aligned
(4 KiB covers every logical block size we meet). A filesystem that refuses
O_DIRECT (tmpfs on old kernels, some network filesystems) is an error with a
fix message, never a silent switch to the page cache. Buffered I/O exists only
as an explicit opt-in (`buffered=True`), which is logged and counted in
`BUFFERED_OPENS`.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import mmap
import os
import stat
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from slacktier.errors import ErrorKind, SlackTierError
from slacktier.tables.layout import PAGE_BYTES

log = logging.getLogger(__name__)

ALIGN_BYTES = PAGE_BYTES
BUFFERED_OPENS = 0  # how many opens ran without O_DIRECT because the caller asked for it
_FULL = (errno.ENOSPC, errno.EDQUOT)   # a full filesystem (or quota): CAPACITY, never a bare [Errno 28]

_ODIRECT_FIX = ("put the target on a filesystem that supports O_DIRECT (ext4, xfs) or use a raw block "
                "device; or pass --buffered (buffered=True) to accept page-cache I/O, which is logged")


def lock_target(fd: int, path: str, *, exclusive: bool) -> None:
    """Lock the target open at `fd` (flock, never waiting): shared by every process serving from it, exclusive
    by a stage writing it, so a stage never writes under a reader.

    flock locks the inode behind the path, so it works on regular files and on raw block devices' device
    nodes alike (every opener of /dev/nvme0n1 takes the same lock). The lock holds while `fd` stays open.
    Refused (TARGET) when the other kind is held, naming the target and the fix."""
    try:
        fcntl.flock(fd, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB)
    except BlockingIOError:
        if exclusive:
            raise SlackTierError(ErrorKind.TARGET, f"target {path} is in use: an engine serving from it holds "
                                 "its lock, and staging would change rows under it",
                                 fix="stop the engines that serve it (or apply a control file without it) first, "
                                     "or stage to another target and apply the manifest that stage writes") from None
        raise SlackTierError(ErrorKind.TARGET, f"target {path} is being staged by another process",
                             fix="wait until that stage finishes, then serve the manifest it writes") from None
    except OSError as exc:   # ENOLCK: a filesystem without flock (some network filesystems)
        raise SlackTierError(ErrorKind.UNAVAILABLE, f"cannot lock target {path}: {exc.strerror}",
                             fix="put the target on a local filesystem (ext4, xfs) or a raw block device") from None


def aligned_array(nbytes: int) -> np.ndarray:
    """A page-aligned, zeroed uint8 array of `nbytes` (an anonymous mapping), safe for O_DIRECT."""
    if nbytes <= 0 or nbytes % ALIGN_BYTES:
        raise SlackTierError(ErrorKind.BAD_INPUT, f"aligned buffer size {nbytes} is not a positive multiple "
                             f"of {ALIGN_BYTES}", fix="round the size up to whole pages")
    return np.frombuffer(mmap.mmap(-1, nbytes), dtype=np.uint8)


@dataclass(frozen=True)
class TargetInfo:
    """What a staging target is: `capacity_bytes` None means a regular file that can grow."""

    path: str
    exists: bool
    is_block_device: bool
    size_bytes: int                # current size (a block device's whole size)
    capacity_bytes: int | None     # most bytes the target can hold, None = bounded only by free space
    free_bytes: int | None         # free space on the filesystem of a regular file


def probe_target(path: str, max_bytes: int | None = None) -> TargetInfo:
    """Describe a staging target; `max_bytes` caps a regular file's capacity."""
    if os.path.exists(path):
        st = os.stat(path)
        if stat.S_ISBLK(st.st_mode):
            fd = os.open(path, os.O_RDONLY)
            try:
                size = os.lseek(fd, 0, os.SEEK_END)
            finally:
                os.close(fd)
            cap = size if max_bytes is None else min(size, max_bytes)
            return TargetInfo(path, True, True, size, cap, None)
        if not stat.S_ISREG(st.st_mode):
            raise SlackTierError(ErrorKind.TARGET, f"{path} is neither a regular file nor a block device",
                                 fix="stage into a file or a raw block device")
        vfs = os.statvfs(os.path.dirname(os.path.abspath(path)))
        return TargetInfo(path, True, False, st.st_size, max_bytes, vfs.f_bavail * vfs.f_frsize)
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise SlackTierError(ErrorKind.MISSING, f"directory {parent} of target {path} does not exist",
                             fix="create the directory first")
    vfs = os.statvfs(parent)
    return TargetInfo(path, False, False, 0, max_bytes, vfs.f_bavail * vfs.f_frsize)


class DirectFile:
    """A file or block device opened for aligned O_DIRECT reads (and writes if `write`)."""

    def __init__(self, path: str, *, write: bool = False, create: bool = False, buffered: bool = False) -> None:
        global BUFFERED_OPENS
        self.path = path
        self.buffered = buffered
        flags = (os.O_RDWR if write else os.O_RDONLY) | (os.O_CREAT if create else 0)
        if buffered:
            BUFFERED_OPENS += 1
            log.warning("opening %s WITHOUT O_DIRECT because buffered I/O was requested (%d such opens)",
                        path, BUFFERED_OPENS)
        else:
            flags |= os.O_DIRECT
        try:
            self.fd = os.open(path, flags, 0o644)
        except OSError as exc:
            if exc.errno == errno.EINVAL and not buffered:
                raise SlackTierError(ErrorKind.UNAVAILABLE, f"{path} refuses O_DIRECT", fix=_ODIRECT_FIX) from exc
            if exc.errno in _FULL:
                raise os_error(exc, f"creating {path}") from None
            raise SlackTierError(ErrorKind.IO, f"cannot open {path}: {exc}",
                                 fix="check the path and its permissions") from exc

    def _check(self, buf: np.ndarray, offset: int) -> None:
        if self.buffered:
            return
        if buf.ctypes.data % ALIGN_BYTES or buf.nbytes % ALIGN_BYTES or offset % ALIGN_BYTES:
            raise SlackTierError(ErrorKind.IO, f"unaligned direct I/O on {self.path}: address "
                                 f"{buf.ctypes.data:#x}, {buf.nbytes} bytes at offset {offset}",
                                 fix="use aligned_array buffers and whole-page offsets")

    def pwrite(self, buf: np.ndarray, offset: int) -> None:
        """Write all of contiguous uint8 `buf` at `offset` (aligned), retrying short writes."""
        self._check(buf, offset)
        view = memoryview(buf).cast("B")
        done = 0
        while done < len(view):
            try:
                n = os.pwrite(self.fd, view[done:], offset + done)
            except OSError as exc:
                if exc.errno == errno.EINVAL and not self.buffered:
                    raise SlackTierError(ErrorKind.UNAVAILABLE, f"{self.path} refused an O_DIRECT write",
                                         fix=_ODIRECT_FIX) from exc
                if exc.errno in _FULL:
                    raise os_error(exc, f"writing {len(view) - done} bytes at {offset + done} to "
                                   f"{self.path}") from None
                raise SlackTierError(ErrorKind.IO, f"write of {len(view) - done} bytes at {offset + done} "
                                     f"to {self.path} failed: {exc}", fix="check the target device") from exc
            if n <= 0:
                raise SlackTierError(ErrorKind.IO, f"write to {self.path} at {offset + done} wrote nothing",
                                     fix="check the target's free space")
            done += n

    def pread_into(self, buf: np.ndarray, offset: int) -> None:
        """Fill all of contiguous uint8 `buf` from `offset` (aligned); a short read is an error."""
        self._check(buf, offset)
        view = memoryview(buf).cast("B")
        done = 0
        while done < len(view):
            try:
                n = os.preadv(self.fd, [view[done:]], offset + done)
            except OSError as exc:
                raise SlackTierError(ErrorKind.IO, f"read of {len(view) - done} bytes at {offset + done} "
                                     f"from {self.path} failed: {exc}", fix="check the target device") from exc
            if n <= 0:
                raise SlackTierError(ErrorKind.IO, f"short read from {self.path}: {done} of {len(view)} bytes "
                                     f"at {offset}", fix="the target is shorter than its manifest says; restage it")
            done += n

    def sync(self) -> None:
        """fsync: durable before the manifest says the table is there."""
        try:
            os.fsync(self.fd)
        except OSError as exc:   # a filesystem may report a full disk only here (delayed allocation)
            raise os_error(exc, f"flushing {self.path}") from None

    def close(self) -> None:
        """Close the descriptor (idempotent)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> DirectFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def write_file_atomic(path: str | Path, data: bytes, *, what: str) -> None:
    """Write `data` to `path` through `<path>.tmp` and a rename; on any failure the temp file is removed and a
    SlackTierError raised: CAPACITY when the filesystem is full (ENOSPC, EDQUOT), IO otherwise."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise os_error(exc, f"writing the {what} {path}") from None


def os_error(exc: OSError, doing: str) -> SlackTierError:
    """An OSError met while `doing` something as one line: CAPACITY for a full filesystem (ENOSPC, EDQUOT)."""
    if exc.errno in _FULL:
        return SlackTierError(ErrorKind.CAPACITY, f"{doing}: no space left on the filesystem "
                              f"({exc.strerror})", fix="free space on that filesystem, or stage elsewhere; "
                              "then stage again")
    return SlackTierError(ErrorKind.IO, f"{doing}: {exc.strerror or exc}", fix="check the path and the device")
