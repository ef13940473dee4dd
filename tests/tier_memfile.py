"""A test-only tier in one file: pages read with plain buffered os.preadv, registered from the tests folder.

It proves that adding a tier takes one file and no change to the package:
the class implements only the queued base's batch read (and the identity
check every registered tier has, here the file tiers' shared one), its
options are one typed struct, and the last line registers both, which also makes
`[table.memfile]` parse in control files. Importing this module is all a
test (or a plug-in) does.

Worked example: page 7 of a region at offset 1 MiB -> os.preadv at byte
1048576 + 7 * 4096 into the pool's buffer.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np

from slacktier.config import Options
from slacktier.errors import ErrorKind, SlackTierError
from slacktier.store._common import check_file_targets
from slacktier.store.queued import Part, QueuedSource, Worker, typed_options
from slacktier.store.registry import register_tier
from slacktier.tables.layout import PAGE_BYTES
from slacktier.tables.manifest import TableIdentity
from slacktier.tables.regions import Region


class MemfileOptions(Options, frozen=True):
    """`[table.memfile]`: whether to tell the kernel the reads are random (no readahead)."""

    advise_random: bool = True


class MemfileSource(QueuedSource[None]):
    """Buffered page reads through the page cache: one worker, one os.preadv per page."""

    read_what = "memfile read"
    engine_name = "preadv"
    #: the page cache has no end-to-end checksum: reads are checked against the manifest by default
    verify_by_default = True

    def __init__(self, regions: Sequence[Region], options: MemfileOptions | None = None, *,
                 page_crc32c: Sequence[np.ndarray] | None = None, identity: TableIdentity | None = None) -> None:
        super().__init__(regions, page_crc32c=page_crc32c)
        self.options = typed_options(options, MemfileOptions)
        if identity is not None:
            self.verify_identity(self.regions, self.options, identity)
        self._fds: dict[str, int] = {}
        try:
            for r in self.regions:
                if r.path not in self._fds:
                    self._fds[r.path] = os.open(r.path, os.O_RDONLY | os.O_CLOEXEC)
                    if self.options.advise_random:
                        os.posix_fadvise(self._fds[r.path], 0, 0, os.POSIX_FADV_RANDOM)
        except FileNotFoundError as exc:
            self._close_files()
            raise SlackTierError(ErrorKind.MISSING, f"region file {exc.filename} does not exist",
                                 fix="stage the table first") from exc
        self._region_fd = [self._fds[r.path] for r in self.regions]
        self._start_workers(1)

    @classmethod
    def verify_identity(cls, regions: Sequence[Region], options: MemfileOptions | None,
                        identity: TableIdentity) -> None:
        """Each region file's header page carries `identity`, complete."""
        typed_options(options, MemfileOptions)
        check_file_targets(regions, identity)

    def _read(self, worker: Worker[None], part: Part) -> SlackTierError | None:
        res = np.empty(part.region.shape[0], dtype=np.int32)  # bytes read, or -errno
        pages = part.pool.pages
        for i, (r, p, b) in enumerate(zip(part.region.tolist(), part.page.tolist(), part.buffer.tolist(),
                                          strict=True)):
            try:
                res[i] = os.preadv(self._region_fd[r], [pages[b]], self.regions[r].offset_bytes + p * PAGE_BYTES)
            except OSError as exc:
                res[i] = -(exc.errno or 5)
        return self._results_error(res, part)

    def close(self) -> None:
        """Finish queued batches, stop the worker, close the files; later calls raise CLOSED."""
        super().close()
        self._close_files()

    def _close_files(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


register_tier("memfile", MemfileSource, MemfileOptions)
