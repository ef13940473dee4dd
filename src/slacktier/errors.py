"""One error family for the whole package: a kind, and a message that says how to fix it."""

from __future__ import annotations

import enum
from pathlib import Path


class ErrorKind(enum.Enum):
    """What went wrong, coarse enough to branch on."""

    BAD_INPUT = "bad_input"          # arguments, config or data of the wrong shape
    BAD_TOKENIZER = "bad_tokenizer"  # a tokenizer that does not give the expected layout
    TARGET = "target"                # a staging target that is too small or holds another table
    CHECKPOINT = "checkpoint"        # a checkpoint tensor missing, or of a wrong dtype or shape
    IO = "io"                        # a failed, short or unaligned read or write
    CHECKSUM = "checksum"            # a page whose checksum does not match its manifest
    MISSING = "missing"              # a region, file, layer or artifact that is not there
    CLOSED = "closed"                # work asked of something already closed
    CAPACITY = "capacity"            # a cache or buffer pool too small for one step
    CERTIFICATE = "certificate"      # a RedKnot artifact certificate that does not match
    UNAVAILABLE = "unavailable"      # a server or kernel facility that is not there
    TIMEOUT = "timeout"              # a read not done within its wait limit (it may still land later)
    UNSUPPORTED = "unsupported"      # a serving engine's version or setting outside an adapter's checked scope


class SlackTierError(Exception):
    """The one exception type SlackTier raises on purpose.

    `kind` says what went wrong; `fix` says what to do about it. Location fields
    (layer, rank, page) are filled where a table's bytes are involved so an
    operator can find the bad page.
    """

    def __init__(
        self,
        kind: ErrorKind,
        message: str,
        *,
        fix: str = "",
        layer: int | None = None,
        rank: int | None = None,
        page: int | None = None,
    ) -> None:
        self.kind = kind
        self.message = message
        self.fix = fix
        self.layer = layer
        self.rank = rank
        self.page = page
        where = ", ".join(
            f"{name} {value}"
            for name, value in (("layer", layer), ("rank", rank), ("page", page))
            if value is not None
        )
        text = f"[{kind.value}] {message}"
        if where:
            text += f" ({where})"
        if fix:
            text += f". Fix: {fix}"
        super().__init__(text)


def optional_import(module: str, extra: str, what: str):
    """`module` imported, or a MISSING error naming the extra that installs it (`pip install slacktier[extra]`).

    The core install holds what serving needs; plotting, traffic datasets and the window probe's model formats
    are extras (pyproject.toml). Worked example: optional_import("matplotlib", "workloads", "characterize's PNG
    plots") without matplotlib -> "[missing] characterize's PNG plots: matplotlib is not installed (the core
    install leaves it out). Fix: pip install 'slacktier[workloads]'".
    """
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as exc:
        package = (exc.name or module).split(".")[0]
        raise SlackTierError(ErrorKind.MISSING, f"{what}: {package} is not installed (the core install leaves it "
                             "out)", fix=f"pip install 'slacktier[{extra}]'") from None


def read_text(path: str | Path, what: str, fmt: str, fix: str) -> str:
    """The text of `path`, `what` (e.g. "device model") in format `fmt` ("TOML"); MISSING when it is not a
    file, IO when it cannot be read, BAD_INPUT (`fix`) when it is not UTF-8 text.

    Worked example: a file of bytes b"\\x93NUMPY..." -> [bad_input] device model m.toml is not TOML text: a
    binary file (byte 0 is not UTF-8)."""
    p = Path(path)
    try:
        data = p.read_bytes()
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        raise SlackTierError(ErrorKind.MISSING, f"{what} {p} is not a file", fix=fix) from None
    except OSError as exc:
        raise SlackTierError(ErrorKind.IO, f"cannot read {what} {p}: {exc.strerror}",
                             fix="check the path and its permissions") from None
    nul = data.find(b"\0")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        at = exc.start if nul < 0 else min(nul, exc.start)
        raise SlackTierError(ErrorKind.BAD_INPUT, f"{what} {p} is not {fmt} text: a binary file (byte {at} is "
                             "not UTF-8)", fix=fix) from None
    if nul >= 0:
        raise SlackTierError(ErrorKind.BAD_INPUT, f"{what} {p} is not {fmt} text: a binary file (a NUL byte at "
                             f"byte {nul})", fix=fix)
    return text
