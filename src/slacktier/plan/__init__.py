"""plan room: the exposure model, its fits, the cache split and the placement planner (pure functions)."""

from slacktier.plan.curves import MissCurve, MissCurves, load_miss_curves, miss_curves_from_dict
from slacktier.plan.exposure import Exposure, LayerRead, exposure, window_order
from slacktier.plan.fit import (FitQuality, KappaFit, Prediction, ReadTimeFit, ReadTimeModel, Run, fit_kappa,
                                fit_quality, fit_read_time, predict_runs)
from slacktier.plan.planner import (control_file, make_plan, plan_to_dict, predict_fixed_placement, predict_placement,
                                    write_plan)
from slacktier.plan.report import format_plan, plan_comment
from slacktier.plan.split import CacheSplit, best_split, split_cost_ms
from slacktier.plan.tiers import TierSpec, load_tiers, tiers_from_dict
from slacktier.plan.types import Plan, TableDemand, TablePlan

__all__ = [
    "CacheSplit", "Exposure", "FitQuality", "KappaFit", "LayerRead", "MissCurve", "MissCurves",
    "Plan", "Prediction", "ReadTimeFit", "ReadTimeModel", "Run", "TableDemand", "TablePlan", "TierSpec",
    "best_split", "control_file", "exposure", "fit_kappa", "fit_quality", "fit_read_time", "format_plan",
    "load_miss_curves", "load_tiers", "make_plan", "miss_curves_from_dict", "plan_comment", "plan_to_dict",
    "predict_fixed_placement", "predict_placement", "predict_runs", "split_cost_ms", "tiers_from_dict", "window_order", "write_plan",
]
