"""Replaying held-out sessions through the V4.1-shaped model under one placement, measured as typed records.

One process, one model, one step engine (`ReplayRig`). A run replays the same
B held-out sessions (agent or chat) under one placement; the engine is
switched between placements in place and its cache is cleared at each switch
(`serve.tiers.TierSet.provider`). A paired run compares the placement with the
DRAM table step by step (arms of `serve.loop.replay`). Step time is the mean
over decode steps with the full batch (B sessions) in them.

The demo runs three placements here; the paper's Table 2 / Figure 3 / Figure 5
harness (benchmarks/e2e/) runs many, with the same rig.
"""

from __future__ import annotations

import hashlib
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from slacktier.engine.counters import LayerCounters
from slacktier.errors import ErrorKind, SlackTierError
from slacktier.models.rows import RowProvider
from slacktier.plan.placement import Placement
from slacktier.serve.loop import LoopConfig, ReplayResult, StepRecord, replay
from slacktier.serve.tiers import TierSet
from slacktier.workloads.sessions import TokenSession

NAN = math.nan


@dataclass(frozen=True)
class RigConfig:
    """The model, the table and the replay every run of one rig shares."""

    workdir: str = "runs/e2e"
    preset: str = "bench"
    engram_vocab: int = 100_000          # each layer's table has ~24x this many rows (264 B each)
    max_batch: int = 16                   # largest B a run will use (sizes the engine's buffers)
    decode_tokens: int = 16               # N tokens per assistant turn (the paper: 128)
    prefill_chunk_tokens: int = 512
    max_session_tokens: int = 2048        # sessions cut to their turns that end within this many tokens
    max_turns: int = 2
    cache_rows: int = 32_768              # most rows any placement's cache holds (both layers)
    devices: int = 4                      # device files of the several-devices placements
    torch_threads: int = 1
    seed: int = 0
    agent_sessions_per_source: int = 5    # agent sessions built per source tree (the demo uses 1: quicker)
    metrics: bool = False                 # the engines publish Prometheus metrics

    def __post_init__(self) -> None:
        if self.max_batch < 1 or self.decode_tokens < 1 or self.devices < 1:
            raise SlackTierError(ErrorKind.BAD_INPUT, f"bad rig config {self}",
                                 fix="max_batch, decode_tokens and devices are >= 1")


@dataclass(frozen=True)
class StepStats:
    """What one step measured per layer: windows and rows() times (ms) from the model, the engine's counters."""

    windows_ms: dict[int, float]
    rows_ms: dict[int, float]
    engine: dict[int, LayerCounters] | None   # None: the stock DRAM table (no engine)


@dataclass
class LayerStats:
    """One layer over a run's full-batch decode steps (means); NaN where the run did not measure it."""

    window_ms: float = NAN   # from lookups issued to the layer asking for its rows (the DRAM arm's when paired)
    rows_ms: float = NAN     # time in rows(): wait + gather
    read_ms: float = NAN     # the engine's read time per step
    wait_ms: float = NAN     # the engine's wait per step
    pages: float = NAN       # pages read per step
    hit_rate: float = NAN    # over all decode steps


@dataclass
class RunRecord:
    """One run: its configuration and what it measured."""

    workload: str
    batch: int
    placement: str            # the placement's label
    rep: int
    order: int
    paired: bool = False      # run side by side with the DRAM table, step by step (arm 0 = DRAM, arm 1 = this)
    step_ms: float = NAN
    base_ms: float = NAN      # paired: the DRAM arm's mean step over the same steps
    overhead_pct: float = NAN
    mismatch_steps: int = 0
    step_p99_ms: float = NAN
    tpot_ms: float = NAN
    ttft_p50_ms: float = NAN
    rss_peak_gib: float = NAN
    decode_steps: int = 0
    wall_s: float = 0.0
    layers: dict[int, LayerStats] = field(default_factory=dict)
    step_reads_ms: list[dict[int, float]] = field(default_factory=list)  # per full decode step: layer -> read ms
    delays_ms: dict[int, float] = field(default_factory=dict)  # layer -> injected hand-out delay (delay runs only)
    digest: str = ""


def clip_sessions(sessions, max_tokens: int | None, max_turns: int | None) -> list[TokenSession]:
    """Each session cut to its first turns that end within `max_tokens` (at most `max_turns`); empty ones dropped.
    None: no cap of that kind (None, None: every session whole)."""
    out = []
    for s in sessions:
        turns = s.num_replies if max_turns is None else min(s.num_replies, max_turns)
        keep = [k for k in range(turns) if max_tokens is None or s.reply_end[k] <= max_tokens]
        if not keep or keep[0] != 0:
            continue
        k = keep[-1] + 1
        end = int(s.reply_end[k - 1])
        out.append(TokenSession(s.session_id, s.source, s.kind, np.asarray(s.tokens[:end]),
                                np.asarray(s.reply_start[:k]), np.asarray(s.reply_end[:k])))
    return out


def load_sessions(workload: str, n: int, cfg: RigConfig) -> list[TokenSession]:
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


class ReplayRig:
    """Holds the model, the staged tables and the engine across runs."""

    def __init__(self, cfg: RigConfig, progress: bool = False) -> None:
        from slacktier.models.deepseek_v41 import V41Config, V41Model   # the `models` extra (transformers)
        from slacktier.serve.runners import V41Runner
        from slacktier.tables.engram_hash import EngramLayout
        from slacktier.workloads.hashing import EngramLookupHasher

        self.cfg = cfg
        torch.set_num_threads(cfg.torch_threads)
        self.model_cfg = V41Config.preset(cfg.preset)
        self.first, self.second = self.model_cfg.engram_layer_ids[:2]
        self.layer_ids = tuple(self.model_cfg.engram_layer_ids)
        self.layout = EngramLayout.scaled(cfg.engram_vocab, self.model_cfg.engram_layer_ids)
        self.hasher = EngramLookupHasher(self.layout)
        self.model = V41Model(self.model_cfg)
        self.runner = V41Runner(self.model)
        self.tiers = TierSet(Path(cfg.workdir) / "tables", self.layout, seed=cfg.seed + 1,
                             max_cache_rows=cfg.cache_rows, max_tokens=max(cfg.prefill_chunk_tokens, cfg.max_batch),
                             devices=cfg.devices, metrics=cfg.metrics)
        t0 = time.perf_counter()
        self.tiers.stage(progress=progress)
        self.stage_s = time.perf_counter() - t0
        self._sessions: dict[tuple[str, int], list[TokenSession]] = {}

    @property
    def table_rows(self) -> tuple[int, ...]:
        """Rows of each Engram layer's table."""
        return tuple(self.layout.rows(i) for i in range(len(self.layer_ids)))

    def sessions_for(self, workload: str, batch: int) -> list[TokenSession]:
        """B held-out sessions: one wave, all live together (the same ones in every run at this load)."""
        key = (workload, batch)
        if key not in self._sessions:
            self._sessions[key] = load_sessions(workload, batch, self.cfg)
        return self._sessions[key]

    def run(self, workload: str, batch: int, placement: Placement, rep: int = 0, order: int = 0,
            paired: bool = True, wrap: Callable[[RowProvider], RowProvider] | None = None) -> RunRecord:
        """One replay under one placement; paired: side by side with the DRAM table, step by step. `wrap` wraps
        the placement's provider (TierSet.provider)."""
        from slacktier.workloads.replay import ReplayConfig, replay_steps

        if batch > self.cfg.max_batch:
            raise SlackTierError(ErrorKind.BAD_INPUT, f"batch {batch} above the rig's max_batch {self.cfg.max_batch}",
                                 fix="build the rig with a larger max_batch")
        paired = paired and not placement.stock
        provider = self.tiers.provider(placement, keep_stock=paired, wrap=wrap)
        arms = [self.tiers.stock_provider(), provider] if paired else None
        self.runner.set_provider(provider)
        sessions = self.sessions_for(workload, batch)
        rc = ReplayConfig(batch=batch, decode_tokens=self.cfg.decode_tokens,
                          prefill_chunk_tokens=self.cfg.prefill_chunk_tokens)
        model = self.model

        def stats() -> StepStats:
            eng = getattr(model.provider, "last_counters", None)
            return StepStats(dict(model.last_windows_ms), dict(model.last_rows_ms),
                             dict(eng.layers) if eng is not None else None)

        t0 = time.perf_counter()
        res = replay(self.runner, sessions, replay_steps(sessions, self.hasher, rc), rc.decode_tokens,
                     LoopConfig(record_digests=True), step_stats=stats, arms=arms)
        rec = RunRecord(workload, batch, placement.name, rep, order, paired=paired,
                        wall_s=time.perf_counter() - t0)
        summarize(rec, res, batch, self.layer_ids)
        return rec

    def close(self) -> None:
        """Close the engine and sources."""
        self.tiers.close()


def _mean(values: list[float]) -> float:
    return float(np.mean(values)) if values else NAN


def summarize(rec: RunRecord, res: ReplayResult, batch: int, layers) -> None:
    """Fill a run record from a replay: full-batch decode steps only (hit rates: every decode step)."""
    full = [s for s in res.steps if s.kind == "decode" and s.sessions >= batch]
    dec = [s for s in res.steps if s.kind == "decode"]
    arm = 1 if rec.paired else 0

    def measured(st: StepRecord) -> StepStats:   # the placement's arm
        return st.arm_stats[arm] if rec.paired else st.stats

    def windows(st: StepRecord) -> StepStats:    # windows come from the DRAM arm when paired
        return st.arm_stats[0] if rec.paired else st.stats

    times = np.array([s.arm_ms[arm] if rec.paired else s.step_ms for s in full])
    s = res.summary()
    rec.decode_steps = len(full)
    rec.mismatch_steps = int(sum(st.mismatch for st in res.steps))
    if len(full):
        rec.step_ms = float(times.mean())
        rec.step_p99_ms = float(np.percentile(times, 99))
        if rec.paired:
            rec.base_ms = float(np.mean([st.arm_ms[0] for st in full]))
            rec.overhead_pct = 100 * (rec.step_ms / rec.base_ms - 1)
    rec.tpot_ms, rec.ttft_p50_ms = s["tpot_ms"], s["ttft_p50_ms"]
    rec.rss_peak_gib = s["rss_peak_bytes"] / 2**30
    rec.digest = hashlib.sha1("".join(st.digest for st in res.steps).encode()).hexdigest()
    for l in layers:
        eng = [measured(st).engine[l] for st in full if measured(st) and measured(st).engine]
        deng = [measured(st).engine[l] for st in dec if measured(st) and measured(st).engine]
        lookups = sum(c.lookups for c in deng)
        rec.layers[l] = LayerStats(
            window_ms=_mean([windows(st).windows_ms[l] for st in full if l in windows(st).windows_ms]),
            rows_ms=_mean([measured(st).rows_ms[l] for st in full if l in measured(st).rows_ms]),
            read_ms=_mean([c.read_us for c in eng]) / 1e3,
            wait_ms=_mean([c.wait_us for c in eng]) / 1e3,
            pages=_mean([c.pages_read for c in eng]),
            hit_rate=(sum(c.hits for c in deng) / lookups if lookups else 0.0) if deng else NAN)
    rec.step_reads_ms = [{l: measured(st).engine[l].read_us / 1e3 for l in layers}
                         for st in full if measured(st) and measured(st).engine]
