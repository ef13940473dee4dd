"""What-if: a placement's decode cost on devices this machine does not have (issue 31).

`slacktier whatif` runs the step timeline (serve.timeline: device compute
from a profile, host pass and cache real) for every TP rank of a staged
table at once, with each table's reads served by an emulated device
(store/emulated.py: real bytes, completions at the times a device model
gives) or, with one rank, by this machine's disk. Ranks map to emulated disks
as the paper's configurations do: `shared` (one disk for all ranks, the
paper's "1 disk") or `per-rank` (one disk per rank, its "4 disks").

One TP step (`WhatIfRun`):

    pull the step's ids (hash), before the step's clock starts (s is begin_step alone, the paper's s)
    every emulated device: begin_step
    for each rank r: device.rank_host_pass(r); begin_step(ids of r's columns)   -> b_r ms  (pre-phase)
    every emulated device: seal (queue, time and copy into the pools the batches the ranks' lanes booked)
    for each rank r: its timeline step; its begin_step is the pre-phase's (its batches land relative to
                     now: device.start_rank(r)), held for b_r ms so s = b_r
    the step's stall is the slowest rank's

The ranks' host passes run one after another in this one process (each
rank's own b_r is what its own CPU would take alone; on a TP node each rank
has its own cores); every rank's batches are placed on its device's clock
relative to its own step start, so the device sees the four ranks' reads as
arriving together, as on the node. One rank runs the same way; only a
placement with a layer on this machine's disk (one rank) runs its
begin_step inline, on the step's clock, since its reads are real.

The report's first line names both sides: "device reads from model X;
device compute from profile Y". Beside the measured stall it prints the
analytic prediction: Eq. 1 (plan.exposure) with each device's read model
(plan.readmodel, the model's terms scaled to the ranks sharing the device)
and the run's own mean pages per rank and s.
"""

from __future__ import annotations

import gc
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

import slacktier.store  # noqa: F401 - registers every tier, the emulated one included, before tier_facts reads them
from slacktier.config import tier_facts
from slacktier.errors import ErrorKind, SlackTierError
from slacktier.plan.report import in_host_memory, save_figure
from slacktier.serve.timeline import (ComputeProfile, LayerSubset, StepTimes, SweepConfig, TimelineRunner,
                                      TimelineStep, load_profile, sleep_then_spin, sweep_sessions)

log = logging.getLogger(__name__)

DISK_MAPS = ("shared", "per-rank")
#: the tiers a what-if table can be placed on: the stock DRAM path, an emulated device, this machine's disk
TABLE_TIERS = ("dram", "emulated", "disk")


@dataclass(frozen=True)
class WhatIfPlacement:
    """Tier of each lookup layer, the device model of each emulated one, and the row cache split."""

    name: str
    tiers: tuple[tuple[int, str], ...]            # (layer, one of TABLE_TIERS)
    models: tuple[tuple[int, str], ...] = ()      # (layer, device model) of the emulated layers
    cache_rows: int = 0                           # rows per rank
    shares: tuple[tuple[int, float], ...] = ()    # (layer, share of cache_rows)
    disks: str = "shared"                         # how ranks map to emulated disks

    def __post_init__(self) -> None:
        tiers = dict(self.tiers)
        models = dict(self.models)
        for layer, tier in self.tiers:
            if tier not in TABLE_TIERS:
                raise SlackTierError(ErrorKind.BAD_INPUT, f"placement {self.name}: layer {layer} on {tier!r}",
                                     fix=f"use one of {', '.join(TABLE_TIERS)}", layer=layer)
        for layer in models:
            if layer not in tiers or tier_facts(tiers[layer]).device_kind != "model":
                raise SlackTierError(ErrorKind.BAD_INPUT, f"placement {self.name}: layer {layer} has device model "
                                     f"{models[layer]} but is placed on {tiers.get(layer, 'dram')}",
                                     fix="a table is read from one device: either emulated with a model or "
                                         "real, not both", layer=layer)
        for layer, tier in self.tiers:
            if tier_facts(tier).device_kind == "model" and layer not in models:
                raise SlackTierError(ErrorKind.BAD_INPUT, f"placement {self.name}: layer {layer} is emulated "
                                     "without a device model", fix="name its model (nvme-paper, rdma-paper, "
                                     "this-disk or a TOML file)", layer=layer)
        if self.disks not in DISK_MAPS:
            raise SlackTierError(ErrorKind.BAD_INPUT, f"disks {self.disks!r}", fix=f"use one of {DISK_MAPS}")
        if sum(s for _, s in self.shares) > 1 + 1e-9 or any(s < 0 for _, s in self.shares):
            raise SlackTierError(ErrorKind.BAD_INPUT, f"placement {self.name}: cache shares {self.shares}",
                                 fix="shares >= 0 summing to at most 1")

    def tier(self, layer: int) -> str:
        """The tier of `layer` (DRAM unless placed)."""
        return dict(self.tiers).get(layer, "dram")

    def share(self, layer: int) -> float:
        return dict(self.shares).get(layer, 0.0)


@dataclass(frozen=True)
class WhatIfConfig:
    """The table, traffic, profile and timing of a what-if (the placement comes per run)."""

    workdir: str = "runs/whatif"
    profile: str = "v41_paper"
    workload: str = "chat"
    batch: int = 32
    ranks: int = 4
    engram_vocab: int = 50_000        # the staged table's per-head vocabulary (V4.1: 16M; see the bench log)
    decode_steps: int = 16            # TP steps timed per run
    warmup_steps: int = 4             # TP steps run before the timed ones, not recorded
    decode_tokens: int = 128
    max_session_tokens: int = 1024
    max_turns: int = 2
    prefill_chunk_tokens: int = 2048
    start_spread_steps: int = 16
    seed: int = 0
    table_seed: int = 1
    check_steps: int = 2              # TP steps after the timed ones with every rank's checker on (untimed)
    this_disk: str = ""               # tiers file with the disk's read fit (model `this-disk`)
    #: the host pass s stated for the user's host (ms per rank): each rank's timeline holds begin_step this long
    #: instead of its own measured pre-phase time; None: measured on this machine (the default)
    host_pass_ms: float | None = None
    table_ranks: int = 0              # ranks the table is staged for (0: `ranks`); ranks 0..ranks-1 of it run

    @property
    def staged_ranks(self) -> int:
        return self.table_ranks or self.ranks

    def __post_init__(self) -> None:
        if self.ranks < 1 or 24 % self.ranks or self.table_ranks < 0 or 24 % (self.table_ranks or 1) or (
                self.table_ranks and self.table_ranks < self.ranks):
            raise SlackTierError(ErrorKind.BAD_INPUT, f"ranks {self.ranks}",
                                 fix="use a rank count that divides V4.1's 24 hash columns (1, 2, 3, 4, 6, ...)")
        if self.host_pass_ms is not None and not (isinstance(self.host_pass_ms, (int, float))
                                                  and math.isfinite(self.host_pass_ms)
                                                  and 0 <= self.host_pass_ms <= 1000):
            raise SlackTierError(ErrorKind.BAD_INPUT, f"host_pass_ms = {self.host_pass_ms!r}",
                                 fix="state the host pass as a number of ms in 0..1000, or leave it measured")
        if self.batch < 1 or self.decode_steps < 1 or self.engram_vocab < 1:
            raise SlackTierError(ErrorKind.BAD_INPUT, f"batch {self.batch}, decode_steps {self.decode_steps}, "
                                 f"engram_vocab {self.engram_vocab}", fix="give positive values")

    def sweep(self) -> SweepConfig:
        return SweepConfig(workload=self.workload, profile=self.profile, batches=(self.batch,),
                           decode_tokens=self.decode_tokens, max_session_tokens=self.max_session_tokens,
                           max_turns=self.max_turns, prefill_chunk_tokens=self.prefill_chunk_tokens, seed=self.seed)


def this_disk_model(tiers_file: str | Path, tier: str = "disk", queue_depth: int = 128):
    """`this-disk`: the read fit of `tier` in a tiers file from `slacktier probe --read-fit` (one rank)."""
    from slacktier.plan.tiers import load_tiers
    from slacktier.store.emulated import DeviceModel

    specs = {t.name: t for t in load_tiers(tiers_file)}
    if tier not in specs:
        raise SlackTierError(ErrorKind.MISSING, f"tiers file {tiers_file} has no tier {tier!r}",
                             fix="fit it first: slacktier probe --read-fit MANIFEST --read-tiers disk")
    m, fit = specs[tier].read, specs[tier].fit
    origin = f"read fit in {tiers_file}" + (f", measured {fit.measured}" if fit is not None and fit.measured else "")
    return DeviceModel("this-disk", m.intercept_ms, m.page_ms * 1e3, m.behind_page_ms * 1e3, queue_depth, 1, origin)


def model_file(spec: str, cfg: WhatIfConfig) -> str:
    """What `[table.emulated] model` gets for a model spec: built-in names and files as given; `this-disk`
    written to a TOML file in the workdir from the read fit of `cfg.this_disk`."""
    if spec != "this-disk":
        return spec
    if not cfg.this_disk:
        raise SlackTierError(ErrorKind.MISSING, "device model this-disk needs the disk's read fit",
                             fix="pass --this-disk TIERS (written by slacktier probe --read-fit)")
    from slacktier.store.emulated import device_model_toml

    text = device_model_toml(this_disk_model(cfg.this_disk))   # a bad tiers file is refused before anything is written
    path = Path(cfg.workdir) / "this-disk.toml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return str(path)


def resolve_model(spec: str, cfg: WhatIfConfig):
    """The DeviceModel a spec names (for reports and predictions)."""
    from slacktier.store.emulated import load_device_model

    return load_device_model(model_file(spec, cfg))


def stage_table(cfg: WhatIfConfig, progress: bool = False):
    """The staged scaled V4.1 table of every rank (reused when its manifest checks out)."""
    from slacktier.tables.engram_hash import EngramLayout
    from slacktier.tables.manifest import Manifest, StagedLayout
    from slacktier.tables.stage import stage_synthetic

    layout = EngramLayout.scaled(cfg.engram_vocab, (1, 14))
    manifest_path = Path(cfg.workdir) / f"v41x{cfg.engram_vocab}-tp{cfg.staged_ranks}.manifest.json"
    target = Path(cfg.workdir) / f"v41x{cfg.engram_vocab}-tp{cfg.staged_ranks}.bin"
    if manifest_path.is_file():
        m = Manifest.load(manifest_path)
        if m.ranks == cfg.staged_ranks and m.source.get("seed") == cfg.table_seed and m.layout == StagedLayout.from_layout(
                layout):
            try:
                m.check_targets()
                return layout, m
            except SlackTierError as exc:   # its file was removed or overwritten: stage it again
                log.info("whatif: restaging %s (%s)", manifest_path, exc)
    Path(cfg.workdir).mkdir(parents=True, exist_ok=True)
    return layout, stage_synthetic([target], layout, cfg.staged_ranks, cfg.table_seed, overwrite=True,
                                   manifest_path=manifest_path, progress=progress)


def device_name(placement: WhatIfPlacement, rank: int, model: str) -> str:
    """The emulated device rank `rank` reads `model`'s tables from: one for all ranks, or its own (tables on
    different models are on different devices)."""
    return f"{model}:disk0" if placement.disks == "shared" else f"{model}:disk{rank}"


def rank_control(manifest, rank: int, placement: WhatIfPlacement, cfg: WhatIfConfig, max_tokens: int):
    """Rank `rank`'s control file for the placement's engine-served layers (owned_only), and those layers."""
    from slacktier.config import ControlFile, DiskOptions, EngineConfig, TableConfig
    from slacktier.store.emulated import EmulatedOptions

    served = [l for l in manifest.layout.layer_ids if not tier_facts(placement.tier(l)).holds_host_copy]
    models = dict(placement.models)
    engine = EngineConfig(device="cpu", cache_rows=placement.cache_rows, max_cache_rows=max(1, placement.cache_rows),
                          max_tokens=max_tokens, owned_only=True, wait_timeout_ms=60_000.0)
    tables = []
    for order, l in enumerate(served):
        tier = placement.tier(l)
        options = (EmulatedOptions(model=model_file(models[l], cfg), device=device_name(placement, rank, models[l]),
                                   rank=rank)
                   if tier_facts(tier).device_kind == "model" else DiskOptions())
        tables.append(TableConfig(layer=l, manifest=str(manifest.path), source=tier, options=options, rank=rank,
                                  cache_share=placement.share(l), order=order))
    return ControlFile(engine=engine, tables=tuple(tables)), served


class _PrePassed(LayerSubset):
    """A rank engine for the timeline (module docstring). Its begin_step already ran in the TP step's pre-phase:
    begin_step then releases the rank's batches on its devices' clocks from now and holds for the pre-phase's own
    time. With a layer on this machine's disk (`inline`, one rank) begin_step runs in place, its batches timed
    from its start."""

    def __init__(self, engine, axes: Sequence[int], rank: int, devices, inline: bool,
                 hold_s: float | None = None) -> None:
        super().__init__(engine, axes)
        self.rank = rank
        self.devices = devices
        self.inline = inline
        self.hold_s = hold_s      # a stated host pass (WhatIfConfig.host_pass_ms); None: the measured one
        self.begin_s = 0.0        # the last pre-phase's begin_step, measured
        self.prepassed = False

    def pre(self, ids: np.ndarray) -> None:
        for d in self.devices:
            d.rank_host_pass(self.rank)
        t = time.perf_counter()
        self.engine.begin_step(np.asarray(ids)[:, self.axes, :])
        self.begin_s = time.perf_counter() - t
        self.prepassed = True

    def begin_step(self, ids: np.ndarray) -> None:
        if self.prepassed:
            t = time.perf_counter_ns()
            for d in self.devices:
                d.start_rank(self.rank, t)
            sleep_then_spin(t / 1e9 + (self.begin_s if self.hold_s is None else self.hold_s))
            self.prepassed = False
            return
        if not self.inline:   # off the TP step protocol (warm steps): batches land as if alone
            self.engine.begin_step(np.asarray(ids)[:, self.axes, :])
            return
        t = time.perf_counter_ns()
        for d in self.devices:
            d.begin_step()
            d.rank_host_pass(self.rank, t)
        self.engine.begin_step(np.asarray(ids)[:, self.axes, :])
        for d in self.devices:
            d.start_rank(self.rank, t)
            d.end_step()


@dataclass(frozen=True)
class WhatIfRun:
    """One run of a placement: per TP step each rank's timeline step."""

    placement: WhatIfPlacement
    rep: int
    times: StepTimes                               # the profile's step and windows at this B
    steps: tuple[tuple[TimelineStep, ...], ...]   # [step][rank]
    served: tuple[int, ...]
    checked_steps: int = 0
    mismatches: int = 0
    wall_s: float = 0.0
    #: [step][rank] begin_step of the pre-phase as measured here, in ms (the timeline's s unless s was stated)
    measured_s_ms: tuple[tuple[float, ...], ...] = ()

    @property
    def step_ms(self) -> float:
        return self.times.step_ms

    @property
    def windows_ms(self) -> dict[int, float]:
        return self.times.windows_ms

    def tp_stalls_ms(self) -> np.ndarray:
        """Each TP step's stall: its slowest rank's."""
        return np.array([max(r.stall_total_ms for r in st) for st in self.steps])

    def rank_mean(self, f) -> np.ndarray:
        """[ranks] mean of f(step) over the run's steps."""
        return np.array([np.mean([f(st[k]) for st in self.steps]) for k in range(len(self.steps[0]))])


def _replay(cfg: WhatIfConfig, hasher):
    from slacktier.workloads.replay import ReplayConfig, replay_steps

    pool = sweep_sessions(cfg.sweep(), cfg.batch)
    rc = ReplayConfig(batch=cfg.batch, decode_tokens=cfg.decode_tokens, prefill_chunk_tokens=cfg.prefill_chunk_tokens,
                      start_spread_steps=cfg.start_spread_steps, seed=cfg.seed)
    return replay_steps(pool, hasher, rc)


def run_placement(cfg: WhatIfConfig, placement: WhatIfPlacement, manifest, layout, profile: ComputeProfile,
                  rep: int = 0, progress: bool = False) -> WhatIfRun:
    """One run of `placement` over every rank (module docstring)."""
    from slacktier.engine.step import StepEngine
    from slacktier.store.emulated import emulated_devices, forget_devices
    from slacktier.workloads.hashing import EngramLookupHasher

    real = [l for l, t in placement.tiers if tier_facts(t).device_kind == "file"]
    if real and cfg.host_pass_ms is not None:
        raise SlackTierError(ErrorKind.BAD_INPUT, f"placement {placement.name}: a stated host pass with layer "
                             f"{real[0]} on this machine's disk", fix="leave s measured for real-disk placements: "
                             "their reads start in begin_step, on the step's clock", layer=real[0])
    if real and cfg.ranks > 1:
        raise SlackTierError(ErrorKind.BAD_INPUT, f"placement {placement.name}: layer {real[0]} on this machine's "
                             f"disk with {cfg.ranks} ranks", fix="run real-disk placements with --ranks 1 (one "
                             "process's disk is the paper's one disk per rank)", layer=real[0])
    t_run = time.perf_counter()
    times = profile.times(cfg.batch, cfg.workload, layout.layer_ids)
    hasher = EngramLookupHasher(layout)
    max_tokens = max(cfg.prefill_chunk_tokens, cfg.batch)
    forget_devices()
    engines, runners, wrapped = [], [], []
    served: list[int] = []
    try:
        for rank in range(cfg.ranks):
            control, served = rank_control(manifest, rank, placement, cfg, max_tokens)
            engines.append(StepEngine.from_config(control, ids_layers=tuple(served), columns=layout.n_columns))
        devices = emulated_devices()
        for rank, eng in enumerate(engines):
            axes = [layout.layer_ids.index(l) for l in served]
            w = _PrePassed(eng, axes, rank, devices, inline=bool(real),
                           hold_s=None if cfg.host_pass_ms is None else cfg.host_pass_ms / 1e3)
            wrapped.append(w)
            runners.append(TimelineRunner(w, StepTimes(times.workload, times.batch, times.step_ms,
                                                       {l: times.windows_ms[l] for l in served})))
        warm = placement.cache_rows > 0
        replay = iter(_replay(cfg, hasher))
        measured: list[tuple[float, ...]] = []
        steps = _tp_steps(runners, wrapped, devices, replay, cfg.batch, cfg.decode_steps, cfg.warmup_steps, warm,
                          measured)
        checked, bad = _checked(engines, runners, wrapped, devices, replay, cfg.batch, cfg.check_steps, warm)
    finally:
        for eng in engines:
            eng.close()
        forget_devices()
        gc.collect()
    run = WhatIfRun(placement, rep, times, tuple(steps), tuple(served), checked, bad,
                    time.perf_counter() - t_run, tuple(measured))
    if progress:
        st = run.tp_stalls_ms()
        print(f"  {placement.name} run {rep}: {len(steps)} TP steps, stall {st.mean():.2f} ms/step "
              f"({100 * st.mean() / run.step_ms:+.1f}%), checker {checked} steps {bad} bad, {run.wall_s:.0f} s",
              flush=True)
    return run


def _tp_steps(runners, wrapped, devices, replay, batch: int, n: int, warmup: int, warm: bool,
              measured: list | None = None) -> list[tuple[TimelineStep, ...]]:
    """`n` timed TP steps (after `warmup` untimed ones) of the replay; other steps warm the caches when `warm`.
    `measured` gets each timed step's measured begin_step per rank (ms)."""
    out: list[tuple[TimelineStep, ...]] = []
    skip = warmup
    warmed_once = False
    while len(out) < n:
        st = next(replay, None)
        if st is None:
            break
        if st.kind == "decode" and st.num_tokens == batch:
            # The step's clock starts once its ids are hashed: s is begin_step alone, the paper's "CPU time to
            # resolve the batch's indices" (section 4.1; the timeline's own runs move to this in issue 28).
            if wrapped[0].inline:   # a layer on this machine's disk: its reads run on the step's own clock
                ranks = [runners[0].step(st.ids)]
            else:
                for d in devices:
                    d.begin_step()
                for w in wrapped:
                    w.pre(st.ids)
                for d in devices:   # the ranks' batches are queued, timed and copied here, off the clocks
                    d.seal()
                ranks = [r.step(st.ids) for r in runners]
                for d in devices:
                    d.end_step()
            if skip > 0:
                skip -= 1
            else:
                out.append(tuple(ranks))
                if measured is not None:
                    measured.append(tuple(r.s_ms if w.inline else 1e3 * w.begin_s for r, w in zip(ranks, wrapped)))
        elif warm or not warmed_once:
            for r in runners:
                r.warm(st.ids)
            warmed_once = True
    if not out:
        raise SlackTierError(ErrorKind.MISSING, "no full-batch decode step ran",
                             fix="use traffic with at least B sessions and enough decode tokens")
    return out


def _checked(engines, runners, wrapped, devices, replay, batch: int, n: int, warm: bool) -> tuple[int, int]:
    """`n` more TP steps with every rank's checker on (untimed); (steps, mismatching rows)."""
    if n <= 0:
        return 0, 0
    cfgs = [e.config for e in engines]
    for e, c in zip(engines, cfgs):
        e.apply(c.replace(check=True))
    before = sum(c.mismatches for e in engines for c in e.totals.values())
    steps = _tp_steps(runners, wrapped, devices, replay, batch, n, 0, warm)
    for e, c in zip(engines, cfgs):
        e.apply(c)
    return len(steps), sum(c.mismatches for e in engines for c in e.totals.values()) - before


# ---- the analytic prediction and the report ------------------------------------------------------------------

def predicted_stall_ms(run: WhatIfRun, cfg: WhatIfConfig) -> float:
    """Eq. 1 per rank with each device's read model (terms scaled to the ranks sharing it) and the run's mean
    pages and s of that rank; the slowest rank's."""
    from slacktier.plan.exposure import LayerRead, exposure
    from slacktier.plan.readmodel import DeviceReadModel, LayerPages, read_times

    p = run.placement
    models = dict(p.models)
    sharing = cfg.ranks if p.disks == "shared" else 1
    worst = 0.0
    for k in range(cfg.ranks):
        loads, dev_models = [], {}
        for order, l in enumerate(run.served):
            pages = float(run.rank_mean(lambda s, l=l: s.pages[l])[k])
            if tier_facts(p.tier(l)).device_kind == "model":
                m = resolve_model(models[l], cfg)
                dev = device_name(p, k, models[l])
                scale = sharing / m.ranks_in_fit
                dev_models[dev] = DeviceReadModel(m.intercept_ms, scale * m.page_us / 1e3, scale * m.page_us / 1e3,
                                                  scale * m.behind_page_us / 1e3)
            else:   # this machine's disk: its read fit
                m = this_disk_model(cfg.this_disk) if cfg.this_disk else None
                if m is None:
                    return float("nan")
                dev = "this-disk"
                dev_models[dev] = DeviceReadModel(m.intercept_ms, m.page_us / 1e3, m.page_us / 1e3,
                                                  m.behind_page_us / 1e3)
            loads.append(LayerPages(l, dev, pages, order))
        t = {r.layer: r.read_ms for r in read_times(loads, dev_models)}
        s = float(run.rank_mean(lambda st: st.s_ms)[k])
        e = exposure([LayerRead(l, run.windows_ms[l], t[l]) for l in run.served], resolve_ms=s)
        worst = max(worst, float(sum(e.stall_ms)))
    return worst


def header(placements: Sequence[WhatIfPlacement], profile: ComputeProfile, cfg: WhatIfConfig) -> str:
    """The report's first line: where device reads and device compute come from."""
    names = sorted({m for p in placements for _, m in p.models})
    real = any(tier_facts(t).device_kind == "file" for p in placements for _, t in p.tiers)
    reads = ", ".join(names) + (" and this machine's disk" if real else "") if names else "this machine's disk"
    line = f"device reads from model {reads or '-'}; device compute from profile {profile.name}"
    if cfg.host_pass_ms is not None:
        line += f"; host pass stated at {cfg.host_pass_ms:g} ms per rank, not measured"
    return line


def placement_words(p: WhatIfPlacement, ranks: int) -> str:
    """A what-if placement in words: 'keep layer 1 in DRAM, layer 14 on nvme-paper (one disk for 4 ranks)'."""
    models = dict(p.models)
    parts = []
    for layer, tier in sorted(p.tiers):
        where = ("in DRAM" if in_host_memory(tier) else f"on {models[layer]}" if layer in models else
                 "on this machine's disk" if tier_facts(tier).device_kind == "file" else f"on {tier}")
        parts.append(f"layer {layer} {where}")
    text = ("keep " if any(in_host_memory(t) for _, t in p.tiers) else "put ") + ", ".join(parts)
    if models:
        text += (f" (one disk for {ranks} ranks)" if p.disks == "shared" and ranks > 1 else
                 " (one disk per rank)" if ranks > 1 else "")
    if p.cache_rows:
        if len(p.shares) == 1:
            text += f", {p.cache_rows:,}-row cache on layer {p.shares[0][0]} only"
        else:
            shares = "/".join(f"{100 * f:.0f}" for _, f in p.shares) or "no share set"
            text += f", {p.cache_rows:,}-row cache split {shares}"
    return text


WHATIF_LEGEND = (
    "overhead: mean stall per TP step (the slowest rank's) as % of the profile's step; min..max over the runs. "
    "model: the stall the exposure model (Eq. 1 of the paper) predicts from each device model, with terms scaled "
    "to the ranks sharing a device, and the run's own pages and host pass. hit: decode lookups found in the row "
    "cache, mean of ranks. pg, read: the slowest rank's mean pages and read ms per step. s: the host pass "
    "(begin_step) per step in ms, the slowest rank's.")


def placement_costs(cfg: WhatIfConfig, runs: Sequence[WhatIfRun]) -> list:
    """Each placement's overhead over its runs (% of the profile's step; mean, min, max), as the verdict and the
    table both read it (serve.report.Measured, named in words)."""
    from slacktier.serve.report import Measured, stat

    out = []
    for p in dict.fromkeys(r.placement for r in runs):
        rs = [r for r in runs if r.placement == p]
        m, lo, hi = stat([100 * r.tp_stalls_ms().mean() / r.step_ms for r in rs])
        out.append(Measured(placement_words(p, cfg.ranks), m, lo, hi, len(rs)))
    return out


def report(cfg: WhatIfConfig, profile: ComputeProfile, runs: Sequence[WhatIfRun]) -> str:
    """What a placement would cost: where reads and compute come from, the verdict in words (the cheapest placement,
    its cost, which others cannot be told apart from it over the runs), then the table: per placement overhead
    (mean, min..max over runs), the model's prediction, hit, pages and read per layer, host pass; the checker."""
    from slacktier.serve.report import verdict_lines, wrap

    placements = list(dict.fromkeys(r.placement for r in runs))
    lines = [header(placements, profile, cfg)]
    for m in sorted({m for p in placements for _, m in p.models}):
        lines.append(wrap(resolve_model(m, cfg).describe(), "  "))
    measured = [max(np.mean([st[k] for st in r.measured_s_ms]) for k in range(cfg.ranks))
                for r in runs if r.measured_s_ms]
    own = f"slowest rank's mean {np.mean(measured):.2f} ms" if measured else "not recorded"
    if cfg.host_pass_ms is not None:
        lines.append(wrap(f"host pass s: stated, {cfg.host_pass_ms:g} ms per rank; each rank's timeline holds "
                          f"begin_step that long (this machine's begin_step, measured in the same runs: {own})", "  "))
    else:
        lines.append(wrap(f"host pass s: measured, each rank's begin_step on this machine, one rank after another "
                          f"in this process ({own})", "  "))
    lines.append(wrap(f"{cfg.workload} traffic, B={cfg.batch}, TP{cfg.staged_ranks}"
                      + (f" (ranks 0..{cfg.ranks - 1} run)" if cfg.ranks < cfg.staged_ranks else "")
                      + f" (step = slowest rank), V4.1 hash over a table of {cfg.engram_vocab:,} rows per head "
                      f"({24 * cfg.engram_vocab:,} per layer), {len(runs[0].steps)} timed TP steps per run; profile "
                      f"step {runs[0].step_ms:.2f} ms, windows "
                      + ", ".join(f"W{l} {w:.2f}" for l, w in runs[0].windows_ms.items()) + " ms", "  "))
    costs = placement_costs(cfg, runs)
    lines += verdict_lines(costs, "of the step in stalls")
    lines.append("")
    layers = sorted(runs[0].windows_ms)
    width = max(30, *(len(p.name) for p in placements))   # 35 keeps two layers' columns within 120 characters
    lines.append(f"{'placement':{width}} {'n':>2} {'overhead':>8} {'min..max %':>12} {'model':>6} "
                 + " ".join(f"{f'hit L{l}':>6} {f'pg L{l}':>6} {f'read L{l}':>7}" for l in layers) + f" {'s':>5}")
    for p, cost in sorted(zip(placements, costs), key=lambda pc: pc[1].mean_pct):   # cheapest first, as the verdict
        rs = [r for r in runs if r.placement == p]
        step = rs[0].step_ms
        pred = np.mean([predicted_stall_ms(r, cfg) for r in rs])
        cells = []
        for l in layers:
            if l in rs[0].served:
                hit = np.mean([np.mean([sum(st[k].hits[l] for st in r.steps) / max(1, sum(st[k].lookups[l]
                                                                                          for st in r.steps))
                                        for k in range(cfg.ranks)]) for r in rs])
                pages = np.mean([r.rank_mean(lambda s, l=l: s.pages[l]).max() for r in rs])
                read = np.mean([r.rank_mean(lambda s, l=l: s.read_ms[l]).max() for r in rs])
                cells.append(f"{100 * hit:5.1f}% {pages:{max(6, len(f'pg L{l}'))}.0f} "
                             f"{read:{max(7, len(f'read L{l}'))}.2f}")
            else:
                cells.append(f"{'dram':>6} {'-':>{max(6, len(f'pg L{l}'))}} {'-':>{max(7, len(f'read L{l}'))}}")
        s_ms = np.mean([r.rank_mean(lambda st: st.s_ms).max() for r in rs])
        lines.append(f"{p.name:{width}} {len(rs):>2} {cost.mean_pct:+7.1f}% {cost.lo_pct:+5.1f}..{cost.hi_pct:<+5.1f} "
                     f"{100 * pred / step:+5.1f}% " + " ".join(cells) + f" {s_ms:5.2f}")
    checked = sum(r.checked_steps for r in runs)
    lines.append(f"checker: {checked} TP steps after the timed ones, every rank's rows against the table's source: "
                 f"{sum(r.mismatches for r in runs)} mismatching rows")
    lines.append(wrap(WHATIF_LEGEND))
    return "\n".join(lines)


def plot_whatif(cfg: WhatIfConfig, runs: Sequence[WhatIfRun], path: str | Path) -> Path:
    """Overhead per placement (% of the profile's step): each run as a point, the mean as a bar, the exposure
    model's prediction as a mark; cheapest first, as the verdict reads them."""
    from slacktier.errors import optional_import

    matplotlib = optional_import("matplotlib", "workloads", "the what-if's PNG plot (or pass --no-plot)")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    placements = list(dict.fromkeys(r.placement for r in runs))
    costs = placement_costs(cfg, runs)
    order = sorted(range(len(placements)), key=lambda i: costs[i].mean_pct)
    fig, ax = plt.subplots(figsize=(9.0, 1.4 + 0.55 * len(placements)))
    for y, i in enumerate(order):
        rs = [r for r in runs if r.placement == placements[i]]
        per_run = [100 * r.tp_stalls_ms().mean() / r.step_ms for r in rs]
        pred = np.mean([100 * predicted_stall_ms(r, cfg) / r.step_ms for r in rs])
        ax.barh(y, costs[i].mean_pct, color="0.8", label="mean over runs" if y == 0 else None)
        ax.plot(per_run, [y] * len(per_run), "o", color="tab:blue", ms=4, label="one run" if y == 0 else None)
        if np.isfinite(pred):
            ax.plot([pred], [y], "|", color="tab:red", ms=14, mew=2, label="model's prediction" if y == 0 else None)
    ax.set_yticks(range(len(order)), [placements[i].name for i in order], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("stall per step, % of the profile's step")
    ax.set_title(f"what-if: {cfg.workload} traffic, B={cfg.batch}, TP{cfg.staged_ranks}, profile {cfg.profile}",
                 fontsize=10)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))   # beside the bars, never over one
    return save_figure(fig, path)


def run_whatif(cfg: WhatIfConfig, placements: Sequence[WhatIfPlacement], runs: int = 1,
               progress: bool = False) -> tuple[ComputeProfile, list[WhatIfRun]]:
    """Stage (or reuse) the table, then every placement `runs` times in shuffled order."""
    profile = load_profile(cfg.profile)
    profile.times(cfg.batch, cfg.workload, (1, 14))       # refuse a batch the profile lacks before staging
    sweep_sessions(cfg.sweep(), cfg.batch)                 # refuse a B the traffic cannot fill
    for p in placements:
        for _, m in p.models:
            resolve_model(m, cfg)                          # refuse a bad model before staging
    layout, manifest = stage_table(cfg, progress)
    rng = np.random.default_rng(cfg.seed)
    out = []
    for rep in range(runs):
        for k in rng.permutation(len(placements)):
            out.append(run_placement(cfg, placements[k], manifest, layout, profile, rep, progress))
    return profile, out


# ---- the paper's configurations -------------------------------------------------------------------------------

def table2_placements(model: str, cache_rows: int = 1_000_000, first: int = 1, second: int = 14,
                      ) -> list[WhatIfPlacement]:
    """Table 2's six placements off host DRAM, both tables' disks on `model` ("1 disk": one shared by the ranks,
    "4 disks": one per rank); the host-DRAM row is the profile itself."""
    both = ((first, "emulated"), (second, "emulated"))
    on = ((first, model), (second, model))
    split = ((first, 0.5), (second, 0.5))
    return [
        WhatIfPlacement(f"L{first} DRAM, L{second} 1 disk", ((first, "dram"), (second, "emulated")),
                        ((second, model),), disks="shared"),
        WhatIfPlacement("both 1 disk", both, on, disks="shared"),
        WhatIfPlacement("both 4 disks", both, on, disks="per-rank"),
        WhatIfPlacement(f"1 disk, cache L{second} only", both, on, cache_rows // 2, ((second, 1.0),), "shared"),
        WhatIfPlacement("1 disk, split", both, on, cache_rows, split, "shared"),
        WhatIfPlacement("4 disks, split", both, on, cache_rows, split, "per-rank"),
    ]
