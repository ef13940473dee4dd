"""The end-to-end harness's wide Table 2 layout: every column a placement's paired runs measured.

The demo prints a narrower table from the same rows (slacktier.serve.report.format_demo_table).
"""

from __future__ import annotations

from typing import Sequence

from slacktier.serve.report import PlacementRow, fmt_ms, fmt_num, fmt_pct
from slacktier.serve.runs import LayerStats


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
