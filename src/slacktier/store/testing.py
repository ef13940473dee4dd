"""Real-component helpers for tests and benchmarks: synthetic staged regions and a private redis-server.

Not a fake of anything: regions are written as real page files, and
`RedisServer` runs the real `redis-server` binary on a free local port.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from slacktier.errors import ErrorKind, SlackTierError
from slacktier.store.base import RegionSpec
from slacktier.tables.codec import synthetic_rows
from slacktier.tables.layout import PAGE_BYTES, pack_rows_into_pages


def supports_o_direct(directory: Path) -> bool:
    """Whether files in `directory` can be opened with O_DIRECT (tmpfs cannot)."""
    probe = Path(directory) / ".odirect-probe"
    try:
        fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
    except OSError:
        return False
    os.close(fd)
    probe.unlink()
    return True


@dataclass(frozen=True)
class StagedRegions:
    """Synthetic regions written to files: specs in order, and each region's pages [P, 4096] uint8."""

    specs: list[RegionSpec]
    pages: list[np.ndarray]


def stage_synthetic(directory: Path, *, layers: tuple[int, ...] = (1,), ranks: int = 2, rows: int = 300,
                    devices: int = 1, seed: int = 7, lead_pages: int = 1) -> StagedRegions:
    """Write layers x ranks regions of `rows` synthetic rows; device d's regions share file dev<d>.bin.

    Ranks map to devices round-robin (rank r -> device r % devices). Each region
    starts `lead_pages` pages after the previous one ends, so offsets are nonzero.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    ends = [0] * devices
    specs, all_pages = [], []
    for layer in layers:
        for rank in range(ranks):
            device = rank % devices
            row_start = (layer * ranks + rank) * rows
            pages = pack_rows_into_pages(synthetic_rows(seed + layer, row_start, rows))
            path = directory / f"dev{device}.bin"
            offset = ends[device] + lead_pages * PAGE_BYTES
            fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
            try:
                os.pwrite(fd, pages.tobytes(), offset)
            finally:
                os.close(fd)
            ends[device] = offset + pages.nbytes
            specs.append(RegionSpec(layer=layer, rank=rank, path=str(path), offset_bytes=offset,
                                    pages=pages.shape[0], device=device))
            all_pages.append(pages)
    return StagedRegions(specs, all_pages)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """A private `redis-server` on 127.0.0.1 with persistence off; `stop()` ends it."""

    def __init__(self, directory: Path, *, start_timeout_s: float = 10.0) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise SlackTierError(ErrorKind.UNAVAILABLE, "redis-server not found",
                                 fix="apt-get install -y redis-server (scripts/test.sh does)")
        self.port = _free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self._proc = subprocess.Popen(
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(directory)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + start_timeout_s
        while True:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as conn:
                    conn.sendall(b"PING\r\n")
                    if conn.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                pass
            if self._proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise SlackTierError(ErrorKind.UNAVAILABLE, f"redis-server did not start on port {self.port}",
                                     fix="run redis-server by hand to see why")
            time.sleep(0.05)

    def stop(self) -> None:
        """End the server (idempotent)."""
        if self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
