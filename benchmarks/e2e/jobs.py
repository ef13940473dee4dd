"""The placements of each experiment, and every (workload, B, placement, rep, paired) job, shuffled (seeded)."""

from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np

from benchmarks.e2e.config import E2EConfig
from benchmarks.rig.placements import replay_table2_placements
from slacktier.plan.placement import Placement


class Experiment(enum.Enum):
    """Which result a placement's runs feed."""

    TABLE2 = "table2"      # Table 2 (and Figure 5's loads)
    FIGURE3 = "figure3"    # the cache-split sweep (f != 0.5; f = 0.5 is Table 2's disk-split)
    DELAY = "delay"        # injected hand-out delays (the paper's Table 3 check of Eq. 1)


@dataclass(frozen=True)
class BenchPlacement:
    """A placement with the experiment it belongs to and its typed parameters."""

    placement: Placement
    experiment: Experiment
    split_f: float | None = None      # FIGURE3 (and Table 2's disk-split at 0.5): share of the first layer
    delays_ms: tuple[tuple[int, float], ...] = ()   # DELAY: (layer, ms) rows are held back after issue

    @property
    def name(self) -> str:
        return self.placement.name


@dataclass(frozen=True, order=True)
class Job:
    """One run to do."""

    workload: str
    batch: int
    placement: str    # key into the placements
    rep: int          # -1: the unpaired memory run
    paired: bool


def placements(cfg: E2EConfig, first: int, second: int) -> dict[str, BenchPlacement]:
    """Every placement the experiments use, by label; Table 2's rows first."""
    rows = cfg.rig.cache_rows
    out: dict[str, BenchPlacement] = {}
    t2 = replay_table2_placements(first, second, rows, cfg.rig.devices)
    for p in t2:
        f = p.share(first) if p.shares and p.devices == 1 and len(p.shares) == 2 else None
        out[p.name] = BenchPlacement(p, Experiment.TABLE2, f)
    both_disk = ((first, "disk"), (second, "disk"))
    for f in cfg.split_fs:
        if abs(f - 0.5) > 1e-9:
            p = Placement(f"disk-split-f{f:.2f}", both_disk, rows, ((first, f), (second, 1.0 - f)))
            out[p.name] = BenchPlacement(p, Experiment.FIGURE3, f)
    for d1, d2 in cfg.delays_ms:
        p = Placement(f"delay-{d1:g}-{d2:g}", ((first, "dram"), (second, "dram")))
        out[p.name] = BenchPlacement(p, Experiment.DELAY, delays_ms=((first, d1), (second, d2)))
    return out


def plan_jobs(cfg: E2EConfig, places: dict[str, BenchPlacement]) -> list[Job]:
    """Every job, shuffled (seeded).

    Paired runs measure overhead side by side with the DRAM table; one unpaired run per placement whose host
    memory differs (rep -1, first workload) measures the process's resident memory with only its tables.
    """
    t2 = [b for b in places.values() if b.experiment is Experiment.TABLE2]
    w0, b0 = cfg.workloads[0], cfg.table2_batch
    jobs: set[Job] = set()
    for w in cfg.workloads:
        for bp in t2:
            if not bp.placement.stock:
                jobs.update(Job(w, b0, bp.name, r, True) for r in range(cfg.runs))
    # Resident memory differs by which tables sit in host memory; the cache is the same 264 B x rows in all.
    memory = {tuple(sorted(set(dict(bp.placement.tiers).values()))) + (bp.placement.stock,): bp for bp in t2
              if bp.placement.devices == 1 and not bp.placement.cache_rows}
    jobs.update(Job(w0, b0, bp.name, -1, False) for bp in memory.values())
    if cfg.figure3:
        jobs.update(Job(w0, b0, bp.name, r, True) for bp in places.values()
                    if bp.experiment is Experiment.FIGURE3 for r in range(cfg.figure3_runs))
    jobs.update(Job(w0, b0, bp.name, 0, True) for bp in places.values() if bp.experiment is Experiment.DELAY)
    if cfg.figure5:
        # Figure 5's placements: one layer in DRAM, or a cache (one layer's, or split), on one device
        fig5 = [bp for bp in t2 if not bp.placement.stock and bp.placement.devices == 1
                and ("dram" in dict(bp.placement.tiers).values() or bp.placement.cache_rows)]
        jobs.update(Job(w0, b, bp.name, 0, True) for b in cfg.batches if b != b0 for bp in fig5)
    out = sorted(jobs)
    np.random.default_rng(cfg.rig.seed).shuffle(out)
    return out
