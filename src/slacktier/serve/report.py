"""What a person reads about served runs: one row per placement, the demo's report, the step timeline's table.

The demo prints these tables; the end-to-end harness (benchmarks/e2e/) builds
its wider Table 2 layout (benchmarks/rig/report.py) from the same rows.
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


LINE_CHARS = 120   # the widest line a report prints: a terminal beside another one


def wrap(text: str, indent: str = "", then: str | None = None) -> str:
    """`text` folded into lines of at most LINE_CHARS characters (a legend, a long caveat); `then`: the indent of
    the lines after the first (default: `indent`)."""
    import textwrap

    return "\n".join(textwrap.wrap(text, LINE_CHARS, initial_indent=indent,
                                    subsequent_indent=indent if then is None else then, break_on_hyphens=False))


@dataclass(frozen=True)
class Measured:
    """One placement's measured cost over its runs, as a verdict compares them: % of the step, mean and range."""

    name: str          # what the verdict calls it: words a person reads ("keep layer 1 in DRAM, ...")
    mean_pct: float
    lo_pct: float
    hi_pct: float
    runs: int


def verdict_lines(items: Sequence[Measured], cost: str = "of the step") -> list[str]:
    """The verdict: the cheapest placement and its cost, which others cannot be told apart from it (their
    min..max ranges over the runs overlap its range), and which cost clearly more.

    Worked example: a 0.4% (0.2..0.6) over 3 runs, b 0.5% (0.5..0.9), c 3.0% (2.8..3.1) ->
    "Verdict: a: +0.4% of the step (3 runs, +0.2..+0.6%)", "Cannot tell apart from it: b (+0.5%) ...",
    "Clearly costlier: c (+3.0%)". With one run per placement no spread is known, and it says so.
    """
    items = sorted((m for m in items if math.isfinite(m.mean_pct)), key=lambda m: m.mean_pct)
    if not items:
        return ["Verdict: nothing measured."]
    best, rest = items[0], items[1:]
    lines = wrap(f"Verdict: {best.name}: {best.mean_pct:+.1f}% {cost} ({best.runs} run{'s' * (best.runs != 1)}, "
                 f"{best.lo_pct:+.1f}..{best.hi_pct:+.1f}%).", then="  ").split("\n")
    if not rest:
        return lines
    if min(m.runs for m in items) < 2:
        lines.append(wrap("One run per placement: the run-to-run spread is unknown, so no difference below can "
                          "be called beyond the noise (run 3 per placement to tell them apart)."))
        lines += [wrap(f"next: {m.name}: {m.mean_pct:+.1f}%", "  ", "    ") for m in rest]
        return lines
    close = [m for m in rest if m.lo_pct <= best.hi_pct]
    clear = [m for m in rest if m.lo_pct > best.hi_pct]
    if close:
        lines.append("Cannot tell apart from it (their min..max ranges overlap):")
        lines += [wrap(f"{m.name}: {m.mean_pct:+.1f}% ({m.lo_pct:+.1f}..{m.hi_pct:+.1f}%)", "  ", "    ")
                  for m in close]
    if clear:
        lines.append("Clearly costlier (beyond the run-to-run spread):")
        lines += [wrap(f"{m.name}: {m.mean_pct:+.1f}% ({m.lo_pct:+.1f}..{m.hi_pct:+.1f}%)", "  ", "    ")
                  for m in clear]
    return lines


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


def exactness_line(records: Sequence[RunRecord]) -> str:
    """How many paired steps' logits differed from the DRAM table's."""
    mism = sum(r.mismatch_steps for r in records)
    steps = sum(r.decode_steps for r in records if r.paired)
    return (f"Bit-exactness: every paired step compares all logits of the placement with the DRAM table's: "
            f"{mism} mismatching steps (over {steps} full decode steps and all prefill steps).")


def format_demo_table(rows: Sequence[PlacementRow], layers: Sequence[int]) -> str:
    """The demo's placement table, narrow enough for a terminal: overhead vs the DRAM table (mean, min..max),
    step time, per-layer hit rate, pages, read and wait times, and whether every step matched the DRAM table."""
    l1, l2 = layers[:2]
    lines = [f"{'placement':18} {'overhead':>8} {'min..max %':>13} {'step':>6} {f'hit L{l1}':>6} {f'hit L{l2}':>7} "
             f"{f'pg L{l1}':>5} {f'pg L{l2}':>6} {f'read L{l1}':>7} {f'read L{l2}':>8} {f'wait L{l1}':>7} "
             f"{f'wait L{l2}':>8} {'exact':>5}"]
    for row in rows:
        o = row.overhead_pct
        a, b = row.layers.get(l1, LayerStats()), row.layers.get(l2, LayerStats())
        lines.append(
            f"{row.placement:18} {o[0]:+7.1f}% {o[1]:+6.1f}..{o[2]:<+5.1f} {row.step_ms:6.1f} "
            f"{fmt_pct(a.hit_rate):>6} {fmt_pct(b.hit_rate):>7} {fmt_num(a.pages, 0):>5} {fmt_num(b.pages, 0):>6} "
            f"{fmt_ms(a.read_ms):>7} {fmt_ms(b.read_ms):>8} {fmt_ms(a.wait_ms):>7} {fmt_ms(b.wait_ms):>8} "
            f"{'yes' if row.mismatch_steps == 0 else 'NO':>5}")
    return "\n".join(lines)


def replay_verdict(rows: Sequence[PlacementRow]) -> list[str]:
    """The replay's verdict: when no read outlasts a window, that no placement costs time here; else the cheapest
    placement and which others cannot be told apart from it."""
    if no_deadline_binds(rows):
        return [wrap("Verdict: every placement meets every deadline on this CPU model (the shortest window is "
                     "longer than the longest read), so none costs time here; the overheads below are machine "
                     "noise. The step timeline below, with a GPU's compute profile, is where placements differ.")]
    return verdict_lines([Measured(placement_words(r.placement), *r.overhead_pct, r.runs) for r in rows[1:]],
                         "over the DRAM table")


def demo_replay_report(model_layers: int, layer_ids: Sequence[int], table_rows: int, batch: int,
                       records: Sequence[RunRecord]) -> str:
    """The demo's replay section: the verdict, what ran, the placement table, the bit-exactness line."""
    head = (f"End to end (short): V4.1-shaped model ({model_layers} layers, Engram at {tuple(layer_ids)}), tables "
            f"of {table_rows:,} rows per layer, agent traffic, B={batch}, each placement run side by side with the "
            f"DRAM table, one run each (benchmarks/paper/bench_e2e_table2.py runs the full set)")
    rows = placement_rows([r for r in records if r.paired], [r for r in records if not r.paired])
    return "\n".join([*replay_verdict(rows), "", wrap(deadline_caveat(rows)), wrap(head),
                      format_demo_table(rows, layer_ids), wrap(exactness_line(records)),
                      wrap("overhead: step time over the DRAM table's in the same run; pg: pages read per step; "
                           "read, wait: ms per step reading a layer's pages and waiting for them at the layer; "
                           "exact: every step's logits equal the DRAM table's.")])


def no_deadline_binds(rows: Sequence[PlacementRow]) -> bool:
    """Whether every read measured was shorter than the shortest window measured (nothing could stall)."""
    windows = [s.window_ms for r in rows for s in r.layers.values() if s.window_ms == s.window_ms]
    reads = [s.read_ms for r in rows for s in r.layers.values() if s.read_ms == s.read_ms]
    return bool(windows and reads) and max(reads) < min(windows)


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
                "what shows them.")
    return (f"Deadlines: the shortest window is {shortest:.1f} ms and the longest read {longest:.1f} ms: a read can "
            "outlast its window here.")



def demo_stage_report(layers: int, rows: int, ranks: int, regions: int, nbytes: int, target: str, stage_s: float,
                      manifest: str, sample_layer: int, sample: Sequence[float], verify_lines: Sequence[str]) -> str:
    """The demo's staging section: what was staged, how fast, one row read back, the verification."""
    lines = ["SlackTier demo",
             f"  table      {layers} layers x {rows:,} rows, {ranks} ranks -> {regions} regions",
             f"  staged     {binary_bytes(nbytes)} in {stage_s:.2f} s "
             f"({binary_bytes(nbytes / stage_s)}/s, O_DIRECT; a first run also compiles the kernels)",
             f"  into       {target}",
             f"  manifest   {manifest}",
             f"  layer {sample_layer} rank 0 row 0 (bf16, first 4): {[round(float(v), 6) for v in sample]}"]
    lines += [f"  {line}" for line in verify_lines]
    return "\n".join(lines)


def placement_words(name: str) -> str:
    """A timeline or demo placement's name in words: 'l1-dram-l14-disk' -> 'keep layer 1 in DRAM, layer 14 on
    disk'; 'disk-split' -> 'both tables on disk, the cache split between them'. Other names come back as they are."""
    import re

    tiers = {"disk": "disk", "remote": "Redis"}
    m = re.fullmatch(r"l(\d+)-dram-l(\d+)-(\w+)", name)
    if m and m.group(3) in tiers:
        return f"keep layer {m.group(1)} in DRAM, layer {m.group(2)} on {tiers[m.group(3)]}"
    m = re.fullmatch(r"(disk|remote)(-split|-cache-l(\d+))?", name)
    if m:
        where = f"both tables on {tiers[m.group(1)]}"
        if m.group(2) is None:
            return where + ", no cache"
        if m.group(2) == "-split":
            return where + ", the cache split between them"
        return where + f", the cache on layer {m.group(3)} only"
    return name


TIMELINE_LEGEND = (
    "n: runs. stall: measured wait per step for rows past each layer's scheduled start (and the host pass "
    "overrunning it), mean and min..max over shuffled runs, in ms and % of the profile's step. model: the stall "
    "predicted "
    "from the same steps' host pass and read times by the exposure model (Eq. 1 of the paper). "
    "s: the host pass per step (begin_step: hashing done, indices resolved, reads issued). "
    "read, pg, hit: read time (ms), pages read and cache hit rate per step for each table's layer.")
PLANNER_LEGEND = (" planner: predicted before the runs from the profile's windows, the read fit, the fit half's "
                  "miss-page curves and the fit configurations' host pass and fixed per-step cost.")


def timeline_table(profile, runs: Sequence, planner_ms: Mapping[tuple[int, str], float] | None = None) -> str:
    """The step-timeline report (benchmarks/paper/timeline_sweep.py, the demo): the profile, then per batch a
    verdict in words (the cheapest placement, what it costs, which others cannot be told apart from it over the
    runs), then the table per batch and placement: measured stall per step (mean and min..max over runs, ms and
    % of the profile's step) beside the exposure model's prediction (and, with `planner_ms` keyed by
    (B, placement), the planner's prediction made before the runs: serve.predict), then a legend."""
    # the profile by name and model in one line; its origin note (which paper table or section each figure comes
    # from) stays in the profile's file
    lines = [wrap(f"device compute from profile {profile.name}; host, cache and I/O real ({profile.model} step "
                  "times)")]
    groups: dict[tuple[int, str], list] = {}
    for r in runs:
        groups.setdefault((r.batch, r.placement), []).append(r)
    if not groups:
        return "\n".join(lines + ["no runs"])
    layers = tuple(next(iter(groups.values()))[0].summary.read_ms)
    l1, l2 = layers[:2]
    batches = sorted({b for b, _ in groups})
    for batch in batches:
        measured = []
        for (b, name), rs in groups.items():
            if b == batch:
                m, lo, hi = stat([100 * r.summary.stall_ms / r.step_ms for r in rs])
                measured.append(Measured(placement_words(name), m, lo, hi, len(rs)))
        if len(batches) > 1:
            lines.append(f"B={batch}:")
        lines += verdict_lines(measured, "of the step in stalls")
    lines.append("")
    lines.append(f"{'B':>4} {'placement':18} {'n':>2} {'stall':>6} {'%':>7} {'min..max':>12} "
                 f"{'model':>6} " + (f"{'planner':>7} " if planner_ms is not None else "") +
                 f"{'s':>5} {f'read L{l1}':>7} {f'read L{l2}':>8} "
                 f"{f'pg L{l1}':>5} {f'pg L{l2}':>6} {f'hit L{l1}':>6} {f'hit L{l2}':>7}")
    for (batch, name), rs in sorted(groups.items(), key=lambda kv: (kv[0][0], stat([r.summary.stall_ms
                                                                                     for r in kv[1]])[0])):
        m, lo, hi = stat([r.summary.stall_ms for r in rs])
        pred = stat([r.summary.predicted_ms for r in rs])[0]
        step = rs[0].step_ms

        def avg(f) -> float:
            return stat([f(r.summary) for r in rs])[0]

        plan = ""
        if planner_ms is not None:
            p = planner_ms.get((batch, name))
            plan = f"{'-':>7} " if p is None else f"{p:7.2f} "
        lines.append(
            f"{batch:>4} {name:18} {len(rs):>2} {m:6.2f} {100 * m / step:+6.1f}% {lo:5.2f}..{hi:<5.2f} "
            f"{pred:6.2f} " + plan + f"{avg(lambda s: s.s_ms):5.2f} "
            f"{avg(lambda s: s.read_ms[l1]):7.2f} {avg(lambda s: s.read_ms[l2]):8.2f} "
            f"{avg(lambda s: s.pages[l1]):5.0f} {avg(lambda s: s.pages[l2]):6.0f} "
            f"{fmt_pct(avg(lambda s: s.hit_rate[l1])):>6} {fmt_pct(avg(lambda s: s.hit_rate[l2])):>7}")
    checked = [r for r in runs if getattr(r, "checked_steps", 0)]
    if checked:
        lines.append(f"checker: {sum(r.checked_steps for r in checked)} decode steps after the timed ones "
                     f"({len(checked)} runs), every row compared with the table's source: "
                     f"{sum(r.mismatches for r in checked)} mismatching rows")
    lines.append(wrap(TIMELINE_LEGEND + (PLANNER_LEGEND if planner_ms is not None else "")))
    return "\n".join(lines)
