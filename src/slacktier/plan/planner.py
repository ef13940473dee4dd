"""The placement planner: windows + tier read-time models + miss curves + a cache budget -> a control file.

For every assignment of tables to tiers (tables are few: two for DeepSeek-V4.1,
one for Qwen3.8), the planner
  1. splits the cache (plan.split) with per-page weights taken from the read time
     that binds on each tier: the first table submitted to a tier pays b per own
     page, every later table on it costs that first table c per page;
  2. predicts each table's read time (plan.tiers) from its pages behind its share,
     and the step's stalls and slowdown (plan.exposure, Eq. 1);
  3. keeps the assignment if the slowdown stays within the target.
Of the kept assignments it returns the one with the least host memory (ties: the
smaller slowdown). With a target of 0 and kappa 0 this puts a table on a slow
tier exactly when its reads fit its window.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

from slacktier.errors import ErrorKind, SlackTierError
from slacktier.plan.curves import MissCurve
from slacktier.plan.exposure import LayerRead, exposure
from slacktier.plan.split import best_split
from slacktier.plan.tiers import TierSpec

MAX_ENUMERATED_TABLES = 8  # 3^8 assignments; real models have one or two tables


@dataclass(frozen=True)
class TableSpec:
    """One table to place: the layer that reads it, its rows (this rank's shard), its manifest, its window."""

    layer: int
    rows: int
    manifest: str
    window_ms: float

    def __post_init__(self) -> None:
        if self.rows < 0 or self.window_ms < 0:
            raise SlackTierError(ErrorKind.BAD_INPUT, f"rows {self.rows}, window {self.window_ms} ms",
                                 fix="rows and windows are >= 0", layer=self.layer)


@dataclass(frozen=True)
class TablePlan:
    """Where one table goes and what the model predicts for it."""

    layer: int
    manifest: str
    source: str            # tier name
    order: int             # window order, 0 = shortest window (submitted first)
    cache_share: float     # f_l
    cache_rows: float      # f_l * C
    window_ms: float
    pages_per_step: float  # P_l(f_l * C)
    read_ms: float         # T_l
    stall_ms: float        # d_l
    host_bytes: int


@dataclass(frozen=True)
class Plan:
    """A placement with its predicted slowdown and host memory."""

    tables: tuple[TablePlan, ...]  # window order
    cache_rows: int
    target_ms: float
    kappa_ms: float
    resolve_ms: float
    slowdown_ms: float
    host_bytes: int
    split_cost_ms: float
    assignments_tried: int
    assignments_feasible: int


def _evaluate(tables: Sequence[TableSpec], tiers: Sequence[TierSpec], curves: Sequence[MissCurve],
              cache_rows: int, *, resolve_ms: float, kappa_ms: float, target_ms: float,
              grid: int, refine: int) -> Plan:
    """Predict one assignment (tables and tiers in window order, paired by position)."""
    n = len(tables)
    first_on_tier: dict[str, int] = {}
    for i, t in enumerate(tiers):
        first_on_tier.setdefault(t.name, i)
    weights = [t.page_ms if first_on_tier[t.name] == i else t.contention_page_ms for i, t in enumerate(tiers)]
    split = best_split([t.layer for t in tables], curves, weights, cache_rows, grid=grid, refine=refine)
    pages = split.pages_per_step
    reads = []
    for i, (tab, tier) in enumerate(zip(tables, tiers)):
        before = sum(pages[j] for j in range(i) if tiers[j].name == tier.name)
        after = sum(pages[j] for j in range(i + 1, n) if tiers[j].name == tier.name)
        read_ms = tier.intercept_ms + tier.page_ms * (pages[i] + before) + tier.contention_page_ms * after
        reads.append(LayerRead(layer=tab.layer, window_ms=tab.window_ms, read_ms=read_ms))
    exp = exposure(reads, resolve_ms=resolve_ms, kappa_ms=kappa_ms)
    plans = tuple(
        TablePlan(layer=tab.layer, manifest=tab.manifest, source=tier.name, order=i,
                  cache_share=split.shares[i], cache_rows=split.shares[i] * cache_rows,
                  window_ms=tab.window_ms, pages_per_step=pages[i], read_ms=reads[i].read_ms,
                  stall_ms=exp.stall_of(tab.layer), host_bytes=tier.host_bytes(tab.rows))
        for i, (tab, tier) in enumerate(zip(tables, tiers)))
    return Plan(tables=plans, cache_rows=int(cache_rows), target_ms=target_ms, kappa_ms=kappa_ms,
                resolve_ms=resolve_ms, slowdown_ms=exp.slowdown_ms,
                host_bytes=sum(p.host_bytes for p in plans), split_cost_ms=split.cost_ms,
                assignments_tried=1, assignments_feasible=int(exp.slowdown_ms <= target_ms))


def predict_placement(tables: Sequence[TableSpec], sources: Mapping[int, str], tiers: Sequence[TierSpec],
                      curves: Mapping[int, MissCurve], cache_rows: int, *, resolve_ms: float = 0.0,
                      kappa_ms: float = 0.0, target_ms: float = 0.0, grid: int = 200, refine: int = 20) -> Plan:
    """Predicted slowdown, split and host memory of a given placement (layer -> tier name)."""
    by_name = {t.name: t for t in tiers}
    ordered = sorted(tables, key=lambda t: (t.window_ms, t.layer))
    try:
        chosen = [by_name[sources[t.layer]] for t in ordered]
    except KeyError as exc:
        raise SlackTierError(ErrorKind.MISSING, f"no tier or source for {exc}",
                             fix=f"place every table on one of {sorted(by_name)}") from exc
    return _evaluate(ordered, chosen, [_curve(curves, t.layer) for t in ordered], cache_rows,
                     resolve_ms=resolve_ms, kappa_ms=kappa_ms, target_ms=target_ms, grid=grid, refine=refine)


def _curve(curves: Mapping[int, MissCurve], layer: int) -> MissCurve:
    if layer not in curves:
        raise SlackTierError(ErrorKind.MISSING, f"no miss-page curve for layer {layer}",
                             fix="characterize this layer's accesses (slacktier characterize)", layer=layer)
    return curves[layer]


def make_plan(tables: Sequence[TableSpec], tiers: Sequence[TierSpec], curves: Mapping[int, MissCurve],
              cache_rows: int, target_ms: float, *, resolve_ms: float = 0.0, kappa_ms: float = 0.0,
              grid: int = 200, refine: int = 20) -> Plan:
    """The placement with the least host memory whose predicted slowdown is within `target_ms`."""
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


def _toml_str(s: str) -> str:
    """A TOML basic string."""
    out = s.replace("\\", "\\\\").replace('"', '\\"')
    return '"' + "".join(c if c >= " " else f"\\u{ord(c):04x}" for c in out) + '"'


@dataclass(frozen=True)
class EngineSettings:
    """The [engine] section of a control file."""

    device: str = "cpu"
    io_threads: int = 1
    verify_reads: bool = False
    lossy: bool = False


def control_toml(plan: Plan, engine: EngineSettings = EngineSettings()) -> str:
    """The engine control file for a plan; predictions ride along as comments."""
    b = lambda x: "true" if x else "false"  # noqa: E731
    lines = [
        "# SlackTier control file written by `slacktier plan`.",
        f"# predicted slowdown {plan.slowdown_ms:.4f} ms per step (target {plan.target_ms:.4f} ms, "
        f"kappa {plan.kappa_ms:.4f} ms, resolve {plan.resolve_ms:.4f} ms)",
        f"# host memory {plan.host_bytes} bytes ({plan.host_bytes / 2**30:.3f} GiB)",
        "",
        "[engine]",
        f"device = {_toml_str(engine.device)}",
        f"cache_rows = {plan.cache_rows}",
        f"io_threads = {engine.io_threads}",
        f"verify_reads = {b(engine.verify_reads)}",
        f"lossy = {b(engine.lossy)}",
    ]
    for t in plan.tables:
        lines += [
            "",
            f"# layer {t.layer}: window {t.window_ms:.4f} ms, {t.pages_per_step:.2f} pages/step behind "
            f"{t.cache_rows:.0f} cache rows, read {t.read_ms:.4f} ms, stall {t.stall_ms:.4f} ms, "
            f"host {t.host_bytes} bytes",
            "[[table]]",
            f"layer = {t.layer}",
            f"manifest = {_toml_str(t.manifest)}",
            f"source = {_toml_str(t.source)}",
            f"cache_share = {t.cache_share!r}",
            f"order = {t.order}",
        ]
    return "\n".join(lines) + "\n"


def write_control_file(plan: Plan, path: str | Path, engine: EngineSettings = EngineSettings()) -> Path:
    """Write the control file for `plan` to `path`."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(control_toml(plan, engine))
    return p
