"""Input files read as bytes and decoded strictly: a file that is not text is refused in one line naming it.

Every verb's input files (profiles, device models, tiers files, curves) come from a user's path, where a
binary file (a checkpoint, a .npy, a tarball) is one typo away. `read_text` reads the bytes, refuses
anything that is not UTF-8 text (or that holds a NUL byte, which no JSON or TOML text has) with a
SlackTierError naming the file, what it was meant to be, and the byte where it stops being text, so no
verb ends in a UnicodeDecodeError traceback.
"""

from __future__ import annotations

from pathlib import Path

from slacktier.errors import ErrorKind, SlackTierError


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
