"""From run records to the results: Table 2 rows, Figure 3 and 5 points, the exposure model's fit (Eq. 1)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from benchmarks.e2e.jobs import Experiment
from benchmarks.e2e.run import E2ERun, Results
from slacktier.serve.report import PlacementRow, placement_rows, stat


def table2_rows(results: Results) -> list[PlacementRow]:
    """Per workload at Table 2's load: the DRAM table, then every Table 2 placement (paired runs), with
    RSS/TPOT/TTFT from the unpaired runs."""
    b = results.config.table2_batch
    out: list[PlacementRow] = []
    for w in results.config.workloads:
        here = [r.record for r in results.runs if r.record.workload == w and r.record.batch == b]
        paired = [r.record for r in results.runs if r.record.workload == w and r.record.batch == b
                  and r.record.paired and r.experiment is Experiment.TABLE2]
        if paired:
            out += placement_rows(paired, [r for r in here if not r.paired])
    return out


def figure3_points(results: Results) -> list[tuple[float, tuple[float, float, float]]]:
    """(f, (mean, min, max) paired overhead %) of the split sweep, with Table 2's disk-split at f = 0.5."""
    cfg = results.config
    by_f: dict[float, list[float]] = {}
    for r in results.runs:
        rec = r.record
        if (r.split_f is not None and rec.paired and rec.workload == cfg.workloads[0]
                and rec.batch == cfg.table2_batch):
            by_f.setdefault(round(r.split_f, 9), []).append(rec.overhead_pct)
    return [(f, stat(v)) for f, v in sorted(by_f.items())]


def figure5_points(results: Results) -> dict[str, dict[int, float]]:
    """Table 2 placement -> {B: mean paired overhead %}, for placements run at two loads or more."""
    out: dict[str, dict[int, list[float]]] = {}
    for r in results.runs:
        rec = r.record
        if r.experiment is Experiment.TABLE2 and rec.paired and rec.workload == results.config.workloads[0]:
            out.setdefault(rec.placement, {}).setdefault(rec.batch, []).append(rec.overhead_pct)
    return {p: {b: float(np.mean(v)) for b, v in sorted(pts.items())} for p, pts in out.items() if len(pts) >= 2}


@dataclass(frozen=True)
class ExposurePoint:
    """One paired engine run: Eq. 1's prediction (with kappa) and the measured slowdown."""

    run: E2ERun
    predicted_ms: float
    measured_ms: float


@dataclass(frozen=True)
class ExposureFit:
    """kappa fitted on the first run of each placement; the other runs and every delay run predicted."""

    fit_runs: int
    held_runs: int
    kappa_ms: float | None = None
    fit_rmse_ms: float = float("nan")
    fit_r2: float = float("nan")
    held_rmse_ms: float = float("nan")
    held_r2: float = float("nan")
    points: tuple[ExposurePoint, ...] = field(default=())


def exposure_fit(runs: list[E2ERun], layers: tuple[int, ...]) -> ExposureFit:
    """Windows W_l from each run's DRAM arm, T_l from the engine's per-step reads (or the injected delay)."""
    from slacktier.plan.exposure import LayerRead, exposure
    from slacktier.plan.fit import fit_quality

    rows = []
    for r in runs:
        rec = r.record
        if not rec.paired or not rec.step_reads_ms or not np.isfinite(rec.base_ms):
            continue
        stalls = [exposure([LayerRead(l, rec.layers[l].window_ms, max(st[l], rec.delays_ms.get(l, 0.0)))
                            for l in layers]).slowdown_ms for st in rec.step_reads_ms]
        rows.append((r, float(np.mean(stalls)), rec.step_ms - rec.base_ms))
    held_out = lambda r: r.record.rep != 0 or r.experiment is Experiment.DELAY  # noqa: E731
    fit = [(p, m) for r, p, m in rows if not held_out(r)]
    held = [(p, m) for r, p, m in rows if held_out(r)]
    if len(fit) < 2 or len(held) < 2:
        return ExposureFit(len(fit), len(held))
    kappa = float(np.mean([m - p for p, m in fit]))
    qf = fit_quality([p + kappa for p, _ in fit], [m for _, m in fit])
    qh = fit_quality([p + kappa for p, _ in held], [m for _, m in held])
    return ExposureFit(qf.runs, qh.runs, kappa, qf.rmse_ms, qf.r2, qh.rmse_ms, qh.r2,
                       tuple(ExposurePoint(r, p + kappa, m) for r, p, m in rows))
