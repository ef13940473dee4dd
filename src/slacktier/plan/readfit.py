"""A tier's device read-time model fitted to its measured reads of two layers (what `probe --read-fit` writes).

The reads come from store.measure: per run, P_first pages of the first layer and
P_second of the second, submitted in that order to the tier's page sources as
the engine opens them, each layer timed from the first submit to its last
completion. The model (plan.readmodel) is fitted by least squares on the first
two thirds of the runs and scored on the rest (plan.fit.fit_device_read_model):

    T_first  = a + b P_first  + c_behind P_second
    T_second = a + b P_second + c P_first

A device serves its tables from one deadline-ordered queue, so the second
layer's reads wait behind the first's: c is what each page queued ahead costs
the second layer, and c_behind what the pages queued behind still cost the
first (the device's contention alone).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from slacktier.errors import ErrorKind, SlackTierError
from slacktier.plan.fit import MIN_FIT_RUNS, DeviceReadFit, device_design, fit_device_read_model
from slacktier.plan.tiers import ReadFitRecord, TierSpec, in_host_memory

#: fewest runs a read fit takes: MIN_FIT_RUNS to fit, half as many held out
MIN_READ_FIT_RUNS = (3 * MIN_FIT_RUNS + 1) // 2
#: a fit whose held-out R^2 is below this explains too little of the reads it did not see to plan with unwarned:
#: the share of read-time variance the model predicts on runs it was not fitted on
TRUSTED_HELD_OUT_R2 = 0.8


class MeasuredReads(Protocol):
    """One tier's measured runs (store.measure.ReadRuns): per run each layer's pages and read time."""

    tier: str
    layers: tuple[int, ...]   # submission order
    pages: np.ndarray         # [runs, layers]
    read_ms: np.ndarray       # [runs, layers]

    def csv(self) -> str: ...


@dataclass(frozen=True)
class TierReadFit:
    """A tier's read fit: the planner's TierSpec (its device read model), the fit's quality, and the runs."""

    spec: TierSpec
    fit: DeviceReadFit
    runs: MeasuredReads


def fit_read_runs(runs: MeasuredReads, *, holds_table: bool | None = None, measured: str = "") -> TierReadFit:
    """The device read model of `runs`' tier (module docstring); `measured` says when and how, for the tiers file.

    Worked example: runs whose reads took T_first = 0.3 + 0.02 P_first + 0.01 P_second and T_second = 0.3 +
    0.02 P_second + 0.015 P_first ms give DeviceReadModel(0.3, 0.02, 0.015, 0.01).
    """
    n = len(runs.pages)
    if n < MIN_READ_FIT_RUNS:
        raise SlackTierError(ErrorKind.BAD_INPUT, f"runs: {n} read-fit runs",
                             fix=f"use at least {MIN_READ_FIT_RUNS} runs ({MIN_FIT_RUNS} to fit, the rest held out)")
    fit = fit_device_read_model(runs.pages, runs.read_ms)
    held = fit.held_out
    record = ReadFitRecord(fit.fit_runs, fit.quality.r2, fit.quality.rmse_ms, n - fit.fit_runs,
                           held.r2 if held else float("nan"), held.rmse_ms if held else float("nan"),
                           fit.at_zero, measured)
    spec = TierSpec(runs.tier, fit.model, holds_table=in_host_memory(runs.tier) if holds_table is None
                    else holds_table, fit=record)
    return TierReadFit(spec, fit, runs)


def describe_fit(f: TierReadFit) -> str:
    """One paragraph a person reads (lines of at most 120 characters): the fitted terms, b/c, and the fit's quality
    in-sample and held out."""
    import textwrap

    m, q, h = f.spec.read, f.fit.quality, f.fit.held_out
    first, second = f.runs.layers[:2]
    held = "none held out" if h is None else f"held-out {h.runs} reads: R^2 {h.r2:.3f}, RMSE {h.rmse_ms:.3f} ms"
    zero = f"; held at 0: {', '.join(f.fit.at_zero)}" if f.fit.at_zero else ""
    return textwrap.fill(f"{f.spec.name}: T_l = {m.intercept_ms:.3f} ms + {m.page_ms * 1e3:.2f} us * P_l + "
            f"{m.ahead_page_ms * 1e3:.2f} us * P_ahead + {m.behind_page_ms * 1e3:.2f} us * P_behind "
            f"(b = {m.page_ms * 1e3:.2f}, c = {m.ahead_page_ms * 1e3:.2f} us/page, c/b = {m.ahead_over_page:.2f}); "
            f"layers {first} then {second}, {f.fit.fit_runs} fit runs ({q.runs} reads): R^2 {q.r2:.3f}, "
            f"RMSE {q.rmse_ms:.3f} ms; {held}{zero}", 120, subsequent_indent="  ", break_on_hyphens=False)


def fit_warning(f: TierReadFit) -> str | None:
    """A warning line when the fit's held-out R^2 is below TRUSTED_HELD_OUT_R2 (or nothing was held out)."""
    import textwrap

    h = f.fit.held_out
    if h is not None and h.r2 >= TRUSTED_HELD_OUT_R2:
        return None
    said = "no runs were held out" if h is None else f"held-out R^2 {h.r2:.2f} is below {TRUSTED_HELD_OUT_R2}"
    return textwrap.fill(f"WARNING {f.spec.name}: {said}: the model predicts reads it was not fitted on poorly, so "
                         "plans built on it may miss; rerun with more --read-runs on a quiet machine, and look at "
                         "the fit's plot", 120, subsequent_indent="  ")


def predicted_read_ms(f: TierReadFit) -> np.ndarray:
    """The fitted model's read time of every measured read: [runs, layers], as `runs.read_ms`."""
    m = f.spec.read
    coef = np.array([m.intercept_ms, m.page_ms, m.ahead_page_ms, m.behind_page_ms])
    return (device_design(f.runs.pages) @ coef).reshape(f.runs.read_ms.shape)
