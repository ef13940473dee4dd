"""The file-backed baseline's reader (benchmarks/tier/mmap_baseline.py) serves SlackTier's rows bit for bit, and
its memory cap holds the page cache under the limit where a cgroup-v1 memory controller is writable."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from benchmarks.paper.full_rank import FullRankConfig, rank_control, stage_rank_shard
from benchmarks.tier.mmap_baseline import (LAYER, MMAP_VARIANTS, MmapLayerReader, MmapReaders, RunConfig,
                                           budget_bytes, dequantized, make_cgroup, remove_cgroup, resident_pages)
from slacktier.engine.checker import mismatching_rows
from slacktier.engine.step import StepEngine
from slacktier.errors import SlackTierError
from slacktier.serve.tiers import Placement

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def shard(o_direct_module_dir: Path):
    """Rank 3 of TP4 of a small V4.1-shaped table, staged; its config and manifest."""
    cfg = FullRankConfig(workdir=str(o_direct_module_dir), rank=3, engram_vocab=5_000)
    return cfg, stage_rank_shard(cfg)


def _ids(manifest, rng: np.random.Generator, tokens: int) -> np.ndarray:
    """[T, 1, 24] global row ids of layer 14 over every rank's rows, the rank's first and last rows included."""
    region = manifest.region(LAYER, 3)
    end = region.row_start + region.rows
    ids = rng.integers(0, end + region.rows, size=(tokens, 1, 24), dtype=np.int64)   # ranks 0..3 (3 is last)
    ids[0, 0, :4] = [region.row_start, region.row_start + 14, region.row_start + 15, end - 1]
    ids[1, 0, :2] = [region.row_start - 1, 0]
    return np.minimum(ids, end - 1)


def _served(cfg, manifest, ids: np.ndarray):
    """SlackTier's gather of layer 14 (disk tier, owned_only, uncached): bf16 [T * 24, 256]."""
    control, served = rank_control(manifest, cfg.rank, Placement("l14-disk", ((1, "dram"), (LAYER, "disk"))),
                                   cfg, ids.shape[0])
    engine = StepEngine.from_config(control, ids_layers=tuple(served), columns=24)
    try:
        engine.begin_step(ids)
        out = engine.gather(LAYER).reshape(-1, 256).clone()
        engine.end_step()
    finally:
        engine.close()
    return out


@pytest.mark.parametrize("variant", sorted(MMAP_VARIANTS))
def test_mapping_rows_equal_slacktier_gather(shard, variant: str) -> None:
    cfg, manifest = shard
    ids = _ids(manifest, np.random.default_rng(7), 64)
    ours = _served(cfg, manifest, ids)
    reader = MmapLayerReader(manifest.region(LAYER, cfg.rank), 0, *MMAP_VARIANTS[variant])
    try:
        reader.begin_step(ids)
        raw = reader.gather(LAYER)
        counters = reader.end_step().layers[LAYER]
        local, mine = reader._local(ids[:, 0, :])
    finally:
        reader.close()
    assert 0 < mine.sum() < mine.size   # both the rank's rows and other ranks' rows are in the step
    assert counters.lookups == mine.sum() and counters.zero_rows == mine.size - mine.sum()
    assert counters.pages_wanted == np.unique(local // 15).shape[0]
    assert int(mismatching_rows(ours, dequantized(raw, ~mine)).sum()) == 0


def test_comparison_sees_a_shifted_region(shard) -> None:
    """The check can fail: a reader whose rows are off by one differs on the rank's rows."""
    cfg, manifest = shard
    ids = _ids(manifest, np.random.default_rng(8), 16)
    ours = _served(cfg, manifest, ids)
    region = manifest.region(LAYER, cfg.rank)
    shifted = dataclasses.replace(region, row_start=region.row_start - 1)
    reader = MmapLayerReader(shifted, 0)
    try:
        reader.begin_step(ids)
        raw = reader.gather(LAYER)
        reader.end_step()
        _, mine = reader._local(ids[:, 0, :])
    finally:
        reader.close()
    assert int(mismatching_rows(ours, dequantized(raw, ~mine)).sum()) > 0


def test_budget_counts_rows_and_directory() -> None:
    assert budget_bytes(100_000) == 100_000 * 264 + 8 * 2 ** 18
    assert budget_bytes(500_000) == 500_000 * 264 + 8 * 2 ** 20


_CAPPED_CHILD = textwrap.dedent("""
    import mmap, os, sys
    from pathlib import Path
    import numpy as np
    cgroup, path, cap = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    (cgroup / "cgroup.procs").write_text(str(os.getpid()))
    usage = int((cgroup / "memory.usage_in_bytes").read_text())
    (cgroup / "memory.limit_in_bytes").write_text(str(usage + cap))
    fd = os.open(path, os.O_RDONLY)
    m = mmap.mmap(fd, os.fstat(fd).st_size, access=mmap.ACCESS_READ)
    m.madvise(mmap.MADV_RANDOM)
    pages = np.frombuffer(m, dtype=np.uint8)[::4096]
    print(int(pages.astype(np.int64).sum()))   # touches every page of the file
""")


def test_cap_keeps_the_mapped_file_under_the_limit(tmp_path: Path) -> None:
    cgroup = make_cgroup(f"test-mmap-cap-{os.getpid()}")
    if cgroup is None:
        pytest.skip("no writable cgroup-v1 memory controller here: the baseline's memory cap cannot be tested")
    path = tmp_path / "table.bin"
    size, cap = 64 << 20, 8 << 20
    with open(path, "wb") as f:
        f.write(np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8).tobytes())
        f.flush()
        os.fsync(f.fileno())
    fd = os.open(path, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)
    try:
        proc = subprocess.run([sys.executable, "-c", _CAPPED_CHILD, str(cgroup), str(path), str(cap)],
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        resident = resident_pages(str(path), 0, size) * 4096
    finally:
        remove_cgroup(cgroup)
    assert resident <= cap, f"{resident} bytes of the file resident under a cap of {cap}"
    assert resident < size // 2


# ---- both layers on disk (placement "disk") ------------------------------------------------------------------

def _ids_both(manifest, rng: np.random.Generator, tokens: int) -> np.ndarray:
    """[T, 2, 24] global row ids of layers 1 and 14 over every rank's rows, each region's first and last rows in."""
    out = []
    for layer in (1, LAYER):
        region = manifest.region(layer, 3)
        end = region.row_start + region.rows
        ids = rng.integers(0, end + region.rows, size=(tokens, 24), dtype=np.int64)
        ids[0, :3] = [region.row_start, region.row_start + 15, end - 1]
        ids[1, :1] = [region.row_start - 1]
        out.append(np.minimum(ids, end - 1))
    return np.stack(out, axis=1)


def _served_both(cfg, manifest, ids: np.ndarray) -> dict:
    """SlackTier's gather of layers 1 and 14, both on the disk tier (owned_only, uncached): layer -> bf16 rows."""
    placement = Placement("disk", ((1, "disk"), (LAYER, "disk")))
    control, served = rank_control(manifest, cfg.rank, placement, cfg, ids.shape[0])
    assert served == [1, LAYER]
    engine = StepEngine.from_config(control, ids_layers=tuple(served), columns=24)
    try:
        engine.begin_step(ids)
        out = {layer: engine.gather(layer).reshape(-1, 256).clone() for layer in served}
        engine.end_step()
    finally:
        engine.close()
    return out


def _mapped_both(manifest, ids: np.ndarray, regions: dict, variant: str = "mmap-random") -> dict:
    """Every layer's rows through MmapReaders over `regions` (layer -> region), dequantized: layer -> bf16 rows,
    and the step's counters."""
    readers = MmapReaders(((regions[layer], axis) for axis, layer in enumerate((1, LAYER))), *MMAP_VARIANTS[variant])
    try:
        readers.begin_step(readers.prepare(ids))
        raw = {layer: readers.gather(layer) for layer in (1, LAYER)}
        counters = readers.end_step()
        mine = {r.layer: r._local(ids[:, i, :])[1] for i, r in enumerate(readers.readers)}
    finally:
        readers.close()
    return {layer: dequantized(raw[layer], ~mine[layer]) for layer in raw}, counters, mine


@pytest.mark.parametrize("variant", ["mmap-random", "mmap-willneed", "mmap-willneed-async"])
def test_both_layers_mapped_equal_slacktier_gather(shard, variant: str) -> None:
    cfg, manifest = shard
    ids = _ids_both(manifest, np.random.default_rng(9), 48)
    ours = _served_both(cfg, manifest, ids)
    regions = {layer: manifest.region(layer, cfg.rank) for layer in (1, LAYER)}
    theirs, counters, mine = _mapped_both(manifest, ids, regions, variant)
    assert sorted(counters.layers) == [1, LAYER]
    for layer in (1, LAYER):
        assert 0 < mine[layer].sum() < mine[layer].size
        assert counters.layers[layer].lookups == mine[layer].sum()
        assert int(mismatching_rows(ours[layer], theirs[layer]).sum()) == 0, f"layer {layer}"


def test_both_layers_check_sees_a_shifted_layer_1(shard) -> None:
    """The per-layer check can fail: layer 1's region off by one row differs on layer 1 only."""
    cfg, manifest = shard
    ids = _ids_both(manifest, np.random.default_rng(10), 16)
    ours = _served_both(cfg, manifest, ids)
    region = manifest.region(1, cfg.rank)
    regions = {1: dataclasses.replace(region, row_start=region.row_start - 1),
               LAYER: manifest.region(LAYER, cfg.rank)}
    theirs, _, _ = _mapped_both(manifest, ids, regions)
    assert int(mismatching_rows(ours[1], theirs[1]).sum()) > 0
    assert int(mismatching_rows(ours[LAYER], theirs[LAYER]).sum()) == 0


def test_both_layers_on_the_timeline(shard) -> None:
    """The runner times each mapped layer at its own window and the step's stall sums them."""
    from slacktier.serve.timeline import StepTimes, TimelineRunner

    cfg, manifest = shard
    ids = _ids_both(manifest, np.random.default_rng(11), 8)
    readers = MmapReaders(((manifest.region(layer, cfg.rank), axis) for axis, layer in enumerate((1, LAYER))),
                          "random")
    try:
        runner = TimelineRunner(readers, StepTimes("agent", 8, 2.0, {1: 0.05, LAYER: 1.0}))
        step = runner.step(runner.prepare(ids))
        with pytest.raises(SlackTierError):
            readers.gather(7)
    finally:
        readers.close()
    assert sorted(step.stall_ms) == [1, LAYER] and step.stall_total_ms == sum(step.stall_ms.values())
    assert step.lookups[1] > 0 and step.lookups[LAYER] > 0


def test_split_placement_budget_and_slots() -> None:
    cfg = RunConfig(placement="disk", split_cache_rows=200_000, split_l1=0.6)
    assert cfg.disk_layers == (1, LAYER)
    assert cfg.cache_slots() == {1: 120_000, LAYER: 80_000}
    assert budget_bytes(cfg.cache_slots()) == 200_000 * 264 + 8 * 2 ** 18 + 8 * 2 ** 18
    assert RunConfig().cache_slots() == {LAYER: 100_000}   # the default placement: the old budget
    assert budget_bytes(RunConfig().cache_slots()) == budget_bytes(100_000)
    assert RunConfig(placement="l1-disk-l14-dram").cache_slots() == {1: 100_000}
    with pytest.raises(SlackTierError):
        RunConfig(placement="disk").cache_slots()   # no split: refused, not guessed
    with pytest.raises(SlackTierError):
        RunConfig(placement="both")
    with pytest.raises(SlackTierError):
        RunConfig(placement="disk", split_l1=1.5)
