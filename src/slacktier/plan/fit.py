"""Fits for the exposure model: the device read-time model, kappa, and predictions on held-out runs.

Read time (paper section 4.1, plan.readmodel): T_l = a + b P_l + c A_l + c_behind B_l
per device, with P_l the 4 KiB pages layer l reads in a step and A_l / B_l the
pages queued ahead of / behind it on its device. It is fitted by least squares
(non-negative) over measured runs, every layer of a run one observation, and
scored on held-out runs. The paper's fit for layer 1 on one NVMe disk is
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
from slacktier.plan.readmodel import TERMS, DeviceReadModel


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


#: fewest runs a read-time fit accepts: 4 coefficients, and enough left over for its R^2 to mean something
MIN_FIT_RUNS = 6


@dataclass(frozen=True)
class DeviceReadFit:
    """A device's fitted read-time model, its in-sample quality and its prediction of held-out runs."""

    model: DeviceReadModel
    quality: FitQuality            # in-sample over every layer's read of the fit runs (its `runs`: reads)
    held_out: FitQuality | None    # the model predicting the reads of the runs after the fit runs (None: none left)
    at_zero: tuple[str, ...]       # terms least squares put below 0, held at 0 (the fit is non-negative)
    fit_runs: int
    layers_per_run: int


def device_design(pages: np.ndarray) -> np.ndarray:
    """Design rows (1, P_l, A_l, B_l) of every layer of every run: pages [runs, L] of L layers on one device,
    columns in submission order -> [runs * L, 4], run-major.

    Worked example: one run with P = (100, 300) gives rows (1, 100, 0, 300) for the first layer (300 pages
    queued behind it) and (1, 300, 100, 0) for the second (100 queued ahead).
    """
    P = np.asarray(pages, dtype=np.float64)              # [runs, L]
    ahead = np.cumsum(P, axis=1) - P                      # pages of the layers submitted before
    behind = P.sum(axis=1, keepdims=True) - P - ahead     # pages of the layers submitted after
    ones = np.ones_like(P)
    return np.stack([ones, P, ahead, behind], axis=2).reshape(-1, 4)   # [runs * L, 4]


def _check_runs(name: str, a: np.ndarray) -> None:
    bad = ~np.isfinite(a) | (a < 0)
    if bad.any():
        run = int(np.argwhere(bad)[0][0])
        raise SlackTierError(ErrorKind.BAD_INPUT, f"{name} of run {run} is {a[run].tolist()}: not finite and >= 0",
                             fix=f"pass measured {name} (finite, >= 0) for every layer of every run; drop failed runs")


def _nonnegative_lstsq(X: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, tuple[int, ...]]:
    """min |X w - y| over w >= 0, exactly: least squares on every subset of free columns, the best feasible one
    (4 columns: 16 subsets). Returns w and the columns held at 0."""
    n = X.shape[1]
    best, best_ss, best_zero = None, math.inf, ()
    for mask in range(1, 1 << n):
        free = [j for j in range(n) if mask >> j & 1]
        w_free, *_ = np.linalg.lstsq(X[:, free], y, rcond=None)
        if (w_free < 0).any():
            continue
        w = np.zeros(n)
        w[free] = w_free
        r = X @ w - y
        ss = float(r @ r)
        if ss < best_ss - 1e-12 * max(1.0, ss):
            best, best_ss, best_zero = w, ss, tuple(j for j in range(n) if j not in free)
    assert best is not None   # the intercept alone is feasible: its least-squares value is mean(y) >= 0
    return best, best_zero


def fit_device_read_model(pages: np.ndarray, read_ms: np.ndarray, *, fit_runs: int | None = None) -> DeviceReadFit:
    """Least-squares fit of T_l = a + b P_l + c A_l + c_behind B_l (plan.readmodel) on one device.

    pages, read_ms: [runs, L], L >= 2 layers sharing the device, columns in submission order (window order): run r
    read pages[r, j] pages for layer j, which landed read_ms[r, j] ms after submission began. The first `fit_runs`
    runs (default two thirds) are fitted, the rest predicted and scored (held out). Coefficients are >= 0 (a term
    least squares puts below 0 is held at 0 and named in `at_zero`). Refuses non-finite or negative inputs, fewer
    than MIN_FIT_RUNS fit runs, and a design in which the terms cannot be told apart.
    """
    P = np.asarray(pages, dtype=np.float64)      # [runs, L]
    T = np.asarray(read_ms, dtype=np.float64)    # [runs, L]
    if P.ndim != 2 or P.shape != T.shape:
        raise SlackTierError(ErrorKind.BAD_INPUT, f"pages shape {P.shape} vs read_ms shape {T.shape}",
                             fix="pass pages and read_ms as [runs, layers], layers in submission order")
    if P.shape[1] < 2:
        raise SlackTierError(ErrorKind.BAD_INPUT, f"{P.shape[1]} layer per run: c and c_behind need two",
                             fix="measure two or more layers on the device per run (`slacktier probe --read-fit` "
                                 "reads two)")
    _check_runs("pages", P)
    _check_runs("read_ms", T)
    n_fit = (2 * P.shape[0]) // 3 if fit_runs is None else int(fit_runs)
    if not MIN_FIT_RUNS <= n_fit <= P.shape[0]:
        raise SlackTierError(ErrorKind.BAD_INPUT, f"runs: {n_fit} fit runs of {P.shape[0]} measured",
                             fix=f"measure at least {MIN_FIT_RUNS} fit runs (and some held out: "
                                 f"{(3 * MIN_FIT_RUNS + 1) // 2} runs or more in all)")
    X = device_design(P[:n_fit])                 # [n_fit * L, 4]
    y = T[:n_fit].reshape(-1)
    rank = np.linalg.matrix_rank(X)
    if rank < X.shape[1]:
        # a term whose column lies in the span of the others cannot be told apart from them
        tied = [TERMS[j] for j in range(X.shape[1]) if np.linalg.matrix_rank(np.delete(X, j, axis=1)) == rank]
        raise SlackTierError(ErrorKind.BAD_INPUT,
                             f"the fit runs cannot tell {', '.join(tied)} apart: those page counts are collinear "
                             "across the runs (e.g. both layers read the same pages every run)",
                             fix="draw each layer's page count independently in every run, with both layers "
                                 "reading on the same device")
    w, zero = _nonnegative_lstsq(X, y)
    model = DeviceReadModel(*(float(v) for v in w))
    held = None
    if n_fit < P.shape[0]:
        Xh = device_design(P[n_fit:])
        held = fit_quality(Xh @ w, T[n_fit:].reshape(-1))
    return DeviceReadFit(model, fit_quality(X @ w, y), held, tuple(TERMS[j] for j in zero), n_fit, int(P.shape[1]))


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
