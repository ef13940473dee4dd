"""The characterization run as a person and the planner read it: CSV, JSON, a table and PNG plots.

`characterize(config)` is what `slacktier characterize` calls: it replays each
workload through one table's hash (`table`: "engram", DeepSeek-V4.1 on
DeepSeek ids, or "ple", Qwen3.8 on Qwen ids), characterizes it
(`workloads.characterize`), and writes under `config.out`, names that
BENCHMARKS.md and the planner rely on:

    hit_rates.csv / .json        one row per (workload, layer, policy, capacity)
    batch_reuse.csv / .json      one row per (workload, layer)
    summary.json                 trace sizes and timings per workload
    miss_curve_<wl>_B<batch>.json  P_l(c) for `slacktier plan`
    with `pack` (PackConfig): the pack list chosen on the fit half, and one TP rank's P_l(c) on the held-out
    half without and with it: miss_curve_<wl>_B<batch>_rank<r>.json, ..._rank<r>_packed.json
    hit_rate_<wl>_L<layer>.png, miss_pages.png  (unless plots are off)

The driver lives here rather than in `characterize.py` so that the verb makes
one call and every byte the run writes is chosen in this module.
"""

from __future__ import annotations

import csv
import json
import logging
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np

from slacktier.errors import ErrorKind, SlackTierError, optional_import
from slacktier.workloads.characterize import (BatchReuse, Capacity, HitResult, Phases, batch_reuse,
                                              capacities_for, hit_table, miss_page_curve, prepare_workload,
                                              trace_summary, write_json)
from slacktier.workloads.corpus import WORKLOADS, CorpusConfig
from slacktier.workloads.packing import PackConfig, characterize_packing
from slacktier.workloads.hashing import TABLE_TOKENS, TABLES, lookup_hasher, table_layer_ids
from slacktier.workloads.policies import KNOWN_POLICIES, POLICIES
from slacktier.workloads.replay import ReplayConfig

log = logging.getLogger(__name__)

TABLE_TITLES = {"engram": "Engram", "ple": "PLE"}


@dataclass(frozen=True)
class CharacterizeConfig:
    """One characterization run: which workloads, how they are replayed, which policies and capacities."""

    corpus: CorpusConfig
    replay: ReplayConfig
    workloads: tuple[str, ...] = ("agent", "chat")
    policies: tuple[str, ...] = POLICIES
    layers: tuple[int, ...] = ()           # empty: every layer of the table
    table: str = "engram"                  # "engram" (V4.1, corpus.tokens "deepseek") or "ple" (Qwen3.8, "qwen")
    capacities_rows: tuple[int, ...] = ()  # empty: capacities_for() per layer
    static_head_share: float = 0.5         # share of capacity static_lru pins
    miss_policy: str = "clock"             # policy behind the miss-page curve: the engine's CLOCK, "clock+RULE" with
                                           # its control file's admission RULE
    miss_points: int = 12                  # capacities on the miss-page curve
    out: Path = Path("runs/characterize")
    pack: PackConfig | None = None         # context packing: choose on the fit half, curves with the list
    engram_vocab: int = 0                  # engram: hash for the table scaled to this per-head vocabulary (0: full)
    plots: bool = True
    progress: bool = True

    def __post_init__(self) -> None:
        for p in (*self.policies, self.miss_policy):
            if p not in KNOWN_POLICIES:
                raise SlackTierError(ErrorKind.BAD_INPUT, f"unknown policy {p}",
                                     fix=f"use {','.join(KNOWN_POLICIES)}")
        for w in self.workloads:
            if w not in WORKLOADS:
                raise SlackTierError(ErrorKind.BAD_INPUT, f"unknown workload {w}", fix=f"use {','.join(WORKLOADS)}")
        if self.table not in TABLES:
            raise SlackTierError(ErrorKind.BAD_INPUT, f"unknown table {self.table}", fix=f"use {','.join(TABLES)}")
        own = table_layer_ids(self.table)
        if not self.layers:
            object.__setattr__(self, "layers", own)
        if (set(self.layers) - set(own) or not 0 <= self.static_head_share <= 1
                or any(c < 0 for c in self.capacities_rows)):
            raise SlackTierError(ErrorKind.BAD_INPUT, f"{self.table} layers {self.layers}, static head share "
                                 f"{self.static_head_share}, capacities {self.capacities_rows}",
                                 fix=f"name layers among {own}, a share in [0, 1] and capacities >= 0 rows")
        if self.pack is not None and len(self.workloads) != 1:
            raise SlackTierError(ErrorKind.BAD_INPUT, f"a pack list for {len(self.workloads)} workloads",
                                 fix="pass one workload with --pack-list (one list per workload's traffic)")
        if self.pack is not None:
            self.pack.rows_of(self.layers)
        if self.corpus.tokens != TABLE_TOKENS[self.table]:
            if self.table == "engram":
                raise SlackTierError(ErrorKind.BAD_INPUT, f"the Engram table hashes DeepSeek-V4 ids, not "
                                     f"{self.corpus.tokens} ids", fix="use CorpusConfig(tokens='deepseek')")
            log.warning("PLE over %s ids: an access pattern of the PLE's shape, not Qwen3.8's own traffic "
                        "(Qwen3.8 hashes Qwen ids: tokens='qwen')", self.corpus.tokens)


@dataclass
class Characterization:
    """What a run measured (also written to files under its `out`)."""

    hits: list[HitResult] = field(default_factory=list)
    reuse: list[dict] = field(default_factory=list)      # asdict(BatchReuse) per (workload, layer)
    summary: dict = field(default_factory=dict)          # workload -> trace_summary() and timings
    curve_paths: list[Path] = field(default_factory=list)  # one miss_curve_<wl>_B<batch>.json per workload


def miss_curve_grid(n_items: int, points: int) -> list[int]:
    """Capacities of the miss-page curve: 0, then geometric from 1/1000 of `n_items` up to `n_items`.

    Worked example: n_items 1000, points 5 -> 0 and 1000 * (0.001, 0.01, 0.1, 1) -> [0, 1, 10, 100, 1000].
    """
    return sorted({0, *[int(round(n_items * f)) for f in np.geomspace(1e-3, 1.0, max(points - 1, 1))]})


def characterize(config: CharacterizeConfig) -> Characterization:
    """Replay every workload, characterize it, write CSV/JSON (and PNG) under config.out, print the table."""
    hasher = lookup_hasher(config.table, config.engram_vocab)
    out = config.out
    out.mkdir(parents=True, exist_ok=True)
    batch = config.replay.batch
    res = Characterization()
    phases = Phases(config.progress)
    for wl in config.workloads:
        pw = prepare_workload(wl, config.corpus, config.replay, hasher, list(config.layers), config.progress,
                              phases)
        if len(pw.split.holdout) < batch:
            log.warning("%s: only %d holdout sessions for batch %d", wl, len(pw.split.holdout), batch)
        caps = {p.layer_id: ([Capacity(c, f"{c} rows") for c in config.capacities_rows] if config.capacities_rows
                             else capacities_for(pw.trace, p.layer_id)) for p in pw.preps}
        t1 = time.perf_counter()
        phases.start(f"{wl}: {len(config.policies)} policies x {sum(map(len, caps.values()))} capacities "
                     "(a first run also compiles them)")
        results = hit_table(pw.preps, list(config.policies), caps, config.static_head_share, config.progress)
        res.hits += results
        phases.start(f"{wl}: batch reuse")
        res.reuse += [asdict(batch_reuse(prep, seed=config.corpus.seed)) for prep in pw.preps]
        # one grid for all layers, up to the most unique rows of a layer
        grid = miss_curve_grid(max(p.n_items for p in pw.preps), config.miss_points)
        phases.start(f"{wl}: miss-page curve ({config.miss_policy}, {len(grid)} capacities)")
        curve = miss_page_curve(pw.preps, grid, config.miss_policy, config.progress)
        phases.end()
        curve |= {"table": config.table, "tokens": config.corpus.tokens}
        curve_path = out / f"miss_curve_{wl}_B{batch}.json"
        write_json(curve_path, curve)
        res.curve_paths.append(curve_path)
        packing = None
        if config.pack is not None:
            phases.start(f"{wl}: replaying the fit split, choosing contexts to pack, rank miss curves")
            packing = characterize_packing(
                pw.split, pw.trace, hasher, config.replay, list(config.layers), config.pack, grid, out,
                config.corpus.tokens, config.corpus.seed)
            phases.end()
        res.summary[wl] = trace_summary(pw) | {"table": config.table, "tokens": config.corpus.tokens,
                                               "characterize_s": time.perf_counter() - t1,
                                               "lru_lookups_per_s": lru_lookups_per_s(results),
                                               "miss_curve": str(curve_path)}
        if packing is not None:
            res.summary[wl]["packing"] = packing
    write_tables(res, out)
    if config.plots:
        phases.start("drawing the plots")
        plot_hit_rates(res.hits, out, TABLE_TITLES[config.table])
        plot_miss_curves(res.curve_paths, out)
        phases.end()
    print(format_characterization(res.hits, res.reuse, res.summary))
    print(f"wrote {out}/hit_rates.csv, hit_rates.json, batch_reuse.csv, summary.json, miss_curve_*.json")
    return res


def lru_lookups_per_s(results: Sequence[HitResult]) -> float | None:
    """Lookups per second of the LRU kernel over its runs (None without an LRU run)."""
    lru = [r for r in results if r.policy == "lru"]
    return sum(r.all_lookups for r in lru) / sum(r.seconds for r in lru) if lru else None


def hit_row(result: HitResult) -> dict:
    """One CSV row of hit_rates.csv: the result's fields, the per-order rates as order<k>_decode_hit_rate."""
    d = asdict(result)
    for k, v in d.pop("order_hit_rate", {}).items():
        d[f"order{k}_decode_hit_rate"] = v
    return d


def write_csv(path: Path, rows: Sequence[dict]) -> None:
    """Rows as CSV with the first row's keys as header (an empty file for no rows)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if not rows:
        path.write_text("")
        return
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


def write_tables(res: Characterization, out: Path) -> None:
    """hit_rates.csv/.json, batch_reuse.csv/.json and summary.json under `out`."""
    write_csv(out / "hit_rates.csv", [hit_row(r) for r in res.hits])
    write_json(out / "hit_rates.json", [asdict(r) for r in res.hits])
    write_csv(out / "batch_reuse.csv", res.reuse)
    write_json(out / "batch_reuse.json", res.reuse)
    write_json(out / "summary.json", res.summary)


def format_characterization(results: Sequence[HitResult], reuse_rows: Sequence[dict | BatchReuse],
                            summary: dict) -> str:
    """Decode hit rates, one line per (workload, layer, capacity) and one column per policy; reuse; trace sizes."""
    policies = sorted({r.policy for r in results}, key=KNOWN_POLICIES.index)
    width = {p: max(10, len(p)) for p in policies}
    keyed = {(r.workload, r.layer, r.capacity_rows, r.capacity_label, r.policy): r for r in results}
    lines = sorted({k[:4] for k in keyed}, key=lambda k: (k[0], k[1], k[2]))
    head = f"{'workload':8} {'layer':>5} {'capacity':>22} {'rows':>11} " + " ".join(f"{p:>{width[p]}}"
                                                                                    for p in policies)
    text = [head, "-" * len(head)]
    for wl, layer, rows, label in lines:
        vals = []
        for p in policies:
            r = keyed.get((wl, layer, rows, label, p))
            vals.append(f"{100 * r.decode_hit_rate:{width[p] - 1}.1f}%" if r else f"{'-':>{width[p]}}")
        text.append(f"{wl:8} {layer:>5} {label:>22} {rows:>11,} " + " ".join(vals))
    text.append("")
    for r in reuse_rows:
        r = asdict(r) if isinstance(r, BatchReuse) else r
        text.append(f"batch reuse {r['workload']:6} layer {r['layer']:>2}: distinct among {r['sample_tokens']} "
                    f"sampled decode tokens {100 * r['sampled_distinct']:.1f}%, consecutive "
                    f"{100 * r['consecutive_distinct']:.1f}%, in {r['window_tokens']}-token windows "
                    f"{100 * r['window_distinct']:.1f}%")
    for wl, s in summary.items():
        ids = f" [{s['table']} on {s['tokens']} ids]" if "table" in s else ""
        text.append(f"{wl}{ids}: {s['holdout_sessions']} holdout sessions ({s['holdout_sources']} sources), fit "
                    f"{s['fit_sessions']} ({s['fit_sources']} sources), {s['trace_tokens']:,} trace tokens, "
                    f"{s['decode_tokens']:,} decode tokens, LRU {s['lru_lookups_per_s'] or 0:,.0f} lookups/s")
        if s.get("packing"):
            pk = s["packing"]
            text.append(f"{wl} packing (chosen on the fit half): {pk['packing']['contexts']} contexts per layer, "
                        f"{pk['packing']['extra_disk_bytes_per_rank'] / 1e9:.3f} GB extra disk and "
                        f"{pk['packing']['index_bytes_per_rank'] / 2**20:.1f} MiB index per rank -> "
                        f"{pk['pack_list']}; curves {pk['curve']}, {pk['packed_curve']}")
    return "\n".join(text)


def plot_hit_rates(results: Sequence[HitResult], out: Path, table_title: str = "Engram") -> list[Path]:
    """hit_rate_<workload>_L<layer>.png: decode hit rate against capacity, one line per policy."""
    matplotlib = optional_import("matplotlib", "workloads", "characterize's PNG plots (or pass --no-plots)")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for wl in sorted({r.workload for r in results}):
        for layer in sorted({r.layer for r in results if r.workload == wl}):
            fig, ax = plt.subplots(figsize=(6, 4))
            for policy in sorted({r.policy for r in results}):
                pts = sorted({(r.capacity_rows, r.decode_hit_rate) for r in results
                              if r.workload == wl and r.layer == layer and r.policy == policy and r.capacity_rows > 0})
                if pts:
                    ax.plot([p[0] for p in pts], [100 * p[1] for p in pts], marker="o", label=policy)
            ax.set_xscale("log")
            ax.set_xlabel("cache capacity (rows per layer)")
            ax.set_ylabel("decode hit rate (%)")
            ax.set_title(f"{wl}, {table_title} layer {layer}")
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=8)
            fig.tight_layout()
            path = out / f"hit_rate_{wl}_L{layer}.png"
            fig.savefig(path, dpi=120)
            plt.close(fig)
            written.append(path)
    return written


def plot_miss_curves(paths: Sequence[Path], out: Path) -> Path:
    """miss_pages.png: P_l(c), pages read per decode step against capacity, per workload and layer."""
    matplotlib = optional_import("matplotlib", "workloads", "characterize's PNG plots (or pass --no-plots)")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for path in paths:
        curve = json.loads(Path(path).read_text())
        for layer, d in curve["layers"].items():
            xs = [max(c, 1) for c in d["capacity_rows"]]  # 0 rows drawn at 1 on the log axis
            ax.plot(xs, d["pages_per_step"], marker=".", label=f"{curve['workload']} L{layer} (B={curve['batch']})")
    ax.set_xscale("log")
    ax.set_xlabel("cache capacity (rows per layer)")
    ax.set_ylabel("pages read per decode step")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = out / "miss_pages.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
