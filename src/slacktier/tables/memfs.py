"""Whether a staging target sits in host memory: a file on tmpfs or ramfs, or a RAM disk (zram, brd).

Such a target takes O_DIRECT writes and reads like a disk (tmpfs does since Linux 6.6), but every byte of it is
host memory: a table staged to /dev/shm and served by the disk tier holds as much DRAM as the DRAM tier would.
Staging warns when it writes one, and `slacktier inspect` and `slacktier plan` count its bytes as host memory.

The filesystem is found from the path's device number in /proc/self/mountinfo (bind mounts and symlinks
resolve to the filesystem that holds the bytes); a block device, or a filesystem on one, is a RAM disk when
/sys/dev/block names it zram<N> or ram<N>.
"""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path

#: filesystems whose files live in host memory (pages of the page cache or the hugetlb pool, nothing behind them)
RAM_FILESYSTEMS = frozenset({"tmpfs", "ramfs", "hugetlbfs", "devtmpfs"})
_RAM_DISK = re.compile(r"^(zram|ram)\d+$")


def _existing(path: str | Path) -> str:
    """`path`, or its nearest existing parent (a target not created yet is created in that folder)."""
    p = os.path.abspath(path)
    while not os.path.exists(p) and os.path.dirname(p) != p:
        p = os.path.dirname(p)
    return p


def _block_name(dev: int) -> str | None:
    """The kernel's name of block device `dev` ("zram0", "vda1"), or None."""
    link = f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}"
    return os.path.basename(os.path.realpath(link)) if os.path.exists(link) else None


def _mount_of(dev: int) -> tuple[str, str, str] | None:
    """(filesystem type, mount point, source) of the mount whose device is `dev`, from /proc/self/mountinfo."""
    want = f"{os.major(dev)}:{os.minor(dev)}"
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        fields = line.split()
        if len(fields) < 10 or fields[2] != want or "-" not in fields[6:]:
            continue
        dash = fields.index("-", 6)
        point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[4])
        return fields[dash + 1], point, fields[dash + 2]
    return None


def ram_backed(path: str | Path) -> str | None:
    """What holds `path` in host memory, in words ("tmpfs at /dev/shm", "RAM disk zram0"), or None.

    A path not created yet is judged by the folder it would be created in. Worked example: "/dev/shm/t.bin"
    on a tmpfs mounted at /dev/shm -> "tmpfs at /dev/shm"; "/var/tables/t.bin" on an ext4 on vda1 -> None.
    """
    try:
        st = os.stat(_existing(path))
    except OSError:
        return None
    if stat.S_ISBLK(st.st_mode):
        name = _block_name(st.st_rdev)
        return f"RAM disk {name}" if name and _RAM_DISK.match(name) else None
    mount = _mount_of(st.st_dev)
    if mount is not None and mount[0] in RAM_FILESYSTEMS:
        return f"{mount[0]} at {mount[1]}"
    name = _block_name(st.st_dev) if os.major(st.st_dev) else None
    if name and _RAM_DISK.match(name):
        return f"{mount[0] if mount else 'a filesystem'} on RAM disk {name}"
    return None
