"""Argument types shared by the verbs: numbers checked for finiteness and range while argparse parses.

Each type refuses with a SlackTierError (BAD_INPUT) naming the flag, which `cli.main` prints as one line
with exit code 2 before the verb runs, so nothing is written. argparse's own type errors would print a
usage block instead. Worked example: `--target-ms nan` -> "[bad_input] --target-ms 'nan' is not a finite
number in 0..1000000".
"""

from __future__ import annotations

import logging
import math
import re
from typing import Callable

from slacktier.errors import ErrorKind, SlackTierError

log = logging.getLogger(__name__)

MAX_MS = 1e6   # 1000 s: no step-time figure (window, target, coefficient) is anywhere near it


def whole(flag: str, lo: int = 0, hi: int = 2**62) -> Callable[[str], int]:
    """An argparse type: a whole number in lo..hi ('1.5', 'nan', '1e400', 'x' refused naming `flag`)."""
    def parse(text: str) -> int:
        try:
            value = int(text.strip())
        except ValueError:
            value = None
        if value is None or not lo <= value <= hi:
            raise SlackTierError(ErrorKind.BAD_INPUT, f"{flag} {text!r} is not a whole number in {lo}..{hi}",
                                 fix=f"pass {flag} as a whole number from {lo} to {hi}")
        return value
    return parse


def finite(flag: str, lo: float = 0.0, hi: float = MAX_MS) -> Callable[[str], float]:
    """An argparse type: a finite number in lo..hi ('nan', 'inf', '1e400', 'x' refused naming `flag`)."""
    def parse(text: str) -> float:
        return finite_number(text, flag, lo, hi)
    return parse


def finite_number(text: str, what: str, lo: float = 0.0, hi: float = MAX_MS) -> float:
    """`text` as a finite float in lo..hi, or BAD_INPUT naming `what` (used for LAYER=MS items too)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and lo <= value <= hi):
        raise SlackTierError(ErrorKind.BAD_INPUT, f"{what} {text!r} is not a finite number in {lo:g}..{hi:g}",
                             fix=f"pass {what} as a number from {lo:g} to {hi:g}")
    return value


_WARNED: set[str] = set()


def layer_item(item: str, flag: str, form: str) -> tuple[int, str]:
    """One item of a layer map, LAYER=VALUE: '1=runs/t.json' -> (1, 'runs/t.json').

    `=` is every verb's one separator between a layer and its value (`--window 1=0.27`, `whatif --table
    1=nvme-paper`). The older `LAYER:VALUE` of `plan --table` and `stage --synthetic` is still read, with a
    warning naming the new form (worked example: `--table 1:runs/t.json` -> (1, 'runs/t.json') and "write
    1=runs/t.json"). Anything else is BAD_INPUT naming `flag` and `form`.
    """
    layer, sep, value = item.partition("=")
    if not sep:
        old_layer, old_sep, old_value = item.partition(":")
        if old_sep and re.fullmatch(r"\s*-?\d+\s*", old_layer):
            if flag not in _WARNED:   # once per flag: a list of items is one mistake
                _WARNED.add(flag)
                log.warning("%s %s: ':' between a layer and its value is deprecated; write %s=%s", flag, item,
                            old_layer.strip(), old_value)
            layer, value = old_layer, old_value
    if not re.fullmatch(r"\s*-?\d+\s*", layer):   # a negative layer is the caller's to refuse, by name
        raise SlackTierError(ErrorKind.BAD_INPUT, f"{flag} {item!r} is not {form}", fix=f"write {flag} {form}")
    return int(layer), value
