"""The step timeline's sweep on a scaled table: every (batch, placement) in shuffled runs (bench_timeline.py).

An experiment beside its benchmark, not the package (issue 29): it stages a scaled V4.1 table, runs each
placement of `serve.timeline.timeline_placements` `cfg.runs` times in shuffled order, and with
`cfg.remote_nodes` also serves the table from a local authenticated Redis Cluster it starts (the reader's
password handed over in this process's environment, as a serving process would get it). The demo's and
the planner's sweeps (`slacktier demo`, serve.predict.planner_sweep) run the same protocol without the cluster.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from slacktier.serve.timeline import (ComputeProfile, SweepConfig, SweepRun, TimelineRunner, checked_steps,
                                      load_profile, run_replay, summarize, sweep_sessions, timeline_placements)


def run_sweep(cfg: SweepConfig, progress: bool = False) -> tuple[ComputeProfile, list[SweepRun]]:
    """Stage the scaled table once, then every (batch, placement) `cfg.runs` times in shuffled order."""
    from slacktier.serve.tiers import TierSet
    from slacktier.tables.engram_hash import EngramLayout
    from slacktier.workloads.hashing import EngramLookupHasher
    from slacktier.workloads.replay import ReplayConfig, replay_steps

    profile = load_profile(cfg.profile)
    layout = EngramLayout.scaled(cfg.engram_vocab, (1, 14))
    first, second = layout.layer_ids[:2]
    hasher = EngramLookupHasher(layout)
    placements = timeline_placements(first, second, cfg.cache_rows, remote=cfg.remote_nodes > 0)
    pools = {b: sweep_sessions(cfg, b) for b in cfg.batches}   # refuse before staging anything
    times = {b: profile.times(b, cfg.workload, layout.layer_ids) for b in cfg.batches}
    tiers = TierSet(Path(cfg.workdir) / "tables", layout, seed=cfg.seed + 1, max_cache_rows=cfg.cache_rows,
                    max_tokens=max(cfg.prefill_chunk_tokens, *cfg.batches), devices=1, metrics=cfg.metrics)
    rng = np.random.default_rng(cfg.seed)
    out: list[SweepRun] = []
    cluster = None
    try:
        tiers.stage(device_counts=(1,), progress=progress)
        if cfg.remote_nodes > 0:
            cluster, reader = _remote_copy(Path(cfg.workdir) / "cluster", cfg.remote_nodes, tiers.manifests[1],
                                           progress)
            tiers.options = (*tiers.options, reader)
        for rep in range(cfg.runs):
            jobs = [(b, p) for b in cfg.batches for p in placements]
            for order, k in enumerate(rng.permutation(len(jobs))):
                batch, placement = jobs[k]
                tiers.provider(placement)   # switches the one engine in place, cold cache
                runner = TimelineRunner(tiers.engine, times[batch])
                rc = ReplayConfig(batch=batch, decode_tokens=cfg.decode_tokens,
                                  prefill_chunk_tokens=cfg.prefill_chunk_tokens)
                replay = iter(replay_steps(pools[batch], hasher, rc))
                steps = run_replay(runner, replay, batch, cfg.decode_steps)
                checked, mismatches = checked_steps(tiers.engine, runner, replay, batch, cfg.check_steps)
                out.append(SweepRun(placement.name, batch, rep, order, times[batch].step_ms, summarize(steps),
                                    checked, mismatches))
                if progress:
                    print(f"  run {rep + 1}/{cfg.runs} B={batch} {placement.name}: "
                          f"{out[-1].summary.stall_ms:.2f} ms stall/step", flush=True)
    finally:
        tiers.close()
        if cluster is not None:
            cluster.stop()
    return profile, out


def _remote_copy(workdir: Path, masters: int, manifest, progress: bool):
    """A local authenticated Redis Cluster holding `manifest`'s table; the cluster and the reader's options (its
    password handed over in this process's environment, as a serving process would get it)."""
    import os

    from slacktier.config import RedisOptions
    from slacktier.store.redis.loader import load_manifest
    from slacktier.testing.redis_cluster import LocalRedisCluster

    cluster = LocalRedisCluster(workdir, masters=masters, replicas=0).start()
    try:
        os.environ["SLACKTIER_TIMELINE_LOADER_PW"] = cluster.loader.password
        os.environ["SLACKTIER_TIMELINE_READER_PW"] = cluster.reader.password
        load_manifest(RedisOptions(mode="cluster", url=cluster.seed_url, username=cluster.loader.name,
                                   password_env="SLACKTIER_TIMELINE_LOADER_PW"), manifest, progress=progress)
    except BaseException:
        cluster.stop()
        raise
    return cluster, RedisOptions(mode="cluster", url=cluster.seed_url, username=cluster.reader.name,
                                 password_env="SLACKTIER_TIMELINE_READER_PW")
