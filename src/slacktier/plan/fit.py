"""Fits for the exposure model: the read-time model, kappa, and predictions on held-out runs.

Read time (paper section 4.1): T_l = a + sum_j b_lj * P_j, where P_j counts the
4 KiB pages layer j reads in a step. It is fitted by ordinary least squares over
runs (numpy lstsq). The paper's fit for layer 1 on one NVMe disk is
T_1 ~ 0.30 ms + 3.05 us * P_1 + 0.37 us * P_14 (R^2 = 0.997).

kappa is the fixed per-step cost: with windows known, measured slowdown =
sum_l d_l + kappa, so its least-squares value is the mean residual.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from slacktier.errors import ErrorKind, SlackTierError
from slacktier.plan.exposure import LayerRead, exposure


@dataclass(frozen=True)
class FitQuality:
    """How well predictions match measurements: R^2 (nan when measurements do not vary) and RMSE."""

    r2: float
    rmse_ms: float
    runs: int


def fit_quality(predicted_ms: Sequence[float], measured_ms: Sequence[float]) -> FitQuality:
    """R^2 = 1 - SS_res / SS_tot and RMSE of `predicted_ms` against `measured_ms`."""
    p = np.asarray(predicted_ms, dtype=np.float64)
    m = np.asarray(measured_ms, dtype=np.float64)
    if p.shape != m.shape or p.ndim != 1 or p.size == 0:
        raise SlackTierError(ErrorKind.BAD_INPUT, f"prediction shape {p.shape} vs measurement shape {m.shape}",
                             fix="pass one prediction per measured run")
    resid = m - p
    ss_res = float(resid @ resid)
    centered = m - m.mean()
    ss_tot = float(centered @ centered)
    r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 else math.nan
    return FitQuality(r2=r2, rmse_ms=math.sqrt(ss_res / m.size), runs=int(m.size))


@dataclass(frozen=True)
class ReadTimeModel:
    """T = intercept + sum_j per_page_ms[j] * P[layers[j]]: read time of one layer from pages per step."""

    intercept_ms: float             # a
    layers: tuple[int, ...]         # whose page counts enter, in this order
    per_page_ms: tuple[float, ...]  # b_lj, one per entry of `layers`

    def __post_init__(self) -> None:
        if len(self.layers) != len(self.per_page_ms):
            raise SlackTierError(ErrorKind.BAD_INPUT,
                                 f"{len(self.layers)} layers but {len(self.per_page_ms)} coefficients",
                                 fix="give one per-page coefficient per layer")

    def predict_ms(self, pages: dict[int, float]) -> float:
        """Read time for page counts per layer (layers missing from `pages` read nothing)."""
        return self.intercept_ms + sum(b * pages.get(l, 0.0) for l, b in zip(self.layers, self.per_page_ms))


@dataclass(frozen=True)
class ReadTimeFit:
    """A fitted read-time model and its in-sample quality."""

    model: ReadTimeModel
    quality: FitQuality


def fit_read_time(layers: Sequence[int], pages: np.ndarray, read_ms: Sequence[float]) -> ReadTimeFit:
    """Least-squares fit of T = a + sum_j b_j P_j.

    pages: [runs, len(layers)] pages per step of each layer in each run;
    read_ms: [runs] the measured read time being modelled.
    """
    P = np.asarray(pages, dtype=np.float64)  # [runs, n_layers]
    y = np.asarray(read_ms, dtype=np.float64)  # [runs]
    if P.ndim != 2 or P.shape[1] != len(layers) or P.shape[0] != y.shape[0]:
        raise SlackTierError(ErrorKind.BAD_INPUT,
                             f"pages shape {P.shape} does not match {len(layers)} layers and {y.shape[0]} runs",
                             fix="pass pages as [runs, layers] and one read time per run")
    if P.shape[0] < P.shape[1] + 1:
        raise SlackTierError(ErrorKind.BAD_INPUT,
                             f"{P.shape[0]} runs cannot determine {P.shape[1] + 1} coefficients",
                             fix="measure more runs with different page counts")
    X = np.hstack([np.ones((P.shape[0], 1)), P])  # [runs, 1 + n_layers]
    coef, _, rank, _ = np.linalg.lstsq(X, y, rcond=None)
    if rank < X.shape[1]:
        raise SlackTierError(ErrorKind.BAD_INPUT,
                             "page counts are collinear across runs, so the coefficients are not identifiable",
                             fix="vary each layer's pages independently (different cache sizes or splits)")
    model = ReadTimeModel(intercept_ms=float(coef[0]), layers=tuple(int(l) for l in layers),
                          per_page_ms=tuple(float(c) for c in coef[1:]))
    return ReadTimeFit(model=model, quality=fit_quality(X @ coef, y))


@dataclass(frozen=True)
class Run:
    """One measured run: per-layer windows and mean read times, and the measured mean slowdown."""

    reads: tuple[LayerRead, ...]
    slowdown_ms: float
    resolve_ms: float = 0.0


@dataclass(frozen=True)
class KappaFit:
    """kappa fitted on a set of runs, with the model's in-sample quality."""

    kappa_ms: float
    quality: FitQuality
    coupled: bool


def fit_kappa(runs: Sequence[Run], *, coupled: bool = True) -> KappaFit:
    """Least-squares kappa: the mean of measured slowdown minus predicted stalls."""
    if not runs:
        raise SlackTierError(ErrorKind.BAD_INPUT, "no runs to fit kappa on", fix="pass at least one run")
    stalls = np.array([exposure(r.reads, resolve_ms=r.resolve_ms, coupled=coupled).slowdown_ms for r in runs])
    measured = np.array([r.slowdown_ms for r in runs])
    kappa = float(np.mean(measured - stalls))
    return KappaFit(kappa_ms=kappa, quality=fit_quality(stalls + kappa, measured), coupled=coupled)


@dataclass(frozen=True)
class Prediction:
    """Predicted slowdowns of runs, and how they compare with the measured ones."""

    predicted_ms: tuple[float, ...]
    measured_ms: tuple[float, ...]
    quality: FitQuality


def predict_runs(runs: Sequence[Run], *, kappa_ms: float, coupled: bool = True) -> Prediction:
    """Predict each run's slowdown from its windows and read times, and score against the measurement."""
    if not runs:
        raise SlackTierError(ErrorKind.BAD_INPUT, "no runs to predict", fix="pass at least one held-out run")
    pred = tuple(exposure(r.reads, resolve_ms=r.resolve_ms, kappa_ms=kappa_ms, coupled=coupled).slowdown_ms
                 for r in runs)
    meas = tuple(float(r.slowdown_ms) for r in runs)
    return Prediction(predicted_ms=pred, measured_ms=meas, quality=fit_quality(pred, meas))
