"""The text a person reads: Table 2, Figures 3 and 5 as numbers, the model's fit; the e2e bench-log section."""

from __future__ import annotations

import datetime as _dt
import os
import platform
from pathlib import Path

import numpy as np

from benchmarks.e2e.analysis import exposure_fit, figure3_points, figure5_points, table2_rows
from benchmarks.e2e.jobs import Experiment
from benchmarks.e2e.run import Results
from benchmarks.rig.report import format_placement_table
from slacktier.serve.report import deadline_caveat, exactness_line

SECTION = "## End to end"


def report(results: Results) -> str:
    """The tables a person reads: Table 2 analog, Figure 3 and 5 numbers, the model's prediction error."""
    cfg = results.config
    l1, l2 = results.layers[:2]
    lines = [deadline_caveat(table2_rows(results)),
             f"Table 2 analog, B={cfg.table2_batch}: decode step time of each placement measured side by side with "
             f"the DRAM table (same steps, alternating order), {cfg.runs} shuffled runs per row; overhead = mean "
             f"(min..max over runs); RSS, TPOT and TTFT (p50) from one run with only that placement",
             format_placement_table(table2_rows(results), results.layers),
             exactness_line([r.record for r in results.runs])]
    f3 = figure3_points(results)
    if len(f3) > 1:
        lines += ["", f"Figure 3 analog ({cfg.workloads[0]}, B={cfg.table2_batch}): overhead vs share f of "
                      f"{cfg.rig.cache_rows} cache rows given to layer {l1}"]
        lines += [f"  f={f:.2f}  {mean:+6.1f}%  (min {lo:+.1f}, max {hi:+.1f})" for f, (mean, lo, hi) in f3]
    f5 = figure5_points(results)
    if f5:
        bs = sorted({b for pts in f5.values() for b in pts})
        lines += ["", f"Figure 5 analog ({cfg.workloads[0]}): overhead vs concurrent sessions B (paired, one run per "
                      f"point, {cfg.runs} at B={cfg.table2_batch})",
                  f"  {'placement':22} " + " ".join(f"{'B=' + str(b):>8}" for b in bs)]
        lines += [f"  {p:22} " + " ".join(f"{pts[b]:+7.1f}%" if b in pts else f"{'-':>8}" for b in bs)
                  for p, pts in f5.items()]
    ex = exposure_fit(results.runs, results.layers)
    lines.append("")
    delay_pts = [pt for pt in ex.points if pt.run.experiment is Experiment.DELAY]
    if delay_pts:
        lines.append(f"Injected hand-out delays (paper Table 3 analog), B={cfg.table2_batch}: measured slowdown vs "
                     f"Eq. 1 with kappa")
        lines += [f"  L{l1} {pt.run.record.delays_ms[l1]:>4g} ms, L{l2} {pt.run.record.delays_ms[l2]:>4g} ms: "
                  f"measured {pt.measured_ms:+7.1f} ms, Eq. 1 {pt.predicted_ms:+7.1f} ms" for pt in delay_pts]
    if ex.kappa_ms is not None:
        lines.append(f"Exposure model (Eq. 1; windows from each run's DRAM arm, T from the engine's per-step read "
                     f"times): kappa {ex.kappa_ms:+.2f} ms fitted on {ex.fit_runs} runs (RMSE {ex.fit_rmse_ms:.2f} "
                     f"ms, R^2 {ex.fit_r2:.2f}); predicts {ex.held_runs} other runs with RMSE "
                     f"{ex.held_rmse_ms:.2f} ms, R^2 {ex.held_r2:.2f}")
    disk = [r.record for r in results.runs if r.experiment is Experiment.TABLE2 and r.record.paired
            and r.record.batch == cfg.table2_batch and _uncached_one_disk(results, r.record.placement)]
    if disk:
        w = {l: np.mean([r.layers[l].window_ms for r in disk]) for l in (l1, l2)}
        t = {l: np.mean([r.layers[l].read_ms for r in disk]) for l in (l1, l2)}
        step = np.mean([r.base_ms for r in disk])
        lines.append(f"Windows at B={cfg.table2_batch} (DRAM arm): W{l1} {w[l1]:.1f} ms, W{l2} {w[l2]:.1f} ms of a "
                     f"{step:.1f} ms step; uncached disk read time per step: T{l1} {t[l1]:.1f} ms, T{l2} "
                     f"{t[l2]:.1f} ms; DRAM step / T{l2} = {step / t[l2]:.1f} (the paper: 29.4 ms / 2-4 ms = 7-15)")
    return "\n".join(lines)


def _uncached_one_disk(results: Results, label: str) -> bool:
    """Whether the placement labelled `label` puts every layer on disk, one device, no cache."""
    from benchmarks.e2e.jobs import placements

    p = placements(results.config, *results.layers[:2])[label].placement
    return (not p.stock and p.devices == 1 and not p.cache_rows
            and all(p.tier(l) == "disk" for l in results.layers))


def write_section(path: Path, results: Results, text: str, pngs: list[Path], command: str) -> None:
    """Replace (or append) the '## End to end' section of a markdown file; other sections stay untouched."""
    cfg, model = results.config, results.model
    body = [SECTION, "",
            f"Command: `{command}`  ",
            f"Machine: {platform.machine()}, {os.cpu_count() or 0} CPUs shared with other agents (load average "
            f"{', '.join(f'{x:.1f}' for x in os.getloadavg())} when rendered), torch "
            f"{__import__('torch').__version__}, one intra-op thread; finished "
            f"{results.finished_utc or _dt.datetime.now(_dt.timezone.utc).strftime('%Y-%m-%d %H:%M')} UTC"
            f"{', ' + format(results.wall_s / 60, '.0f') + ' min' if results.wall_s else ''}.  ",
            f"Model: transformers' DeepseekV4 decoder layers ({model['layers']} layers, hidden {model['hidden_size']}, "
            f"hc_mult {model['hc_mult']}, {model['dtype']}) with Engram at layers {tuple(model['engram_layer_ids'])}; "
            f"tables of {results.table_rows[0]:,} and {results.table_rows[1]:,} rows (264 B) staged in "
            f"{results.stage_s:.0f} s; row cache {cfg.rig.cache_rows:,} rows; B={cfg.table2_batch} "
            f"(the paper: 128), {cfg.rig.decode_tokens} decode tokens per turn, held-out sessions.",
            "", "```", text, "```", ""]
    body += [f"![{p.stem}]({p})" for p in pngs]
    body.append("")
    old = path.read_text() if path.exists() else ""
    lines = old.splitlines()
    start = next((i for i, l in enumerate(lines) if l.strip() == SECTION), None)
    if start is None:
        new = old.rstrip("\n") + "\n\n" + "\n".join(body) + "\n"
    else:
        end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
        new = "\n".join(lines[:start] + body + lines[end:]) + "\n"
    path.write_text(new)
