"""What a person reads about served runs: one row per placement (the Table 2 layout), the demo's report.

The demo prints these tables; the end-to-end harness (benchmarks/e2e/) prints
the same table for Table 2 and adds its figures and the model's fit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import numpy as np

from slacktier.serve.runs import LayerStats, RunRecord
from slacktier.tables.layout import binary_bytes

NAN = math.nan


def fmt_num(x: float | None, digits: int) -> str:
    """`x` with `digits` decimals, '-' when not measured."""
    return "-" if x is None or not np.isfinite(x) else f"{x:.{digits}f}"


def fmt_pct(x: float | None) -> str:
    """A fraction as a whole percent, '-' when not measured."""
    return "-" if x is None or not np.isfinite(x) else f"{100 * x:.0f}%"


def fmt_ms(x: float | None) -> str:
    """Milliseconds with one decimal, '-' when not measured."""
    return fmt_num(x, 1)


def stat(values: Sequence[float]) -> tuple[float, float, float]:
    """(mean, min, max) over the finite values; NaNs when there are none."""
    a = np.array([v for v in values if v is not None and np.isfinite(v)], dtype=np.float64)
    return (float(a.mean()), float(a.min()), float(a.max())) if a.size else (NAN, NAN, NAN)


@dataclass
class PlacementRow:
    """One placement over its runs at one workload and load: means, and the overhead's spread."""

    workload: str
    placement: str
    runs: int
    step_ms: float
    base_ms: float
    overhead_pct: tuple[float, float, float]   # mean, min, max over runs
    p99_ms: float = NAN
    tpot_ms: float = NAN                        # from a run with only this placement (unpaired)
    ttft_ms: float = NAN
    rss_gib: float = NAN
    layers: dict[int, LayerStats] = field(default_factory=dict)
    mismatch_steps: int = 0


def placement_rows(paired: Sequence[RunRecord], alone: Sequence[RunRecord] = (),
                   stock: str = "dram-table") -> list[PlacementRow]:
    """Rows for one workload and load: the DRAM table first (its arm of every paired run), then each placement.

    `paired`: runs side by side with the DRAM table; `alone`: unpaired runs (one placement in the process), which
    give resident memory, TPOT and TTFT (a paired run's clocks include the other arm's work).
    """
    by_alone = {r.placement: r for r in alone}
    base = by_alone.get(stock)
    rows = [PlacementRow(paired[0].workload if paired else "", stock, len(paired),
                         step_ms=stat([r.base_ms for r in paired])[0], base_ms=stat([r.base_ms for r in paired])[0],
                         overhead_pct=(0.0, 0.0, 0.0),
                         tpot_ms=base.tpot_ms if base else NAN, ttft_ms=base.ttft_p50_ms if base else NAN,
                         rss_gib=base.rss_peak_gib if base else NAN)]
    names = sorted({r.placement for r in paired})
    for name in names:
        rs = [r for r in paired if r.placement == name]
        one = by_alone.get(name)
        layer_ids = sorted({l for r in rs for l in r.layers})
        layers = {l: LayerStats(**{f: stat([getattr(r.layers.get(l, LayerStats()), f) for r in rs])[0]
                                   for f in ("window_ms", "rows_ms", "read_ms", "wait_ms", "pages", "hit_rate")})
                  for l in layer_ids}
        rows.append(PlacementRow(
            rs[0].workload, name, len(rs), step_ms=stat([r.step_ms for r in rs])[0],
            base_ms=stat([r.base_ms for r in rs])[0], overhead_pct=stat([r.overhead_pct for r in rs]),
            p99_ms=stat([r.step_p99_ms for r in rs])[0], tpot_ms=one.tpot_ms if one else NAN,
            ttft_ms=one.ttft_p50_ms if one else NAN, rss_gib=one.rss_peak_gib if one else NAN,
            layers=layers, mismatch_steps=sum(r.mismatch_steps for r in rs)))
    return rows


def format_placement_table(rows: Sequence[PlacementRow], layers: Sequence[int]) -> str:
    """The placement table: overhead vs the DRAM table (mean, min..max), step times, memory, per-layer hits,
    pages, read and wait times, TPOT/TTFT, and whether every step's logits matched the DRAM table's."""
    l1, l2 = layers[:2]
    lines = [f"{'workload':8} {'placement':16} {'overhead':>8} {'min..max':>14} {'step':>7} {'DRAM':>7} "
             f"{'(p99)':>8} {'RSS GiB':>7} {f'hit L{l1}':>7} {f'hit L{l2}':>7} {f'pg L{l1}':>6} "
             f"{f'pg L{l2}':>6} {f'read L{l1}':>7} {f'read L{l2}':>7} {f'wait L{l1}':>7} {f'wait L{l2}':>7} "
             f"{'TPOT':>6} {'TTFT':>6} {'exact':>5}"]
    for row in rows:
        o = row.overhead_pct
        a, b = row.layers.get(l1, LayerStats()), row.layers.get(l2, LayerStats())
        lines.append(
            f"{row.workload:8} {row.placement:16} {o[0]:+7.1f}% {o[1]:+6.1f}..{o[2]:<+6.1f} "
            f"{row.step_ms:7.1f} {row.base_ms:7.1f} {fmt_ms(row.p99_ms):>8} {fmt_num(row.rss_gib, 2):>7} "
            f"{fmt_pct(a.hit_rate):>7} {fmt_pct(b.hit_rate):>7} {fmt_num(a.pages, 0):>6} {fmt_num(b.pages, 0):>6} "
            f"{fmt_ms(a.read_ms):>7} {fmt_ms(b.read_ms):>7} {fmt_ms(a.wait_ms):>7} {fmt_ms(b.wait_ms):>7} "
            f"{fmt_ms(row.tpot_ms):>6} {fmt_num(row.ttft_ms, 0):>6} {'yes' if row.mismatch_steps == 0 else 'NO':>5}")
    return "\n".join(lines)


def exactness_line(records: Sequence[RunRecord]) -> str:
    """How many paired steps' logits differed from the DRAM table's."""
    mism = sum(r.mismatch_steps for r in records)
    steps = sum(r.decode_steps for r in records if r.paired)
    return (f"Bit-exactness: every paired step compares all logits of the placement with the DRAM table's: "
            f"{mism} mismatching steps (over {steps} full decode steps and all prefill steps).")


def demo_replay_report(model_layers: int, layer_ids: Sequence[int], table_rows: int, batch: int,
                       records: Sequence[RunRecord]) -> str:
    """The demo's replay section: what ran, the placement table, the bit-exactness line."""
    head = (f"End to end (short): V4.1-shaped model ({model_layers} layers, Engram at {tuple(layer_ids)}), tables "
            f"of {table_rows:,} rows per layer, agent traffic, B={batch}, each placement run side by side with the "
            f"DRAM table, one run each (benchmarks/paper/bench_e2e_table2.py runs the full set)")
    rows = placement_rows([r for r in records if r.paired], [r for r in records if not r.paired])
    return "\n".join([deadline_caveat(rows), head, format_placement_table(rows, layer_ids), exactness_line(records)])


def deadline_caveat(rows: Sequence[PlacementRow]) -> str:
    """The first line of a CPU-model replay: whether any deadline could bind, from what it measured.

    A placement can only cost time when a layer's reads outlast its window. On a CPU the model's step is
    far longer than a read, so the overheads are noise; said first, with the numbers that show it.
    """
    windows = [s.window_ms for r in rows for s in r.layers.values() if s.window_ms == s.window_ms]
    reads = [s.read_ms for r in rows for s in r.layers.values() if s.read_ms == s.read_ms]
    if not windows or not reads:
        return "Deadlines: not measured in this run."
    shortest, longest = min(windows), max(reads)
    if longest < shortest:
        return (f"NO DEADLINE BINDS HERE: the shortest window is {shortest:.1f} ms (the CPU model's compute before "
                f"its first table layer) and the longest read {longest:.1f} ms, so every placement meets every "
                "deadline and the overheads below are machine noise, not placement costs. A GPU step timeline is "
                "what shows them (issue 13).")
    return (f"Deadlines: the shortest window is {shortest:.1f} ms and the longest read {longest:.1f} ms: a read can "
            "outlast its window here.")


def demo_stage_report(layers: int, rows: int, ranks: int, regions: int, nbytes: int, target: str, stage_s: float,
                      manifest: str, sample_layer: int, sample: Sequence[float], verify_lines: Sequence[str]) -> str:
    """The demo's staging section: what was staged, how fast, one row read back, the verification."""
    lines = ["SlackTier demo",
             f"  table      {layers} layers x {rows:,} rows, {ranks} ranks -> {regions} regions",
             f"  staged     {binary_bytes(nbytes)} into {target} in {stage_s:.2f} s "
             f"({binary_bytes(nbytes / stage_s)}/s, O_DIRECT; a first run also compiles the kernels)",
             f"  manifest   {manifest}",
             f"  layer {sample_layer} rank 0 row 0 (bf16, first 4): {[round(float(v), 6) for v in sample]}"]
    lines += [f"  {line}" for line in verify_lines]
    return "\n".join(lines)


def _planner_cell(planner_ms: Mapping[tuple[int, str], float] | None, batch: int, name: str, step: float) -> str:
    """The planner column's two cells ('' without predictions, '-' where none was made)."""
    if planner_ms is None:
        return ""
    p = planner_ms.get((batch, name))
    return f"{'-':>7} {'-':>6} " if p is None else f"{p:7.2f} {100 * p / step:+5.1f}% "


def timeline_table(profile, runs: Sequence, planner_ms: Mapping[tuple[int, str], float] | None = None) -> str:
    """The step-timeline table (benchmarks/paper/timeline_sweep.py): per batch and placement, measured overhead per step
    (mean and min..max over runs, ms and % of the profile's step) beside Eq. 1's prediction (and, with
    `planner_ms` keyed by (B, placement), the planner's prediction made before the runs: serve.predict), then
    whether the placements are told apart by more than the run-to-run spread. First line: the profile and what
    is real."""
    lines = [profile.header]
    groups: dict[tuple[int, str], list] = {}
    for r in runs:
        groups.setdefault((r.batch, r.placement), []).append(r)
    if not groups:
        return "\n".join(lines + ["no runs"])
    layers = tuple(next(iter(groups.values()))[0].summary.read_ms)
    l1, l2 = layers[:2]
    lines.append(f"{'B':>4} {'placement':18} {'runs':>4} {'profile':>7} {'stall/step':>10} {'%':>6} {'min..max':>13} "
                 f"{'Eq.1':>6} {'%':>6} " + (f"{'planner':>7} {'%':>6} " if planner_ms is not None else "") +
                 f"{'p99':>6} {'s':>5} {'prep':>5} {f'read L{l1}':>8} {f'read L{l2}':>8} "
                 f"{f'pg L{l1}':>6} {f'pg L{l2}':>6} {f'hit L{l1}':>6} {f'hit L{l2}':>6} {'pass':>5}")
    spans: dict[int, list[tuple[str, float, float]]] = {}
    for (batch, name), rs in sorted(groups.items(), key=lambda kv: (kv[0][0], stat([r.summary.stall_ms
                                                                                     for r in kv[1]])[0])):
        m, lo, hi = stat([r.summary.stall_ms for r in rs])
        pred = stat([r.summary.predicted_ms for r in rs])[0]
        step = rs[0].step_ms

        def avg(f) -> float:
            return stat([f(r.summary) for r in rs])[0]

        spans.setdefault(batch, []).append((name, lo, hi))
        lines.append(
            f"{batch:>4} {name:18} {len(rs):>4} {step:7.2f} {m:7.2f} ms {100 * m / step:+5.1f}% {lo:6.2f}..{hi:<6.2f}"
            f"{pred:6.2f} {100 * pred / step:+5.1f}% " + _planner_cell(planner_ms, batch, name, step) +
            f"{avg(lambda s: s.p99_stall_ms):6.2f} {avg(lambda s: s.s_ms):5.2f} {avg(lambda s: s.prepare_ms):5.2f} "
            f"{avg(lambda s: s.read_ms[l1]):8.2f} {avg(lambda s: s.read_ms[l2]):8.2f} "
            f"{avg(lambda s: s.pages[l1]):6.0f} {avg(lambda s: s.pages[l2]):6.0f} "
            f"{fmt_pct(avg(lambda s: s.hit_rate[l1])):>6} {fmt_pct(avg(lambda s: s.hit_rate[l2])):>6} "
            f"{avg(lambda s: sum(s.gather_ms.values())):5.2f}")
    checked = [r for r in runs if getattr(r, "checked_steps", 0)]
    if checked:
        lines.append(f"checker: {sum(r.checked_steps for r in checked)} decode steps after the timed ones "
                     f"({len(checked)} runs), every row compared with the table's source: "
                     f"{sum(r.mismatches for r in checked)} mismatching rows")
    lines.append("stall/step: measured wait for rows past each layer's scheduled start (and begin_step overrun), "
                 "the dequant pass ('pass', ms, all layers) excluded; Eq. 1: predicted from the same steps' s and "
                 "read times; min..max over shuffled runs; ms and % of the profile's step. s: begin_step, from "
                 "its call to its return (the step starts there); prep: pulling and hashing the step's ids from the "
                 "replay before the step (the benchmark's work, not a server's; not on the timeline)."
                 + (" planner: predicted before the runs from the profile's windows, the read fit, the fit half's "
                    "miss-page curves and the fit configurations' s(B) and kappa (serve.predict)."
                    if planner_ms is not None else ""))
    for batch, sp in sorted(spans.items()):
        sp = sorted(sp, key=lambda t: t[1])
        overlaps = [f"{a[0]} / {b[0]}" for a, b in zip(sp, sp[1:]) if b[1] <= a[2]]
        if overlaps:
            lines.append(f"B={batch}: CANNOT tell apart by more than the run-to-run spread: {', '.join(overlaps)} "
                         "(their min..max ranges overlap).")
        else:
            lines.append(f"B={batch}: every placement's min..max range is clear of the others': the placements are "
                         "told apart by more than the run-to-run spread.")
    return "\n".join(lines)
