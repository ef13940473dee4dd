"""Miss-page curves P_l(c): pages per step layer l reads behind a cache of c rows.

They come from the access characterization (slacktier characterize), as JSON:

    {"workload": "agent", "batch": 128,
     "layers": {"1":  {"capacity_rows": [0, 250000, ...], "pages_per_step": [5000.0, 1900.0, ...]},
                "14": {...}}}

Between measured points the curve is linear; below the first and above the last
point it is held flat (a cache larger than any measured one is not assumed to
help further).

A curve may say what its pages were counted with: `policy`, `admission` (a rule
in front of CLOCK, "none" by default), one rank of a TP partition (`ranks`,
`rank`, `partition`; a whole table is one rank), and `packing` (contexts packed
per layer, the extra disk and index bytes per rank they take; null: none).
A curve counted with packing or admission predicts fewer pages; `describe()`
says which curve the plan used.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from slacktier.errors import ErrorKind, SlackTierError

MAX_CAPACITY_ROWS = 2.0**62      # a cache capacity in rows
MAX_PAGES_PER_STEP = 1e12        # far above any step's reads; larger ones overflow the model


@dataclass(frozen=True)
class MissCurve:
    """Pages per step read by one layer as a function of its cache rows (piecewise linear)."""

    capacity_rows: tuple[float, ...]    # strictly increasing
    pages_per_step: tuple[float, ...]   # same length, >= 0

    def __post_init__(self) -> None:
        caps, pages = self.capacity_rows, self.pages_per_step
        if len(caps) == 0 or len(caps) != len(pages):
            raise SlackTierError(ErrorKind.BAD_INPUT,
                                 f"{len(caps)} capacities but {len(pages)} page counts",
                                 fix="give one pages_per_step value per capacity_rows value (at least one)")
        if any(b <= a for a, b in zip(caps, caps[1:])) or caps[0] < 0:
            raise SlackTierError(ErrorKind.BAD_INPUT, f"capacities {caps} are not strictly increasing from >= 0",
                                 fix="sort the curve's points by capacity and drop duplicates")
        if not all(math.isfinite(x) for x in (*caps, *pages)):
            raise SlackTierError(ErrorKind.BAD_INPUT, "a miss curve holds NaN or an infinite value",
                                 fix="capacities and page counts are finite numbers")
        if any(p < 0 for p in pages):
            raise SlackTierError(ErrorKind.BAD_INPUT, "negative pages per step in a miss curve",
                                 fix="page counts are >= 0")

    def pages_at(self, rows: float | np.ndarray) -> np.ndarray | float:
        """Pages per step behind `rows` cache rows, linearly interpolated, flat outside the points."""
        out = np.interp(rows, self.capacity_rows, self.pages_per_step)
        return float(out) if np.ndim(out) == 0 else out

    def is_convex(self, tol: float = 1e-12) -> bool:
        """Whether the piecewise-linear curve is convex (slopes never decrease, flat tail included)."""
        caps = np.asarray(self.capacity_rows, dtype=np.float64)
        pages = np.asarray(self.pages_per_step, dtype=np.float64)
        if caps.size < 2:
            return True
        slopes = np.append(np.diff(pages) / np.diff(caps), 0.0)  # the flat tail beyond the last point
        return bool(np.all(np.diff(slopes) >= -tol * max(1.0, float(np.abs(slopes).max()))))


@dataclass(frozen=True)
class MissCurves:
    """The miss-page curves of one workload at one batch size, by layer."""

    workload: str
    batch: int
    by_layer: dict[int, MissCurve]
    policy: str = ""
    admission: str = "none"
    ranks: int = 1
    rank: int | None = None
    partition: str = ""
    packing: dict | None = None     # contexts, extra_disk_bytes_per_rank, index_bytes_per_rank, pack_list

    def describe(self) -> str:
        """One line: whose traffic, which cache policy and admission, which rank, and the packing counted."""
        who = f"{self.workload or 'unnamed'} traffic, B={self.batch}, {self.policy or 'policy unstated'}"
        if self.admission != "none":
            who += f", admission {self.admission}"
        who += f", rank {self.rank} of TP{self.ranks} ({self.partition})" if self.rank is not None else \
            ", one rank holding the whole table"
        if not self.packing:
            return who + ", no context packing"
        pk = self.packing
        contexts = ", ".join(f"L{k} {v:,}" for k, v in sorted(pk.get("contexts", {}).items(), key=lambda x: int(x[0])))
        return (who + f", context packing: {contexts} contexts, {pk.get('extra_disk_bytes_per_rank', 0) / 1e9:.3f} GB "
                f"extra disk and {pk.get('index_bytes_per_rank', 0) / 2**20:.1f} MiB index memory per rank "
                f"(list {pk.get('pack_list')})")

    def curve(self, layer: int) -> MissCurve:
        """The curve of `layer`."""
        if layer not in self.by_layer:
            raise SlackTierError(ErrorKind.MISSING, f"no miss curve for layer {layer}",
                                 fix=f"characterize layer {layer} too (have {sorted(self.by_layer)})", layer=layer)
        return self.by_layer[layer]


def _points(values: object, key: str, hi: float) -> tuple[float, ...]:
    """A curve's list `key` as floats, each a finite JSON number in 0..hi (no booleans, strings, NaN, inf)."""
    if not isinstance(values, list):
        raise TypeError(f"{key} is not a list")
    for x in values:
        if isinstance(x, bool) or not isinstance(x, (int, float)) or not (math.isfinite(x) and 0 <= x <= hi):
            raise SlackTierError(ErrorKind.BAD_INPUT, f"miss curve {key} holds {x!r}, want a finite number in "
                                 f"0..{hi:g}", fix="pass the JSON the characterization wrote")
    return tuple(float(x) for x in values)


def miss_curves_from_dict(doc: dict) -> MissCurves:
    """Parse the characterization JSON document into curves, every point checked (`_points`)."""
    fix = '{"workload":..,"batch":..,"layers":{"1":{"capacity_rows":[..],"pages_per_step":[..]}}}'
    if not isinstance(doc, dict) or not isinstance(doc.get("layers"), dict):
        what = type(doc.get("layers")).__name__ if isinstance(doc, dict) else f"the document is a {type(doc).__name__}"
        raise SlackTierError(ErrorKind.BAD_INPUT, f"miss-curve document is malformed: `layers` is {what}, want an "
                             "object of layer id -> curve", fix=f"write {fix}")
    try:
        layers = {int(k): MissCurve(_points(v["capacity_rows"], f"layers.{k}.capacity_rows", MAX_CAPACITY_ROWS),
                                    _points(v["pages_per_step"], f"layers.{k}.pages_per_step", MAX_PAGES_PER_STEP))
                  for k, v in doc["layers"].items()}
        batch = doc.get("batch", 0)
        if type(batch) is not int or batch < 0:
            raise SlackTierError(ErrorKind.BAD_INPUT, f"miss curves' batch is {batch!r}, want a whole number",
                                 fix="pass the JSON the characterization wrote")
        packing = doc.get("packing")
        if packing is not None and not isinstance(packing, dict):
            raise SlackTierError(ErrorKind.BAD_INPUT, f"miss curves' packing is {packing!r}, want an object or null",
                                 fix="pass the JSON the characterization wrote")
        rank = doc.get("rank")
        return MissCurves(workload=str(doc.get("workload", "")), batch=batch, by_layer=layers,
                          policy=str(doc.get("policy", "")), admission=str(doc.get("admission", "none")),
                          ranks=int(doc.get("ranks", 1)), rank=None if rank is None else int(rank),
                          partition=str(doc.get("partition", "")), packing=packing)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise SlackTierError(ErrorKind.BAD_INPUT, f"miss-curve document is malformed: {exc!r}",
                             fix=f"write {fix}") from exc


def load_miss_curves(path: str | Path) -> MissCurves:
    """Read a characterization JSON file of miss-page curves."""
    p = Path(path)
    try:
        doc = json.loads(p.read_text())
    except FileNotFoundError as exc:
        raise SlackTierError(ErrorKind.MISSING, f"miss-curve file {p} not found",
                             fix="run `slacktier characterize` first or pass the right path") from exc
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise SlackTierError(ErrorKind.BAD_INPUT, f"miss-curve file {p} is not JSON: {exc}",
                             fix="pass the JSON the characterization wrote") from None
    except OSError as exc:
        raise SlackTierError(ErrorKind.IO, f"cannot read miss-curve file {p}: {exc.strerror}",
                             fix="check the path and its permissions") from None
    return miss_curves_from_dict(doc)
