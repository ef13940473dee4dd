"""The exposure model (Eq. 1) and its fits, with exact numbers from the paper."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from slacktier.errors import SlackTierError
from slacktier.plan import (LayerRead, ReadTimeModel, Run, exposure, fit_kappa, fit_quality, fit_read_time,
                            predict_runs)

W1, W14 = 0.27, 9.35

# Table 3 of the paper: (s + T_1, s + T_14) -> Eq. 1 prediction, sum of excesses.
TABLE3 = [
    (0.4, 9.0, 0.13, 0.13),
    (0.9, 9.0, 0.63, 0.63),
    (0.9, 12.0, 2.65, 3.28),
    (1.5, 12.0, 2.65, 3.88),
    (1.5, 15.0, 5.65, 6.88),
    (2.5, 15.0, 5.65, 7.88),
]


def _reads(t1: float, t14: float) -> list[LayerRead]:
    return [LayerRead(layer=1, window_ms=W1, read_ms=t1), LayerRead(layer=14, window_ms=W14, read_ms=t14)]


@pytest.mark.parametrize("t1,t14,eq1,excess", TABLE3)
def test_table3_eq1_and_sum_of_excesses(t1, t14, eq1, excess):
    coupled = exposure(_reads(t1, t14))
    assert coupled.slowdown_ms == pytest.approx(eq1, abs=1e-12)
    assert round(coupled.slowdown_ms, 2) == eq1
    uncoupled = exposure(_reads(t1, t14), coupled=False)
    assert uncoupled.slowdown_ms == pytest.approx(excess, abs=1e-12)
    assert round(uncoupled.slowdown_ms, 2) == excess


def test_table3_stalls_per_layer():
    e = exposure(_reads(1.5, 12.0))
    assert e.layers == (1, 14)
    assert e.stall_of(1) == pytest.approx(1.23, abs=1e-12)
    assert e.stall_of(14) == pytest.approx(12.0 - 9.35 - 1.23, abs=1e-12)


def test_resolve_time_and_kappa_add_where_the_recurrence_says():
    # s = 0.1 shifts both reads; kappa is added once.
    e = exposure(_reads(0.8, 11.9), resolve_ms=0.1, kappa_ms=0.05)
    assert e.slowdown_ms == pytest.approx(2.65 + 0.05, abs=1e-12)


def test_layers_are_taken_in_window_order_whatever_order_given():
    given_order = list(reversed(_reads(0.9, 12.0)))
    e = exposure(given_order)
    assert e.layers == (1, 14)
    assert e.slowdown_ms == pytest.approx(2.65, abs=1e-12)


def test_three_layers_chain_the_stalls():
    reads = [LayerRead(2, 1.0, 3.0), LayerRead(10, 5.0, 6.5), LayerRead(20, 9.0, 12.0)]
    e = exposure(reads)
    # d2 = 2, d10 = [6.5 - 5 - 2]+ = 0, d20 = 12 - 9 - 2 - 0 = 1
    assert e.stall_ms == pytest.approx((2.0, 0.0, 1.0), abs=1e-12)
    assert exposure(reads, coupled=False).stall_ms == pytest.approx((2.0, 1.5, 3.0), abs=1e-12)


def test_bad_inputs_raise_with_a_fix():
    with pytest.raises(SlackTierError) as e:
        LayerRead(1, -1.0, 0.0)
    assert e.value.fix
    with pytest.raises(SlackTierError):
        exposure([LayerRead(1, 1.0, 1.0), LayerRead(1, 2.0, 1.0)])


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 50), st.floats(0, 50)), min_size=1, max_size=6),
       st.floats(0, 2))
def test_coupling_never_predicts_more_than_sum_of_excesses(pairs, s):
    reads = [LayerRead(i, w, t) for i, (w, t) in enumerate(pairs)]
    coupled = exposure(reads, resolve_ms=s).slowdown_ms
    loose = exposure(reads, resolve_ms=s, coupled=False).slowdown_ms
    assert 0.0 <= coupled <= loose + 1e-9
    # the coupled total equals the largest excess seen so far (a max-plus identity of the recurrence)
    order = sorted(reads, key=lambda r: (r.window_ms, r.layer))
    assert coupled == pytest.approx(max(0.0, max(s + r.read_ms - r.window_ms for r in order)), abs=1e-9)


def test_read_time_fit_recovers_known_coefficients_from_noisy_runs():
    rng = np.random.default_rng(7)
    runs = 60
    pages = np.column_stack([rng.uniform(0, 4000, runs), rng.uniform(0, 20000, runs)])  # [runs, 2]
    a, b, c = 0.30, 3.05e-3, 0.37e-3
    noise = rng.normal(0, 0.02, runs)
    read = a + b * pages[:, 0] + c * pages[:, 1] + noise
    fit = fit_read_time([1, 14], pages, read)
    assert fit.model.layers == (1, 14)
    assert fit.model.intercept_ms == pytest.approx(a, abs=0.02)
    assert fit.model.per_page_ms[0] == pytest.approx(b, rel=0.02)
    assert fit.model.per_page_ms[1] == pytest.approx(c, rel=0.05)
    assert fit.quality.r2 > 0.99
    assert fit.quality.rmse_ms == pytest.approx(0.02, rel=0.3)
    # held-out: the fitted model predicts fresh runs about as well as the noise allows
    held = np.column_stack([rng.uniform(0, 4000, 20), rng.uniform(0, 20000, 20)])
    truth = a + b * held[:, 0] + c * held[:, 1]
    pred = [fit.model.predict_ms({1: p1, 14: p14}) for p1, p14 in held]
    assert fit_quality(pred, truth).rmse_ms < 0.02


def test_read_time_fit_refuses_collinear_or_too_few_runs():
    pages = np.array([[1.0, 2.0], [2.0, 4.0], [3.0, 6.0], [4.0, 8.0]])
    with pytest.raises(SlackTierError):
        fit_read_time([1, 14], pages, [1.0, 2.0, 3.0, 4.0])
    with pytest.raises(SlackTierError):
        fit_read_time([1, 14], pages[:2], [1.0, 2.0])


def test_fit_quality_exact_numbers():
    q = fit_quality([1.0, 2.0, 3.0], [1.0, 2.0, 4.0])
    # SS_res = 1, SS_tot = (1-7/3)^2 + (2-7/3)^2 + (4-7/3)^2 = 14/3
    assert q.r2 == pytest.approx(1 - 3 / 14, abs=1e-12)
    assert q.rmse_ms == pytest.approx((1 / 3) ** 0.5, abs=1e-12)
    assert q.runs == 3


def test_kappa_fit_and_held_out_prediction():
    rng = np.random.default_rng(3)
    kappa = 0.11

    def make(n):
        out = []
        for _ in range(n):
            t1, t14 = rng.uniform(0.1, 3.0), rng.uniform(5.0, 16.0)
            true = exposure(_reads(t1, t14), kappa_ms=kappa).slowdown_ms
            out.append(Run(reads=tuple(_reads(t1, t14)), slowdown_ms=true + rng.normal(0, 0.01)))
        return out

    fit = fit_kappa(make(14))
    assert fit.kappa_ms == pytest.approx(kappa, abs=0.01)
    pred = predict_runs(make(30), kappa_ms=fit.kappa_ms)
    assert pred.quality.rmse_ms < 0.03
    assert pred.quality.r2 > 0.99
    # the uncoupled model misses these runs by far more
    worse = predict_runs(make(30), kappa_ms=fit.kappa_ms, coupled=False)
    assert worse.quality.rmse_ms > 5 * pred.quality.rmse_ms


def test_read_time_model_predicts_exactly():
    m = ReadTimeModel(intercept_ms=0.30, layers=(1, 14), per_page_ms=(3.05e-3, 0.37e-3))
    assert m.predict_ms({1: 100.0, 14: 1000.0}) == pytest.approx(0.30 + 0.305 + 0.37, abs=1e-12)
    assert m.predict_ms({}) == 0.30
