"""Issue 34: a full filesystem anywhere in staging is one `[capacity]` line, and no temporary file stays behind.

The filesystems are real: small tmpfs mounts (root only; skipped elsewhere), filled by a real file. The
staging run meets ENOSPC where a full disk gives it: the target's header page (a sparse target passes the
free-space check, as its size is already there), the space reservation, the checksum file (the disk fills
up while the rows are written), the manifest.
"""

from __future__ import annotations

import errno
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from slacktier.errors import ErrorKind, SlackTierError
from slacktier.tables.page_writer import stage_table
from slacktier.tables.stage import staged_layout
from slacktier.tables.synthetic_source import SyntheticSource


@pytest.fixture()
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A 2 MiB tmpfs at tmp_path/fs, unmounted after the test."""
    where = tmp_path / "fs"
    where.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(where)], capture_output=True, text=True)
    if res.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {res.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def fill(fs: Path, leave_bytes: int = 0) -> None:
    """Write fs/hog until the filesystem is full (less `leave_bytes`, given back by truncating)."""
    fd = os.open(fs / "hog", os.O_CREAT | os.O_WRONLY)
    try:
        while True:
            os.write(fd, b"\xab" * 65536)
    except OSError as exc:
        assert exc.errno == errno.ENOSPC
    try:
        while True:   # the last partial chunk
            os.write(fd, b"\xab" * 4096)
    except OSError as exc:
        assert exc.errno == errno.ENOSPC
    if leave_bytes:
        os.ftruncate(fd, os.fstat(fd).st_size - leave_bytes)
    os.close(fd)


class FillsTheDisk(SyntheticSource):
    """A synthetic source that, while its first rows are written, lets another file take the rest of a disk."""

    def __init__(self, layout, seed: int, disk: Path) -> None:
        super().__init__(layout, seed)
        self.disk = disk

    def fill_pages(self, layer, row_start, rows, pages, crcs=None) -> None:
        if not (self.disk / "hog").exists():
            fill(self.disk)
        super().fill_pages(layer, row_start, rows, pages, crcs)


def _leftovers(*dirs: Path) -> list[str]:
    return sorted(p.name for d in dirs for p in d.iterdir() if p.name.endswith(".tmp"))


def _assert_capacity(exc: SlackTierError, doing: str) -> None:
    assert exc.kind is ErrorKind.CAPACITY, exc
    assert exc.message.startswith(doing) and exc.message.endswith("no space left on the filesystem (No space left "
                                                                    "on device)"), exc.message
    assert "\n" not in str(exc) and "[Errno" not in str(exc)


def test_the_disk_filling_up_before_the_checksum_file_is_written(tmp_path, small_fs) -> None:
    source = FillsTheDisk(staged_layout({1: 3000}), 1, small_fs)
    manifest = small_fs / "t.manifest.json"
    with pytest.raises(SlackTierError) as exc:
        stage_table(source, [tmp_path / "t.bin"], 1, manifest_path=manifest, progress=False)
    _assert_capacity(exc.value, f"writing the checksum file {small_fs / 't.manifest.crc'}: ")
    assert sorted(p.name for p in small_fs.iterdir()) == ["hog"]   # no .crc.tmp, no checksum file, no manifest


def test_a_manifest_saved_onto_a_full_disk(tmp_path, small_fs) -> None:
    m = stage_table(SyntheticSource(staged_layout({1: 300}), 1), [tmp_path / "t.bin"], 1, progress=False)
    fill(small_fs)
    with pytest.raises(SlackTierError) as exc:
        m.save(small_fs / "m.manifest.json")
    _assert_capacity(exc.value, f"writing the manifest {small_fs / 'm.manifest.json'}: ")
    assert sorted(p.name for p in small_fs.iterdir()) == ["hog"]


def test_a_sparse_target_on_a_full_disk(tmp_path, small_fs) -> None:
    """The header page is the first write: ENOSPC there, from the library and from the command line."""
    target = small_fs / "t.bin"
    with open(target, "wb") as f:
        f.truncate(8 << 20)   # sparse: its size is there, its blocks are not
    fill(small_fs)
    with pytest.raises(SlackTierError) as exc:
        stage_table(SyntheticSource(staged_layout({1: 3000}), 1), [target], 1, progress=False,
                    manifest_path=tmp_path / "m.json")
    _assert_capacity(exc.value, f"writing 4096 bytes at 0 to {target}: ")
    res = subprocess.run([sys.executable, "-m", "slacktier.cli", "stage", "--synthetic", "1=3000", "--target",
                          str(target), "--manifest", str(tmp_path / "cli.json"), "--no-progress"],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 2 and res.stdout == ""
    # the small filesystem is RAM-backed, which staging says in a WARNING line of its own; the error is one line
    lines = [line for line in res.stderr.splitlines() if "is in host memory" not in line]
    assert len(lines) == 1 and "Traceback" not in res.stderr
    assert lines[0].startswith(f"slacktier stage: error: [capacity] writing 4096 bytes at 0 to {target}: no space")
    assert _leftovers(tmp_path, small_fs) == [] and not (tmp_path / "m.json").exists()
    assert not (tmp_path / "cli.json").exists()


def test_no_room_to_reserve_the_regions(tmp_path, small_fs) -> None:
    target = small_fs / "t.bin"
    with open(target, "wb") as f:
        f.truncate(4 << 20)   # sparse, and larger than the table (3.7 MiB): the free-space check passes
    with pytest.raises(SlackTierError) as exc:
        stage_table(SyntheticSource(staged_layout({1: 14_000}), 1), [target], 1, progress=False,
                    manifest_path=tmp_path / "m.json")
    _assert_capacity(exc.value, "reserving ")
    assert f"bytes for {target}: " in exc.value.message
    assert _leftovers(tmp_path, small_fs) == [] and not (tmp_path / "m.json").exists()
