"""Figure 3 (overhead vs cache split) and Figure 5 (overhead vs load) analogs as PNGs."""

from __future__ import annotations

from pathlib import Path

from benchmarks._harness import pyplot, save_figure
from benchmarks.e2e.analysis import figure3_points, figure5_points, table2_rows
from benchmarks.e2e.run import Results


def plot(results: Results, out_dir: Path) -> list[Path]:
    """Write the figures that have points; returns their paths."""
    cfg = results.config
    l1, l2 = results.layers[:2]
    paths = []
    f3 = figure3_points(results)
    if len(f3) > 1:
        plt = pyplot()
        fig, ax = plt.subplots(figsize=(5, 3.2))
        mean = [m for _, (m, _, _) in f3]
        err = [[m - lo for _, (m, lo, _) in f3], [hi - m for _, (m, _, hi) in f3]]
        ax.errorbar([f for f, _ in f3], mean, yerr=err, marker="o", capsize=3, label="both on disk, split cache")
        for row in table2_rows(results):
            if row.workload == cfg.workloads[0] and row.placement == f"l{l1}-dram-l{l2}-disk":
                ax.axhline(row.overhead_pct[0], ls="--", color="gray", label=f"L{l1} DRAM, L{l2} disk, no cache")
            if row.workload == cfg.workloads[0] and row.placement == f"disk{cfg.rig.devices}-split":
                ax.axhline(row.overhead_pct[0], ls=":", color="k", label=f"{cfg.rig.devices} devices, even split")
        ax.set_xlabel(f"share f of the cache given to layer {l1}")
        ax.set_ylabel("decode step overhead vs DRAM (%)")
        ax.set_title(f"{cfg.workloads[0]}, B={cfg.table2_batch}, {cfg.rig.cache_rows} cache rows", fontsize=9)
        ax.legend(fontsize=7)
        fig.tight_layout()
        paths.append(Path(out_dir) / "e2e_fig3_cache_split.png")
        save_figure(fig, paths[-1])
        plt.close(fig)
    f5 = figure5_points(results)
    if f5:
        plt = pyplot()
        fig, ax = plt.subplots(figsize=(5, 3.2))
        for name, pts in f5.items():
            bs = sorted(pts)
            ax.plot(bs, [pts[b] for b in bs], marker="o", label=name)
        ax.axhline(0, color="k", lw=0.5)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent sessions B")
        ax.set_ylabel("decode step overhead vs DRAM (%)")
        ax.set_title(f"{cfg.workloads[0]} traffic", fontsize=9)
        ax.legend(fontsize=7)
        fig.tight_layout()
        paths.append(Path(out_dir) / "e2e_fig5_load.png")
        save_figure(fig, paths[-1])
        plt.close(fig)
    return paths
