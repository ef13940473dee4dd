"""One TP rank's view: staging only some ranks' shards, refusing a disk too small before writing, every rank's
pages on a trace, and the full-rank timeline on a scaled table (CI; the benchmark stages the full size)."""

from __future__ import annotations

import os

import numpy as np
import pytest

from slacktier import cli
from slacktier.config import ControlFile, EngineConfig, TableConfig
from slacktier.engine.step import StepEngine
from slacktier.errors import ErrorKind, SlackTierError
from slacktier.tables.engram_hash import EngramLayout
from slacktier.tables.layout import PAGE_BYTES
from slacktier.tables.manifest import Manifest, StagedLayout, check_tp_sharding, plan_regions
from slacktier.tables.page_writer import check_free_space, check_targets
from slacktier.tables.stage import stage_synthetic
from benchmarks.paper.rank_pages import rank_pages, rank_trace, slowest_rank
from slacktier.workloads.replay import LookupTrace

LAYOUT = EngramLayout.scaled(400)   # 24 columns of ~400 rows per layer


def _region_bytes(region) -> bytes:
    fd = os.open(region.path, os.O_RDONLY)
    try:
        return os.pread(fd, region.pages * PAGE_BYTES, region.offset_bytes)
    finally:
        os.close(fd)


# ---- staging one rank -------------------------------------------------------------------------------------

def test_only_ranks_stages_the_same_rows_as_the_whole_table(tmp_path):
    whole = stage_synthetic([tmp_path / "all.bin"], LAYOUT, ranks=4, seed=3, progress=False)
    one = stage_synthetic([tmp_path / "r3.bin"], LAYOUT, ranks=4, seed=3, progress=False, only_ranks=(3,))
    assert one.ranks == 4 and [(r.layer, r.rank) for r in one.regions] == [(1, 3), (14, 3)]
    assert os.path.getsize(tmp_path / "r3.bin") < os.path.getsize(tmp_path / "all.bin") / 3
    for layer in (1, 14):
        a, b = whole.region(layer, 3), one.region(layer, 3)
        assert (a.row_start, a.rows, a.pages) == (b.row_start, b.rows, b.pages)
        assert _region_bytes(a) == _region_bytes(b)
        # rank 3 owns hash columns 18..23 (4-gram heads 2..7)
        bounds = LAYOUT.layer_column_bounds(layer)
        assert (b.row_start, b.row_start + b.rows) == (bounds[18], bounds[24])
    check_tp_sharding(Manifest.load(one.path), 4)   # a rank-subset manifest is checked on the ranks it holds
    with pytest.raises(SlackTierError) as e:
        one.runtime_regions(layer=1, rank=0)
    assert e.value.kind == ErrorKind.MISSING


def test_plan_regions_only_ranks_worked_example():
    regions = plan_regions(StagedLayout.from_rows({1: 1000, 14: 1000}), 4, ["t"], only_ranks=[3])
    assert [(r.layer, r.rank, r.offset_bytes, r.rows, r.crc_first_page) for r in regions] == [
        (1, 3, 4096, 250, 0), (14, 3, 4096 + 17 * 4096, 250, 17)]
    with pytest.raises(SlackTierError):
        plan_regions(StagedLayout.from_rows({1: 1000}), 4, ["t"], only_ranks=[4])


def test_a_rank_process_serves_its_staged_shard_bit_exact(tmp_path):
    m = stage_synthetic([tmp_path / "r3.bin"], LAYOUT, ranks=4, seed=3, progress=False, only_ranks=(3,))
    tables = tuple(TableConfig(layer=l, manifest=m.path, source="disk", rank=3, order=i, cache_share=0.5)
                   for i, l in enumerate((1, 14)))
    cfg = ControlFile(engine=EngineConfig(owned_only=True, check=True, cache_rows=64), tables=tables)
    engine = StepEngine.from_config(cfg, ids_layers=(1, 14), columns=24)
    try:
        rng = np.random.default_rng(0)
        ids = np.stack([np.stack([rng.integers(0, LAYOUT.layer_rows(l), 24) for l in (1, 14)]) for _ in range(6)])
        r3 = m.region(1, 3)
        own = (ids[:, 0, :] >= r3.row_start) & (ids[:, 0, :] < r3.row_start + r3.rows)
        assert own.any() and (~own).any()   # some lookups are rank 3's, the rest other ranks' (foreign)
        engine.begin_step(ids)
        for layer in (1, 14):
            engine.gather(layer)
        c = engine.end_step()
        assert sum(t.mismatches for t in engine.totals.values()) == 0   # the checker compared every row
        assert c.layers[1].lookups == ids.shape[0] * 24 and c.layers[1].pages_read > 0
    finally:
        engine.close()
    with pytest.raises(SlackTierError) as e:   # rank 0 is not on this machine
        StepEngine.from_config(ControlFile(engine=EngineConfig(owned_only=True), tables=(
            TableConfig(layer=1, manifest=m.path, source="disk", rank=0),)), ids_layers=(1,), columns=24)
    assert e.value.kind == ErrorKind.MISSING


def test_cli_only_ranks_and_a_bad_rank(tmp_path, capsys):
    t = tmp_path / "t.bin"
    assert cli.main(["stage", "--engram", "300", "--ranks", "4", "--only-ranks", "3", "--target", str(t),
                     "--no-progress"]) == 0
    assert "staged 2 regions" in capsys.readouterr().out
    assert cli.main(["stage", "--engram", "300", "--ranks", "4", "--only-ranks", "4", "--target",
                     str(tmp_path / "u.bin"), "--no-progress"]) == 2
    assert "--only-ranks" in capsys.readouterr().err
    assert not (tmp_path / "u.bin").exists()


# ---- a disk too small: refused before anything is written -------------------------------------------------

def test_free_space_is_summed_over_targets_on_one_filesystem():
    def fake(path):   # both on filesystem 7 with 3.5 GB free
        return 7, 3_500_000_000

    check_free_space(["a", "b"], [2_000_000_000, 1_000_000_000], [0, 0], free_space=fake)
    with pytest.raises(SlackTierError) as e:   # a grows by 2 GB, b by 2 GB: 4 GB > 3.5 GB
        check_free_space(["a", "b"], [3_000_000_000, 2_000_000_000], [1_000_000_000, 0], free_space=fake)
    assert e.value.kind == ErrorKind.TARGET and "nothing was written" in str(e.value)
    assert "3.73 GiB more" in str(e.value) and "3.26 GiB free" in str(e.value)   # binary units
    # on two filesystems, each is checked alone
    check_free_space(["a", "b"], [3_000_000_000, 3_000_000_000], [0, 0],
                     free_space=lambda p: (hash(p), 3_500_000_000))


def test_check_targets_with_a_small_fake_free_space_refuses_and_writes_nothing(tmp_path):
    need = [50 * PAGE_BYTES, 50 * PAGE_BYTES]
    paths = [str(tmp_path / "a.bin"), str(tmp_path / "b.bin")]
    with pytest.raises(SlackTierError) as e:
        check_targets(paths, need, "sha256:x", tmp_path / "m.json", overwrite=False, max_bytes=None,
                      free_space=lambda p: (1, 80 * PAGE_BYTES))
    assert e.value.kind == ErrorKind.TARGET
    assert list(tmp_path.iterdir()) == []
    # the checksum file and manifest count too: 50 pages fit 60 free, 50 + 20 beside the manifest do not
    check_targets(paths[:1], need[:1], "sha256:x", tmp_path / "m.json", overwrite=False, max_bytes=None,
                  free_space=lambda p: (1, 60 * PAGE_BYTES))
    with pytest.raises(SlackTierError):
        check_targets(paths[:1], need[:1], "sha256:x", tmp_path / "m.json", overwrite=False, max_bytes=None,
                      free_space=lambda p: (1, 60 * PAGE_BYTES), side_bytes=20 * PAGE_BYTES)


def test_stage_refuses_a_table_larger_than_the_disk_before_writing(tmp_path, capsys):
    # 10^14 rows (27 PB of pages) exceeds any disk this runs on: the real free space is the figure
    t = tmp_path / "big.bin"
    assert cli.main(["stage", "--synthetic", "1=100000000000000", "--target", str(t), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "not enough disk space" in err and "nothing was written" in err
    assert list(tmp_path.iterdir()) == []


# ---- every rank's pages -------------------------------------------------------------------------------------

def _trace(rows_by_token: np.ndarray, steps: list[int], decode: list[bool], batch: int) -> LookupTrace:
    """A one-layer trace of 4 columns (2 orders x 2 heads) of 30 rows each: column c owns rows [30c, 30c + 30)."""
    t = rows_by_token.shape[0]
    return LookupTrace("test", batch, (1,), (120,), 4, 2, 2, rows_by_token.reshape(1, -1).astype(np.int64),
                       np.array(steps, dtype=np.int32), np.array(decode), np.zeros(t, dtype=np.int32),
                       ((0, 30, 60, 90, 120),))


def test_rank_pages_counts_only_the_ranks_own_columns():
    # two decode steps of 2 tokens; rank 0 owns columns 0..1 (rows 0..59), rank 1 columns 2..3 (rows 60..119)
    rows = np.array([[0, 31, 60, 95],     # step 0: rank 0 rows 0, 31 -> shard pages 0, 2; rank 1 rows 60, 95
                     [1, 44, 61, 119],    # step 0: rank 0 rows 1 (page 0), 44 (page 2); rank 1 61, 119
                     [0, 31, 75, 76],     # step 1: rank 0 the same rows again; rank 1 rows 75, 76 (one page)
                     [2, 32, 90, 91]])
    tr = _trace(rows, [0, 0, 1, 1], [True] * 4, batch=2)
    sub, start = rank_trace(tr, 1, 1, 2)
    assert start == 60 and sub.n_columns == 2 and sub.rows[0].tolist() == [60, 95, 61, 119, 75, 76, 90, 91]
    r0 = {r.capacity_rows: r for r in rank_pages(tr, 1, 0, 2, (0, 100))}
    r1 = {r.capacity_rows: r for r in rank_pages(tr, 1, 1, 2, (0, 100))}
    # rank 0 uncached: step 0 pages {0, 2}, step 1 pages {0, 2} -> 2 per step; cached: step 1 rows 0, 31 hit
    assert r0[0].pages_mean == 2.0 and r0[0].hit_rate == 0.0 and r0[0].steps == 2
    assert r0[100].pages_mean == pytest.approx((2 + 2) / 2)   # step 1 still misses rows 2 and 32 (pages 0, 2)
    assert r0[100].hit_rate == pytest.approx(2 / 8)
    # rank 1: step 0 rows 60, 61 (page 0), 95 (page 2), 119 (page 3) -> 3; step 1: 75, 76 (page 1), 90, 91 (page 2)
    assert r1[0].pages_mean == pytest.approx((3 + 2) / 2) and r1[0].orders == (3,)
    assert slowest_rank([*r0.values(), *r1.values()], 0) == 1
    with pytest.raises(SlackTierError):
        rank_trace(tr, 1, 0, 3)   # 4 columns do not split over 3 ranks


def test_rank_pages_counts_full_batch_decode_steps_only():
    rows = np.array([[0, 31, 60, 95], [1, 44, 61, 119], [5, 6, 7, 8]])
    tr = _trace(rows, [0, 0, 1], [True, True, True], batch=2)   # step 1 decodes one token: not a full batch
    (r,) = rank_pages(tr, 1, 0, 2, (0,))
    assert r.steps == 1 and r.pages_mean == 2.0


# ---- the full-rank timeline on a scaled table ---------------------------------------------------------------

def test_full_rank_timeline_on_a_scaled_table(tmp_path):
    from benchmarks.paper.full_rank import FullRankConfig, full_rank_table, host_memory_bytes, run_full_rank
    from slacktier.plan.placement import Placement

    cfg = FullRankConfig(workdir=str(tmp_path), rank=3, workload="chat", batches=(8,), runs=1, decode_steps=3,
                         warmup_steps=2, check_steps=2, cache_rows=4096, engram_vocab=300)
    profile, manifest, runs = run_full_rank(cfg)
    assert [(r.layer, r.rank) for r in manifest.regions] == [(1, 3), (14, 3)]
    by = {r.placement: r for r in runs}
    assert set(by) == {"l1-dram-l14-disk", "disk", "disk-cache-l14", "disk-split"}
    assert by["l1-dram-l14-disk"].served == (14,) and set(by["l1-dram-l14-disk"].summary.pages) == {14}
    assert by["disk"].served == (1, 14) and not by["disk"].warmed and by["disk-split"].warmed
    for r in runs:
        assert r.summary.steps == 3 and r.checked_steps == 2 and r.mismatches == 0
        assert all(p > 0 for p in r.summary.pages.values())
    assert by["disk"].summary.hit_rate == {1: 0.0, 14: 0.0}
    # host memory (computed): a DRAM layer's shard in pages, a directory sized to its cache rows for the others
    r1 = manifest.region(1, 3)
    assert by["l1-dram-l14-disk"].host_bytes == r1.nbytes + 8 * 16   # no cache rows: the least directory
    assert by["disk"].host_bytes == host_memory_bytes(manifest, 3, Placement("x", ((1, "disk"), (14, "disk")))) \
        == 2 * 8 * 16
    assert by["disk-split"].host_bytes == 2 * 8 * 4096   # 2,048 cache rows each
    table = full_rank_table(profile, cfg, manifest, runs)
    assert table.splitlines()[0] == profile.header and "host DRAM (all)" in table and "0 mismatching rows" in table


def test_full_rank_refuses_a_batch_the_traffic_cannot_fill(tmp_path):
    from benchmarks.paper.full_rank import FullRankConfig, run_full_rank

    cfg = FullRankConfig(workdir=str(tmp_path), workload="agent", batches=(128,), max_session_tokens=1024,
                         engram_vocab=300)
    with pytest.raises(SlackTierError) as e:
        run_full_rank(cfg)
    assert e.value.kind == ErrorKind.BAD_INPUT and "B=128" in str(e.value)
    assert list(tmp_path.iterdir()) == []   # refused before staging


def test_whole_sessions_window_deep_in_the_replay_beside_the_characterizer(tmp_path):
    """Whole sessions, prefills longer than the engine's token capacity chunked (none dropped), the timed window
    after untimed decode steps; the engine's hit rates and pages in the window equal the characterizer's CLOCK
    on the same replay (same rank's lookups, same cache rows) with evict-ahead off (which runs CLOCK exactly as
    the characterizer)."""
    from benchmarks.paper.full_rank import FullRankConfig, run_full_rank, window_hit_rates, window_table
    from slacktier.serve.timeline import sweep_sessions
    from slacktier.workloads.corpus import CorpusConfig, load_workload

    cfg = FullRankConfig(workdir=str(tmp_path), rank=3, workload="chat", batches=(8,), runs=1, decode_steps=4,
                         warmup_steps=1, check_steps=2, cache_rows=2048, engram_vocab=300, whole_sessions=True,
                         start_decode_steps=40, prefill_chunk_tokens=256, evict_ahead=False,
                         placements=("disk", "disk-split", "disk-cache-l14"))
    pool = sweep_sessions(cfg.sweep(), 8)
    split = load_workload("chat", CorpusConfig(seed=0, agent_sessions_per_source=1))
    whole = {s.session_id: s for s in [*split.holdout, *split.fit]}
    assert len(pool) == len(whole)   # no session dropped, every turn kept
    assert all(s.num_replies == whole[s.session_id].num_replies for s in pool)
    assert max(s.num_tokens for s in pool) > cfg.prefill_chunk_tokens   # longer than the engine's max_tokens
    profile, manifest, runs = run_full_rank(cfg)
    (window,) = {r.window for r in runs}
    assert len(window) == 4 and min(window) > 40   # the window starts after 40 decode steps (and their prefills)
    for r in runs:
        assert r.summary.steps == 4 and r.checked_steps == 2 and r.mismatches == 0
    hits = window_hit_rates(cfg, manifest, 8, runs)
    assert hits.sessions == len(pool) and hits.window[0] > 1 and hits.window_turn >= 1
    by = {r.placement: r for r in runs}
    for (name, layer), (cap, window_hits, _) in hits.rates.items():
        assert cap == {"disk": 0, "disk-split": 1024, "disk-cache-l14": 1024 if layer == 14 else 0}[name]
        assert by[name].summary.hit_rate[layer] == pytest.approx(window_hits.slot_hit_rate, abs=1e-9)
        assert by[name].summary.pages[layer] == pytest.approx(window_hits.pages, abs=1e-9)
        assert window_hits.hit_rate >= window_hits.slot_hit_rate
    assert hits.rates[("disk-split", 14)][1].slot_hit_rate > 0
    assert "charact. hit" in window_table(hits, runs)
    # the planner from the characterizer's pages: a disk of 1 ms a page stalls a layer-1-on-disk placement
    from benchmarks.paper.full_rank import planner_stalls
    from slacktier.plan.readmodel import DeviceReadModel

    planned = planner_stalls(profile, cfg, hits, runs, DeviceReadModel(0.0, 1.0, 1.0, 0.0))
    assert set(planned) == set(by) and planned["disk"] > planned["disk-split"] > 0
    assert "planner" in window_table(hits, runs, planned)
