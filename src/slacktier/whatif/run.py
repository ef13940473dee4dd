"""What-if: a placement's decode cost on devices this machine does not have.

`slacktier whatif` runs the step timeline (serve.timeline: device compute
from a profile, host pass and cache real) for every TP rank of a staged
table at once, with each table's reads served by an emulated device
(whatif.tier: real bytes, completions at the times a device model gives) or,
with one rank, by this machine's disk. Ranks map to emulated disks
as the paper's configurations do: `shared` (one disk for all ranks, the
paper's "1 disk") or `per-rank` (one disk per rank, its "4 disks").

One TP step (`WhatIfRun`):

    pull the step's ids (hash), before the step's clock starts (s is begin_step alone, the paper's s)
    every emulated device: begin_step
    for each rank r: device.rank_host_pass(r); begin_step(ids of r's columns)   -> b_r ms  (pre-phase)
    every emulated device: seal (queue, time and copy into the pools the batches the ranks' lanes recorded)
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

Each placement run opens its own emulated devices (whatif.device,
`device_session`) and closes them with its engines. The report
(whatif.report) names both sides on its first line and prints Eq. 1's
prediction beside the measured stall.
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

import slacktier.store  # noqa: F401 - registers the built-in tiers before tier_facts reads them
import slacktier.whatif.tier  # noqa: F401 - registers the emulated tier
from slacktier.config import ADMISSION_RULES, tier_facts
from slacktier.errors import ErrorKind, SlackTierError
from slacktier.plan.placement import Placement, placement_control
from slacktier.serve.timeline import (ComputeProfile, LayerSubset, StepTimes, SweepConfig, TimelineRunner,
                                      TimelineStep, load_profile, sleep_then_spin, sweep_sessions)
from slacktier.whatif.device import device_session
from slacktier.whatif.models import DeviceModel, device_model_toml, load_device_model, this_disk_model

log = logging.getLogger(__name__)

#: the tiers a what-if table can be placed on: the stock DRAM path, an emulated device, this machine's disk
TABLE_TIERS = ("dram", "emulated", "disk")


def check_whatif_tiers(placement: Placement) -> None:
    """Refuse a placement naming a tier the what-if cannot run (it serves DRAM, emulated devices and this disk)."""
    for layer, tier in placement.tiers:
        if tier not in TABLE_TIERS:
            raise SlackTierError(ErrorKind.BAD_INPUT, f"placement {placement.name}: layer {layer} on {tier!r}",
                                 fix=f"a what-if places tables on one of {', '.join(TABLE_TIERS)}", layer=layer)


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
    #: context packing: a pack list (tables.packing) made for THIS scaled table (its ids < engram_vocab-scaled
    #: rows), staged with the budgets below; "" stages no packed region
    pack_list: str = ""
    pack_disk_gb: float = 1.0         # extra disk per rank for packed pages (GB = 1e9 B)
    pack_index_mb: float = 64.0       # host memory per rank for the packing index (MB = 1e6 B)
    admission: str = "off"            # the ranks' cache admission rule (the control file's; cache.ADMISSIONS)

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
        if self.admission not in ADMISSION_RULES:
            raise SlackTierError(ErrorKind.BAD_INPUT, f"admission {self.admission!r}",
                                 fix=f"use one of {ADMISSION_RULES}")

    def sweep(self) -> SweepConfig:
        return SweepConfig(workload=self.workload, profile=self.profile, batches=(self.batch,),
                           decode_tokens=self.decode_tokens, max_session_tokens=self.max_session_tokens,
                           max_turns=self.max_turns, prefill_chunk_tokens=self.prefill_chunk_tokens, seed=self.seed)


def model_file(spec: str, cfg: WhatIfConfig) -> str:
    """What `[table.emulated] model` gets for a model spec: built-in names and files as given; `this-disk`
    written to a TOML file in the workdir from the read fit of `cfg.this_disk`."""
    if spec != "this-disk":
        return spec
    if not cfg.this_disk:
        raise SlackTierError(ErrorKind.MISSING, "device model this-disk needs the disk's read fit",
                             fix="pass --this-disk TIERS (written by slacktier probe --read-fit)")
    text = device_model_toml(this_disk_model(cfg.this_disk))   # a bad tiers file is refused before anything is written
    path = Path(cfg.workdir) / "this-disk.toml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return str(path)


def resolve_model(spec: str, cfg: WhatIfConfig) -> DeviceModel:
    """The DeviceModel a spec names (for reports and predictions)."""
    return load_device_model(model_file(spec, cfg))


def _pack_request(cfg: WhatIfConfig, layout):
    """The staging request of cfg's pack list and a tag naming it in the staged file names ("" without one).

    A pack list's contexts are global row ids of the table its traffic was hashed for: one made for another
    vocabulary (the full V4.1 table, say) names rows this scaled table does not have, or other rows than the
    traffic here reads, so a list whose ids leave a layer's rows or whose layers differ is refused."""
    if not cfg.pack_list:
        return None, ""
    import hashlib

    from slacktier.tables.packing import PackRequest, read_pack_list

    pl = read_pack_list(cfg.pack_list)
    rows = {int(layer): int(layout.layer_column_bounds(layer)[-1]) for layer in layout.layer_ids}
    for layer in pl.layers:
        ids = pl.ids[layer]
        if layer not in rows or (ids.size and (int(ids.max()) >= rows[layer] or int(ids.min()) < 0)):
            raise SlackTierError(ErrorKind.BAD_INPUT, f"pack list {cfg.pack_list} names layer {layer} rows outside "
                                 f"the what-if's table ({rows.get(layer, 0)} rows at vocabulary {cfg.engram_vocab})",
                                 fix="make the pack list by hashing the traffic for the same scaled table "
                                     "(the same engram vocabulary as the what-if)")
    digest = hashlib.sha256(Path(cfg.pack_list).read_bytes())
    digest.update(f"{cfg.pack_disk_gb!r}/{cfg.pack_index_mb!r}".encode())
    return (PackRequest(pl, int(cfg.pack_disk_gb * 1e9), int(cfg.pack_index_mb * 1e6)),
            f"-pack{digest.hexdigest()[:10]}")


def stage_table(cfg: WhatIfConfig, progress: bool = False):
    """The staged scaled V4.1 table of every rank (reused when its manifest checks out), packed when cfg has a
    pack list (its own file names, so an unpacked table is never taken for a packed one, nor one list's for
    another's)."""
    from slacktier.tables.engram_hash import EngramLayout
    from slacktier.tables.manifest import Manifest, StagedLayout
    from slacktier.tables.stage import stage_synthetic

    layout = EngramLayout.scaled(cfg.engram_vocab, (1, 14))
    pack, tag = _pack_request(cfg, layout)
    name = f"v41x{cfg.engram_vocab}-tp{cfg.staged_ranks}{tag}"
    manifest_path = Path(cfg.workdir) / f"{name}.manifest.json"
    target = Path(cfg.workdir) / f"{name}.bin"
    if manifest_path.is_file():
        m = Manifest.load(manifest_path)
        if (m.ranks == cfg.staged_ranks and m.source.get("seed") == cfg.table_seed
                and m.layout == StagedLayout.from_layout(layout)):
            try:
                m.check_targets()
                return layout, m
            except SlackTierError as exc:   # its file was removed or overwritten: stage it again
                log.info("whatif: restaging %s (%s)", manifest_path, exc)
    Path(cfg.workdir).mkdir(parents=True, exist_ok=True)
    return layout, stage_synthetic([target], layout, cfg.staged_ranks, cfg.table_seed, overwrite=True,
                                   manifest_path=manifest_path, progress=progress, pack=pack)


def device_name(placement: Placement, rank: int, model: str) -> str:
    """The emulated device rank `rank` reads `model`'s tables from: one for all ranks, or its own (tables on
    different models are on different devices)."""
    return f"{model}:disk0" if placement.disks == "shared" else f"{model}:disk{rank}"


def rank_control(manifest, rank: int, placement: Placement, cfg: WhatIfConfig, max_tokens: int):
    """Rank `rank`'s control file for the placement's engine-served layers (owned_only), and those layers."""
    from slacktier.config import DiskOptions, EngineConfig
    from slacktier.whatif.tier import EmulatedOptions

    def options(layer: int, tier: str):
        if tier_facts(tier).device_kind != "model":
            return DiskOptions()
        model = placement.model(layer)
        return EmulatedOptions(model=model_file(model, cfg), device=device_name(placement, rank, model), rank=rank)

    engine = EngineConfig(device="cpu", max_cache_rows=1, max_tokens=max_tokens, owned_only=True,
                          wait_timeout_ms=60_000.0, admission=cfg.admission)
    control = placement_control(placement, engine, str(manifest.path), manifest.layout.layer_ids, options=options,
                                rank=rank, engine_layers_only=True)
    return control, [t.layer for t in control.tables]


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

    def begin_step(self, ids: np.ndarray, decode: np.ndarray | None = None) -> None:
        if self.prepassed:
            t = time.perf_counter_ns()
            for d in self.devices:
                d.start_rank(self.rank, t)
            sleep_then_spin(t / 1e9 + (self.begin_s if self.hold_s is None else self.hold_s))
            self.prepassed = False
            return
        if not self.inline:   # off the TP step protocol (warm steps): batches land as if alone
            self.engine.begin_step(np.asarray(ids)[:, self.axes, :], decode)
            return
        t = time.perf_counter_ns()
        for d in self.devices:
            d.begin_step()
            d.rank_host_pass(self.rank, t)
        self.engine.begin_step(np.asarray(ids)[:, self.axes, :], decode)
        for d in self.devices:
            d.start_rank(self.rank, t)
            d.end_step()


@dataclass(frozen=True)
class WhatIfRun:
    """One run of a placement: per TP step each rank's timeline step."""

    placement: Placement
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


def run_placement(cfg: WhatIfConfig, placement: Placement, manifest, layout, profile: ComputeProfile,
                  rep: int = 0, progress: bool = False) -> WhatIfRun:
    """One run of `placement` over every rank (module docstring)."""
    from slacktier.engine.step import StepEngine
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
    engines, runners, wrapped = [], [], []
    served: list[int] = []
    with device_session() as session:
        try:
            for rank in range(cfg.ranks):
                control, served = rank_control(manifest, rank, placement, cfg, max_tokens)
                engines.append(StepEngine.from_config(control, ids_layers=tuple(served), columns=layout.n_columns))
            devices = session.devices()
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
            steps = _tp_steps(runners, wrapped, devices, replay, cfg.batch, cfg.decode_steps, cfg.warmup_steps,
                              warm, measured)
            checked, bad = _checked(engines, runners, wrapped, devices, replay, cfg.batch, cfg.check_steps, warm)
        finally:
            for eng in engines:
                eng.close()
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
            # resolve the batch's indices" (section 4.1).
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
                r.warm(st.ids, st.is_decode)
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


def run_whatif(cfg: WhatIfConfig, placements: Sequence[Placement], runs: int = 1,
               progress: bool = False) -> tuple[ComputeProfile, list[WhatIfRun]]:
    """Stage (or reuse) the table, then every placement `runs` times in shuffled order."""
    profile = load_profile(cfg.profile)
    profile.times(cfg.batch, cfg.workload, (1, 14))       # refuse a batch the profile lacks before staging
    sweep_sessions(cfg.sweep(), cfg.batch)                 # refuse a B the traffic cannot fill
    for p in placements:
        check_whatif_tiers(p)
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
                      ) -> list[Placement]:
    """Table 2's six placements off host DRAM, both tables' disks on `model` ("1 disk": one shared by the ranks,
    "4 disks": one per rank); the host-DRAM row is the profile itself."""
    both = ((first, "emulated"), (second, "emulated"))
    on = ((first, model), (second, model))
    split = ((first, 0.5), (second, 0.5))
    return [
        Placement(f"L{first} DRAM, L{second} 1 disk", ((first, "dram"), (second, "emulated")),
                  models=((second, model),), disks="shared"),
        Placement("both 1 disk", both, models=on, disks="shared"),
        Placement("both 4 disks", both, models=on, disks="per-rank"),
        Placement(f"1 disk, cache L{second} only", both, models=on, cache_rows=cache_rows // 2,
                  shares=((second, 1.0),), disks="shared"),
        Placement("1 disk, split", both, models=on, cache_rows=cache_rows, shares=split, disks="shared"),
        Placement("4 disks, split", both, models=on, cache_rows=cache_rows, shares=split, disks="per-rank"),
    ]
