"""The probe's run-time configuration: which layer to hold back, and until when.

A small file, JSON or TOML by its suffix, that the probe re-reads whenever it
changes, so one process sweeps every (layer, delay) pair without touching the
model:

    probe.json:  {"layer": 5, "delay_ms": 3.0}      ("layer": null = no target)
    probe.toml:  layer = 5
                 delay_ms = 3.0                     (layer = -1 or absent = no target)

`layer` is the index of the decoder layer in its ModuleList (0-based, as in
`model.model.layers[5]`). Writers replace the file atomically (write a temporary
file, stamp it with the current time in ns, then rename), and the watcher keys on
(mtime_ns, size, inode), so two writes within one kernel timestamp tick are
still told apart.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path

from slacktier.errors import ErrorKind, SlackTierError


@dataclass(frozen=True)
class ProbeTarget:
    """Hold layer `layer` until `delay_ms` after step start; layer None = hold nothing."""

    layer: int | None = None
    delay_ms: float = 0.0

    def __post_init__(self) -> None:
        if self.delay_ms < 0 or (self.layer is not None and self.layer < 0):
            raise SlackTierError(ErrorKind.BAD_INPUT, f"probe target layer {self.layer}, delay {self.delay_ms} ms",
                                 fix="use a layer index >= 0 (or none) and a delay >= 0 ms")


NO_TARGET = ProbeTarget()


def _parse(path: Path, text: str) -> ProbeTarget:
    try:
        if path.suffix == ".toml":
            doc = tomllib.loads(text)
        elif path.suffix == ".json":
            doc = json.loads(text)
        else:
            raise SlackTierError(ErrorKind.BAD_INPUT, f"probe config {path} is neither .json nor .toml",
                                 fix="name the file probe.json or probe.toml")
    except (json.JSONDecodeError, tomllib.TOMLDecodeError) as exc:
        raise SlackTierError(ErrorKind.BAD_INPUT, f"probe config {path} does not parse: {exc}",
                             fix='write {"layer": 5, "delay_ms": 3.0} (JSON) or layer = 5 / delay_ms = 3.0 '
                                 '(TOML)') from exc
    layer = doc.get("layer")
    if layer is not None and int(layer) < 0:
        layer = None
    return ProbeTarget(layer=None if layer is None else int(layer), delay_ms=float(doc.get("delay_ms", 0.0)))


def read_probe_config(path: str | Path) -> ProbeTarget:
    """Read a probe config file."""
    p = Path(path)
    try:
        text = p.read_bytes().decode("utf-8")
    except UnicodeDecodeError:
        raise SlackTierError(ErrorKind.BAD_INPUT, f"probe config {p} is not UTF-8 text",
                             fix='write {"layer": 5, "delay_ms": 3.0} (JSON) or layer = 5 / delay_ms = 3.0 '
                                 '(TOML)') from None
    except FileNotFoundError as exc:
        raise SlackTierError(ErrorKind.MISSING, f"probe config {p} not found",
                             fix="write the file before attaching the probe, or pass no config path") from exc
    return _parse(p, text)


def write_probe_config(path: str | Path, target: ProbeTarget) -> None:
    """Replace the probe config file atomically with `target`."""
    p = Path(path)
    if p.suffix == ".toml":
        text = f"layer = {-1 if target.layer is None else target.layer}\ndelay_ms = {target.delay_ms!r}\n"
    elif p.suffix == ".json":
        text = json.dumps({"layer": target.layer, "delay_ms": target.delay_ms})
    else:
        raise SlackTierError(ErrorKind.BAD_INPUT, f"probe config {p} is neither .json nor .toml",
                             fix="name the file probe.json or probe.toml")
    fd, tmp = tempfile.mkstemp(dir=p.parent, prefix=p.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        now_ns = time.time_ns()  # explicit ns stamp: coarse kernel ticks could repeat an mtime
        os.utime(tmp, ns=(now_ns, now_ns))
        os.replace(tmp, p)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


class ConfigWatcher:
    """Re-reads a probe config file when it changes (one stat per poll)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._key: tuple[int, int, int] | None = None
        self._target = NO_TARGET
        self.reloads = 0

    def poll(self) -> ProbeTarget:
        """The current target, re-read if the file changed since the last poll."""
        try:
            st = os.stat(self.path)
        except FileNotFoundError as exc:
            raise SlackTierError(ErrorKind.MISSING, f"probe config {self.path} disappeared",
                                 fix="keep the config file in place while the probe is attached") from exc
        key = (st.st_mtime_ns, st.st_size, st.st_ino)
        if key != self._key:
            self._target = read_probe_config(self.path)
            self._key = key
            self.reloads += 1
        return self._target
