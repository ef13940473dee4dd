"""The placement planner: windows + tier read-time models + miss curves + a cache budget -> a control file.

The planner's answer is data: `make_plan` returns a `Plan` (what goes where and
what the model predicts), `control_file(plan, ...)` turns it into a
`slacktier.config.ControlFile`, and `write_plan` writes that with
`config.write_control`, the predictions riding along as comments
(`plan.report.plan_comment`). Nothing here writes TOML by hand.

For every assignment of tables to tiers (tables are few: two for DeepSeek-V4.1,
one for Qwen3.8), the planner
  1. splits the cache (plan.split) with per-page weights taken from the read time
     that binds on each tier: the first table submitted to a tier pays b per own
     page, every later table on it costs that first table c_behind per page;
  2. predicts each table's read time from its pages behind its share and the pages
     queued ahead of and behind it on its tier (plan.readmodel, one model per tier),
     and the step's stalls and slowdown (plan.exposure.device_exposure, Eq. 1);
  3. keeps the assignment if the slowdown stays within the target.
Of the kept assignments it returns the one with the least host memory (ties: the
smaller slowdown). With a target of 0 and kappa 0 this puts a table on a slow
tier exactly when its reads fit its window.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import numbers
from pathlib import Path
from typing import Mapping, Sequence

import msgspec

from slacktier.config import ControlFile, EngineConfig, Options, TableConfig, tier_options_type, write_control
from slacktier.errors import ErrorKind, SlackTierError
from slacktier.plan.curves import MissCurve
from slacktier.plan.exposure import device_exposure
from slacktier.plan.readmodel import LayerPages
from slacktier.plan.report import plan_comment
from slacktier.plan.split import CacheSplit, best_split, split_cost_ms
from slacktier.plan.tiers import TierSpec
from slacktier.plan.types import Plan, TableDemand, TablePlan

MAX_ENUMERATED_TABLES = 8  # 3^8 assignments; real models have one or two tables


def _evaluate(tables: Sequence[TableDemand], tiers: Sequence[TierSpec], curves: Sequence[MissCurve],
              cache_rows: int, *, resolve_ms: float, kappa_ms: float, target_ms: float,
              grid: int, refine: int) -> Plan:
    """Predict one assignment (tables and tiers in window order, paired by position)."""
    weights = _page_weights(tiers)
    split = best_split([t.layer for t in tables], curves, weights, cache_rows, grid=grid, refine=refine)
    return _predict(tables, tiers, split, resolve_ms=resolve_ms, kappa_ms=kappa_ms, target_ms=target_ms)


def _page_weights(tiers: Sequence[TierSpec]) -> list[float]:
    """b_l per position: the first table submitted to a tier pays its page_ms, every later one its behind_page_ms
    (what its pages cost the first table)."""
    first_on_tier: dict[str, int] = {}
    for i, t in enumerate(tiers):
        first_on_tier.setdefault(t.name, i)
    return [t.read.page_ms if first_on_tier[t.name] == i else t.read.behind_page_ms for i, t in enumerate(tiers)]


def _predict(tables: Sequence[TableDemand], tiers: Sequence[TierSpec], split: CacheSplit, *, resolve_ms: float,
             kappa_ms: float, target_ms: float) -> Plan:
    """Read times, stalls and host memory of tables on tiers (submission order, paired by position) behind `split`."""
    cache_rows = split.cache_rows
    pages = split.pages_per_step
    loads = [LayerPages(tab.layer, tier.name, pages[i], i) for i, (tab, tier) in enumerate(zip(tables, tiers))]
    exp = device_exposure(loads, {t.layer: t.window_ms for t in tables}, {t.name: t.read for t in tiers},
                          resolve_ms=resolve_ms, kappa_ms=kappa_ms)
    read_ms = {r.layer: r.read_ms for r in exp.reads}
    plans = tuple(
        TablePlan(layer=tab.layer, manifest=tab.manifest, source=tier.name, order=i,
                  cache_share=split.shares[i], cache_rows=split.shares[i] * cache_rows,
                  window_ms=tab.window_ms, pages_per_step=pages[i], read_ms=read_ms[tab.layer],
                  stall_ms=exp.stall_of(tab.layer),
                  host_bytes=tier.host_bytes(tab.rows, int(split.shares[i] * cache_rows)) + tab.in_memory_bytes)
        for i, (tab, tier) in enumerate(zip(tables, tiers)))
    return Plan(tables=plans, cache_rows=int(cache_rows), target_ms=target_ms, kappa_ms=kappa_ms,
                resolve_ms=resolve_ms, slowdown_ms=exp.slowdown_ms,
                host_bytes=sum(p.host_bytes for p in plans), split_cost_ms=split.cost_ms,
                assignments_tried=1, assignments_feasible=int(exp.slowdown_ms <= target_ms))


def predict_placement(tables: Sequence[TableDemand], sources: Mapping[int, str], tiers: Sequence[TierSpec],
                      curves: Mapping[int, MissCurve], cache_rows: int, *, resolve_ms: float = 0.0,
                      kappa_ms: float = 0.0, target_ms: float = 0.0, grid: int = 200, refine: int = 20) -> Plan:
    """Predicted slowdown, split and host memory of a given placement (layer -> tier name)."""
    check_plan_inputs(cache_rows, target_ms=target_ms, resolve_ms=resolve_ms, kappa_ms=kappa_ms)
    by_name = {t.name: t for t in tiers}
    ordered = sorted(tables, key=lambda t: (t.window_ms, t.layer))
    try:
        chosen = [by_name[sources[t.layer]] for t in ordered]
    except KeyError as exc:
        raise SlackTierError(ErrorKind.MISSING, f"no tier or source for {exc}",
                             fix=f"place every table on one of {sorted(by_name)}") from exc
    return _evaluate(ordered, chosen, [_curve(curves, t.layer) for t in ordered], cache_rows,
                     resolve_ms=resolve_ms, kappa_ms=kappa_ms, target_ms=target_ms, grid=grid, refine=refine)


def predict_fixed_placement(tables: Sequence[TableDemand], sources: Mapping[int, str], shares: Mapping[int, float],
                            tiers: Sequence[TierSpec], curves: Mapping[int, MissCurve], cache_rows: int, *,
                            order: Mapping[int, int] | None = None, resolve_ms: float = 0.0, kappa_ms: float = 0.0,
                            target_ms: float = 0.0) -> Plan:
    """Predicted slowdown and host memory of a placement as stated: tier and cache share per layer, nothing re-split.

    Tables are submitted in `order` (layer -> the control file's `order`; ties and None: window order, as the
    planner submits). Worked example: a plan from `make_plan` fed back with its own sources, shares and orders
    gives that plan's slowdown_ms, pages and host_bytes again (split_cost_ms too: the same shares). The
    returned Plan lists the tables in submission order; assignments_tried is 1.
    """
    check_plan_inputs(cache_rows, target_ms=target_ms, resolve_ms=resolve_ms, kappa_ms=kappa_ms)
    by_name = {t.name: t for t in tiers}
    rank = order or {}
    ordered = sorted(tables, key=lambda t: (rank.get(t.layer, 0), t.window_ms, t.layer))
    try:
        chosen = [by_name[sources[t.layer]] for t in ordered]
        f = tuple(float(shares[t.layer]) for t in ordered)
    except KeyError as exc:
        raise SlackTierError(ErrorKind.MISSING, f"no tier, source or cache share for {exc}",
                             fix=f"give every table a cache share and one of the tiers {sorted(by_name)}") from exc
    if any(x < 0 for x in f) or sum(f) > 1.0 + 1e-9 or cache_rows < 0:
        raise SlackTierError(ErrorKind.BAD_INPUT, f"cache shares {f} of {cache_rows} rows",
                             fix="shares are >= 0 and sum to at most 1; cache_rows >= 0")
    ordered_curves = [_curve(curves, t.layer) for t in ordered]
    weights = _page_weights(chosen)
    split = CacheSplit(layers=tuple(t.layer for t in ordered), shares=f, cache_rows=int(cache_rows),
                       pages_per_step=tuple(float(c.pages_at(x * cache_rows)) for c, x in zip(ordered_curves, f)),
                       cost_ms=split_cost_ms(ordered_curves, weights, f, cache_rows))
    return _predict(ordered, chosen, split, resolve_ms=resolve_ms, kappa_ms=kappa_ms, target_ms=target_ms)


def check_plan_inputs(cache_rows: int, *, target_ms: float, resolve_ms: float, kappa_ms: float) -> None:
    """Refuse (BAD_INPUT) a cache budget that is not a whole number >= 0, a target that is not a finite time in
    0..1e6 ms (`target_ms=nan` compared false with every slowdown, so every plan "met" it), and a resolve or
    kappa time that is not finite and within 1e6 ms (either may be a fitted intercept below 0)."""
    if isinstance(cache_rows, bool) or not isinstance(cache_rows, numbers.Integral) or not 0 <= cache_rows <= 2**62:
        raise SlackTierError(ErrorKind.BAD_INPUT, f"cache_rows {cache_rows!r}, want a whole number >= 0",
                             fix="give the cache budget in rows")
    for name, value, lo in (("target_ms", target_ms, 0.0), ("resolve_ms", resolve_ms, -1e6),
                            ("kappa_ms", kappa_ms, -1e6)):
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not (math.isfinite(value)
                                                                                  and lo <= value <= 1e6):
            raise SlackTierError(ErrorKind.BAD_INPUT, f"{name} {value!r}, want a finite number of ms in "
                                 f"{lo:g}..{1e6:g}", fix=f"give {name} as a finite time")


def _curve(curves: Mapping[int, MissCurve], layer: int) -> MissCurve:
    if layer not in curves:
        raise SlackTierError(ErrorKind.MISSING, f"no miss-page curve for layer {layer}",
                             fix="characterize this layer's accesses (slacktier characterize)", layer=layer)
    return curves[layer]


def make_plan(tables: Sequence[TableDemand], tiers: Sequence[TierSpec], curves: Mapping[int, MissCurve],
              cache_rows: int, target_ms: float, *, resolve_ms: float = 0.0, kappa_ms: float = 0.0,
              grid: int = 200, refine: int = 20) -> Plan:
    """The placement with the least host memory whose predicted slowdown is within `target_ms`."""
    check_plan_inputs(cache_rows, target_ms=target_ms, resolve_ms=resolve_ms, kappa_ms=kappa_ms)
    if not tables or not tiers:
        raise SlackTierError(ErrorKind.BAD_INPUT, "nothing to place or nowhere to place it",
                             fix="give at least one table and one tier")
    if len(tables) > MAX_ENUMERATED_TABLES:
        raise SlackTierError(ErrorKind.BAD_INPUT, f"{len(tables)} tables; the planner enumerates at most "
                             f"{MAX_ENUMERATED_TABLES}", fix="plan groups of tables separately")
    if len({t.layer for t in tables}) != len(tables):
        raise SlackTierError(ErrorKind.BAD_INPUT, "two tables for one layer", fix="give each layer one table")
    ordered = sorted(tables, key=lambda t: (t.window_ms, t.layer))
    ordered_curves = [_curve(curves, t.layer) for t in ordered]
    best: Plan | None = None
    closest: Plan | None = None
    tried = feasible = 0
    for choice in itertools.product(tiers, repeat=len(ordered)):
        plan = _evaluate(ordered, choice, ordered_curves, cache_rows, resolve_ms=resolve_ms, kappa_ms=kappa_ms,
                         target_ms=target_ms, grid=grid, refine=refine)
        tried += 1
        if closest is None or plan.slowdown_ms < closest.slowdown_ms:
            closest = plan
        if plan.slowdown_ms > target_ms:
            continue
        feasible += 1
        if best is None or (plan.host_bytes, plan.slowdown_ms) < (best.host_bytes, best.slowdown_ms):
            best = plan
    if best is None:
        assert closest is not None
        raise SlackTierError(ErrorKind.CAPACITY,
                             f"no placement meets the {target_ms:.3f} ms target; the best predicts "
                             f"{closest.slowdown_ms:.3f} ms "
                             f"({', '.join(f'L{p.layer}:{p.source}' for p in closest.tables)})",
                             fix="raise the slowdown target, grow the cache budget, or add a faster tier")
    return dataclasses.replace(best, assignments_tried=tried, assignments_feasible=feasible)


def plan_to_dict(plan: Plan) -> dict:
    """The plan as plain data (for JSON)."""
    return dataclasses.asdict(plan)


def control_file(plan: Plan, engine: EngineConfig = EngineConfig(), options: Sequence[Options] = ()) -> ControlFile:
    """The control file that serves `plan`: `engine` with the plan's cache budget, one [[table]] per planned table.

    `options` are tier option structs (e.g. `DiskOptions(io_threads=4)`); each table gets the one of its tier's
    type, or its tier's defaults. Worked example: a plan putting layer 1 on "dram" (share 0.7, order 0) and
    layer 14 on "disk" (share 0.3, order 1) with `options=(DiskOptions(io_threads=4),)` gives layer 14
    `DiskOptions(io_threads=4)` and layer 1 `DramOptions()`.
    """
    by_type = {type(o): o for o in options}
    if len(by_type) != len(options):
        raise SlackTierError(ErrorKind.BAD_INPUT, "two option structs of one tier",
                             fix="give each tier's options once")
    rows = plan.cache_rows
    eng = msgspec.structs.replace(engine, cache_rows=rows, max_cache_rows=max(engine.max_cache_rows, rows))
    tables = tuple(TableConfig(layer=t.layer, manifest=t.manifest, source=t.source,
                               options=by_type.get(tier_options_type(t.source)),
                               cache_share=t.cache_share, order=t.order)
                   for t in plan.tables)
    return ControlFile(engine=eng, tables=tables)


def write_plan(plan: Plan, path: str | Path, engine: EngineConfig = EngineConfig(),
               options: Sequence[Options] = ()) -> ControlFile:
    """Write the control file of `plan` to `path`, its predictions as comments; returns what was written."""
    cfg = control_file(plan, engine, options)
    write_control(cfg, path, comment=plan_comment(plan))
    return cfg


def stall_by_cache(plan: Plan, tables: Sequence, tiers: Sequence, curves: Mapping, budgets: Sequence[int], *,
                   grid: int = 200, refine: int = 20, source: str | None = None) -> list[tuple[int, Plan]]:
    """The plan's placement (each table on its tier; with `source`, every table on that tier instead) predicted
    again at other cache budgets, split anew at each: [(cache rows, Plan)]. What the plan's plot draws."""
    by_name = {t.name: t for t in tiers}
    by_layer = {t.layer: t for t in tables}
    ordered = [by_layer[t.layer] for t in plan.tables]            # plan.tables are in window order
    choice = [by_name[source or t.source] for t in plan.tables]
    ordered_curves = [_curve(curves, t.layer) for t in ordered]
    return [(int(c), _evaluate(ordered, choice, ordered_curves, int(c), resolve_ms=plan.resolve_ms,
                               kappa_ms=plan.kappa_ms, target_ms=plan.target_ms, grid=grid, refine=refine))
            for c in budgets]
