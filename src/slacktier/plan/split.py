"""The cache split: shares f_l of a C-row cache minimizing sum_l b_l * P_l(f_l * C).

b_l is what one more page of layer l costs the binding read time (ms per page);
P_l is layer l's miss-page curve. Paper section 4.2: with b_1 / b_14 ~ 8 the best
split gives layer 1 most, but not all, of the budget.

Search: the shares are first restricted to multiples of 1/grid. With up to three
layers every such split is enumerated (exact on the grid for any curves); with
more, units of C/grid are handed out one at a time to the layer whose cost falls
most, which is exact on the grid when every curve is convex (separable convex
resource allocation). Then a pairwise-exchange search moves units of
C/(grid*refine) between layers while the cost falls; for convex curves it stops
at the optimum of the finer grid. Ties go to the layer listed first (the
shortest window).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from slacktier.errors import ErrorKind, SlackTierError
from slacktier.plan.curves import MissCurve

EXHAUSTIVE_MAX_LAYERS = 3


@dataclass(frozen=True)
class CacheSplit:
    """Shares of the cache per layer and what they cost."""

    layers: tuple[int, ...]
    shares: tuple[float, ...]          # f_l, summing to 1
    cache_rows: int                    # C
    pages_per_step: tuple[float, ...]  # P_l(f_l * C)
    cost_ms: float                     # sum_l b_l * P_l(f_l * C)

    def rows_of(self, layer: int) -> float:
        """Cache rows given to `layer` (f_l * C)."""
        return self.shares[self.layers.index(layer)] * self.cache_rows


def split_cost_ms(curves: Sequence[MissCurve], weights_ms_per_page: Sequence[float],
                  shares: Sequence[float], cache_rows: int) -> float:
    """sum_l b_l * P_l(f_l * C) for given shares."""
    return float(sum(w * c.pages_at(f * cache_rows) for c, w, f in zip(curves, weights_ms_per_page, shares)))


def _unit_costs(curves: Sequence[MissCurve], weights: Sequence[float], cache_rows: int, units: int) -> np.ndarray:
    """costs[l, k] = b_l * P_l(k * C / units), k = 0..units."""
    rows = np.arange(units + 1, dtype=np.float64) * (cache_rows / units)  # [units + 1]
    return np.stack([w * np.asarray(c.pages_at(rows)) for c, w in zip(curves, weights)])  # [n, units + 1]


def _exhaustive(costs: np.ndarray, units: int) -> tuple[int, ...]:
    """Best composition of `units` over the layers by enumeration (ties: more to the first layer)."""
    n = costs.shape[0]
    if n == 1:
        return (units,)
    if n == 2:
        k0 = np.arange(units, -1, -1)  # descending so argmin's first hit gives layer 0 the most
        total = costs[0, k0] + costs[1, units - k0]
        i = int(np.argmin(total))
        return (int(k0[i]), int(units - k0[i]))
    best, best_cost = None, np.inf
    for k0 in range(units, -1, -1):
        sub = _exhaustive(costs[1:], units - k0)
        c = costs[0, k0] + sum(costs[1 + j, k] for j, k in enumerate(sub))
        if c < best_cost:
            best, best_cost = (k0, *sub), c
    return best  # type: ignore[return-value]


def _greedy(costs: np.ndarray, units: int) -> tuple[int, ...]:
    """Hand out units one at a time to the largest cost decrease (exact for convex curves)."""
    n = costs.shape[0]
    k = [0] * n
    for _ in range(units):
        gains = [costs[l, k[l]] - costs[l, k[l] + 1] for l in range(n)]
        k[int(np.argmax(gains))] += 1
    return tuple(k)


def best_split(layers: Sequence[int], curves: Sequence[MissCurve], weights_ms_per_page: Sequence[float],
               cache_rows: int, *, grid: int = 200, refine: int = 20) -> CacheSplit:
    """The split of `cache_rows` over `layers` minimizing sum_l b_l * P_l(f_l * C) (see module docstring)."""
    n = len(layers)
    if n == 0 or len(curves) != n or len(weights_ms_per_page) != n:
        raise SlackTierError(ErrorKind.BAD_INPUT,
                             f"{n} layers, {len(curves)} curves, {len(weights_ms_per_page)} weights",
                             fix="give one miss curve and one per-page weight per layer")
    if cache_rows < 0 or grid < 1 or refine < 1:
        raise SlackTierError(ErrorKind.BAD_INPUT, f"cache_rows={cache_rows}, grid={grid}, refine={refine}",
                             fix="cache_rows >= 0, grid >= 1, refine >= 1")
    if any(w < 0 for w in weights_ms_per_page):
        raise SlackTierError(ErrorKind.BAD_INPUT, f"negative per-page weight in {weights_ms_per_page}",
                             fix="per-page read costs are >= 0")
    if cache_rows == 0:
        shares = tuple(1.0 / n for _ in range(n))  # nothing to split; an even split keeps the file valid
    else:
        costs = _unit_costs(curves, weights_ms_per_page, cache_rows, grid)
        k = _exhaustive(costs, grid) if n <= EXHAUSTIVE_MAX_LAYERS else _greedy(costs, grid)
        fine_units = grid * refine
        kf = [ki * refine for ki in k]

        def cost_of(kk: Sequence[int]) -> float:
            return split_cost_ms(curves, weights_ms_per_page, [x / fine_units for x in kk], cache_rows)

        if refine > 1 and n > 1:
            current = cost_of(kf)
            improved = True
            while improved:
                improved = False
                for i, j in itertools.permutations(range(n), 2):
                    if kf[i] == 0:
                        continue
                    trial = list(kf)
                    trial[i] -= 1
                    trial[j] += 1
                    c = cost_of(trial)
                    if c < current - 1e-12 * max(1.0, abs(current)):
                        kf, current, improved = trial, c, True
        shares = tuple(x / fine_units for x in kf)
    pages = tuple(float(c.pages_at(f * cache_rows)) for c, f in zip(curves, shares))
    return CacheSplit(layers=tuple(int(l) for l in layers), shares=shares, cache_rows=int(cache_rows),
                      pages_per_step=pages,
                      cost_ms=split_cost_ms(curves, weights_ms_per_page, shares, cache_rows))
