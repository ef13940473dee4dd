"""plan room: the exposure model, the device read-time model and its fit, the cache split and the placement planner
(pure functions)."""

from slacktier.plan.curves import MissCurve, MissCurves, load_miss_curves, miss_curves_from_dict
from slacktier.plan.exposure import Exposure, LayerRead, device_exposure, device_reads, exposure, window_order
from slacktier.plan.fit import (MIN_FIT_RUNS, DeviceReadFit, FitQuality, KappaFit, Prediction, Run, device_design,
                                fit_device_read_model, fit_kappa, fit_quality, predict_runs)
from slacktier.plan.planner import (control_file, make_plan, plan_to_dict, predict_fixed_placement, predict_placement,
                                    write_plan)
from slacktier.plan.readmodel import PAPER_NVME, DeviceReadModel, LayerPages, ReadTime, read_times
from slacktier.plan.report import format_plan, plan_comment
from slacktier.plan.split import CacheSplit, best_split, split_cost_ms
from slacktier.plan.tiers import (TIERS_FORMAT, ReadFitRecord, TierSpec, load_tiers, tiers_from_dict, tiers_to_dict,
                                  write_tiers)
from slacktier.plan.types import Plan, TableDemand, TablePlan

__all__ = [
    "CacheSplit", "DeviceReadFit", "DeviceReadModel", "Exposure", "FitQuality", "KappaFit", "LayerPages", "LayerRead",
    "MIN_FIT_RUNS", "MissCurve", "MissCurves", "PAPER_NVME", "Plan", "Prediction", "ReadFitRecord", "ReadTime", "Run",
    "TIERS_FORMAT", "TableDemand", "TablePlan", "TierSpec",
    "best_split", "control_file", "device_design", "device_exposure", "device_reads", "exposure", "fit_device_read_model",
    "fit_kappa", "fit_quality", "format_plan", "load_miss_curves", "load_tiers", "make_plan", "miss_curves_from_dict",
    "plan_comment", "plan_to_dict", "predict_fixed_placement", "predict_placement", "predict_runs", "read_times",
    "split_cost_ms", "tiers_from_dict", "tiers_to_dict", "window_order", "write_plan", "write_tiers",
]
