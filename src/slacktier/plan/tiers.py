"""Tiers as the planner sees them: a read-time model per page and a host-memory cost.

Read time of a table on a tier (ms from the end of index resolution): the tier's
requests are served in window order (short-window tables submitted first, paper
section 5), so a table waits for its own pages and those of every table submitted
before it on the same tier, and is slowed only by contention from tables
submitted after it:

    T_l = a + b * (P_l + sum_{j before l, same tier} P_j) + c * sum_{j after l, same tier} P_j

(paper: one NVMe disk, T_1 = 0.30 ms + 3.05 us * P_1 + 0.37 us * P_14).

Host memory of a table on a tier: the whole table as 4 KiB pages if the tier
keeps it in host memory (DRAM), plus a directory of `directory_bytes_per_row`
per row (4 B, int32 row -> slot) for tiers that do not, plus the tier's page
buffers (counted once per table that uses it).

A tiers file (TOML) holds one [[tier]] per tier:

    [[tier]]
    name = "disk"            # also the engine's `source`: a tier of slacktier.config.tier_names()
    intercept_ms = 0.30
    page_ms = 0.00305
    contention_page_ms = 0.00037
    holds_table = false
    directory_bytes_per_row = 4
    buffer_bytes = 67108864
"""

from __future__ import annotations

import math
import tomllib
from dataclasses import dataclass
from pathlib import Path

from slacktier.config import DramOptions, tier_names, tier_options_type
from slacktier.errors import ErrorKind, SlackTierError

# The page layout (slacktier.tables.layout), restated so plan/ stays a room of pure
# functions with no dependencies; tests/test_plan_planner.py checks they agree.
PAGE_BYTES = 4096
ROWS_PER_PAGE = 15

# Paper section 4.1, one NVMe disk shared by four ranks, least-squares fit over its
# end-to-end runs (R^2 = 0.997). Quoted for reference; measure your own disk.
PAPER_NVME_INTERCEPT_MS = 0.30
PAPER_NVME_PAGE_MS = 3.05e-3
PAPER_NVME_CONTENTION_PAGE_MS = 0.37e-3
MAX_COEFFICIENT_MS = 1e6   # 1000 s: larger read-time coefficients are typos (and overflow the model to inf)


@dataclass(frozen=True)
class TierSpec:
    """One tier: how long its reads take and what it costs in host memory."""

    name: str                      # engine source: one of slacktier.config.tier_names()
    intercept_ms: float            # a
    page_ms: float                 # b: per page of this table or of one submitted before it
    contention_page_ms: float      # c: per page of a table submitted after it on the same tier
    holds_table: bool              # the table's pages live in host memory (DRAM)
    directory_bytes_per_row: int = 4
    buffer_bytes: int = 0

    def __post_init__(self) -> None:
        if self.name not in tier_names():
            raise SlackTierError(ErrorKind.BAD_INPUT, f"unknown tier {self.name!r}",
                                 fix=f"name a tier one of {', '.join(tier_names())}")
        coefficients = (self.intercept_ms, self.page_ms, self.contention_page_ms)
        if not all(math.isfinite(x) and 0 <= x <= MAX_COEFFICIENT_MS for x in coefficients):
            raise SlackTierError(ErrorKind.BAD_INPUT, f"read-time coefficients {coefficients} of tier {self.name} "
                                 f"are not finite numbers in 0..{MAX_COEFFICIENT_MS:g} ms",
                                 fix="read-time coefficients are finite and >= 0")
        if self.directory_bytes_per_row < 0 or self.buffer_bytes < 0:
            raise SlackTierError(ErrorKind.BAD_INPUT, f"negative host-memory size for tier {self.name}",
                                 fix="sizes are >= 0 bytes")

    def host_bytes(self, rows: int) -> int:
        """Host memory one table of `rows` rows costs on this tier."""
        table = -(-rows // ROWS_PER_PAGE) * PAGE_BYTES if self.holds_table else 0  # whole pages
        directory = 0 if self.holds_table else self.directory_bytes_per_row * rows
        return table + directory + self.buffer_bytes


def _in_host_memory(name: str) -> bool:
    """Default of `holds_table`: the tier keeps whole pages in host memory (the DRAM tier's option type)."""
    return name in tier_names() and tier_options_type(name) is DramOptions


def _checked_tier(t: object, i: int) -> dict:
    """[[tier]] number `i` with every value checked for type, finiteness and range before any conversion:
    booleans are not numbers (intercept_ms = true), "false" is not a boolean, NaN and inf are not times."""
    def bad(key: str, want: str) -> SlackTierError:
        return SlackTierError(ErrorKind.BAD_INPUT, f"tier {i} ({name!r}): {key} = {t.get(key)!r}, want {want}",
                              fix="write finite, non-negative numbers in each [[tier]]")

    if not isinstance(t, dict):
        raise SlackTierError(ErrorKind.BAD_INPUT, f"tier {i} is {t!r}, not a table", fix="write one [[tier]] per tier")
    name = t.get("name")
    if not isinstance(name, str):
        raise bad("name", "a tier name")
    for key in ("intercept_ms", "page_ms", "contention_page_ms"):
        x = t.get(key, 0.0)
        if isinstance(x, bool) or not isinstance(x, (int, float)) or not (math.isfinite(x) and
                                                                          0 <= x <= MAX_COEFFICIENT_MS):
            raise bad(key, f"a finite number of ms in 0..{MAX_COEFFICIENT_MS:g}")
    for key, hi in (("directory_bytes_per_row", 1 << 20), ("buffer_bytes", 1 << 50)):
        x = t.get(key, 0)
        if type(x) is not int or not 0 <= x <= hi:
            raise bad(key, f"a whole number of bytes in 0..{hi}")
    if not isinstance(t.get("holds_table", False), bool):
        raise bad("holds_table", "true or false")
    return t


def tiers_from_dict(doc: dict) -> tuple[TierSpec, ...]:
    """Tiers from a parsed tiers document ({"tier": [{...}, ...]}), each value checked (`_checked_tier`)."""
    try:
        tiers = tuple(TierSpec(name=str(t["name"]), intercept_ms=float(t["intercept_ms"]),
                               page_ms=float(t["page_ms"]),
                               contention_page_ms=float(t.get("contention_page_ms", t["page_ms"])),
                               holds_table=bool(t.get("holds_table", _in_host_memory(str(t["name"])))),
                               directory_bytes_per_row=int(t.get("directory_bytes_per_row", 4)),
                               buffer_bytes=int(t.get("buffer_bytes", 0)))
                      for t in (_checked_tier(t, i) for i, t in enumerate(doc["tier"])))
    except (KeyError, TypeError, ValueError) as exc:
        raise SlackTierError(ErrorKind.BAD_INPUT, f"tiers document is malformed: {exc!r}",
                             fix="write one [[tier]] per tier with name, intercept_ms and page_ms") from exc
    names = [t.name for t in tiers]
    if len(set(names)) != len(names) or not tiers:
        raise SlackTierError(ErrorKind.BAD_INPUT, f"tiers {names}: empty or a name twice",
                             fix="list each tier once")
    return tiers


def load_tiers(path: str | Path) -> tuple[TierSpec, ...]:
    """Read a tiers TOML file."""
    p = Path(path)
    try:
        doc = tomllib.loads(p.read_text())
    except FileNotFoundError as exc:
        raise SlackTierError(ErrorKind.MISSING, f"tiers file {p} not found", fix="pass the right path") from exc
    except tomllib.TOMLDecodeError as exc:
        raise SlackTierError(ErrorKind.BAD_INPUT, f"tiers file {p} is not TOML: {exc}",
                             fix="write one [[tier]] table per tier") from exc
    return tiers_from_dict(doc)
