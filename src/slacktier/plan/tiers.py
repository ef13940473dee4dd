"""Tiers as the planner sees them: one device read-time model each (plan.readmodel) and a host-memory cost.

A tier is one device queue: every table the planner places on it shares that
queue, which admits reads in window order, so a table's read time is

    T_l = a + b * P_l + c * (pages queued ahead of l on the tier) + c_behind * (pages queued behind it)

(plan.readmodel; paper: one NVMe disk, T_1 = 0.30 ms + 3.05 us * P_1 + 0.37 us * P_14).

Host memory of a table on a tier: the whole table as 4 KiB pages if the tier
keeps it in host memory (DRAM), plus the table's cache directory, which
follows the cache slots it owns (cache.rowdir: 16-32 B per slot), plus
`directory_bytes_per_row` per table row for tiers that do not hold the table
(0 by default: an implementation with a per-row directory, as the paper's
int32 row -> slot array, sets 4), plus the tier's page buffers (counted once
per table that uses it).

A tiers file (TOML), as `slacktier probe --read-fit` writes it, holds one [[tier]] per device queue:

    format = "slacktier-tiers/2"

    [[tier]]
    name = "disk"              # also the engine's `source`: a tier of slacktier.config.tier_names()
    intercept_ms = 0.30        # a
    page_ms = 0.00305          # b: ms per page of the table itself
    ahead_page_ms = 0.00305    # c: ms per page queued ahead of it on this tier (earlier-window tables)
    behind_page_ms = 0.00037   # c_behind: ms per page queued behind it (later-window tables)
    holds_table = false        # default: true for the DRAM tier only
    directory_bytes_per_row = 0
    buffer_bytes = 67108864

    [tier.fit]                 # optional, written by the read fit: what the numbers came from
    runs = 30                  # fit runs (every layer of a run one observation)
    r2 = 0.81
    rmse_ms = 4.2
    held_out_runs = 15
    held_out_r2 = 0.78
    held_out_rmse_ms = 4.9
    at_zero = []               # terms least squares put below 0, held at 0
    measured = "YYYY-MM-DD HH:MM UTC, slacktier probe --read-fit ..."   # when, and the command

A file without `format` is the first form (intercept_ms, page_ms, contention_page_ms:
T_l = a + b (P_l + pages ahead) + c (pages behind)), read as (a, b, c_ahead = b,
c_behind = c): the same equation.
"""

from __future__ import annotations

import math
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import tomli_w

from slacktier.config import tier_facts, tier_names
from slacktier.errors import ErrorKind, SlackTierError
from slacktier.plan.constants import DIRECTORY_BYTES_PER_ROW, PAGE_BYTES, ROWS_PER_PAGE
from slacktier.plan.readmodel import DeviceReadModel
from slacktier.errors import read_text

TIERS_FORMAT = "slacktier-tiers/2"
_COMMON_KEYS = {"name", "holds_table", "directory_bytes_per_row", "buffer_bytes"}
_V2_KEYS = _COMMON_KEYS | {"intercept_ms", "page_ms", "ahead_page_ms", "behind_page_ms", "fit"}
_V1_KEYS = _COMMON_KEYS | {"intercept_ms", "page_ms", "contention_page_ms"}
_FIT_KEYS = ("runs", "r2", "rmse_ms", "held_out_runs", "held_out_r2", "held_out_rmse_ms", "at_zero", "measured")

__all__ = ["PAGE_BYTES", "ROWS_PER_PAGE", "TIERS_FORMAT", "ReadFitRecord", "TierSpec", "load_tiers",
           "tiers_from_dict", "tiers_to_dict", "write_tiers"]


@dataclass(frozen=True)
class ReadFitRecord:
    """Where a tier's read model came from: the fit's size and quality, in-sample and held out (NaN: not known)."""

    runs: int
    r2: float
    rmse_ms: float
    held_out_runs: int = 0
    held_out_r2: float = math.nan
    held_out_rmse_ms: float = math.nan
    at_zero: tuple[str, ...] = ()
    measured: str = ""


@dataclass(frozen=True)
class TierSpec:
    """One tier (one device queue): its read-time model and what it costs in host memory."""

    name: str                      # engine source: one of slacktier.config.tier_names()
    read: DeviceReadModel          # T_l = a + b P_l + c A_l + c_behind B_l
    holds_table: bool              # the table's pages live in host memory (DRAM)
    directory_bytes_per_row: int = DIRECTORY_BYTES_PER_ROW
    buffer_bytes: int = 0
    fit: ReadFitRecord | None = None

    def __post_init__(self) -> None:
        if self.name not in tier_names():
            raise SlackTierError(ErrorKind.BAD_INPUT, f"unknown tier {self.name!r}",
                                 fix=f"name a tier one of {', '.join(tier_names())}")
        if self.directory_bytes_per_row < 0 or self.buffer_bytes < 0:
            raise SlackTierError(ErrorKind.BAD_INPUT, f"negative host-memory size for tier {self.name}",
                                 fix="sizes are >= 0 bytes")

    def host_bytes(self, rows: int, cache_slots: int = 0) -> int:
        """Host memory one table of `rows` rows, owning `cache_slots` cache slots, costs on this tier."""
        table = -(-rows // ROWS_PER_PAGE) * PAGE_BYTES if self.holds_table else 0  # whole pages
        per_row = 0 if self.holds_table else self.directory_bytes_per_row * rows
        return table + per_row + directory_bytes(cache_slots) + self.buffer_bytes


def directory_bytes(cache_slots: int) -> int:
    """Host bytes of a table's cache directory when it owns `cache_slots` slots: cache.rowdir's 8 B entries, at
    least two per slot, a power of two of them, at least 16 (the cache room is above this one, so the rule is
    restated here; tests/test_cache_rowdir.py holds the two equal)."""
    need = max(16, 2 * max(int(cache_slots), 0))
    return 8 * (1 << (need - 1).bit_length())


def in_host_memory(name: str) -> bool:
    """Default of `holds_table`: the tier keeps whole pages in host memory (its fact `holds_host_copy`)."""
    return name in tier_names() and tier_facts(name).holds_host_copy


def _bad(msg: str, fix: str) -> SlackTierError:
    return SlackTierError(ErrorKind.BAD_INPUT, f"tiers document: {msg}", fix=fix)


def _number(t: dict, key: str, where: str) -> float:
    if key not in t:
        raise _bad(f"{where} has no {key}", f"give {key} (ms{' per page' if key != 'intercept_ms' else ''}); "
                   "`slacktier probe --read-fit MANIFEST` writes all four read-time terms")
    v = t[key]
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise _bad(f"{where}: {key} = {v!r} is not a number", f"write {key} as a number of ms")
    return float(v)


def _fit_record(doc, where: str) -> ReadFitRecord:
    if not isinstance(doc, dict) or set(doc) - set(_FIT_KEYS) or not {"runs", "r2", "rmse_ms"} <= set(doc):
        raise _bad(f"{where}.fit must hold runs, r2, rmse_ms (and optionally {', '.join(_FIT_KEYS[3:])})",
                   "keep the [tier.fit] table as `slacktier probe --read-fit` wrote it, or delete it")
    try:
        return ReadFitRecord(int(doc["runs"]), float(doc["r2"]), float(doc["rmse_ms"]),
                             int(doc.get("held_out_runs", 0)), float(doc.get("held_out_r2", math.nan)),
                             float(doc.get("held_out_rmse_ms", math.nan)), tuple(str(x) for x in doc.get("at_zero", ())),
                             str(doc.get("measured", "")))
    except (TypeError, ValueError) as exc:
        raise _bad(f"{where}.fit: {exc}", "numbers for runs, r2, rmse_ms") from None


def _tier(t, version: int, i: int) -> TierSpec:
    if not isinstance(t, dict) or "name" not in t:
        raise _bad(f"tier[{i}] has no name", "write one [[tier]] per tier with its name")
    if not isinstance(t["name"], str):
        raise _bad(f"tier[{i}]: name = {t['name']!r}, want a tier name", f"name one of {', '.join(tier_names())}")
    name = t["name"]
    where = f"tier {name!r}"
    allowed = _V2_KEYS if version == 2 else _V1_KEYS
    unknown = sorted(set(t) - allowed)
    if unknown:
        if version == 1 and set(unknown) & {"ahead_page_ms", "behind_page_ms", "fit"}:
            fix = f'these are keys of the second form: put format = "{TIERS_FORMAT}" at the top of the file'
        elif version == 2 and "contention_page_ms" in unknown:
            fix = ("in this form, contention_page_ms is behind_page_ms, and ahead_page_ms (c) is its own term; "
                   "refit with `slacktier probe --read-fit MANIFEST`")
        else:
            fix = f"use only {', '.join(sorted(allowed))}"
        raise _bad(f"{where}: unknown key(s) {unknown}", fix)
    a, b = _number(t, "intercept_ms", where), _number(t, "page_ms", where)
    if version == 2:
        c, c_behind = _number(t, "ahead_page_ms", where), _number(t, "behind_page_ms", where)
    else:   # T = a + b (P_l + ahead) + c behind: c_ahead = b, c_behind = c (default b, as the first form read it)
        c, c_behind = b, _number(t, "contention_page_ms", where) if "contention_page_ms" in t else b
    try:
        read = DeviceReadModel(a, b, c, c_behind)
    except SlackTierError as exc:
        raise SlackTierError(exc.kind, f"{where}: {exc.message}", fix=exc.fix) from None
    holds = t.get("holds_table", in_host_memory(name))
    if not isinstance(holds, bool):
        raise _bad(f"{where}: holds_table = {holds!r}, want true or false", "write holds_table = true or false")
    for key in ("directory_bytes_per_row", "buffer_bytes"):
        v = t.get(key, 0)
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise _bad(f"{where}: {key} = {v!r}, want a whole number of bytes >= 0", f"write {key} as an integer")
    try:
        return TierSpec(name=name, read=read, holds_table=holds,
                        directory_bytes_per_row=int(t.get("directory_bytes_per_row", DIRECTORY_BYTES_PER_ROW)),
                        buffer_bytes=int(t.get("buffer_bytes", 0)),
                        fit=_fit_record(t["fit"], where) if "fit" in t else None)
    except (TypeError, ValueError) as exc:
        raise _bad(f"{where}: {exc}", "directory_bytes_per_row and buffer_bytes are integers") from None


def tiers_from_dict(doc: dict) -> tuple[TierSpec, ...]:
    """Tiers from a parsed tiers document ({"format": ..., "tier": [{...}, ...]}); see the module docstring."""
    if not isinstance(doc, dict):
        raise _bad("not a table", "write one [[tier]] per tier")
    fmt = doc.get("format")
    if fmt not in (None, TIERS_FORMAT):
        raise _bad(f"format {fmt!r}", f'use format = "{TIERS_FORMAT}", or refit with `slacktier probe --read-fit`')
    extra = sorted(set(doc) - {"format", "tier"})
    if extra:
        raise _bad(f"unknown top-level key(s) {extra}", "a tiers file holds `format` and [[tier]] tables only")
    raw = doc.get("tier")
    if not isinstance(raw, list) or not raw:
        raise _bad("no [[tier]]", "write one [[tier]] per tier with name and its read-time terms")
    tiers = tuple(_tier(t, 2 if fmt else 1, i) for i, t in enumerate(raw))
    names = [t.name for t in tiers]
    if len(set(names)) != len(names):
        raise _bad(f"tiers {names}: a name twice", "list each tier once")
    return tiers


def tiers_to_dict(tiers: Sequence[TierSpec]) -> dict:
    """The tiers document (second form) of `tiers`; `tiers_from_dict` reads it back to the same tiers."""
    out = []
    for t in tiers:
        r = t.read
        d: dict = {"name": t.name, "intercept_ms": r.intercept_ms, "page_ms": r.page_ms,
                   "ahead_page_ms": r.ahead_page_ms, "behind_page_ms": r.behind_page_ms,
                   "holds_table": t.holds_table, "directory_bytes_per_row": t.directory_bytes_per_row,
                   "buffer_bytes": t.buffer_bytes}
        if t.fit is not None:
            f = t.fit
            d["fit"] = {"runs": f.runs, "r2": f.r2, "rmse_ms": f.rmse_ms, "held_out_runs": f.held_out_runs,
                        "held_out_r2": f.held_out_r2, "held_out_rmse_ms": f.held_out_rmse_ms,
                        "at_zero": list(f.at_zero), "measured": f.measured}
        out.append(d)
    return {"format": TIERS_FORMAT, "tier": out}


def write_tiers(tiers: Sequence[TierSpec], path: str | Path, comment: str = "") -> Path:
    """Write a tiers file (second form) with `comment` lines at its top; returns the path."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    head = "".join(f"# {line}\n" for line in comment.splitlines())
    p.write_text(head + tomli_w.dumps(tiers_to_dict(tiers)))
    return p


def load_tiers(path: str | Path) -> tuple[TierSpec, ...]:
    """Read a tiers TOML file (either form)."""
    p = Path(path)
    text = read_text(p, "tiers file", "TOML", "write one [[tier]] table per tier (slacktier probe --read-fit "
                                              "writes one)")
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise SlackTierError(ErrorKind.BAD_INPUT, f"tiers file {p} is not TOML: {exc}",
                             fix="write one [[tier]] table per tier") from None
    try:
        return tiers_from_dict(doc)
    except SlackTierError as exc:
        raise SlackTierError(exc.kind, f"{p}: {exc.message}", fix=exc.fix) from None
