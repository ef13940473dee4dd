"""A what-if's report: where reads and compute come from, the verdict, the table, and Eq. 1's prediction.

The report's first line names both sides: "device reads from model X; device
compute from profile Y". Beside the measured stall it prints the analytic
prediction: Eq. 1 (plan.exposure) with each device's read model
(plan.readmodel: the device model's terms scaled to the ranks sharing the
device, `DeviceModel.scaled`) and the run's own mean pages per rank and s.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np

from slacktier.config import tier_facts
from slacktier.plan.report import in_host_memory, save_figure
from slacktier.serve.report import Measured, stat, verdict_lines, wrap
from slacktier.serve.timeline import ComputeProfile
from slacktier.whatif.models import this_disk_model
from slacktier.plan.placement import Placement
from slacktier.whatif.run import WhatIfConfig, WhatIfRun, device_name, resolve_model

def predicted_stall_ms(run: WhatIfRun, cfg: WhatIfConfig) -> float:
    """Eq. 1 per rank with each device's read model (terms scaled to the ranks sharing it) and the run's mean
    pages and s of that rank; the slowest rank's."""
    from slacktier.plan.exposure import LayerRead, exposure
    from slacktier.plan.readmodel import LayerPages, read_times

    p = run.placement
    models = dict(p.models)
    sharing = cfg.ranks if p.disks == "shared" else 1
    worst = 0.0
    for k in range(cfg.ranks):
        loads, dev_models = [], {}
        for order, l in enumerate(run.served):
            pages = float(run.rank_mean(lambda s, l=l: s.pages[l])[k])
            if tier_facts(p.tier(l)).device_kind == "model":
                dev = device_name(p, k, models[l])
                dev_models[dev] = resolve_model(models[l], cfg).scaled(sharing)
            else:   # this machine's disk: its read fit
                if not cfg.this_disk:
                    return float("nan")
                dev = "this-disk"
                dev_models[dev] = this_disk_model(cfg.this_disk).read
            loads.append(LayerPages(l, dev, pages, order))
        t = {r.layer: r.read_ms for r in read_times(loads, dev_models)}
        s = float(run.rank_mean(lambda st: st.s_ms)[k])
        e = exposure([LayerRead(l, run.windows_ms[l], t[l]) for l in run.served], resolve_ms=s)
        worst = max(worst, float(sum(e.stall_ms)))
    return worst


def header(placements: Sequence[Placement], profile: ComputeProfile, cfg: WhatIfConfig) -> str:
    """The report's first line: where device reads and device compute come from."""
    names = sorted({m for p in placements for _, m in p.models})
    real = any(tier_facts(t).device_kind == "file" for p in placements for _, t in p.tiers)
    reads = ", ".join(names) + (" and this machine's disk" if real else "") if names else "this machine's disk"
    line = f"device reads from model {reads or '-'}; device compute from profile {profile.name}"
    if cfg.host_pass_ms is not None:
        line += f"; host pass stated at {cfg.host_pass_ms:g} ms per rank, not measured"
    if cfg.admission != "off":
        line += f"; cache admission \"{cfg.admission}\""
    return line


def placement_words(p: Placement, ranks: int) -> str:
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


