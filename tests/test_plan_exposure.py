"""The exposure model (Eq. 1) and its fits, with exact numbers from the paper."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from slacktier.errors import SlackTierError
from slacktier.plan import (PAPER_NVME, DeviceReadModel, LayerPages, LayerRead, Run, device_exposure, exposure,
                            fit_kappa, fit_quality, predict_runs)

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


def test_device_exposure_takes_read_times_from_the_device_model():
    """Eq. 1 with T_l from plan.readmodel: the docstring's worked example, then layer 1 moved to its own device."""
    both = [LayerPages(1, "disk", 100.0, 0), LayerPages(14, "disk", 1000.0, 1)]
    exp = device_exposure(both, {1: W1, 14: W14}, {"disk": PAPER_NVME})
    assert [r.read_ms for r in exp.reads] == pytest.approx([0.975, 3.655])
    assert exp.stall_ms == pytest.approx((0.705, 0.0)) and exp.slowdown_ms == pytest.approx(0.705)
    # layer 1 in DRAM: nothing queued ahead of or behind layer 14 on the disk any more
    dram = DeviceReadModel(0.05, 1e-3, 1e-3, 0.0)
    apart = [LayerPages(1, "dram", 100.0, 0), LayerPages(14, "disk", 1000.0, 1)]
    exp = device_exposure(apart, {1: W1, 14: W14}, {"disk": PAPER_NVME, "dram": dram}, resolve_ms=0.1, kappa_ms=0.05)
    assert [r.read_ms for r in exp.reads] == pytest.approx([0.15, 3.35])
    assert exp.stall_ms == pytest.approx((0.0, 0.0)) and exp.slowdown_ms == pytest.approx(0.05)
    # a device whose second layer waits the full b per page queued ahead, stalling layer 14 too:
    # T14 = 0.3 + 0.02*1000 + 0.02*100 = 22.3; d1 = 0.3 + 0.02*100 + 0.001*1000 - 0.27 = 3.03;
    # d14 = 22.3 - 9.35 - 3.03 = 9.92
    slow = DeviceReadModel(0.3, 0.02, 0.02, 0.001)
    exp = device_exposure(both, {1: W1, 14: W14}, {"disk": slow})
    assert exp.stall_ms == pytest.approx((3.03, 9.92))
    with pytest.raises(SlackTierError, match="no window for layer"):
        device_exposure(both, {1: W1}, {"disk": slow})
