"""Issue 34: the planner checks its inputs for finiteness and range where it loads them. A NaN target, or a
NaN or infinite tier coefficient, used to give a plan that "meets the target"."""

from __future__ import annotations

import math

import pytest

from slacktier.errors import ErrorKind, SlackTierError
from slacktier.plan import MissCurve, TableDemand, make_plan, tiers_from_dict
from slacktier.plan.readmodel import DeviceReadModel
from slacktier.plan.tiers import TIERS_FORMAT
from slacktier.plan.curves import miss_curves_from_dict

DISK = {"name": "disk", "intercept_ms": 0.30, "page_ms": 3.05e-3, "ahead_page_ms": 3.05e-3, "behind_page_ms": 0.37e-3}
TABLES = [TableDemand(1, 1000, "l1.json", 0.5)]
CURVES = {1: MissCurve((0.0, 1000.0), (30.0, 3.0))}


def _refused(fn, kind: ErrorKind = ErrorKind.BAD_INPUT) -> str:
    with pytest.raises(SlackTierError) as exc:
        fn()
    assert exc.value.kind is kind
    return exc.value.message


@pytest.mark.parametrize("key,value,said", [
    ("page_ms", math.nan, "page_ms = nan is not a finite number in 0..1e+06 ms"),
    ("page_ms", math.inf, "page_ms = inf"),
    ("intercept_ms", 1e300, "intercept_ms = 1e+300"),
    ("behind_page_ms", -1.0, "behind_page_ms = -1.0"),
    ("intercept_ms", True, "intercept_ms = True is not a number"),
    ("page_ms", "0.003", "page_ms = '0.003' is not a number"),
    ("holds_table", "false", "holds_table = 'false', want true or false"),
    ("buffer_bytes", 1.5, "buffer_bytes = 1.5, want a whole number of bytes"),
    ("directory_bytes_per_row", True, "directory_bytes_per_row = True"),
    ("name", 7, "name = 7, want a tier name"),
])
def test_a_tier_value_out_of_type_or_range_is_refused_naming_it(key, value, said) -> None:
    msg = _refused(lambda: tiers_from_dict({"format": TIERS_FORMAT, "tier": [{**DISK, key: value}]}))
    assert said in msg, msg


def test_a_read_model_refuses_non_finite_terms() -> None:
    for x in (math.nan, math.inf, -1.0, 1e7):
        msg = _refused(lambda: DeviceReadModel(0.3, x, 0.0, 0.0))
        assert "page_ms" in msg and "is not a finite number in 0..1e+06 ms" in msg


@pytest.mark.parametrize("layer,said", [
    ({"capacity_rows": [0, 1000], "pages_per_step": [30, math.nan]}, "layers.1.pages_per_step holds nan"),
    ({"capacity_rows": [0, math.inf], "pages_per_step": [30, 3]}, "layers.1.capacity_rows holds inf"),
    ({"capacity_rows": [0, True], "pages_per_step": [30, 3]}, "layers.1.capacity_rows holds True"),
    ({"capacity_rows": [0, 1000], "pages_per_step": [30, "3"]}, "layers.1.pages_per_step holds '3'"),
    ({"capacity_rows": [0, 1000], "pages_per_step": [30, 1e300]}, "layers.1.pages_per_step holds 1e+300"),
])
def test_a_miss_curve_point_out_of_type_or_range_is_refused(layer, said) -> None:
    msg = _refused(lambda: miss_curves_from_dict({"layers": {"1": layer}}))
    assert msg.startswith(f"miss curve {said}, want a finite number"), msg
    assert "batch is True" in _refused(lambda: miss_curves_from_dict({"batch": True, "layers": {}}))
    assert "NaN or an infinite value" in _refused(lambda: MissCurve((0.0, math.nan), (1.0, 1.0)))


@pytest.mark.parametrize("kw,said", [
    (dict(target_ms=math.nan), "target_ms nan, want a finite number of ms in 0..1e+06"),
    (dict(kappa_ms=-2e6), "kappa_ms -2000000.0, want a finite number of ms in -1e+06..1e+06"),
    (dict(target_ms=math.inf), "target_ms inf"),
    (dict(target_ms=-1.0), "target_ms -1.0"),
    (dict(kappa_ms=math.nan), "kappa_ms nan"),
    (dict(resolve_ms=math.inf), "resolve_ms inf"),
    (dict(cache_rows=1.5), "cache_rows 1.5, want a whole number >= 0"),
    (dict(cache_rows=True), "cache_rows True"),
])
def test_make_plan_refuses_a_nan_target_and_other_bad_scalars(kw, said) -> None:
    args = {"cache_rows": 100, "target_ms": 1.0} | kw
    tiers = tiers_from_dict({"format": TIERS_FORMAT, "tier": [DISK]})
    assert _refused(lambda: make_plan(TABLES, tiers, CURVES, **args)).startswith(said)


def test_a_table_window_must_be_finite() -> None:
    for w in (math.nan, math.inf, -0.1):
        assert _refused(lambda: TableDemand(1, 1000, "l1.json", w)).startswith("rows 1000, window")


def test_good_inputs_still_plan() -> None:
    plan = make_plan(TABLES, tiers_from_dict({"format": TIERS_FORMAT, "tier": [DISK]}), CURVES, cache_rows=100, target_ms=1.0)
    assert [t.source for t in plan.tables] == ["disk"] and math.isfinite(plan.slowdown_ms)
    # a calibrated kappa (a fit's intercept) may be below 0
    assert make_plan(TABLES, tiers_from_dict({"format": TIERS_FORMAT, "tier": [DISK]}), CURVES, cache_rows=100, target_ms=1.0,
                     kappa_ms=-4.3).slowdown_ms < plan.slowdown_ms
