"""The device read-time model (plan.readmodel) and its least-squares fit (plan.fit), with exact numbers."""

from __future__ import annotations

import math

import numpy as np
import pytest

from slacktier.errors import SlackTierError
from slacktier.plan import (MIN_FIT_RUNS, PAPER_NVME, DeviceReadModel, LayerPages, device_design,
                            fit_device_read_model, fit_quality, read_times)
from slacktier.plan import constants


def test_the_paper_nvme_constants_are_the_papers_fit():
    assert (PAPER_NVME.intercept_ms, PAPER_NVME.page_ms, PAPER_NVME.behind_page_ms) == (0.30, 3.05e-3, 0.37e-3)
    assert PAPER_NVME.ahead_page_ms == constants.PAPER_NVME_AHEAD_PAGE_MS == PAPER_NVME.page_ms
    assert PAPER_NVME.page_ms / PAPER_NVME.behind_page_ms == pytest.approx(8.24, abs=0.01)   # the paper's b/c ~ 8


def test_worked_example_of_the_module_docstring():
    both = read_times([LayerPages(1, "disk", 100, 0), LayerPages(14, "disk", 1000, 1)], {"disk": PAPER_NVME})
    t1, t14 = both
    assert (t1.pages, t1.ahead_pages, t1.behind_pages) == (100.0, 0.0, 1000.0)
    assert (t14.pages, t14.ahead_pages, t14.behind_pages) == (1000.0, 100.0, 0.0)
    assert t1.read_ms == pytest.approx(0.975, abs=1e-12) and t14.read_ms == pytest.approx(3.655, abs=1e-12)
    dram = DeviceReadModel(0.05, 1e-3, 1e-3, 0.0)
    apart = read_times([LayerPages(1, "dram", 100, 0), LayerPages(14, "disk", 1000, 1)],
                       {"disk": PAPER_NVME, "dram": dram})
    assert [t.read_ms for t in apart] == pytest.approx([0.15, 3.35], abs=1e-12)


def test_queued_ahead_and_behind_count_only_the_layers_on_the_same_device_in_submission_order():
    m = DeviceReadModel(intercept_ms=1.0, page_ms=0.01, ahead_page_ms=0.004, behind_page_ms=0.001)
    loads = [LayerPages(20, "disk", 300, 2), LayerPages(1, "disk", 100, 0), LayerPages(7, "dram", 50, 1),
             LayerPages(14, "disk", 200, 1)]
    got = {t.layer: t for t in read_times(loads, {"disk": m, "dram": DeviceReadModel(0, 0, 0, 0)})}
    assert [t.layer for t in read_times(loads, {"disk": m, "dram": m})] == [20, 1, 7, 14]   # the order given
    # layer 1: nothing ahead, 200 + 300 behind; 14: 100 ahead, 300 behind; 20: 300 ahead; dram's 50 count nowhere
    assert (got[1].ahead_pages, got[1].behind_pages) == (0.0, 500.0)
    assert (got[14].ahead_pages, got[14].behind_pages) == (100.0, 300.0)
    assert (got[20].ahead_pages, got[20].behind_pages) == (300.0, 0.0)
    assert got[1].read_ms == pytest.approx(1.0 + 1.0 + 0.5, abs=1e-12)
    assert got[14].read_ms == pytest.approx(1.0 + 2.0 + 0.4 + 0.3, abs=1e-12)
    assert got[20].read_ms == pytest.approx(1.0 + 3.0 + 1.2, abs=1e-12)
    assert got[7].read_ms == 0.0
    # equal order: ties are broken by layer id, as window order breaks them
    tie = read_times([LayerPages(14, "disk", 200, 0), LayerPages(1, "disk", 100, 0)], {"disk": m})
    assert [t.ahead_pages for t in tie] == [100.0, 0.0]


def test_a_layer_that_reads_nothing_waits_for_nothing():
    got = read_times([LayerPages(1, "disk", 0, 0), LayerPages(14, "disk", 1000, 1)], {"disk": PAPER_NVME})
    assert got[0].read_ms == 0.0
    assert got[1].read_ms == pytest.approx(0.30 + 3.05, abs=1e-12)   # 0 pages queued ahead


@pytest.mark.parametrize("key", ["intercept_ms", "page_ms", "ahead_page_ms", "behind_page_ms"])
@pytest.mark.parametrize("value", [-1e-3, math.nan, math.inf])
def test_the_model_refuses_a_non_finite_or_negative_term_naming_it(key, value):
    terms = {"intercept_ms": 0.3, "page_ms": 3e-3, "ahead_page_ms": 3e-3, "behind_page_ms": 4e-4, key: value}
    with pytest.raises(SlackTierError) as e:
        DeviceReadModel(**terms)
    assert key in e.value.message and "probe --read-fit" in e.value.fix


def test_read_times_refuse_a_device_without_a_model_and_a_layer_twice():
    with pytest.raises(SlackTierError, match=r"no read-time model for device \['redis'\]"):
        read_times([LayerPages(1, "redis", 10, 0)], {"disk": PAPER_NVME})
    with pytest.raises(SlackTierError, match="layer listed twice"):
        read_times([LayerPages(1, "disk", 10, 0), LayerPages(1, "disk", 5, 1)], {"disk": PAPER_NVME})
    with pytest.raises(SlackTierError, match="pages"):
        LayerPages(1, "disk", -1, 0)


# ---- the fit ---------------------------------------------------------------------------------------------

def test_design_rows_worked_example():
    X = device_design(np.array([[100.0, 300.0], [5.0, 7.0]]))
    assert X.tolist() == [[1, 100, 0, 300], [1, 300, 100, 0], [1, 5, 0, 7], [1, 7, 5, 0]]
    three = device_design(np.array([[1.0, 2.0, 4.0]]))
    assert three.tolist() == [[1, 1, 0, 6], [1, 2, 1, 4], [1, 4, 3, 0]]


def _runs(model: DeviceReadModel, runs: int, seed: int, noise_ms: float = 0.0):
    rng = np.random.default_rng(seed)
    P = rng.integers(1, 3001, (runs, 2)).astype(np.float64)   # [runs, 2]
    w = np.array([model.intercept_ms, model.page_ms, model.ahead_page_ms, model.behind_page_ms])
    T = (device_design(P) @ w).reshape(runs, 2) + rng.normal(0, noise_ms, (runs, 2)) if noise_ms else \
        (device_design(P) @ w).reshape(runs, 2)
    return P, T


def test_fit_is_exact_on_noiseless_runs():
    truth = DeviceReadModel(0.30, 3.05e-3, 2.5e-3, 0.37e-3)
    P, T = _runs(truth, 12, seed=1)
    fit = fit_device_read_model(P, T)
    got = (fit.model.intercept_ms, fit.model.page_ms, fit.model.ahead_page_ms, fit.model.behind_page_ms)
    assert got == pytest.approx((0.30, 3.05e-3, 2.5e-3, 0.37e-3), abs=1e-12)
    assert fit.fit_runs == 8 and fit.layers_per_run == 2 and fit.at_zero == ()
    assert fit.quality.runs == 16 and fit.quality.rmse_ms == pytest.approx(0.0, abs=1e-9)
    assert fit.held_out.runs == 8 and fit.held_out.rmse_ms == pytest.approx(0.0, abs=1e-9)


def test_fit_recovers_known_terms_from_noisy_runs_and_predicts_held_out_runs():
    truth = DeviceReadModel(0.30, 3.05e-3, 3.05e-3, 0.37e-3)
    P, T = _runs(truth, 90, seed=7, noise_ms=0.05)
    fit = fit_device_read_model(P, T)
    m = fit.model
    assert m.intercept_ms == pytest.approx(0.30, abs=0.03)
    assert m.page_ms == pytest.approx(3.05e-3, rel=0.01) and m.ahead_page_ms == pytest.approx(3.05e-3, rel=0.02)
    assert m.behind_page_ms == pytest.approx(0.37e-3, rel=0.1)
    assert fit.quality.r2 > 0.999 and fit.held_out.runs == 60
    # the held-out score is the model's own prediction of those runs
    Ph, Th = P[60:], T[60:]
    pred = [m.read_ms(p1, 0, p2) for p1, p2 in Ph] + [m.read_ms(p2, p1, 0) for p1, p2 in Ph]
    want = fit_quality(pred, list(Th[:, 0]) + list(Th[:, 1]))
    assert fit.held_out.rmse_ms == pytest.approx(want.rmse_ms, rel=1e-9) and fit.held_out.rmse_ms < 0.07


def test_a_term_least_squares_puts_below_zero_is_held_at_zero_and_named():
    # T = -2 + 0.01 P_l + 0.002 A_l + 0.001 B_l (a negative intercept, as a saturating disk gives): the fit
    # keeps every term >= 0, says which one it held, and refits the others.
    P = np.array([[300.0 + 200 * i, 300.0 + 150.0 * ((7 * i) % 11)] for i in range(12)])
    w = np.array([-2.0, 0.01, 0.002, 0.001])
    T = (device_design(P) @ w).reshape(12, 2)   # >= 1.3 ms: valid measurements
    assert T.min() > 0
    fit = fit_device_read_model(P, T, fit_runs=12)
    assert fit.at_zero == ("intercept_ms",) and fit.model.intercept_ms == 0.0
    assert min(fit.model.page_ms, fit.model.ahead_page_ms, fit.model.behind_page_ms) > 0
    # it is the least-squares answer among models with a = 0: the unconstrained fit of the other three terms
    X = device_design(P)[:, 1:]
    rest, *_ = np.linalg.lstsq(X, T.reshape(-1), rcond=None)
    assert (fit.model.page_ms, fit.model.ahead_page_ms, fit.model.behind_page_ms) == pytest.approx(tuple(rest),
                                                                                                    rel=1e-9)
    assert fit.held_out is None


def test_fit_refuses_bad_runs_with_the_key_and_a_fix():
    P, T = _runs(PAPER_NVME, 12, seed=2)
    bad = T.copy()
    bad[3, 1] = math.nan
    with pytest.raises(SlackTierError, match="read_ms of run 3") as e:
        fit_device_read_model(P, bad)
    assert "finite" in e.value.fix
    neg = P.copy()
    neg[5, 0] = -1
    with pytest.raises(SlackTierError, match="pages of run 5"):
        fit_device_read_model(neg, T)
    with pytest.raises(SlackTierError, match="runs: 5 fit runs") as e:
        fit_device_read_model(P[:8], T[:8])   # two thirds of 8 = 5 < MIN_FIT_RUNS
    assert str(MIN_FIT_RUNS) in e.value.fix
    with pytest.raises(SlackTierError, match="two"):
        fit_device_read_model(P[:, :1], T[:, :1])
    with pytest.raises(SlackTierError, match="shape"):
        fit_device_read_model(P, T[:, :1])


def test_fit_refuses_a_design_whose_terms_cannot_be_told_apart():
    # both layers always read the same number of pages: own = ahead + behind on every row
    same = np.repeat(np.arange(1.0, 13.0)[:, None] * 100, 2, axis=1)
    with pytest.raises(SlackTierError, match="cannot tell page_ms, ahead_page_ms, behind_page_ms apart") as e:
        fit_device_read_model(same, same * 0.01)
    assert "independently" in e.value.fix
    # the same pages in every run: not even the intercept is apart from the rest
    flat = np.full((12, 2), 500.0)
    with pytest.raises(SlackTierError, match="cannot tell intercept_ms, page_ms, ahead_page_ms, behind_page_ms"):
        fit_device_read_model(flat, flat * 0.01)
