"""Real-component helpers for tests and benchmarks: synthetic staged tables and a private redis-server.

Not a fake of anything: tables are staged by the real staging code, and
`RedisServer` runs the real `redis-server` binary on a free local port.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from slacktier.errors import ErrorKind, SlackTierError
from slacktier.tables.codec import synthetic_rows
from slacktier.tables.layout import pack_rows_into_pages
from slacktier.tables.manifest import Manifest
from slacktier.tables.regions import Region
from slacktier.tables.stage import layer_seed
from slacktier.tables.stage import stage_synthetic as stage_table_synthetic


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
    """A staged synthetic table: runtime regions in manifest order, each region's expected pages [P, 4096] uint8."""

    specs: list[Region]
    pages: list[np.ndarray]
    manifest: Manifest


def stage_synthetic(directory: Path, *, layers: tuple[int, ...] = (1,), ranks: int = 2, rows: int = 300,
                    devices: int = 1, seed: int = 7, overwrite: bool = False) -> StagedRegions:
    """Stage layers x ranks regions of `rows` rows each with the real staging into files dev<d>.bin of `directory`.

    A thin wrapper over `slacktier.tables.stage.stage_synthetic` (header page,
    manifest, CRC file): rank r goes to device r % devices; `overwrite` restages
    over targets that hold another table. Writes are O_DIRECT
    where `directory` takes it, else buffered (tmpfs), which only the Redis tests
    need. The expected pages come from the scalar reference path
    (`codec.synthetic_rows` + `layout.pack_rows_into_pages`), not from the files.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    targets = [directory / f"dev{d}.bin" for d in range(devices)]
    manifest = stage_table_synthetic(targets, {layer: rows * ranks for layer in layers}, ranks, seed,
                                     overwrite=overwrite, buffered=not supports_o_direct(directory), progress=False)
    pages = [pack_rows_into_pages(synthetic_rows(int(layer_seed(seed, r.layer)), r.row_start, r.rows))
             for r in manifest.regions]
    return StagedRegions(manifest.runtime_regions(), pages, manifest)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """A private `redis-server` on 127.0.0.1 with persistence off; `stop()` ends it, `pause()` / `resume()`
    freeze and thaw it (SIGSTOP / SIGCONT: connections stay open and nothing answers, as with a hung host).

    With `password`, the server requires it for the default user; the url carries no secret (pass it with
    `RedisOptions.password_env` or `password_file`).
    """

    def __init__(self, directory: Path, *, start_timeout_s: float = 10.0, password: str | None = None) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise SlackTierError(ErrorKind.UNAVAILABLE, "redis-server not found",
                                 fix="apt-get install -y redis-server (scripts/test.sh does)")
        self.port = _free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self._proc = subprocess.Popen(
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(directory), *(["--requirepass", password] if password else [])],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + start_timeout_s
        while True:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as conn:
                    conn.sendall(b"PING\r\n")
                    if conn.recv(16).startswith((b"+PONG", b"-NOAUTH")):  # up (asking for its password)
                        return
            except OSError:
                pass
            if self._proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise SlackTierError(ErrorKind.UNAVAILABLE, f"redis-server did not start on port {self.port}",
                                     fix="run redis-server by hand to see why")
            time.sleep(0.05)

    def pause(self) -> None:
        """Freeze the server (SIGSTOP): it accepts connections in the kernel but answers nothing."""
        self._proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        """Thaw a paused server (SIGCONT)."""
        self._proc.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        """End the server (idempotent; a paused one too)."""
        if self._proc.poll() is None:
            self._proc.send_signal(signal.SIGCONT)
            self._proc.terminate()
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
