"""Per-rank cache sizing: one total cache split over tensor-parallel ranks by their miss curves.

A TP step waits for its slowest rank, so the split that matters minimizes the
largest rank's pages per step, not their sum. Each rank is its own process with
its own control file, so its `cache_rows` may differ from the others' (both
plug-ins allow it: the cache is per process). Given each rank's miss curve
P_k(c) (pages per step of its layers behind c cache rows, piecewise linear,
`plan.curves.MissCurve`), `rank_cache_rows` finds the smallest page level T at
which the ranks' cheapest capacities reaching T fit the total, by bisection on
T, then hands what is left, unit by unit, to the rank whose pages fall most.

Worked example: two ranks, curves 100 -> 0 pages over 0..100 rows (rank 0) and
100 -> 50 over 0..100 (rank 1), 100 rows in all, unit 10 -> (40, 60) rows, pages
(60, 70): the slowest reads 70, against 75 for the even split (50, 50).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from slacktier.errors import ErrorKind, SlackTierError
from slacktier.plan.curves import MissCurve


@dataclass(frozen=True)
class RankSplit:
    """Cache rows per rank, and each rank's pages per step behind them (from its curve)."""

    cache_rows: tuple[int, ...]
    pages: tuple[float, ...]

    @property
    def slowest_pages(self) -> float:
        """The largest rank's pages per step: what the TP step waits for."""
        return max(self.pages)


def _rows_for(curve: MissCurve, target: float, units: np.ndarray) -> int:
    """The fewest rows (a multiple of the unit, from `units`) at which `curve` reads at most `target` pages."""
    pages = curve.pages_at(units)
    ok = np.flatnonzero(pages <= target + 1e-9)
    return int(units[ok[0]]) if ok.size else -1


def rank_cache_rows(curves: Sequence[MissCurve], total_rows: int, unit_rows: int = 1000) -> RankSplit:
    """Split `total_rows` cache rows over the ranks whose miss curves are `curves`, minimizing the largest rank's
    pages per step (ties: the leftover rows go where pages fall most). Rows come in multiples of `unit_rows`."""
    if not curves:
        raise SlackTierError(ErrorKind.BAD_INPUT, "no rank curves", fix="give one miss curve per rank")
    if total_rows < 0 or unit_rows <= 0:
        raise SlackTierError(ErrorKind.BAD_INPUT, f"total {total_rows} rows in units of {unit_rows}",
                             fix="pass a total >= 0 and a unit > 0")
    n_units = total_rows // unit_rows
    units = np.arange(n_units + 1, dtype=np.float64) * unit_rows
    lo = max(c.pages_at(float(units[-1])) for c in curves)    # no rank can go below its own curve at everything
    hi = max(c.pages_at(0.0) for c in curves)
    for _ in range(60):
        mid = (lo + hi) / 2
        need = [_rows_for(c, mid, units) for c in curves]
        if all(n >= 0 for n in need) and sum(need) <= total_rows:
            hi = mid
        else:
            lo = mid
    rows = [_rows_for(c, hi, units) for c in curves]
    left = (total_rows - sum(rows)) // unit_rows
    for _ in range(left):   # the rest where one more unit saves the most pages
        gain = [c.pages_at(float(r)) - c.pages_at(float(r + unit_rows)) for c, r in zip(curves, rows)]
        k = int(np.argmax(gain))
        if gain[k] <= 0:
            k = int(np.argmax([c.pages_at(float(r)) for c, r in zip(curves, rows)]))
        rows[k] += unit_rows
    return RankSplit(tuple(rows), tuple(float(c.pages_at(float(r))) for c, r in zip(curves, rows)))
