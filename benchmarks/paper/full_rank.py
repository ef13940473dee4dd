"""One TP rank's view of the full-size V4.1 tables on the step timeline (issue 13, items 2-4).

An experiment beside its benchmark (benchmarks/paper/bench_full_rank.py, bench_one_disk.py,
bench_rank_partition.py, bench_whatif.py), not the package: no verb uses it (issue 29).

Under TP4 column sharding each rank's process serves only its own shard of each
Engram layer (~96M rows, ~26 GB of pages per layer), with `owned_only` and the
rank's regions; rows of other ranks come out as -0.0 and the all-reduce sums
them (engine/step.py). A TP step waits for its slowest rank, so:

1. `rank_page_counts` counts every rank's missed pages per full-batch decode
   step on the traffic (benchmarks/paper/rank_pages.py, the served CLOCK replayed), with
   no cache and with each placement's cache: this names the slowest rank.
2. `stage_rank_shard` stages that rank's shard of both layers, full size
   (`stage --only-ranks`), refusing before writing when the disk lacks space.
3. `run_full_rank` serves it on the step timeline (serve.timeline) under
   Table 2's placements, each `runs` times in shuffled order, and checks rows
   after the timed steps.

A layer placed in host DRAM is the stock path on a GPU server: the device
gathers it from pinned host memory inside the layer, and nothing of it is on
the host's `begin_step` path. So its timing is the profile itself (0 stall),
its host memory is computed (the rank's shard, in pages), and the engine serves
only the other layer (`LayerSubset`). This also keeps the 26 GB layer out of
this VM's 23 GB of RAM. The all-DRAM row (the baseline) is the profile itself.

Uncached placements skip the prefill steps on the engine (they are hashed, as
the replay pulls them, but not read): with no cache a prefill leaves nothing
behind that a decode step could use, and reading ~2,000 prefill tokens per
session on this VM's shared disk (tens of thousands of IOPS) would cost minutes per run. Cached placements
read every prefill step, so their cache is warm as on a serving node.

Whole sessions (`whole_sessions`, issue 27): every assistant turn of every session, no token cap; prefills
longer than the engine's `max_tokens` are packed into chunks of `prefill_chunk_tokens` by the replay, so no
session is dropped. The timed window then starts deep in the replay (`start_decode_steps`): every step before
it runs on the engine untimed (cached placements; uncached ones skip them), and `window_hit_rates` runs the
characterizer's CLOCK on the same replay for the rank's lookups, so the window's measured hit rates sit beside
the simulator's over the same window and over the whole replay.
"""

from __future__ import annotations

import gc
import resource
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from slacktier.errors import ErrorKind, SlackTierError
from slacktier.serve.timeline import (ComputeProfile, LayerSubset, StepTimes, SweepConfig, TimelineRunner,
                                      TimelineSummary, load_profile, run_replay, summarize, sweep_sessions,
                                      timeline_placements)

MAX_SESSION_TOKENS = {"agent": 4096, "chat": 1024}   # agent: 305 sessions fit 4096 tokens, 5 fit 1024


@dataclass(frozen=True)
class FullRankConfig:
    """The full-size V4.1 shard of one TP rank on the step timeline."""

    workdir: str = "runs/full_rank"
    rank: int = 3
    ranks: int = 4
    profile: str = "v41_paper"
    workload: str = "agent"
    batches: tuple[int, ...] = (128,)
    runs: int = 3
    decode_steps: int = 64            # full-batch decode steps timed per run
    warmup_steps: int = 8             # full-batch decode steps run before the timed ones, not recorded
    start_spread_steps: int = 32      # the first B sessions start over this many decode steps (a node already
                                      # serving, not B replies starting in lockstep)
    decode_tokens: int = 128          # N tokens per assistant turn (the paper's protocol)
    cache_rows: int = 1_000_000       # rows per rank of the split cache (half of it on layer 14 alone)
    max_session_tokens: int = 0       # 0: MAX_SESSION_TOKENS[workload]
    max_turns: int = 2
    prefill_chunk_tokens: int = 4096
    seed: int = 0
    table_seed: int = 1               # the synthetic rows' seed
    check_steps: int = 4              # decode steps after the timed ones, every row checked (untimed)
    placements: tuple[str, ...] = ()  # names to run (default: all of timeline_placements)
    engram_vocab: int = 0             # 0: the full V4.1 tables; > 0: EngramLayout.scaled (tests, CI)
    wait_timeout_ms: float = 60_000.0  # the engine's longest wait for a layer's reads (a 4k-token prefill chunk)
    partition: str = "columns"        # the rank partition the shard is staged and served under (tables.partition)
    whole_sessions: bool = False      # every turn of every session, no token cap (max_session_tokens, max_turns unused)
    start_decode_steps: int = 0       # decode steps of the replay run untimed before the timed window (cached
                                      # placements on the engine; uncached ones skip them)
    evict_ahead: bool = True          # the engine's evict-ahead (config: [engine] evict_ahead); False runs CLOCK
                                      # exactly as the characterizer does
    order_seed: int | None = None     # the seed of the placements' shuffled order (None: `seed`); rounds run as
                                      # separate calls (bench_one_disk.py) vary it and keep the traffic's `seed`

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.ranks:
            raise SlackTierError(ErrorKind.BAD_INPUT, f"rank {self.rank} of {self.ranks}",
                                 fix=f"pick a rank in 0..{self.ranks - 1}")
        if self.start_decode_steps < 0:
            raise SlackTierError(ErrorKind.BAD_INPUT, f"start_decode_steps {self.start_decode_steps}",
                                 fix="pass decode steps >= 0 to run before the timed window")
        if self.max_session_tokens == 0:
            object.__setattr__(self, "max_session_tokens", MAX_SESSION_TOKENS.get(self.workload, 1024))

    def sweep(self) -> SweepConfig:
        """The traffic settings in the scaled sweep's terms (serve.timeline.sweep_sessions reads them)."""
        whole = self.whole_sessions
        return SweepConfig(workload=self.workload, profile=self.profile, batches=self.batches, runs=self.runs,
                           decode_steps=self.decode_steps, decode_tokens=self.decode_tokens,
                           cache_rows=self.cache_rows, max_session_tokens=None if whole else self.max_session_tokens,
                           max_turns=None if whole else self.max_turns, prefill_chunk_tokens=self.prefill_chunk_tokens,
                           seed=self.seed, check_steps=self.check_steps)

    @property
    def sessions_text(self) -> str:
        """How the sessions are cut, for a report."""
        if self.whole_sessions:
            return f"whole sessions (every turn, no token cap; prefills chunked at {self.prefill_chunk_tokens} tokens)"
        return f"sessions within {self.max_session_tokens} tokens, {self.max_turns} turns"

    def layout(self):
        """The Engram layout: V4.1's, or the same hash over scaled tables."""
        from slacktier.tables.engram_hash import EngramLayout

        return EngramLayout.scaled(self.engram_vocab) if self.engram_vocab else EngramLayout.v41()

    @property
    def table_name(self) -> str:
        name = f"v41-rank{self.rank}" if not self.engram_vocab else f"v41x{self.engram_vocab}-rank{self.rank}"
        return name if self.partition == "columns" else f"{name}-{self.partition}"

    @property
    def manifest_path(self) -> Path:
        return Path(self.workdir) / f"{self.table_name}.manifest.json"

    @property
    def target_path(self) -> Path:
        return Path(self.workdir) / f"{self.table_name}.bin"


def _replay(cfg: FullRankConfig, batch: int, hasher, pool: Sequence | None = None) -> Iterator:
    from slacktier.workloads.replay import ReplayConfig, replay_steps

    if pool is None:
        pool = sweep_sessions(cfg.sweep(), batch)   # refuses a B the traffic cannot fill
    rc = ReplayConfig(batch=batch, decode_tokens=cfg.decode_tokens, prefill_chunk_tokens=cfg.prefill_chunk_tokens,
                      start_spread_steps=cfg.start_spread_steps, seed=cfg.seed)
    return replay_steps(pool, hasher, rc)


# ---- 1. every rank's pages ------------------------------------------------------------------------------

def rank_page_counts(cfg: FullRankConfig, batch: int, capacities: Sequence[int] = (0, 500_000),
                     progress: bool = False, partitions: Sequence[str] = ("columns",)) -> list:
    """RankPages of every rank and layer on the full replay of the traffic at `batch` (all full-batch decode
    steps), at each per-layer cache capacity (0: uncached; 500,000: half of a 1M-row split cache), under each
    rank partition (tables.partition), all on the one trace."""
    from slacktier.workloads.hashing import EngramLookupHasher
    from benchmarks.paper.rank_pages import rank_pages
    from slacktier.workloads.replay import collect_trace

    hasher = EngramLookupHasher(cfg.layout())
    trace = collect_trace(_replay(cfg, batch, hasher), hasher, cfg.workload, batch, progress=progress)
    return [r for part in partitions for layer in trace.layer_ids for rank in range(cfg.ranks)
            for r in rank_pages(trace, layer, rank, cfg.ranks, capacities, part)]


def _owned_text(columns: Sequence[int], orders: Sequence[int]) -> str:
    """"cols 0..5, orders 2" for a run of columns; "cols 0,1,8,9,16,17, orders 2,3,4" otherwise."""
    from slacktier.tables.partition import columns_text

    return f"cols {columns_text(columns)}, orders {','.join(map(str, orders))}"


def rank_pages_table(results: Sequence) -> str:
    """Per workload, B, cache and partition: every rank's pages per full-batch decode step (layer 1 / layer 14)
    and decode hit rate (layer 1), the slowest rank (most pages over both layers) and its pages."""
    from benchmarks.paper.rank_pages import slowest_rank

    ranks = sorted({r.rank for r in results})
    layers = sorted({r.layer for r in results})
    parts = list(dict.fromkeys(r.partition for r in results))
    width = 28
    lines = [f"{'workload':8} {'B':>4} {'cache/layer':>11} {'partition':>9} {'steps':>5} "
             + " ".join(f"{f'rank {k} pages L' + '/L'.join(map(str, layers)) + ' hit':>{width}}" for k in ranks)
             + f" {'slowest':>7} {'its pages':>9}"]
    for part in parts:
        owns = {r.rank: _owned_text(r.columns, r.orders) for r in results if r.partition == part}
        lines.append(f"{'':8} {'':>4} {'':>11} {part:>9} {'':>5} " + " ".join(f"{owns[k]:>{width}}" for k in ranks))
    keys = sorted({(r.workload, r.batch, r.capacity_rows) for r in results})
    for wl, batch, cap in keys:
        for part in parts:
            rs = [r for r in results if (r.workload, r.batch, r.capacity_rows, r.partition) == (wl, batch, cap, part)]
            by = {(r.rank, r.layer): r for r in rs}
            cells = []
            for k in ranks:
                pages = "/".join(f"{by[(k, l)].pages_mean:.0f}" for l in layers)
                cells.append(f"{pages + f' {100 * by[(k, layers[0])].hit_rate:3.0f}%':>{width}}")
            slow = slowest_rank(rs, cap)
            slow_pages = sum(by[(slow, l)].pages_mean for l in layers)
            lines.append(f"{wl:8} {batch:>4} {cap:>11,} {part:>9} {rs[0].steps:>5} " + " ".join(cells)
                         + f" {slow:>7} {slow_pages:>9.0f}")
    return "\n".join(lines)


# ---- 2. the rank's shard, full size ----------------------------------------------------------------------

def stage_rank_shard(cfg: FullRankConfig, progress: bool = False):
    """The staged manifest of the rank's full-size shard (both layers): reused when its targets check out,
    else staged (`stage_synthetic(..., only_ranks=(rank,))`, refused before writing if the disk lacks space)."""
    from slacktier.tables.manifest import Manifest, StagedLayout
    from slacktier.tables.stage import stage_synthetic

    layout = cfg.layout()
    if cfg.manifest_path.is_file():
        m = Manifest.load(cfg.manifest_path)
        if ({r.rank for r in m.regions} == {cfg.rank} and m.ranks == cfg.ranks and m.partition_kind == cfg.partition
                and m.source.get("seed") == cfg.table_seed and m.layout == StagedLayout.from_layout(layout)):
            m.check_targets()
            return m
    Path(cfg.workdir).mkdir(parents=True, exist_ok=True)
    return stage_synthetic([cfg.target_path], layout, cfg.ranks, cfg.table_seed, overwrite=True,
                           manifest_path=cfg.manifest_path, progress=progress, only_ranks=(cfg.rank,),
                           partition=cfg.partition, heads_per_order=layout.n_heads)


# ---- 3. serving it on the timeline -----------------------------------------------------------------------

def _host_copy(tier: str) -> bool:
    """The tier keeps the whole table in host memory: the stock path, not served through the engine here."""
    from slacktier.config import tier_facts

    return tier_facts(tier).holds_host_copy


def served_slots(manifest, placement) -> dict[int, int]:
    """Cache rows (slots) of each engine-served layer under `placement` (cache.rowcache.split_slots); the DRAM
    layers (stock path) hold none."""
    from slacktier.cache.rowcache import split_slots

    served = {l: placement.share(l) for l in manifest.layout.layer_ids if not _host_copy(placement.tier(l))}
    return split_slots(placement.cache_rows, served) if served else {}


def host_memory_bytes(manifest, rank: int, placement) -> int:
    """Host memory of the rank's process for the tables under `placement` (computed): each DRAM layer's shard
    in pages, plus each engine-served layer's directory, sized to the cache slots it owns (cache.rowdir). The
    row cache is device memory.

    Worked example: rank 3 of V4.1, layer 1 in DRAM (6,400,168 pages = 26.2 GB) and layer 14 on disk with
    500,000 cache rows (a directory of 2**20 entries, 8 MiB) -> 26.2 GB.
    """
    from slacktier.cache.rowdir import entries_for

    slots = served_slots(manifest, placement)
    total = 0
    for layer in manifest.layout.layer_ids:
        region = manifest.region(layer, rank)
        if _host_copy(placement.tier(layer)):
            total += region.nbytes
        else:
            total += 8 * entries_for(slots.get(layer, 0))
    return total


def all_dram_bytes(manifest, rank: int) -> int:
    """Host memory of the all-DRAM baseline: every layer's shard in pages (the stock host table holds rows of
    264 B; pages are what a DRAM tier of ours would hold)."""
    return sum(manifest.region(l, rank).nbytes for l in manifest.layout.layer_ids)


def rank_control(manifest, rank: int, placement, cfg: FullRankConfig, max_tokens: int):
    """The control file of the rank's process for `placement`'s engine-served (non-DRAM) layers, owned_only."""
    from slacktier.config import ControlFile, EngineConfig, TableConfig

    served = [l for l in manifest.layout.layer_ids if not _host_copy(placement.tier(l))]
    # a prefill chunk reads up to ~24k pages per layer, seconds on a shared disk: past the 5 s default wait
    engine = EngineConfig(device="cpu", cache_rows=placement.cache_rows,
                          max_cache_rows=max(cfg.cache_rows, placement.cache_rows), max_tokens=max_tokens,
                          owned_only=True, wait_timeout_ms=cfg.wait_timeout_ms, evict_ahead=cfg.evict_ahead)
    tables = tuple(TableConfig(layer=l, manifest=str(manifest.path), source=placement.tier(l), rank=rank,
                               partition=manifest.partition_kind, cache_share=placement.share(l), order=order)
                   for order, l in enumerate(served))
    return ControlFile(engine=engine, tables=tables), served


@dataclass(frozen=True)
class FullRankRun:
    """One timed run of a placement at one batch size on the rank's full-size shard."""

    placement: str
    batch: int
    rep: int
    order: int
    step_ms: float                  # the profile's step at this batch
    summary: TimelineSummary         # the timed steps (the all-DRAM row is the profile itself, not a run)
    served: tuple[int, ...]         # layers on the host's path (the rest: DRAM, stock path)
    host_bytes: int
    checked_steps: int = 0
    mismatches: int = 0
    wall_s: float = 0.0
    warmed: bool = True
    step_stalls_ms: tuple[float, ...] = ()   # each timed step's stall (ms): the TP step is the slowest rank's
    window: tuple[int, ...] = ()             # replay indices of the timed steps (workloads.replay.Step.index)


def _checked(engine, runner: TimelineRunner, replay: Iterator, batch: int, n: int, warm: bool) -> tuple[int, int]:
    """`n` more decode steps with the engine's checker on (untimed); (steps checked, mismatching rows)."""
    if n <= 0:
        return 0, 0
    cfg = engine.config
    engine.apply(cfg.replace(check=True))
    before = sum(c.mismatches for c in engine.totals.values())
    steps = run_replay(runner, replay, batch, n, warm, warm_first=False)
    engine.apply(cfg)   # not in a `finally`: after a failed step the engine is closed, not reused
    return len(steps), sum(c.mismatches for c in engine.totals.values()) - before


def run_full_rank(cfg: FullRankConfig, progress: bool = False, before_step=None,
                  ) -> tuple[ComputeProfile, object, list[FullRankRun]]:
    """Every (batch, placement) `cfg.runs` times in shuffled order on the rank's staged full-size shard.

    `before_step` (serve.timeline.run_replay) runs before each timed run's steps: several rank processes
    started with the same config meet there, so the ranks step together (benchmarks/paper/bench_one_disk.py)."""
    import time

    from slacktier.engine.step import StepEngine
    from slacktier.workloads.hashing import EngramLookupHasher

    profile = load_profile(cfg.profile)
    layout = cfg.layout()
    first, second = layout.layer_ids[:2]
    hasher = EngramLookupHasher(layout)
    placements = timeline_placements(first, second, cfg.cache_rows)
    if cfg.placements:
        unknown = sorted(set(cfg.placements) - {p.name for p in placements})
        if unknown:
            raise SlackTierError(ErrorKind.BAD_INPUT, f"unknown placements {unknown}",
                                 fix=f"pick among {', '.join(p.name for p in placements)}")
        placements = [p for p in placements if p.name in cfg.placements]
    for b in cfg.batches:
        sweep_sessions(cfg.sweep(), b)   # refuse a B the traffic cannot fill before staging anything
    times = {b: profile.times(b, cfg.workload, layout.layer_ids) for b in cfg.batches}
    manifest = stage_rank_shard(cfg, progress=progress)
    rng = np.random.default_rng(cfg.seed if cfg.order_seed is None else cfg.order_seed)
    out: list[FullRankRun] = []
    max_tokens = max(cfg.prefill_chunk_tokens, *cfg.batches)
    for rep in range(cfg.runs):
        jobs = [(b, p) for b in cfg.batches for p in placements]
        for order, k in enumerate(rng.permutation(len(jobs))):
            batch, placement = jobs[k]
            t_run = time.perf_counter()
            control, served = rank_control(manifest, cfg.rank, placement, cfg, max_tokens)
            engine = StepEngine.from_config(control, ids_layers=tuple(served), columns=layout.n_columns)
            try:
                axes = [layout.layer_ids.index(l) for l in served]
                st = times[batch]
                runner = TimelineRunner(LayerSubset(engine, axes),
                                        StepTimes(st.workload, st.batch, st.step_ms,
                                                  {l: st.windows_ms[l] for l in served}))
                warm = placement.cache_rows > 0
                replay = iter(_replay(cfg, batch, hasher))
                steps = run_replay(runner, replay, batch, cfg.decode_steps, warm, cfg.warmup_steps,
                                   before_step=before_step, start_decode_steps=cfg.start_decode_steps)
                checked, bad = _checked(engine, runner, replay, batch, cfg.check_steps, warm)
            finally:
                engine.close()
                del engine
                gc.collect()
            out.append(FullRankRun(placement.name, batch, rep, order, st.step_ms, summarize(steps), tuple(served),
                                   host_memory_bytes(manifest, cfg.rank, placement), checked, bad,
                                   time.perf_counter() - t_run, warm,
                                   tuple(st.stall_total_ms for st in steps), tuple(st.replay_index for st in steps)))
            if progress:
                s = out[-1].summary
                print(f"  run {rep + 1}/{cfg.runs} B={batch} {placement.name}: {s.steps} steps, "
                      f"{s.stall_ms:.2f} ms stall/step, pages {dict((l, round(v)) for l, v in s.pages.items())}, "
                      f"{out[-1].wall_s:.0f} s, checker {checked} steps {bad} bad", flush=True)
    return profile, manifest, out


@dataclass(frozen=True)
class WindowHits:
    """The characterizer's CLOCK (cache.simulate, pins per step) on the replay the timed runs served, over the
    rank's own lookups: per (placement, layer) its cache rows, and hit rate and missed pages per step over the
    timed window's steps and over every full-batch decode step of the whole replay."""

    batch: int
    sessions: int
    turns: int                        # assistant turns replayed, all sessions
    session_tokens: int
    decode_steps: int                 # of any size
    full_steps: int                   # with B tokens
    window: tuple[int, int]           # the timed window: its first and last step's place among the full-batch steps
    window_turn: float                # mean turn (1 = first) of the sessions in the window's steps
    window_position: float            # mean token position of the window's decode tokens
    rates: dict[tuple[str, int], tuple[int, object, object]]   # (placement, layer) -> (cache rows, window's
                                      # StepSetHits, whole replay's StepSetHits (benchmarks.paper.rank_pages))


def window_hit_rates(cfg: FullRankConfig, manifest, batch: int, runs: Sequence[FullRankRun]) -> WindowHits:
    """The characterizer's hit rates of every run's placement on the same sessions, B, cache rows and split as
    the timed runs of `batch`, over their timed window and over the whole replay (module docstring)."""
    from benchmarks.paper.rank_pages import full_batch_steps, rank_hit_rates
    from slacktier.workloads.hashing import EngramLookupHasher
    from slacktier.workloads.replay import collect_trace

    windows = {r.window for r in runs if r.batch == batch}
    if len(windows) != 1 or not next(iter(windows)):
        raise SlackTierError(ErrorKind.BAD_INPUT, f"the runs of B={batch} timed {len(windows)} different windows",
                             fix="pass runs of one config (the replay is deterministic: one window per B)")
    window = np.asarray(next(iter(windows)), dtype=np.int64)
    wanted = set(window.tolist())
    hasher = EngramLookupHasher(cfg.layout())
    pool = sweep_sessions(cfg.sweep(), batch)
    turns: list[int] = []
    positions: list[int] = []

    def tap(steps):   # the window's sessions: which turn each is in, at which position
        for st in steps:
            if st.index in wanted:
                for sid, pos in zip(st.session_ids, st.positions):
                    turns.append(int(np.searchsorted(pool[sid].reply_start, pos, side="right")))
                    positions.append(int(pos))
            yield st

    trace = collect_trace(tap(_replay(cfg, batch, hasher, pool)), hasher, cfg.workload, batch)
    full = full_batch_steps(trace)
    placements = {p.name: p for p in timeline_placements(*cfg.layout().layer_ids[:2], cfg.cache_rows)}
    sets = {"window": window, "whole": full}
    by_capacity: dict[tuple[int, int], dict] = {}
    rates = {}
    for name in sorted({r.placement for r in runs if r.batch == batch}):
        slots = served_slots(manifest, placements[name])
        for layer in slots:
            key = (layer, slots[layer])
            if key not in by_capacity:
                by_capacity[key] = rank_hit_rates(trace, layer, cfg.rank, cfg.ranks, slots[layer], sets,
                                                  cfg.partition, cfg.evict_ahead)
            got = by_capacity[key]
            rates[(name, layer)] = (slots[layer], got["window"], got["whole"])
    place = np.searchsorted(full, window)
    return WindowHits(batch, len(pool), sum(s.num_replies for s in pool), sum(s.num_tokens for s in pool),
                      int(np.unique(trace.token_step[trace.token_decode]).shape[0]), int(full.shape[0]),
                      (int(place[0]) + 1, int(place[-1]) + 1), float(np.mean(turns)), float(np.mean(positions)),
                      rates)


def planner_stalls(profile: ComputeProfile, cfg: FullRankConfig, hits: WindowHits, runs: Sequence[FullRankRun],
                   model) -> dict[str, float]:
    """Per placement: the planner's stall per step (Eq. 1 over the device read-time model `model`, a
    plan.readmodel.DeviceReadModel fitted before the runs), with the pages the characterizer counts in the window
    (no timing), the profile's windows, and the runs' mean s (begin_step: the host pass, measured)."""
    from slacktier.plan.exposure import device_exposure
    from slacktier.plan.readmodel import LayerPages
    from slacktier.serve.report import stat

    times = profile.times(hits.batch, cfg.workload, cfg.layout().layer_ids)
    out = {}
    for name in sorted({n for n, _ in hits.rates}):
        layers = sorted(l for n, l in hits.rates if n == name)
        loads = [LayerPages(l, "disk", hits.rates[(name, l)][1].pages, i) for i, l in enumerate(layers)]
        s_ms = stat([r.summary.s_ms for r in runs if r.batch == hits.batch and r.placement == name])[0]
        out[name] = device_exposure(loads, {l: times.windows_ms[l] for l in layers}, {"disk": model},
                                    resolve_ms=s_ms).slowdown_ms
    return out


def window_table(hits: WindowHits, runs: Sequence[FullRankRun], planned: dict[str, float] | None = None) -> str:
    """The timed window's measured hit rates and pages (mean over runs) beside the characterizer's, per placement
    and served layer; with `planned` (planner_stalls), each placement's planned stall beside its measured one."""
    from slacktier.serve.report import stat

    def pct(x: float) -> str:
        return f"{100 * x:.1f}%" if np.isfinite(x) else "-"

    lines = [f"B={hits.batch}: {hits.sessions} sessions, {hits.turns} assistant turns, {hits.session_tokens:,} "
             f"tokens; {hits.decode_steps} decode steps, {hits.full_steps} of them full-batch; timed window = "
             f"full-batch steps {hits.window[0]}..{hits.window[1]}, its sessions at turn {hits.window_turn:.1f} "
             f"and token {hits.window_position:,.0f} on average",
             f"{'placement':16} {'layer':>5} {'cache rows':>10} | {'measured':>8} {'sim':>6} | {'sim':>6} "
             f"{'whole':>6} | {'measured':>8} {'sim':>6} {'whole':>6}",
             f"{'':16} {'':>5} {'':>10} | {'slot hit, window':>15} | {'charact. hit: window':>20} | "
             f"{'pages per step: window':>22}"]
    for (name, layer), (cap, win, whole) in sorted(hits.rates.items()):
        rs = [r for r in runs if r.batch == hits.batch and r.placement == name]
        hm = stat([r.summary.hit_rate[layer] for r in rs])[0]
        pm = stat([r.summary.pages[layer] for r in rs])[0]
        lines.append(f"{name:16} {layer:>5} {cap:>10,} | {pct(hm):>8} {pct(win.slot_hit_rate):>6} | "
                     f"{pct(win.hit_rate):>6} {pct(whole.hit_rate):>6} | {pm:8.0f} {win.pages:6.0f} "
                     f"{whole.pages:6.0f}")
    lines.append("over the rank's own decode lookups; sim = the characterizer's CLOCK (cache.simulate: the served "
                 "cache's pass, pins per step) on the same replay, the rank's lookups, the placement's cache rows "
                 "per layer; slot hit = cached when the step began (the engine's `hits`, Table 2's hit column); "
                 "charact. hit = `characterize`'s (also a row read earlier in the same step); window = the timed "
                 "steps, whole = every full-batch decode step of the replay")
    if planned:
        lines.append(f"{'placement':16} {'stall measured':>14} {'planner':>8}   (ms per step, mean over runs)")
        for name, ms in sorted(planned.items(), key=lambda kv: kv[1]):
            measured = stat([r.summary.stall_ms for r in runs if r.batch == hits.batch and r.placement == name])[0]
            lines.append(f"{name:16} {measured:14.2f} {ms:8.2f}")
    return "\n".join(lines)


def peak_rss_gib() -> float:
    """This process's peak resident memory (GiB), as the kernel counts it."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20


def full_rank_table(profile: ComputeProfile, cfg: FullRankConfig, manifest, runs: Sequence[FullRankRun]) -> str:
    """Table 2's rows for the rank: overhead vs the profile (mean, min..max over runs), p99 step, host memory,
    hit rate and pages per layer, Eq. 1's prediction; the all-DRAM row first (the profile itself)."""
    from slacktier.serve.report import fmt_pct, stat

    layers = tuple(manifest.layout.layer_ids)
    gb = 1e9
    shard = ", ".join(f"layer {l}: {manifest.region(l, cfg.rank).rows:,} rows" for l in layers)
    lines = [profile.header,
             f"rank {cfg.rank} of TP{cfg.ranks}, {'full-size' if not cfg.engram_vocab else 'scaled'} V4.1 shard "
             f"({shard}), {cfg.workload} traffic, "
             f"{cfg.decode_tokens} decode tokens per turn, {cfg.sessions_text}"
             + (f", timed after {cfg.start_decode_steps} untimed decode steps" if cfg.start_decode_steps else ""),
             f"{'B':>4} {'placement':16} {'runs':>4} {'profile':>7} {'overhead':>9} {'%':>6} {'min..max ms':>12} "
             f"{'p99 step':>8} {'Eq.1':>5} {'host GB':>7} "
             + " ".join(f"{f'hit L{l}':>6} {f'pg L{l}':>6} {f'read L{l}':>7}" for l in layers) + f" {'s ms':>5}"]
    for batch in sorted({r.batch for r in runs}):
        step = next(r.step_ms for r in runs if r.batch == batch)
        lines.append(f"{batch:>4} {'host DRAM (all)':16} {'-':>4} {step:7.2f} {0:6.2f} ms {0:+5.1f}% {'(profile)':>12} "
                     f"{'-':>8} {'-':>5} {all_dram_bytes(manifest, cfg.rank) / gb:7.1f} "
                     + " ".join(f"{'dram':>6} {'-':>6} {'-':>7}" for _ in layers) + f" {'-':>5}")
        groups: dict[str, list[FullRankRun]] = {}
        for r in runs:
            if r.batch == batch:
                groups.setdefault(r.placement, []).append(r)
        for name, rs in sorted(groups.items(), key=lambda kv: stat([r.summary.stall_ms for r in kv[1]])[0]):
            m, lo, hi = stat([r.summary.stall_ms for r in rs])

            def avg(f) -> float:
                return stat([f(r.summary) for r in rs])[0]

            cells = []
            for l in layers:
                if l in rs[0].served:
                    cells.append(f"{fmt_pct(avg(lambda s: s.hit_rate[l])):>6} {avg(lambda s: s.pages[l]):6.0f} "
                                 f"{avg(lambda s: s.read_ms[l]):7.2f}")
                else:
                    cells.append(f"{'dram':>6} {'-':>6} {'-':>7}")
            lines.append(f"{batch:>4} {name:16} {len(rs):>4} {step:7.2f} {m:6.2f} ms {100 * m / step:+5.1f}% "
                         f"{lo:5.2f}..{hi:<5.2f} {step + avg(lambda s: s.p99_stall_ms):8.2f} "
                         f"{avg(lambda s: s.predicted_ms):5.2f} {rs[0].host_bytes / gb:7.1f} " + " ".join(cells)
                         + f" {avg(lambda s: s.s_ms):5.2f}")
    checked = [r for r in runs if r.checked_steps]
    lines.append(f"checker: {sum(r.checked_steps for r in checked)} decode steps after the timed ones "
                 f"({len(checked)} runs), every row against the table's source: "
                 f"{sum(r.mismatches for r in checked)} mismatching rows")
    lines.append("overhead: mean measured stall per step (wait for rows past each layer's scheduled start, plus "
                 "begin_step overrun; dequant pass excluded); min..max over shuffled runs; p99 step = profile + p99 "
                 "stall; Eq. 1 from the same steps' s and read times; host GB computed (DRAM shards in pages + "
                 "the directories, sized to the cache; the cache is device memory); hit over decode lookups; pg = pages "
                 "read per step; s = begin_step from its call to its return (resolve + submit; the step's ids are "
                 "pulled and hashed before the step starts).")
    return "\n".join(lines)
