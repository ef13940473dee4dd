"""The replay benchmark (`slacktier bench`): Table 2, Figure 3 and Figure 5 of the paper, on this machine.

One process, one model, one step engine. Every run replays the same held-out
sessions (agent or chat) with B concurrent sessions under one placement; the
engine is switched between placements with `StepEngine.reconfigure` (the
control file's reload path) and its cache is cleared at each switch. Runs are
shuffled (seeded) across placements, loads and workloads; each configuration
runs `runs` times. Step time is the mean over decode steps with the full batch
(B sessions) in them.

The exposure model (plan.exposure, Eq. 1) is then fitted on the first run of
each configuration and predicts the others: windows W_l are measured in the
DRAM-table runs at the same load (time from "lookups issued" to the layer
asking for its rows), T_l is the engine's per-step read time of layer l,
slowdown = step time - the DRAM table's step time at the same load, and
kappa is the one fitted constant.
"""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from slacktier.errors import ErrorKind, SlackTierError
from slacktier.models.deepseek_v41 import V41Config, V41Model
from slacktier.serve.loop import LoopConfig, ReplayResult, replay
from slacktier.serve.runners import V41Runner
from slacktier.serve.tiers import Placement, TierSet, split_placement, table2_placements
from slacktier.workloads.sessions import TokenSession

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BenchConfig:
    """What the benchmark runs."""

    workdir: str = "runs/e2e"
    preset: str = "bench"
    engram_vocab: int = 100_000          # each layer's table has ~24x this many rows (264 B each)
    workloads: tuple[str, ...] = ("agent", "chat")
    table2_batch: int = 8                 # B of Table 2 and Figure 3 (the paper: 128)
    batches: tuple[int, ...] = (4, 8, 16)  # Figure 5's loads (the paper: 8..256)
    runs: int = 3
    decode_tokens: int = 16               # N tokens per assistant turn (the paper: 128)
    prefill_chunk_tokens: int = 512
    max_session_tokens: int = 2048        # sessions cut to their turns that end within this many tokens
    max_turns: int = 2
    cache_rows: int = 32_768              # rows in the row cache (both layers)
    devices: int = 4
    split_fs: tuple[float, ...] = (0.0, 0.25, 0.5, 0.75, 1.0)
    # (first-layer ms, second-layer ms) hand-out delays on top of the DRAM tier, run at table2_batch: the
    # paper's Table 3 check of Eq. 1 on read times this machine's disk does not produce.
    delays_ms: tuple[tuple[float, float], ...] = ((60.0, 100.0), (60.0, 160.0), (90.0, 160.0), (120.0, 220.0))
    figure3_runs: int = 1                 # per f other than 0.5 (which is Table 2's disk-split, `runs` times)
    figure3: bool = True
    figure5: bool = True
    torch_threads: int = 1
    seed: int = 0
    agent_sessions_per_source: int = 5    # agent sessions built per source tree (the demo uses 1: quicker first run)

    def __post_init__(self) -> None:
        if self.runs < 1 or self.table2_batch < 1 or any(b < 1 for b in self.batches):
            raise SlackTierError(ErrorKind.BAD_INPUT, f"bad bench config {self}", fix="runs and batches >= 1")


@dataclass
class RunRecord:
    """One run: configuration and what it measured."""

    workload: str
    batch: int
    placement: str
    rep: int
    order: int
    paired: bool = False      # run side by side with the DRAM table, step by step (arm 0 = DRAM, arm 1 = this)
    step_ms: float = math.nan
    base_ms: float = math.nan  # paired: the DRAM arm's mean step over the same steps
    overhead_pct: float = math.nan
    mismatch_steps: int = 0
    step_p99_ms: float = math.nan
    tpot_ms: float = math.nan
    ttft_p50_ms: float = math.nan
    rss_peak_gib: float = math.nan
    decode_steps: int = 0
    wall_s: float = 0.0
    window_ms: dict = field(default_factory=dict)     # layer -> mean window (from lookups issued)
    rows_ms: dict = field(default_factory=dict)       # layer -> mean time in rows() (wait + gather)
    read_ms: dict = field(default_factory=dict)       # layer -> mean engine read time per step
    wait_ms: dict = field(default_factory=dict)       # layer -> mean engine wait per step
    pages: dict = field(default_factory=dict)         # layer -> mean pages read per step
    hit_rate: dict = field(default_factory=dict)      # layer -> decode-step hit rate
    step_reads: list = field(default_factory=list)    # per full decode step: {layer: read_ms}
    delays_ms: dict = field(default_factory=dict)     # layer -> injected hand-out delay (delay runs only)
    digest: str = ""


def clip_sessions(sessions, max_tokens: int, max_turns: int) -> list[TokenSession]:
    """Each session cut to its first turns that end within `max_tokens` (at most `max_turns`); empty ones dropped."""
    out = []
    for s in sessions:
        keep = [k for k in range(min(s.num_replies, max_turns)) if s.reply_end[k] <= max_tokens]
        if not keep or keep[0] != 0:
            continue
        k = keep[-1] + 1
        end = int(s.reply_end[k - 1])
        out.append(TokenSession(s.session_id, s.source, s.kind, np.asarray(s.tokens[:end]),
                                np.asarray(s.reply_start[:k]), np.asarray(s.reply_end[:k])))
    return out


def load_sessions(workload: str, n: int, cfg: BenchConfig) -> list[TokenSession]:
    """`n` held-out sessions of `workload` (workloads.corpus), clipped; repeats the list if it is short."""
    from slacktier.workloads.corpus import CorpusConfig, load_workload

    split = load_workload(workload, CorpusConfig(seed=cfg.seed,
                                                 agent_sessions_per_source=cfg.agent_sessions_per_source))
    pool = clip_sessions(split.holdout, cfg.max_session_tokens, cfg.max_turns)
    if len(pool) < n:
        pool += clip_sessions(split.fit, cfg.max_session_tokens, cfg.max_turns)
    if not pool:
        raise SlackTierError(ErrorKind.MISSING, f"no {workload} session fits in {cfg.max_session_tokens} tokens",
                             fix="raise max_session_tokens")
    return [pool[i % len(pool)] for i in range(n)]


class Bench:
    """Holds the model, the staged tables and the engine across runs."""

    def __init__(self, cfg: BenchConfig, progress: bool = False) -> None:
        from slacktier.tables.engram_hash import EngramLayout
        from slacktier.workloads.hashing import EngramLookupHasher

        self.cfg = cfg
        torch.set_num_threads(cfg.torch_threads)
        self.model_cfg = V41Config.preset(cfg.preset)
        first, second = self.model_cfg.engram_layer_ids[:2]
        self.first, self.second = first, second
        self.layout = EngramLayout.scaled(cfg.engram_vocab, self.model_cfg.engram_layer_ids)
        self.hasher = EngramLookupHasher(self.layout)
        self.model = V41Model(self.model_cfg)
        self.runner = V41Runner(self.model)
        max_tokens = max(cfg.prefill_chunk_tokens, max(cfg.batches + (cfg.table2_batch,)))
        self.tiers = TierSet(Path(cfg.workdir) / "tables", self.layout, seed=cfg.seed + 1,
                             max_cache_rows=cfg.cache_rows, max_tokens=max_tokens, devices=cfg.devices)
        t0 = time.perf_counter()
        self.tiers.stage(progress=progress)
        self.stage_s = time.perf_counter() - t0
        self.sessions: dict[tuple[str, int], list[TokenSession]] = {}
        self.placements = {p.name: p for p in table2_placements(first, second, cfg.cache_rows, cfg.devices)}
        for f in cfg.split_fs:
            p = split_placement(first, second, cfg.cache_rows, f)
            self.placements[p.name] = p
        for d1, d2 in cfg.delays_ms:
            p = Placement(f"delay-{d1:g}-{d2:g}", ((first, "dram"), (second, "dram")),
                          delays_ms=((first, d1), (second, d2)))
            self.placements[p.name] = p

    def sessions_for(self, workload: str, batch: int) -> list[TokenSession]:
        """B held-out sessions: one wave, all live together (the same ones in every run at this load)."""
        key = (workload, batch)
        if key not in self.sessions:
            self.sessions[key] = load_sessions(workload, batch, self.cfg)
        return self.sessions[key]

    def run_one(self, workload: str, batch: int, placement: Placement, rep: int, order: int,
                paired: bool = True) -> RunRecord:
        """One replay under one placement; paired: side by side with the DRAM table, step by step."""
        from slacktier.workloads.replay import ReplayConfig, replay_steps

        paired = paired and not placement.stock
        provider = self.tiers.provider(placement, keep_stock=paired)
        arms = [self.tiers.stock_provider(), provider] if paired else None
        self.runner.set_provider(provider)
        sessions = self.sessions_for(workload, batch)
        rc = ReplayConfig(batch=batch, decode_tokens=self.cfg.decode_tokens,
                          prefill_chunk_tokens=self.cfg.prefill_chunk_tokens)
        model = self.model

        def stats() -> dict:
            eng = getattr(model.provider, "last_counters", None)
            return {"win": dict(model.last_windows_ms), "rows": dict(model.last_rows_ms),
                    "eng": {l: c.as_dict() for l, c in eng.layers.items()} if eng is not None else None}

        t0 = time.perf_counter()
        res = replay(self.runner, sessions, replay_steps(sessions, self.hasher, rc), rc.decode_tokens,
                     LoopConfig(record_digests=True), step_stats=stats, arms=arms)
        rec = RunRecord(workload, batch, placement.name, rep, order, paired=paired,
                        wall_s=time.perf_counter() - t0, delays_ms=dict(placement.delays_ms))
        summarize(rec, res, batch, self.model_cfg.engram_layer_ids)
        return rec

    def close(self) -> None:
        """Close the engine and sources."""
        self.tiers.close()


def summarize(rec: RunRecord, res: ReplayResult, batch: int, layers) -> None:
    """Fill a run record from a replay: full-batch decode steps only."""
    full = [s for s in res.steps if s.kind == "decode" and s.sessions >= batch]
    dec = [s for s in res.steps if s.kind == "decode"]
    arm = 1 if rec.paired else 0
    times = np.array([s.extra["arm_ms"][arm] if rec.paired else s.step_ms for s in full])
    s = res.summary()
    rec.decode_steps = len(full)
    rec.mismatch_steps = int(sum(st.extra.get("mismatch", 0) for st in res.steps))
    if len(full):
        rec.step_ms = float(times.mean())
        rec.step_p99_ms = float(np.percentile(times, 99))
        if rec.paired:
            base = np.array([st.extra["arm_ms"][0] for st in full])
            rec.base_ms = float(base.mean())
            rec.overhead_pct = 100 * (rec.step_ms / rec.base_ms - 1)

    def ex(st) -> dict:   # the measured arm's stats; windows come from the DRAM arm when paired
        return st.extra["arms"][arm] if rec.paired else st.extra

    def ex_win(st) -> dict:
        return st.extra["arms"][0] if rec.paired else st.extra
    rec.tpot_ms, rec.ttft_p50_ms = s["tpot_ms"], s["ttft_p50_ms"]
    rec.rss_peak_gib = s["rss_peak_bytes"] / 2**30
    rec.digest = __import__("hashlib").sha1("".join(st.digest for st in res.steps).encode()).hexdigest()
    for l in layers:
        w = [ex_win(st)["win"][l] for st in full if l in ex_win(st).get("win", {})]
        r = [ex(st)["rows"][l] for st in full if l in ex(st).get("rows", {})]
        rec.window_ms[l] = float(np.mean(w)) if w else math.nan
        rec.rows_ms[l] = float(np.mean(r)) if r else math.nan
        eng = [ex(st)["eng"][l] for st in full if ex(st).get("eng")]
        if eng:
            rec.read_ms[l] = float(np.mean([e["read_us"] for e in eng])) / 1e3
            rec.wait_ms[l] = float(np.mean([e["wait_us"] for e in eng])) / 1e3
            rec.pages[l] = float(np.mean([e["pages_read"] for e in eng]))
        deng = [ex(st)["eng"][l] for st in dec if ex(st).get("eng")]
        if deng:
            lookups = sum(e["lookups"] for e in deng)
            rec.hit_rate[l] = sum(e["hits"] for e in deng) / lookups if lookups else 0.0
    rec.step_reads = [{l: ex(st)["eng"][l]["read_us"] / 1e3 for l in layers} for st in full if ex(st).get("eng")]


def plan_runs(cfg: BenchConfig, bench: Bench) -> list[tuple[str, int, str, int, bool]]:
    """Every (workload, B, placement, rep, paired) to run, shuffled (seeded).

    Paired runs measure overhead side by side with the DRAM table; one unpaired run per Table 2 placement
    (rep -1, first workload) measures the process's resident memory with only that placement's tables.
    """
    t2 = [p for p in bench.placements if not p.startswith(("disk-split-f", "delay-")) and p != "dram-table"]
    jobs = set()
    for w in cfg.workloads:
        for p in t2:
            for r in range(cfg.runs):
                jobs.add((w, cfg.table2_batch, p, r, True))
    # Resident memory differs by which tables sit in host memory; the cache is the same 264 B x rows in all.
    for p in ("dram-table", f"l{bench.first}-dram-l{bench.second}-disk", "disk"):
        jobs.add((cfg.workloads[0], cfg.table2_batch, p, -1, False))
    if cfg.figure3:
        for f in cfg.split_fs:
            if abs(f - 0.5) > 1e-9:   # f = 0.5 is Table 2's disk-split
                for r in range(cfg.figure3_runs):
                    jobs.add((cfg.workloads[0], cfg.table2_batch, f"disk-split-f{f:.2f}", r, True))
    for p in bench.placements:
        if p.startswith("delay-"):
            jobs.add((cfg.workloads[0], cfg.table2_batch, p, 0, True))
    if cfg.figure5:
        fig5 = [f"l{bench.first}-dram-l{bench.second}-disk", f"disk-cache-l{bench.second}", "disk-split"]
        for b in cfg.batches:
            if b != cfg.table2_batch:
                for p in fig5:
                    jobs.add((cfg.workloads[0], b, p, 0, True))
    out = sorted(jobs)
    np.random.default_rng(cfg.seed).shuffle(out)
    return out


def run_bench(cfg: BenchConfig, progress: bool = True, on_run=None) -> dict:
    """Run everything; returns {"config", "runs", "stage_s", ...} (also written to workdir/results.json)."""
    bench = Bench(cfg, progress=progress)
    records: list[RunRecord] = []
    jobs = plan_runs(cfg, bench)
    t0 = time.perf_counter()
    partial = Path(cfg.workdir) / "results.partial.jsonl"
    partial.parent.mkdir(parents=True, exist_ok=True)
    partial.write_text("")
    try:
        for i, (w, b, p, r, paired) in enumerate(jobs):
            rec = bench.run_one(w, b, bench.placements[p], r, i, paired=paired)
            records.append(rec)
            with partial.open("a") as f:   # survives an interrupted benchmark
                f.write(json.dumps(asdict(rec), default=float) + "\n")
            if on_run is not None:
                on_run(i, len(jobs), rec)
    finally:
        bench.close()
    out = {"config": asdict(cfg), "stage_s": bench.stage_s, "layers": list(bench.model_cfg.engram_layer_ids),
           "model": asdict(bench.model_cfg), "table_rows": [bench.layout.rows(i) for i in range(2)],
           "wall_s": time.perf_counter() - t0, "runs": [asdict(r) for r in records],
           "finished_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime())}
    path = Path(cfg.workdir) / "results.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(out, indent=1, default=float)
    path.write_text(text)
    return json.loads(text)   # layer keys as strings, as a reader of results.json sees them


# ---- analysis -----------------------------------------------------------------------------------------
def _by(runs, **match):
    return [r for r in runs if all(r[k] == v for k, v in match.items())]


def _stat(vals):
    a = np.array([v for v in vals if v is not None and np.isfinite(v)])
    return (float(a.mean()), float(a.min()), float(a.max())) if a.size else (math.nan,) * 3


def _is_t2(name: str) -> bool:
    return not name.startswith(("disk-split-f", "delay-"))


def table2(results: dict) -> list[dict]:
    """Rows of the Table 2 analog per workload and placement: paired overhead (mean, min, max over runs),
    the placement's and the DRAM arm's step, p99, hit rates, read and wait times, RSS of the unpaired run."""
    cfg = results["config"]
    runs = results["runs"]
    b = cfg["table2_batch"]
    l1, l2 = [str(l) for l in results["layers"]]
    out = []
    for w in cfg["workloads"]:
        names = sorted({r["placement"] for r in runs if r["workload"] == w and r["batch"] == b and r["paired"]
                        and _is_t2(r["placement"])})
        # Unpaired runs (one placement alone): resident memory, TPOT and TTFT. A paired run's clocks include the
        # other arm's work, so its TPOT/TTFT are not the placement's.
        alone = {r["placement"]: r for r in runs if not r["paired"] and r["workload"] == w and r["batch"] == b}
        rss_of = {p: r["rss_peak_gib"] for p, r in alone.items()}
        base_unpaired = _by(runs, workload=w, batch=b, placement="dram-table", paired=False)
        paired_all = [r for r in runs if r["workload"] == w and r["batch"] == b and r["paired"]]
        out.append({"workload": w, "placement": "dram-table", "runs": len(paired_all),
                    "step_ms": _stat([r["base_ms"] for r in paired_all])[0], "overhead": (0.0, 0.0, 0.0),
                    "p99_ms": math.nan, "base_ms": _stat([r["base_ms"] for r in paired_all])[0],
                    "rss_gib": rss_of.get("dram-table", math.nan),
                    "tpot_ms": _stat([r["tpot_ms"] for r in base_unpaired])[0],
                    "ttft_ms": _stat([r["ttft_p50_ms"] for r in base_unpaired])[0],
                    "hit": {}, "read_ms": {}, "wait_ms": {}, "pages": {}, "mismatch": 0})
        for p in names:
            rs = _by(runs, workload=w, batch=b, placement=p, paired=True)
            out.append({
                "workload": w, "placement": p, "runs": len(rs),
                "step_ms": _stat([r["step_ms"] for r in rs])[0], "base_ms": _stat([r["base_ms"] for r in rs])[0],
                "overhead": _stat([r["overhead_pct"] for r in rs]),
                "p99_ms": _stat([r["step_p99_ms"] for r in rs])[0],
                "tpot_ms": alone[p]["tpot_ms"] if p in alone else math.nan,
                "ttft_ms": alone[p]["ttft_p50_ms"] if p in alone else math.nan,
                "rss_gib": rss_of.get(p, math.nan),
                "hit": {l: _stat([r["hit_rate"].get(l, math.nan) for r in rs])[0] for l in (l1, l2)},
                "read_ms": {l: _stat([r["read_ms"].get(l, math.nan) for r in rs])[0] for l in (l1, l2)},
                "wait_ms": {l: _stat([r["wait_ms"].get(l, math.nan) for r in rs])[0] for l in (l1, l2)},
                "pages": {l: _stat([r["pages"].get(l, math.nan) for r in rs])[0] for l in (l1, l2)},
                "mismatch": sum(r["mismatch_steps"] for r in rs),
            })
    return out


def exposure_fit(results: dict) -> dict:
    """Fit kappa of Eq. 1 on the first run of each placement, predict every other paired engine run."""
    from slacktier.plan.exposure import LayerRead, exposure
    from slacktier.plan.fit import fit_quality

    layers = [str(l) for l in results["layers"]]
    rows = []
    for r in results["runs"]:
        if not r["paired"] or not r["step_reads"] or not np.isfinite(r["base_ms"]):
            continue
        windows = r["window_ms"]   # measured in this run's DRAM arm, same steps
        delay = {str(k): v for k, v in r.get("delays_ms", {}).items()}
        stalls = [exposure([LayerRead(int(l), windows[l], max(st[l], delay.get(l, 0.0))) for l in layers]).slowdown_ms
                  for st in r["step_reads"]]
        rows.append((r, float(np.mean(stalls)), r["step_ms"] - r["base_ms"]))
    # Fitted on the first run of each placement; predicted: the other runs and every injected-delay run.
    is_held = (lambda r: r["rep"] != 0 or r["placement"].startswith("delay-"))
    fit = [(p, m) for r, p, m in rows if not is_held(r)]
    held = [(p, m) for r, p, m in rows if is_held(r)]
    if len(fit) < 2 or len(held) < 2:
        return {"fit_runs": len(fit), "held_runs": len(held)}
    kappa = float(np.mean([m - p for p, m in fit]))
    qf = fit_quality([p + kappa for p, _ in fit], [m for _, m in fit])
    qh = fit_quality([p + kappa for p, _ in held], [m for _, m in held])
    return {"kappa_ms": kappa, "fit_runs": qf.runs, "fit_rmse_ms": qf.rmse_ms, "fit_r2": qf.r2,
            "held_runs": qh.runs, "held_rmse_ms": qh.rmse_ms, "held_r2": qh.r2,
            "points": [(r["placement"], r["batch"], r["rep"], p + kappa, m) for r, p, m in rows]}


def report(results: dict) -> str:
    """The tables a person reads: Table 2 analog, Figure 3 and 5 numbers, the model's prediction error."""
    cfg = results["config"]
    l1, l2 = [str(l) for l in results["layers"]]
    lines = []
    t2 = table2(results)
    lines.append(f"Table 2 analog, B={cfg['table2_batch']}: decode step time of each placement measured side by side "
                 f"with the DRAM table (same steps, alternating order), {cfg['runs']} shuffled runs per row; overhead "
                 f"= mean (min..max over runs); RSS, TPOT and TTFT (p50) from one run with only that placement")
    lines.append(f"{'workload':8} {'placement':16} {'overhead':>8} {'min..max':>14} {'step':>7} {'DRAM':>7} "
                 f"{'(p99)':>8} {'RSS GiB':>7} {'hit L' + l1:>7} {'hit L' + l2:>7} {'pg L' + l1:>6} "
                 f"{'pg L' + l2:>6} {'read L' + l1:>7} {'read L' + l2:>7} {'wait L' + l1:>7} {'wait L' + l2:>7} "
                 f"{'TPOT':>6} {'TTFT':>6} {'exact':>5}")
    for row in t2:
        o = row["overhead"]
        lines.append(
            f"{row['workload']:8} {row['placement']:16} {o[0]:+7.1f}% {o[1]:+6.1f}..{o[2]:<+6.1f} "
            f"{row['step_ms']:7.1f} {row['base_ms']:7.1f} {_ms(row['p99_ms']):>8} {_num(row['rss_gib'], 2):>7} "
            f"{_pct(row['hit'].get(l1)):>7} {_pct(row['hit'].get(l2)):>7} {_num(row['pages'].get(l1), 0):>6} "
            f"{_num(row['pages'].get(l2), 0):>6} {_ms(row['read_ms'].get(l1)):>7} {_ms(row['read_ms'].get(l2)):>7} "
            f"{_ms(row['wait_ms'].get(l1)):>7} {_ms(row['wait_ms'].get(l2)):>7} {_ms(row['tpot_ms']):>6} "
            f"{_num(row['ttft_ms'], 0):>6} {'yes' if row['mismatch'] == 0 else 'NO':>5}")
    mism = sum(r["mismatch_steps"] for r in results["runs"])
    steps = sum(r["decode_steps"] for r in results["runs"] if r["paired"])
    lines.append(f"Bit-exactness: every paired step compares all logits of the placement with the DRAM table's: "
                 f"{mism} mismatching steps (over {steps} full decode steps and all prefill steps).")
    f3 = figure3_points(results)
    if len(f3) > 1:
        lines.append("")
        lines.append(f"Figure 3 analog ({cfg['workloads'][0]}, B={cfg['table2_batch']}): overhead vs share f of "
                     f"{cfg['cache_rows']} cache rows given to layer {l1}")
        for f, (mean, lo, hi) in f3:
            lines.append(f"  f={f:.2f}  {mean:+6.1f}%  (min {lo:+.1f}, max {hi:+.1f})")
    f5 = figure5_points(results)
    if f5:
        lines.append("")
        lines.append(f"Figure 5 analog ({cfg['workloads'][0]}): overhead vs concurrent sessions B (paired, "
                     f"one run per point, {cfg['runs']} at B={cfg['table2_batch']})")
        bs = sorted({b for pts in f5.values() for b in pts})
        lines.append(f"  {'placement':22} " + " ".join(f"{'B=' + str(b):>8}" for b in bs))
        for p, pts in f5.items():
            lines.append(f"  {p:22} " + " ".join(f"{pts[b]:+7.1f}%" if b in pts else f"{'-':>8}" for b in bs))
    ex = exposure_fit(results)
    lines.append("")
    delay_pts = [pt for pt in ex.get("points", []) if pt[0].startswith("delay-")]
    if delay_pts:
        lines.append(f"Injected hand-out delays (paper Table 3 analog), B={cfg['table2_batch']}: measured slowdown vs "
                     f"Eq. 1 with kappa")
        for name, b, rep, pred, meas in delay_pts:
            d = name.split("-")[1:]
            lines.append(f"  L{l1} {d[0]:>4} ms, L{l2} {d[1]:>4} ms: measured {meas:+7.1f} ms, Eq. 1 {pred:+7.1f} ms")
    if "kappa_ms" in ex:
        lines.append(f"Exposure model (Eq. 1; windows from each run's DRAM arm, T from the engine's per-step read "
                     f"times): kappa {ex['kappa_ms']:+.2f} ms fitted on {ex['fit_runs']} runs (RMSE "
                     f"{ex['fit_rmse_ms']:.2f} ms, R^2 {ex['fit_r2']:.2f}); predicts {ex['held_runs']} other runs "
                     f"with RMSE {ex['held_rmse_ms']:.2f} ms, R^2 {ex['held_r2']:.2f}")
    disk = [r for r in results["runs"] if r["placement"] == "disk" and r["batch"] == cfg["table2_batch"]
            and r["paired"]]
    if disk:
        w = {l: np.mean([r["window_ms"][l] for r in disk]) for l in (l1, l2)}
        t = {l: np.mean([r["read_ms"][l] for r in disk]) for l in (l1, l2)}
        step = np.mean([r["base_ms"] for r in disk])
        lines.append(f"Windows at B={cfg['table2_batch']} (DRAM arm): W{l1} {w[l1]:.1f} ms, W{l2} {w[l2]:.1f} ms of a "
                     f"{step:.1f} ms step; uncached disk read time per step: T{l1} {t[l1]:.1f} ms, T{l2} "
                     f"{t[l2]:.1f} ms; DRAM step / T{l2} = {step / t[l2]:.1f} (the paper: 29.4 ms / 2-4 ms = 7-15)")
    return "\n".join(lines)


def _num(x, digits: int) -> str:
    return "-" if x is None or not np.isfinite(x) else f"{x:.{digits}f}"


def _pct(x) -> str:
    return "-" if x is None or not np.isfinite(x) else f"{100 * x:.0f}%"


def _ms(x) -> str:
    return "-" if x is None or not np.isfinite(x) else f"{x:.1f}"


def figure3_points(results: dict) -> list[tuple[float, tuple[float, float, float]]]:
    """(f, (mean, min, max) paired overhead %) of the split sweep; f = 0.5 is Table 2's disk-split."""
    cfg = results["config"]
    w, b = cfg["workloads"][0], cfg["table2_batch"]
    out = []
    for f in cfg["split_fs"]:
        name = "disk-split" if abs(f - 0.5) < 1e-9 else f"disk-split-f{f:.2f}"
        rs = _by(results["runs"], workload=w, batch=b, placement=name, paired=True)
        if rs:
            out.append((f, _stat([r["overhead_pct"] for r in rs])))
    return out


def figure5_points(results: dict) -> dict[str, dict[int, float]]:
    """placement -> {B: mean paired overhead %}."""
    cfg = results["config"]
    runs = [r for r in results["runs"] if r["workload"] == cfg["workloads"][0] and r["paired"]
            and _is_t2(r["placement"])]
    out: dict[str, dict[int, list]] = {}
    for r in runs:
        out.setdefault(r["placement"], {}).setdefault(r["batch"], []).append(r["overhead_pct"])
    return {p: {b: float(np.mean(v)) for b, v in sorted(pts.items())} for p, pts in out.items() if len(pts) >= 2}


def plot(results: dict, out_dir: Path) -> list[Path]:
    """Figure 3 and Figure 5 analogs as PNGs."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    f3 = figure3_points(results)
    cfg = results["config"]
    l1, l2 = results["layers"]
    if len(f3) > 1:
        fig, ax = plt.subplots(figsize=(5, 3.2))
        fs = [f for f, _ in f3]
        mean = [m for _, (m, _, _) in f3]
        err = [[m - lo for _, (m, lo, _) in f3], [hi - m for _, (m, _, hi) in f3]]
        ax.errorbar(fs, mean, yerr=err, marker="o", capsize=3, label="both on disk, split cache")
        for row in table2(results):
            if row["workload"] == cfg["workloads"][0] and row["placement"] == f"l{l1}-dram-l{l2}-disk":
                ax.axhline(row["overhead"][0], ls="--", color="gray", label=f"L{l1} DRAM, L{l2} disk, no cache")
            if row["workload"] == cfg["workloads"][0] and row["placement"] == f"disk{cfg['devices']}-split":
                ax.axhline(row["overhead"][0], ls=":", color="k", label=f"{cfg['devices']} devices, even split")
        ax.set_xlabel(f"share f of the cache given to layer {l1}")
        ax.set_ylabel("decode step overhead vs DRAM (%)")
        ax.set_title(f"{cfg['workloads'][0]}, B={cfg['table2_batch']}, {cfg['cache_rows']} cache rows", fontsize=9)
        ax.legend(fontsize=7)
        fig.tight_layout()
        p = out_dir / "e2e_fig3_cache_split.png"
        fig.savefig(p, dpi=120)
        plt.close(fig)
        paths.append(p)
    f5 = figure5_points(results)
    if f5:
        fig, ax = plt.subplots(figsize=(5, 3.2))
        for name, pts in f5.items():
            bs = sorted(pts)
            ax.plot(bs, [pts[b] for b in bs], marker="o", label=name)
        ax.axhline(0, color="k", lw=0.5)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent sessions B")
        ax.set_ylabel("decode step overhead vs DRAM (%)")
        ax.set_title(f"{cfg['workloads'][0]} traffic", fontsize=9)
        ax.legend(fontsize=7)
        fig.tight_layout()
        p = out_dir / "e2e_fig5_load.png"
        fig.savefig(p, dpi=120)
        plt.close(fig)
        paths.append(p)
    return paths


def run_short_demo(workdir: str | Path, progress: bool = False) -> str:
    """The demo's short version: agent traffic, B=4, three placements, one run each; returns the printed table."""
    cfg = BenchConfig(workdir=str(Path(workdir) / "e2e"), engram_vocab=20_000, workloads=("agent",),
                      table2_batch=4, batches=(4,), runs=1, decode_tokens=8, max_session_tokens=1600,
                      max_turns=1, cache_rows=8192, devices=1, figure3=False, figure5=False, delays_ms=(),
                      agent_sessions_per_source=1)
    bench = Bench(cfg, progress=progress)
    names = [f"l{bench.first}-dram-l{bench.second}-disk", "disk", "disk-split"]
    records = []
    try:
        for i, name in enumerate(names):
            records.append(bench.run_one("agent", cfg.table2_batch, bench.placements[name], 0, i, paired=True))
    finally:
        bench.close()
    results = json.loads(json.dumps({"config": asdict(cfg), "layers": list(bench.model_cfg.engram_layer_ids),
                                     "runs": [asdict(r) for r in records]}, default=float))
    head = (f"End to end (short): V4.1-shaped model ({bench.model_cfg.layers} layers, Engram at "
            f"{bench.model_cfg.engram_layer_ids}), tables of {bench.layout.rows(0):,} rows per layer, agent traffic, "
            f"each placement run side by side with the DRAM table, one run each (`slacktier bench` runs the full set)")
    return head + "\n" + report(results)
