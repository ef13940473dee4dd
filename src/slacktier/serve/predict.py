"""The planner's prediction of the step timeline, made before the timed runs.

Prediction of one (placement, B) on a profile, from inputs fixed before any timed run:

    windows W_l        the profile at B (serve.timeline.ComputeProfile.times)
    read-time model    per tier, the device read model (plan.readmodel: T_l = a + b P_l + c P_ahead +
                       c_behind P_behind) fitted to the tier's reads of the staged table's own regions
                       (serve.readfit.read_fit, what `slacktier probe --read-fit` runs), through the tier's page
                       sources as the engine opens them
    pages P_l          miss-page curves P_l(rows) of the FIT half of the traffic (`fit_miss_curves`), replayed
                       with the timeline's protocol (same B, same turns; the served cache's CLOCK); the timed runs
                       replay the held-out half
    resolve time s     s(B) = s0 + s1 * B, least squares over the fit configurations' measured mean s
    kappa              the mean residual over the fit configurations (plan.fit.fit_kappa)

and then plan.planner.predict_fixed_placement (the planner's own path: plan.exposure.device_exposure, Eq. 1
generalized) gives the stall per step, exactly as `slacktier plan` and `inspect` predict it. Only s and kappa
come from timed runs, and only from the fit configurations (`Calibration`); every other run is held out and
scored with plan.fit.fit_quality.

The tables of a step share each device's one deadline-ordered queue, so a table submitted second pays for the
pages queued ahead of it (c) and the first pays only what the pages behind it still cost (c_behind): the
model's ahead and behind terms, fitted on the same queue.

Injected delays (the paper's Table 3) are an experiment beside its benchmark,
benchmarks/paper/injected_delays.py: `run_jobs` and `planner_sweep` run a job with delays through the `delayed`
runner they are given.
"""

from __future__ import annotations

from pathlib import Path
from dataclasses import dataclass
from typing import Callable, Iterator, Mapping, Sequence

import numpy as np

from slacktier.errors import ErrorKind, SlackTierError
from slacktier.plan.curves import MissCurve, MissCurves
from slacktier.plan.exposure import LayerRead
from slacktier.plan.fit import FitQuality, Run, fit_kappa, fit_quality
from slacktier.plan.placement import Placement
from slacktier.plan.planner import predict_fixed_placement
from slacktier.plan.readfit import TierReadFit
from slacktier.plan.tiers import TierSpec
from slacktier.plan.types import TableDemand
from slacktier.serve.readfit import read_fit
from slacktier.serve.timeline import (ComputeProfile, StepTimes, SweepConfig, SweepRun, TimelineRunner,
                                      TimelineStep, summarize)


# ---- miss-page curves from the fit half -----------------------------------------------------------------

@dataclass(frozen=True)
class FitCurves:
    """Miss-page curves of full-batch decode steps of the fit half at one B, and how they were made."""

    curves: MissCurves
    batch: int             # the B predicted for
    replayed_batch: int    # the B the fit half was replayed at (< batch: it has too few sessions; pages scaled)
    sessions: int          # fit-half sessions available
    steps: int             # full-batch decode steps averaged

    @property
    def note(self) -> str:
        """'' when the fit half filled B, else what was scaled."""
        if self.replayed_batch == self.batch:
            return ""
        return (f"B={self.batch}: the fit half has {self.sessions} sessions, so its curve is replayed at "
                f"B={self.replayed_batch} and pages scaled by {self.batch}/{self.replayed_batch}")


def fit_miss_curves(cfg: SweepConfig, fit_sessions: Sequence, hasher, batch: int,
                    capacities_rows: Sequence[int]) -> FitCurves:
    """P_l(rows) of the first `cfg.decode_steps` full-batch decode steps of the fit sessions replayed as the
    timeline replays its traffic (prefill warms, CLOCK with step pins: the served cache's policy).

    Worked example: rows 0, 14, 15 missed in one decode step -> pages 0, 0, 1 -> 2 pages (15 rows a page).
    """
    from slacktier.workloads.characterize import decode_step_pages, prepare_layer, run_policy
    from slacktier.workloads.replay import ReplayConfig, collect_trace, replay_steps

    if not fit_sessions:
        raise SlackTierError(ErrorKind.MISSING, "no fit-half sessions for the miss-page curves",
                             fix="use traffic with a fit half (workloads.split)")
    b = min(batch, len(fit_sessions))
    rc = ReplayConfig(batch=b, decode_tokens=cfg.decode_tokens, prefill_chunk_tokens=cfg.prefill_chunk_tokens)
    steps, full = [], 0
    for st in replay_steps(list(fit_sessions), hasher, rc):
        steps.append(st)
        full += st.kind == "decode" and st.num_tokens == b
        if full >= cfg.decode_steps:
            break
    if full == 0:
        raise SlackTierError(ErrorKind.MISSING, f"the fit half ran no full B={b} decode step",
                             fix="use more decode tokens per turn or a smaller B")
    trace = collect_trace(iter(steps), hasher, cfg.workload, b)
    dec_steps = np.unique(trace.token_step[trace.token_decode])
    per_step = np.bincount(trace.token_step, minlength=int(trace.token_step.max()) + 1)
    is_full = per_step[dec_steps] == b                        # [decode steps] bool
    caps = sorted({int(c) for c in capacities_rows} | {0})
    layers: dict[int, MissCurve] = {}
    for layer in trace.layer_ids:
        prep = prepare_layer(trace, layer)
        pages = []
        for c in caps:
            hit = (np.zeros(prep.ids.shape[0], dtype=np.uint8) if c == 0
                   else run_policy(prep, "clock", c))
            pages.append(float(decode_step_pages(prep, hit)[is_full].mean()) * batch / b)
        layers[int(layer)] = MissCurve(tuple(float(c) for c in caps), tuple(pages))
    return FitCurves(MissCurves(cfg.workload, batch, layers), batch, b, len(fit_sessions), int(is_full.sum()))


# ---- the prediction and its calibration -----------------------------------------------------------------

@dataclass(frozen=True)
class Calibration:
    """What the timed fit configurations set: s(B) = s0 + s1 * B and kappa."""

    s0_ms: float
    s1_ms: float         # per sequence of the batch
    kappa_ms: float
    runs: int

    def resolve_ms(self, batch: int) -> float:
        """Modelled resolve time s at `batch` (never below 0)."""
        return max(0.0, self.s0_ms + self.s1_ms * batch)


@dataclass(frozen=True)
class PlannerInputs:
    """Everything the planner's timeline prediction uses, all fixed before a timed run."""

    profile: ComputeProfile
    workload: str
    tiers: Mapping[str, TierSpec]     # by tier name: the device read model and host-memory cost
    curves: Mapping[int, FitCurves]   # by B
    table_rows: Mapping[int, int]     # rows of each layer's table (this rank)

    def times(self, batch: int, layers: Sequence[int]) -> StepTimes:
        """The profile's windows and step at `batch`."""
        return self.profile.times(batch, self.workload, layers)


@dataclass(frozen=True)
class StepPrediction:
    """The predicted step: each layer's window and read time (window order), pages, s, kappa and the stall."""

    reads: tuple[LayerRead, ...]
    pages: dict[int, float]
    resolve_ms: float
    kappa_ms: float
    slowdown_ms: float


def predict(inputs: PlannerInputs, placement: Placement, batch: int, cal: Calibration | None = None) -> StepPrediction:
    """The predicted stall per step of `placement` at `batch`; `cal` None: s = 0 and kappa = 0.

    plan.planner.predict_fixed_placement with each tier's device read model, the placement's tiers and cache
    shares, tables submitted in depth (= window) order as the engine submits them, pages from the fit half's
    curves. Worked example: both on disk with (a, b, c, c_behind) = (0.3, 0.02, 0.005, 0.01), P = (100, 200) ->
    T1 = 0.3 + 0.02*100 + 0.01*200 = 4.3, T14 = 0.3 + 0.02*200 + 0.005*100 = 4.8.
    """
    if batch not in inputs.curves:
        raise SlackTierError(ErrorKind.MISSING, f"no miss-page curves for B={batch}",
                             fix="compute fit-half curves (fit_miss_curves) for every B of the sweep")
    curves = inputs.curves[batch].curves
    layers = sorted(curves.by_layer)
    times = inputs.times(batch, layers)
    missing = sorted({placement.tier(l) for l in layers} - set(inputs.tiers))
    if missing:
        raise SlackTierError(ErrorKind.MISSING, f"placement {placement.name} uses tiers {missing} without a "
                             "read-time model", fix="run the read fit (serve.readfit.read_fit) on every tier of the "
                             "sweep")
    s = cal.resolve_ms(batch) if cal else 0.0
    kappa = cal.kappa_ms if cal else 0.0
    tables = [TableDemand(l, int(inputs.table_rows[l]), "", times.windows_ms[l]) for l in layers]
    plan = predict_fixed_placement(
        tables, {l: placement.tier(l) for l in layers}, {l: placement.share(l) for l in layers},
        list(inputs.tiers.values()), curves.by_layer, placement.cache_rows,
        order={l: i for i, l in enumerate(layers)},   # the engine submits in depth = window order
        resolve_ms=s, kappa_ms=kappa)
    return StepPrediction(tuple(LayerRead(t.layer, t.window_ms, t.read_ms) for t in plan.tables),
                          {t.layer: t.pages_per_step for t in plan.tables}, s, kappa, plan.slowdown_ms)


def calibrate(inputs: PlannerInputs, fit_runs: Sequence[tuple[Placement, SweepRun]]) -> Calibration:
    """s(B) by least squares over the fit runs' mean s, then kappa (plan.fit.fit_kappa) from the predicted
    reads at those runs and their measured stall; refuses an empty fit set."""
    if not fit_runs:
        raise SlackTierError(ErrorKind.BAD_INPUT, "no fit runs to calibrate s and kappa on",
                             fix="name at least one fit configuration that ran")
    B = np.array([r.batch for _, r in fit_runs], dtype=np.float64)
    s = np.array([r.summary.s_ms for _, r in fit_runs], dtype=np.float64)
    if np.unique(B).size >= 2:
        s1, s0 = (float(x) for x in np.polyfit(B, s, 1))
    else:
        s1, s0 = 0.0, float(s.mean())
    cal = Calibration(s0, s1, 0.0, len(fit_runs))
    runs = [Run(reads=predict(inputs, p, r.batch).reads, slowdown_ms=r.summary.stall_ms,
                resolve_ms=cal.resolve_ms(r.batch)) for p, r in fit_runs]
    return Calibration(s0, s1, fit_kappa(runs).kappa_ms, len(fit_runs))


# ---- a sweep of given jobs on one staged table ------------------------------------------------------------

@dataclass(frozen=True)
class Job:
    """One timed configuration: a placement at B, with optional injected delays (layer, ms from step start)."""

    batch: int
    placement: Placement
    delays_ms: tuple[tuple[int, float], ...] = ()
    group: str = "load"      # which report it belongs to (load, split, delays)

    @property
    def label(self) -> str:
        """The placement's name, with its delays."""
        if not self.delays_ms:
            return self.placement.name
        return self.placement.name + "+delay " + "/".join(f"{ms:g}" for _, ms in self.delays_ms)


def run_jobs(tiers, cfg: SweepConfig, jobs: Sequence[Job], pools: Mapping[int, list], hasher,
             times: Mapping[int, StepTimes], progress: bool = False, delayed: DelayedRun | None = None
             ) -> list[tuple[Job, SweepRun]]:
    """Every job `cfg.runs` times, shuffled per repetition, on one staged TierSet (the protocol of
    benchmarks/paper/timeline_sweep.py: cold cache per run, prefill warms off the timeline, the checker after).

    A job with injected delays is run by `delayed` (the Table 3 analog's experiment,
    benchmarks/paper/injected_delays.py: `run_delayed`); without it such a job is refused before any run."""
    from slacktier.serve.timeline import checked_steps, run_replay
    from slacktier.workloads.replay import ReplayConfig, replay_steps

    _check_delayed(jobs, delayed)

    rng = np.random.default_rng(cfg.seed)
    out: list[tuple[Job, SweepRun]] = []
    for rep in range(cfg.runs):
        for order, k in enumerate(rng.permutation(len(jobs))):
            job = jobs[k]
            tiers.provider(job.placement)   # switches the one engine in place, cold cache
            rc = ReplayConfig(batch=job.batch, decode_tokens=cfg.decode_tokens,
                              prefill_chunk_tokens=cfg.prefill_chunk_tokens)
            replay = iter(replay_steps(pools[job.batch], hasher, rc))
            if job.delays_ms:
                steps = delayed(tiers.engine, times[job.batch], dict(job.delays_ms), replay, job.batch,
                                cfg.decode_steps)
                checked, mism = 0, 0
            else:
                runner = TimelineRunner(tiers.engine, times[job.batch])
                steps = run_replay(runner, replay, job.batch, cfg.decode_steps)
                checked, mism = checked_steps(tiers.engine, runner, replay, job.batch, cfg.check_steps)
            run = SweepRun(job.label, job.batch, rep, order, times[job.batch].step_ms, summarize(steps),
                           checked, mism)
            out.append((job, run))
            if progress:
                print(f"  run {rep + 1}/{cfg.runs} B={job.batch} {job.label}: {run.summary.stall_ms:.2f} ms "
                      "stall/step", flush=True)
    return out


#: runs a job with injected delays: (engine, the profile's times at B, delays_ms, replay, B, decode steps) ->
#: its timed steps (benchmarks/paper/injected_delays.py: run_delayed)
DelayedRun = Callable[[object, StepTimes, Mapping[int, float], Iterator, int, int], list[TimelineStep]]


def _check_delayed(jobs: Sequence[Job], delayed: DelayedRun | None) -> None:
    """Refuses jobs with injected delays when no runner for them was given (before anything is staged)."""
    if delayed is None and any(j.delays_ms for j in jobs):
        label = next(j.label for j in jobs if j.delays_ms)
        raise SlackTierError(ErrorKind.BAD_INPUT, f"job {label} injects delays, and no runner for them was given",
                             fix="pass delayed=run_delayed (benchmarks/paper/injected_delays.py)")


# ---- the whole protocol: inputs before the runs, the runs, calibration on the fit set, predictions -----------

@dataclass
class PlannerSweep:
    """A sweep's runs with the planner's predictions (see the module docstring) and what they came from."""

    profile: ComputeProfile
    layer_ids: tuple[int, ...]
    table_rows: int                          # rows per layer of the scaled table
    fits: dict[str, TierReadFit]
    inputs: PlannerInputs
    cal: Calibration
    done: list[tuple[Job, SweepRun]]
    is_fit: list[bool]                       # per entry of `done`: a fit configuration (sets s and kappa)
    predicted_ms: dict[tuple[int, str], float]   # (B, label) -> the planner's stall per step
    holdout_sessions: int
    fit_sessions: int

    def held_out(self, group: str | None = None, held_out_sessions_only: bool = False) -> list[tuple[Job, SweepRun]]:
        """Runs not in the fit set (of `group`; with `held_out_sessions_only`, only B the held-out half fills)."""
        return [(j, r) for (j, r), f in zip(self.done, self.is_fit)
                if not f and j.group != "delays" and (group is None or j.group == group)
                and (not held_out_sessions_only or j.batch <= self.holdout_sessions)]

    def quality(self, rows: Sequence[tuple[Job, SweepRun]]) -> FitQuality | None:
        """RMSE and R^2 of the prediction against the measured stall per step over `rows` (None: under 2 runs)."""
        if len(rows) < 2:
            return None
        return fit_quality([self.predicted_ms[(j.batch, j.label)] for j, _ in rows],
                           [r.summary.stall_ms for _, r in rows])


def planner_sweep(cfg: SweepConfig, jobs_of, is_fit, *, read_fit_runs: int = 30, max_cache_rows: int = 0,
                  curve_points: int = 17, progress: bool = False, delayed: DelayedRun | None = None
                  ) -> PlannerSweep:
    """Stage the scaled table; fix the planner's inputs (read fits of disk and DRAM on its regions, fit-half
    miss curves at every B the jobs use); run `jobs_of(first, second)` `cfg.runs` times shuffled; set s(B) and
    kappa on the runs `is_fit(job)` picks; predict every job.

    The traffic is serve.timeline.sweep_sessions' (held-out sessions first); a B it cannot fill is refused.
    """
    from slacktier.serve.runs import clip_sessions
    from slacktier.serve.tiers import TierSet
    from slacktier.serve.timeline import load_profile
    from slacktier.tables.engram_hash import EngramLayout
    from slacktier.workloads.corpus import CorpusConfig, load_workload
    from slacktier.workloads.hashing import EngramLookupHasher

    profile = load_profile(cfg.profile)
    layout = EngramLayout.scaled(cfg.engram_vocab, (1, 14))
    first, second = layout.layer_ids[:2]
    hasher = EngramLookupHasher(layout)
    jobs: list[Job] = list(jobs_of(first, second))
    _check_delayed(jobs, delayed)
    split = load_workload(cfg.workload, CorpusConfig(seed=cfg.seed, agent_sessions_per_source=1))
    holdout = clip_sessions(split.holdout, cfg.max_session_tokens, cfg.max_turns)
    fit = clip_sessions(split.fit, cfg.max_session_tokens, cfg.max_turns)
    pool = holdout + fit
    batches = sorted({j.batch for j in jobs})
    for b in batches:
        if len(pool) < b:
            raise SlackTierError(ErrorKind.BAD_INPUT, f"B={b} needs {b} sessions; the {cfg.workload} traffic "
                                 f"has {len(pool)} within {cfg.max_session_tokens} tokens",
                                 fix="pick a smaller B or more traffic (no session is repeated to fill a batch)")
    times = {b: profile.times(b, cfg.workload, layout.layer_ids) for b in batches}
    cache_rows = max([cfg.cache_rows, max_cache_rows, *(j.placement.cache_rows for j in jobs)])
    tiers = TierSet(Path(cfg.workdir) / "tables", layout, seed=cfg.seed + 1, max_cache_rows=cache_rows,
                    max_tokens=max(cfg.prefill_chunk_tokens, *batches), devices=1, metrics=cfg.metrics)
    try:
        tiers.stage(device_counts=(1,), progress=progress)
        if progress:
            print("  read fit (disk, dram) on the staged regions; fit-half miss-page curves ...", flush=True)
        fits = {t: read_fit(t, tiers.manifests[1], (first, second), runs=read_fit_runs, seed=cfg.seed)
                for t in sorted({t for j in jobs for _, t in j.placement.tiers})}
        caps = np.linspace(0, cache_rows, curve_points).astype(int).tolist()
        curves = {b: fit_miss_curves(cfg, fit, hasher, b, caps) for b in batches}
        inputs = PlannerInputs(profile, cfg.workload, {t: f.spec for t, f in fits.items()}, curves,
                               {l: layout.rows(i) for i, l in enumerate(layout.layer_ids)})
        done = run_jobs(tiers, cfg, jobs, {b: pool for b in batches}, hasher, times, progress=progress,
                        delayed=delayed)
    finally:
        tiers.close()
    flags = [bool(is_fit(j)) for j, _ in done]
    fit_runs = [(j.placement, r) for (j, r), f in zip(done, flags) if f]
    cal = calibrate(inputs, fit_runs)
    pred = {(j.batch, j.label): predict(inputs, j.placement, j.batch, cal).slowdown_ms
            for j, _ in done if j.group != "delays"}
    return PlannerSweep(profile, tuple(layout.layer_ids), layout.rows(0), fits, inputs, cal, done, flags, pred,
                        len(holdout), len(fit))
