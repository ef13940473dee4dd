"""Building an engine from a control file and switching it between steps (the schema: tests/test_config.py)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from slacktier.config import from_dict, write_control
from slacktier.engine.step import StepEngine
from slacktier.errors import ErrorKind, SlackTierError
from slacktier.testing.store import supports_o_direct
from slacktier.tables.codec import dequantize_bits
from slacktier.tables.manifest import Manifest
from slacktier.tables.stage import SyntheticSource, stage_synthetic

ROWS = {1: 2000, 14: 2500}


@pytest.fixture()
def tables(tmp_path: Path) -> tuple[Manifest, Manifest]:
    """The same layout staged twice with different seeds (different bytes)."""
    if not supports_o_direct(tmp_path):
        pytest.skip("tmp_path does not support O_DIRECT")
    a = stage_synthetic([tmp_path / "a.bin"], ROWS, 2, 1, progress=False)
    b = stage_synthetic([tmp_path / "b.bin"], ROWS, 2, 2, progress=False)
    return a, b


def toml(tmp_path: Path, name: str, *, cache_rows: int, tables: list[dict], **engine: object) -> str:
    """A control file built as data and written with config.write_control; its path."""
    doc = {"engine": {"cache_rows": cache_rows, "max_cache_rows": 4000, "check": True, **engine}, "table": tables}
    return str(write_control(from_dict(doc), tmp_path / name))


def run_step(engine: StepEngine, ids: np.ndarray, truth: dict[int, SyntheticSource]) -> dict:
    engine.begin_step(ids)
    for j, layer in enumerate(engine.ids_layers):
        out = engine.gather(layer)
        want = dequantize_bits(truth[layer].rows(layer, ids[:, j].reshape(-1)))
        assert np.array_equal(out.reshape(-1, 256).view(torch.int16).numpy(), want.view(np.int16))
    return engine.end_step().layers


def test_reload_switches_tiers_sizes_and_tables_in_one_process(tables, tmp_path: Path) -> None:
    a, b = tables
    truth = {layer: SyntheticSource(a.layout, 1) for layer in ROWS}
    first = toml(tmp_path, "a.toml", cache_rows=2000, tables=[
        {"layer": 1, "source": "disk", "manifest": a.path, "cache_share": 0.5, "order": 0},
        {"layer": 14, "source": "disk", "manifest": a.path, "cache_share": 0.5, "order": 1}])
    rng = np.random.default_rng(1)
    hot = {layer: rng.integers(0, n, 300) for layer, n in ROWS.items()}
    steps = [np.stack([rng.choice(hot[layer], (16, 24)) for layer in ROWS], axis=1) for _ in range(6)]
    engine = StepEngine.from_control(first)
    for ids in steps[:3]:
        run_step(engine, ids, truth)
    src1, src14 = engine.table(1).source, engine.table(14).source
    cached_before = {layer: set(engine.cache.cached(layer)[0].tolist()) for layer in ROWS}
    assert all(cached_before.values())

    # Layer 1 moves to DRAM, the cache shrinks and its split changes; layer 14 is untouched.
    second = toml(tmp_path, "b.toml", cache_rows=1200, tables=[
        {"layer": 1, "source": "dram", "manifest": a.path, "cache_share": 0.75, "order": 0},
        {"layer": 14, "source": "disk", "manifest": a.path, "cache_share": 0.25, "order": 1}])
    engine.apply(second)
    assert engine.table(14).source is src14 and engine.table(1).source is not src1
    with pytest.raises(SlackTierError) as exc:       # the replaced source was closed
        src1.submit(None, None)
    assert exc.value.kind == ErrorKind.CLOSED
    assert engine.cache.slots == 1200
    assert (engine.cache.owned_slots(1), engine.cache.owned_slots(14)) == (900, 300)
    kept = {layer: set(engine.cache.cached(layer)[0].tolist()) for layer in ROWS}
    assert kept[1] == cached_before[1]              # layer 1 kept every row (the same bytes, another tier)
    assert kept[14] <= cached_before[14] and len(kept[14]) == min(300, len(cached_before[14]))
    layers = run_step(engine, steps[3], truth)
    assert layers[1].hits > 0 and layers[14].hits > 0
    assert engine.cache.verify() == []

    # Layer 14 now comes from another staged table (other bytes): its cached rows are dropped.
    # The window order is swapped too.
    third = toml(tmp_path, "c.toml", cache_rows=1200, tables=[
        {"layer": 1, "source": "dram", "manifest": a.path, "cache_share": 0.75, "order": 1},
        {"layer": 14, "source": "disk", "manifest": b.path, "cache_share": 0.25, "order": 0}])
    engine.apply(third)
    assert engine.layers == (14, 1)
    assert engine.cache.cached(14)[0].size == 0 and engine.cache.cached(1)[0].size > 0
    truth[14] = SyntheticSource(b.layout, 2)
    layers = run_step(engine, steps[4], truth)
    assert layers[14].hits == 0 and layers[1].hits > 0
    run_step(engine, steps[5], truth)
    assert sum(c.mismatches for c in engine.totals.values()) == 0

    # A control file naming a layer the table does not have is refused; the engine keeps working.
    broken = toml(tmp_path, "d.toml", cache_rows=1200, tables=[
        {"layer": 2, "source": "disk", "manifest": a.path, "cache_share": 0.5}])
    with pytest.raises(SlackTierError) as exc:
        engine.apply(broken)
    assert exc.value.kind == ErrorKind.MISSING and exc.value.layer == 2
    run_step(engine, steps[0], truth)

    # No reload in the middle of a step.
    engine.begin_step(steps[0])
    with pytest.raises(SlackTierError):
        engine.apply(first)
    engine.end_step()
    engine.close()


def test_reload_to_a_larger_reserved_cache_and_lossy(tables, tmp_path: Path) -> None:
    a, _ = tables
    truth = {layer: SyntheticSource(a.layout, 1) for layer in ROWS}
    first = toml(tmp_path, "a.toml", cache_rows=100, tables=[
        {"layer": 1, "source": "dram", "manifest": a.path, "cache_share": 0.5},
        {"layer": 14, "source": "dram", "manifest": a.path, "cache_share": 0.5, "order": 1}])
    engine = StepEngine.from_control(first)
    ids = np.stack([np.arange(240).reshape(10, 24) * 3 for _ in ROWS], axis=1)
    run_step(engine, ids, truth)
    seen = tmp_path / "seen.npy"
    np.save(seen, np.arange(0, 2000, 2, dtype=np.int64))        # even rows seen
    second = toml(tmp_path, "b.toml", cache_rows=100, max_cache_rows=8000, lossy=True, tables=[
        {"layer": 1, "source": "dram", "manifest": a.path, "cache_share": 0.5, "seen": str(seen)},
        {"layer": 14, "source": "dram", "manifest": a.path, "cache_share": 0.5, "order": 1, "seen": str(seen)}])
    engine.apply(second)
    assert engine.cache.max_slots == 8000 and engine.lossy
    engine.begin_step(ids)
    out = engine.gather(1).reshape(-1, 256)
    engine.end_step()
    flat = ids[:, 0].reshape(-1)
    odd = torch.from_numpy(flat % 2 == 1)
    assert not out[odd].view(torch.int16).any()
    want = dequantize_bits(truth[1].rows(1, flat[flat % 2 == 0]))
    assert np.array_equal(out[~odd].view(torch.int16).numpy(), want.view(np.int16))
    assert engine.last_step.layers[1].zero_rows == int(odd.sum())
    engine.close()


def test_reload_onto_a_redis_tier_keeps_the_cache(tables, tmp_path: Path) -> None:
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (scripts/test.sh installs it)")
    from slacktier.config import RedisOptions
    from slacktier.store.redis.loader import load_manifest
    from slacktier.store.redis.source import RedisSource
    from slacktier.testing.store import RedisServer
    a, _ = tables
    truth = {layer: SyntheticSource(a.layout, 1) for layer in ROWS}
    server = RedisServer(tmp_path)
    try:
        load_manifest(RedisOptions(url=server.url, prefix="t"), a)
        first = toml(tmp_path, "a.toml", cache_rows=1000, tables=[
            {"layer": 1, "source": "disk", "manifest": a.path, "cache_share": 0.5},
            {"layer": 14, "source": "disk", "manifest": a.path, "cache_share": 0.5, "order": 1}])
        second = toml(tmp_path, "b.toml", cache_rows=1000, tables=[
            {"layer": 1, "source": "redis", "manifest": a.path, "cache_share": 0.5,
             "redis": {"url": server.url, "prefix": "t"}},
            {"layer": 14, "source": "redis", "manifest": a.path, "cache_share": 0.5, "order": 1,
             "redis": {"url": server.url, "prefix": "t"}}])
        rng = np.random.default_rng(3)
        with StepEngine.from_control(first) as engine:
            ids = np.stack([rng.integers(0, 300, (8, 24)) for _ in ROWS], axis=1)
            run_step(engine, ids, truth)
            engine.apply(second)
            assert isinstance(engine.table(1).source, RedisSource)
            layers = run_step(engine, ids, truth)                 # same bytes: the cache is kept
            assert all(c.hits == c.lookups - c.reused for c in layers.values())
            fresh = np.stack([rng.integers(300, 2000, (8, 24)) for _ in ROWS], axis=1)
            layers = run_step(engine, fresh, truth)               # misses now come from Redis
            assert all(c.pages_read > 0 for c in layers.values())
            assert sum(c.mismatches for c in engine.totals.values()) == 0
    finally:
        server.stop()


def test_targets_override_moves_a_table_to_another_device(tables, tmp_path: Path) -> None:
    a, _ = tables
    moved = tmp_path / "moved.bin"
    shutil.copyfile(a.targets[0], moved)
    truth = {layer: SyntheticSource(a.layout, 1) for layer in ROWS}
    cfg = toml(tmp_path, "m.toml", cache_rows=0, tables=[
        {"layer": 1, "manifest": a.path, "targets": [str(moved)]},
        {"layer": 14, "manifest": a.path, "targets": [str(moved)], "order": 1}])
    with StepEngine.from_control(cfg) as engine:
        assert {r.path for layer in ROWS for r in engine.table(layer).regions} == {str(moved)}
        os.unlink(a.targets[0])                 # the original target is gone: every read comes from the copy
        ids = np.stack([np.arange(96).reshape(4, 24) * 20 for _ in ROWS], axis=1)
        run_step(engine, ids, truth)


def test_per_rank_control_files_sum_to_the_single_process_gather(tables, tmp_path: Path) -> None:
    """`rank` + `owned_only`: each rank's process serves its own shard; the sum over ranks is bit-exact."""
    a, _ = tables
    tbl = [{"layer": layer, "manifest": str(a.path), "cache_share": 0.5, "order": i} for i, layer in enumerate(ROWS)]
    whole = toml(tmp_path, "all.toml", cache_rows=600, tables=tbl)
    per_rank = [toml(tmp_path, f"r{r}.toml", cache_rows=300, owned_only=True,
                     tables=[dict(t, rank=r) for t in tbl]) for r in range(2)]
    rng = np.random.default_rng(7)
    with StepEngine.from_control(whole) as one, \
            StepEngine.from_control(per_rank[0]) as r0, StepEngine.from_control(per_rank[1]) as r1:
        for _ in range(3):
            ids = np.stack([rng.integers(0, n, (16, 24)) for n in ROWS.values()], axis=1)
            for e in (one, r0, r1):
                e.begin_step(ids)
            for layer in ROWS:
                want = one.gather(layer)
                got = r0.gather(layer) + r1.gather(layer)
                assert torch.equal(got.view(torch.int16), want.view(torch.int16))
            counts = [e.end_step().layers for e in (one, r0, r1)]
            for layer in ROWS:
                # Every lookup is read or hit by exactly one rank and zero-filled by the other.
                assert counts[1][layer].zero_rows + counts[2][layer].zero_rows == counts[0][layer].lookups
        assert sum(c.mismatches for e in (one, r0, r1) for c in e.totals.values()) == 0
    with pytest.raises(SlackTierError) as err:
        StepEngine.from_control(toml(tmp_path, "bad.toml", cache_rows=10, tables=[dict(tbl[0], rank=5)]))
    assert err.value.kind is ErrorKind.MISSING and err.value.rank == 5


def test_evict_ahead_follows_the_control_file(tables, tmp_path: Path) -> None:
    """[engine] evict_ahead: off, a full cache stays full between steps (CLOCK evicts inside the pass); on,
    end_step empties as many slots as the step claimed, the ones CLOCK takes next; rows exact throughout."""
    a, _ = tables
    truth = {layer: SyntheticSource(a.layout, 1) for layer in ROWS}
    spec = [{"layer": 1, "source": "dram", "manifest": a.path, "cache_share": 0.5},
            {"layer": 14, "source": "dram", "manifest": a.path, "cache_share": 0.5, "order": 1}]
    off = toml(tmp_path, "off.toml", cache_rows=800, evict_ahead=False, tables=spec)
    on = toml(tmp_path, "on.toml", cache_rows=800, tables=spec)   # the default
    rng = np.random.default_rng(3)
    order = {layer: rng.permutation(n) for layer, n in ROWS.items()}
    steps = iter(np.stack([order[layer][k * 48:(k + 1) * 48].reshape(2, 24) for layer in ROWS], axis=1)
                 for k in range(40))   # 48 rows per layer never looked up before, each step

    def cached() -> list[int]:
        return [len(engine.cache.cached(layer)[0]) for layer in ROWS]

    engine = StepEngine.from_control(off)
    for _ in range(12):   # 400 slots per layer: full after 9 steps, then every miss evicts in the pass
        run_step(engine, next(steps), truth)
    assert not engine.evict_ahead and cached() == [400, 400]
    engine.apply(on)
    for _ in range(2):
        run_step(engine, next(steps), truth)
    assert engine.evict_ahead and cached() == [352, 352]   # the step's 48 claims emptied again, ahead
    engine.apply(off)
    run_step(engine, next(steps), truth)
    assert cached() == [400, 400]   # the next 48 misses took the emptied slots; none emptied after
    engine.close()


def test_a_reload_changing_the_device_queue_settings_is_refused_naming_the_key(tables, tmp_path: Path) -> None:
    """The device queue keeps its settings while the served tables hold it: a reload asking for others is refused
    naming the key, all or nothing, and the engine's config still says what the queue does."""
    a, _ = tables
    truth = {layer: SyntheticSource(a.layout, 1) for layer in ROWS}
    disk = {"engine": "threads", "queue_depth": 64, "io_threads": 1}
    first = toml(tmp_path, "q64.toml", cache_rows=2000, tables=[
        {"layer": layer, "source": "disk", "manifest": a.path, "cache_share": 0.5, "order": i, "disk": disk}
        for i, layer in enumerate(ROWS)])
    engine = StepEngine.from_control(first)
    ids = np.random.default_rng(3).integers(0, 2000, (8, 2, 24))
    run_step(engine, ids, truth)
    for key, value in (("queue_depth", 8), ("io_threads", 4)):
        other = toml(tmp_path, f"{key}.toml", cache_rows=2000, tables=[
            {"layer": layer, "source": "disk", "manifest": a.path, "cache_share": 0.5, "order": i,
             "disk": disk | {key: value}} for i, layer in enumerate(ROWS)])
        with pytest.raises(SlackTierError) as exc:
            engine.apply(other)
        assert exc.value.kind is ErrorKind.BAD_INPUT and f"cannot change [table.disk] {key} to {value}" in \
            exc.value.message and f"{key} = {disk[key]}" in exc.value.message
        assert all(getattr(t.options, key) == disk[key] for t in engine.config.tables)
        run_step(engine, ids, truth)
    engine.apply(first)   # the same settings: kept
    run_step(engine, ids, truth)
    engine.close()


def test_an_engine_dropped_without_close_releases_its_files_queues_and_locks(tables, tmp_path: Path,
                                                                           caplog) -> None:
    """Garbage-collected without close(): its descriptors, device-queue attachments and target locks are
    released (a restage of its target is accepted), and the log says so once."""
    import gc
    import logging

    from slacktier.store.devqueue import open_queues

    a, _ = tables
    targets = {str(Path(t).resolve()) for t in a.targets}

    def open_fds() -> tuple[int, int]:
        """(descriptors of this process, those on the table's files). Other tests' background threads may close
        theirs while this runs, so the process's count is only held to not rising; the table's exactly."""
        on = 0
        for fd in os.listdir("/proc/self/fd"):
            try:
                on += os.readlink(f"/proc/self/fd/{fd}") in targets
            except OSError:   # closed since the listing
                pass
        return len(os.listdir("/proc/self/fd")), on

    gc.collect()   # engines other tests dropped: their descriptors and queue attachments go now, not mid-test
    fds, on_table = open_fds()
    users = sum(q.users for q in open_queues())   # attachments, whether or not a queue for this device was open
    path = toml(tmp_path, "drop.toml", cache_rows=2000, tables=[
        {"layer": layer, "source": "disk", "manifest": a.path, "cache_share": 0.5, "order": i,
         "disk": {"engine": "threads"}} for i, layer in enumerate(ROWS)])
    engine = StepEngine.from_control(path)
    run_step(engine, np.random.default_rng(4).integers(0, 2000, (8, 2, 24)),
             {layer: SyntheticSource(a.layout, 1) for layer in ROWS})
    assert open_fds()[1] > on_table and sum(q.users for q in open_queues()) > users
    with pytest.raises(SlackTierError) as exc:   # the engine's shared lock on its target refuses a restage
        stage_synthetic(list(a.targets), ROWS, 2, 1, overwrite=True, progress=False)
    assert exc.value.kind is ErrorKind.TARGET and "in use" in exc.value.message
    with caplog.at_level(logging.WARNING, logger="slacktier.engine.step"):
        del engine
        gc.collect()
    after, after_on_table = open_fds()
    assert after <= fds and after_on_table == on_table and sum(q.users for q in open_queues()) == users
    said = [r.getMessage() for r in caplog.records if "garbage-collected without close()" in r.getMessage()]
    assert len(said) == 1 and "closed its 2 page sources" in said[0]
    stage_synthetic(list(a.targets), ROWS, 2, 1, overwrite=True, progress=False)   # its lock is gone
