"""The fault suite: never a wrong row, on every tier, with faults injected into real media (issue 11).

Each tier serves a table staged on a real O_DIRECT file (and, for Redis, loaded
into a real redis-server) through an engine built from a control file, with
the checker on: every gathered row is compared with the row regenerated from
the table's own source (the manifest's synthetic seed), not read back from the
medium. Faults are injected while it runs: a corrupted page on the medium, a
truncated file (short reads), late reads past the wait limit (a disk tier that
holds a batch; a real paused Redis server), a target restaged underneath. An
error must name the layer (and page where there is one); no wrong row may ever
be served, in the faulted step or after it. Each tier runs >= 1M lookups.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import msgspec
import numpy as np
import pytest
import redis
import torch

from slacktier.cache import RowCache
from slacktier.config import (MAX_CACHE_ROWS, ControlFile, DiskOptions, EngineConfig, RedisOptions, TableConfig,
                              load_control)
from slacktier.engine import StepEngine
from slacktier.engine.tables import TableSpec
from slacktier.errors import ErrorKind, SlackTierError
from slacktier.store.disk import DiskSource
from slacktier.store.redis.keys import default_prefix, identity_key, page_key
from slacktier.store.redis.loader import load_manifest
from slacktier.store.registry import register_tier
from slacktier.tables.codec import dequantize_bits
from slacktier.tables.layout import PAGE_BYTES, ROW_BYTES, ROWS_PER_PAGE
from slacktier.tables.manifest import Manifest, manifest_digest
from slacktier.tables.stage import SyntheticSource, stage_synthetic, stage_table
from slacktier.tables import page_writer
from slacktier.testing.tables import FailingSource

ROWS = {1: 30_000, 14: 45_000}
TOKENS = 64                       # lookups per step: 64 x 24 x 2 layers = 3,072
STEPS = 330                       # > 1M lookups per tier


class HeldDisk(DiskSource):
    """The disk tier with one real late completion on demand: `hold()` holds the device queue when the next
    batch is submitted, so that batch (and every read on the device) waits until `release()`."""

    armed = False
    holding: list = []   # sources whose device queues are held

    @classmethod
    def hold(cls) -> None:
        cls.armed = True

    @classmethod
    def release(cls) -> None:
        cls.armed = False   # a hold no batch took yet must not catch a later test's batch
        for source in cls.holding:
            DiskSource.hold(source, False)
        cls.holding.clear()

    def submit(self, reads, pool):
        if HeldDisk.armed:
            HeldDisk.armed = False
            HeldDisk.holding.append(self)
            DiskSource.hold(self, True)
        return super().submit(reads, pool)


register_tier("held_disk", HeldDisk, DiskOptions)


@pytest.fixture()
def staged(o_direct_dir: Path):
    return stage_synthetic([o_direct_dir / "t.bin"], ROWS, 2, 11, progress=False)


def control(manifest, source: str, options=None, **engine) -> ControlFile:
    eng = EngineConfig(**({"cache_rows": 20_000, "check": True, "wait_timeout_ms": 300.0, "verify_reads": True}
                          | engine))
    return ControlFile(engine=eng, tables=tuple(
        TableConfig(layer=layer, manifest=manifest.path, source=source, options=options, cache_share=0.5, order=i)
        for i, layer in enumerate(ROWS)))


class Run:
    """Steps of Zipf-ish ids through an engine, every row compared with the table's source."""

    def __init__(self, engine: StepEngine, manifest, seed: int = 0) -> None:
        self.engine = engine
        self.truth = SyntheticSource(manifest.layout, int(manifest.source["seed"]))
        self.rng = np.random.default_rng(seed)
        self.lookups = 0
        self.wrong = 0
        self.errors: list[SlackTierError] = []

    def ids(self) -> np.ndarray:
        # A hot set and a long tail, so the cache both hits and evicts.
        return np.stack([np.where(self.rng.random((TOKENS, 24)) < 0.5, self.rng.integers(0, 2000, (TOKENS, 24)),
                                  self.rng.integers(0, n, (TOKENS, 24))) for n in ROWS.values()], axis=1)

    def step(self, ids: np.ndarray | None = None) -> None:
        ids = self.ids() if ids is None else ids
        e = self.engine
        e.begin_step(ids)
        for j, layer in enumerate(e.ids_layers):
            try:
                out = e.gather(layer)
            except SlackTierError as exc:
                assert exc.layer == layer
                self.errors.append(exc)
                continue
            want = dequantize_bits(self.truth.rows(layer, ids[:, j].reshape(-1)))
            got = out.reshape(-1, 256).view(torch.int16).numpy()
            self.wrong += int((got != want.view(np.int16)).any(axis=1).sum())
            self.lookups += ids[:, j].size
        try:
            e.end_step()
        except SlackTierError as exc:
            self.errors.append(exc)

    def steps(self, n: int) -> None:
        for _ in range(n):
            self.step()

    def check_clean(self, min_lookups: int) -> None:
        assert self.wrong == 0
        assert sum(c.mismatches for c in self.engine.totals.values()) == 0
        assert self.lookups >= min_lookups


def _flip_byte_on_disk(manifest, layer: int, rank: int, page: int) -> int:
    r = manifest.region(layer, rank)
    at = r.offset_bytes + page * PAGE_BYTES + 3 * ROW_BYTES + 100   # inside row 3 of the page (_ids_on_page)
    with open(r.path, "r+b") as f:
        f.seek(at)
        old = f.read(1)
        f.seek(at)
        f.write(bytes([old[0] ^ 0x5A]))
        f.flush()
        os.fsync(f.fileno())
    return at


def _drop_cache(engine: StepEngine) -> None:
    """Empty the row cache (apply the same control file with no cache rows, then the old one again)."""
    cfg = engine.config
    engine.apply(cfg.replace(cache_rows=0))
    engine.apply(cfg)


def _ids_on_page(manifest, layer: int, rank: int, page: int) -> np.ndarray:
    r = manifest.region(layer, rank)
    row = r.row_start + page * ROWS_PER_PAGE + 3
    ids = np.zeros((1, len(ROWS), 24), dtype=np.int64)
    ids[0, list(ROWS).index(layer), :] = row
    return ids


@pytest.mark.slow
def test_disk_tier_survives_corruption_truncation_and_late_reads(staged, tmp_path: Path) -> None:
    """>= 1M lookups from a real O_DIRECT file; corrupted page, truncated file, a late read: 0 wrong rows."""
    engine = StepEngine.from_config(control(staged, "held_disk"))
    run = Run(engine, staged)
    run.steps(STEPS // 3)
    # 1. A flipped byte on the medium: the read fails its CRC32C, naming the page; nothing is served from it.
    page = 7
    at = _flip_byte_on_disk(staged, 14, 1, page)
    bad = _ids_on_page(staged, 14, 1, page)
    _drop_cache(engine)                     # the page is read, not served from a cached row
    engine.begin_step(bad)
    with pytest.raises(SlackTierError) as exc:
        engine.gather(14)
    assert (exc.value.kind, exc.value.layer, exc.value.rank, exc.value.page) == (ErrorKind.CHECKSUM, 14, 1, page)
    engine.end_step()
    with open(staged.region(14, 1).path, "r+b") as f:   # heal the medium
        f.seek(at)
        old = f.read(1)
        f.seek(at)
        f.write(bytes([old[0] ^ 0x5A]))
    run.step(bad)
    run.steps(STEPS // 3)
    # 2. A late read: layer 1's batch is held past the wait limit, then lands while later steps run.
    HeldDisk.hold()
    try:
        run.step()
        assert run.errors and run.errors[-1].kind is ErrorKind.TIMEOUT
        engine.wait_timeout_s = 30.0
    finally:   # released even when the assertion fails: a batch left held would hang every later test
        HeldDisk.release()
    run.steps(10)
    assert engine.retired_pools == 1
    # 3. The file is truncated under the running engine: short reads are errors, never rows.
    target = staged.targets[0]
    saved = tmp_path / "saved.bin"
    shutil.copyfile(target, saved)
    os.truncate(target, staged.region(14, 0).offset_bytes + PAGE_BYTES)
    errors = len(run.errors)
    run.steps(5)
    assert len(run.errors) > errors and all(e.kind is ErrorKind.IO for e in run.errors[errors:])
    shutil.copyfile(saved, target)
    run.steps(STEPS - 2 * (STEPS // 3) - 15)
    run.check_clean(1_000_000)
    engine.close()


def test_dram_tier_refuses_a_corrupted_file_at_load_and_serves_exactly(staged) -> None:
    """DRAM loads the pages once and checks them then: a corrupted target is refused before any row is served."""
    at = _flip_byte_on_disk(staged, 1, 0, 3)
    with pytest.raises(SlackTierError) as exc:
        StepEngine.from_config(control(staged, "dram"))
    assert exc.value.kind is ErrorKind.CHECKSUM and (exc.value.layer, exc.value.rank) == (1, 0)
    with open(staged.region(1, 0).path, "r+b") as f:
        f.seek(at)
        old = f.read(1)
        f.seek(at)
        f.write(bytes([old[0] ^ 0x5A]))
    engine = StepEngine.from_config(control(staged, "dram"))
    run = Run(engine, staged, seed=1)
    run.steps(STEPS)
    run.check_clean(1_000_000)
    engine.close()


def test_redis_tier_survives_a_corrupted_value_and_a_paused_server(staged, redis_server) -> None:
    """A real redis-server: a corrupted page value is caught by default, a paused server times out; 0 wrong rows."""
    options = RedisOptions(url=redis_server.url, prefix="faults")
    load_manifest(options, staged, tag_buckets=8)
    cfg = control(staged, "redis", options)
    cfg = cfg.replace(verify_reads="auto")   # Redis verifies by default: no end-to-end checksum of its own
    engine = StepEngine.from_config(cfg)
    run = Run(engine, staged, seed=2)
    run.steps(STEPS // 2)
    client = redis.Redis.from_url(redis_server.url)
    try:
        key = page_key("faults", 14, 0, 5, 8)
        good = client.get(key)
        client.set(key, bytes([good[0] ^ 1]) + good[1:])
        bad = _ids_on_page(staged, 14, 0, 5)
        _drop_cache(engine)
        engine.begin_step(bad)
        with pytest.raises(SlackTierError) as exc:
            engine.gather(14)
        assert exc.value.kind is ErrorKind.CHECKSUM and exc.value.page == 5
        engine.end_step()
        client.set(key, good)
        run.step(bad)
        # The server answers nobody for a while: the step fails on its wait limit, the next ones are exact.
        client.execute_command("CLIENT", "PAUSE", 1200, "ALL")
        errors = len(run.errors)
        run.step()
        assert any(e.kind in (ErrorKind.TIMEOUT, ErrorKind.IO) for e in run.errors[errors:])
        engine.wait_timeout_s = 30.0
        run.steps(STEPS - STEPS // 2)
    finally:
        client.close()
    run.check_clean(1_000_000)
    engine.close()


def _ignoring_target_locks(monkeypatch) -> None:
    """Stage as a process that ignores the targets' locks would (an older version, another tool)."""
    monkeypatch.setattr(page_writer, "lock_target", lambda fd, path, exclusive: None)


def test_a_table_restaged_underneath_is_refused_at_open_and_at_reload(staged, o_direct_dir: Path,
                                                                      monkeypatch) -> None:
    cfg = control(staged, "disk")
    engine = StepEngine.from_config(cfg)
    Run(engine, staged).steps(2)
    with pytest.raises(SlackTierError) as exc:   # the engine's shared lock refuses the stage, naming the target
        stage_synthetic([staged.targets[0]], ROWS, 2, 12, overwrite=True, progress=False,
                        manifest_path=o_direct_dir / "other.manifest.json")
    assert exc.value.kind is ErrorKind.TARGET and f"target {staged.targets[0]} is in use" in exc.value.message
    # Another table is staged over the same target anyway (its own manifest); the old manifest names wrong bytes.
    _ignoring_target_locks(monkeypatch)
    stage_synthetic([staged.targets[0]], ROWS, 2, 12, overwrite=True, progress=False,
                    manifest_path=o_direct_dir / "other.manifest.json")
    for open_it in (lambda: engine.apply(cfg), lambda: StepEngine.from_config(cfg),
                    lambda: StepEngine.from_config(control(staged, "dram"))):
        with pytest.raises(SlackTierError) as exc:
            open_it()
        assert exc.value.kind is ErrorKind.TARGET
    engine.close()


def test_a_half_written_restage_is_refused(staged, o_direct_dir: Path, monkeypatch) -> None:
    """The same table restaged and interrupted: the target says "staging" until the end, and is refused.

    (Many small chunks and the default fillers: a failing row source once left the other fillers waiting
    forever for the buffers the failed chunks never gave back.)"""
    engine = StepEngine.from_config(control(staged, "disk"))
    _ignoring_target_locks(monkeypatch)
    with pytest.raises(RuntimeError, match="row source failed"):
        stage_table(FailingSource(staged.layout, 11, fail_after=2), staged.targets, 2, overwrite=True,
                    progress=False, chunk_bytes=4 * PAGE_BYTES, manifest_path=o_direct_dir / "half.manifest.json")
    for open_it in (lambda: engine.apply(engine.config), lambda: StepEngine.from_config(control(staged, "disk"))):
        with pytest.raises(SlackTierError) as exc:
            open_it()
        assert exc.value.kind is ErrorKind.TARGET   # the stage id differs, and the header still says "staging"
    engine.close()


def test_a_redis_prefix_holding_another_table_is_refused(staged, redis_server, o_direct_dir: Path) -> None:
    other = stage_synthetic([o_direct_dir / "other.bin"], ROWS, 2, 99, progress=False)
    load_manifest(RedisOptions(url=redis_server.url, prefix="shared"), other)
    with pytest.raises(SlackTierError) as exc:
        StepEngine.from_config(control(staged, "redis", RedisOptions(url=redis_server.url, prefix="shared")))
    assert exc.value.kind in (ErrorKind.TARGET, ErrorKind.MISSING)
    with pytest.raises(SlackTierError):    # nothing loaded under this prefix at all
        StepEngine.from_config(control(staged, "redis", RedisOptions(url=redis_server.url, prefix="empty")))


def test_another_table_loaded_into_the_served_prefix_is_never_served_with_every_check_off(
        staged, redis_server, o_direct_dir: Path) -> None:
    """verify_reads = false and check = false: another table loaded into the prefix an engine serves fails
    every read of its pages in one line (its stored CRC32Cs are not the manifest's), nothing of it is cached,
    and once the right table is loaded again every row is exact."""
    other = stage_synthetic([o_direct_dir / "other.bin"], ROWS, 2, 12, progress=False)
    options = RedisOptions(url=redis_server.url, prefix="swapped")
    load_manifest(options, staged, tag_buckets=8)
    engine = StepEngine.from_config(control(staged, "redis", options, verify_reads=False, check=False,
                                            wait_timeout_ms=5000.0))
    run = Run(engine, staged, seed=5)
    run.steps(10)
    assert not run.errors
    load_manifest(options, other, tag_buckets=8)   # the same keys now hold another table's pages
    errors = len(run.errors)
    run.steps(20)
    refused = run.errors[errors:]
    assert refused and all(e.kind is ErrorKind.CHECKSUM and "a page of another load" in e.message
                           and "\n" not in str(e) for e in refused)
    assert run.wrong == 0
    load_manifest(options, staged, tag_buckets=8)   # the right table again: nothing wrong was cached
    errors = len(run.errors)
    run.steps(40)
    assert len(run.errors) == errors
    run.check_clean(20_000)
    engine.close()


def test_the_checker_compares_with_the_source_not_the_medium(staged) -> None:
    """With verification off, a corrupted page passes the tier, but check=True compares with the table's source:
    the gather fails [checksum] naming layer, rank and page, and the wrong row is never served, then or later."""
    _flip_byte_on_disk(staged, 14, 0, 2)
    engine = StepEngine.from_config(control(staged, "disk", verify_reads=False, wait_timeout_ms=5000.0))
    ids = _ids_on_page(staged, 14, 0, 2)
    for _ in range(2):   # the second step reads the page again (nothing of it was cached) and fails again
        engine.begin_step(ids)
        engine.gather(1)
        with pytest.raises(SlackTierError) as exc:
            engine.gather(14)
        assert (exc.value.kind, exc.value.layer, exc.value.rank, exc.value.page) == (ErrorKind.CHECKSUM, 14, 0, 2)
        assert "none is served" in exc.value.message
        engine.end_step()
    assert engine.totals[14].mismatches == 48
    run = Run(engine, staged, seed=5)   # every other row is still served exactly; that one never
    run.steps(3)
    assert run.wrong == 0 and run.lookups >= 4 * TOKENS * 24
    assert {(e.kind, e.layer, e.rank, e.page) for e in run.errors} <= {(ErrorKind.CHECKSUM, 14, 0, 2)}
    engine.close()


def test_an_edited_manifest_is_refused_and_never_serves_swapped_rows(staged) -> None:
    """Two regions' offsets swapped in the manifest (layer 14's ranks 0 and 1, the same size): refused at load by
    the manifest's own digest; the same edit with a recomputed digest (a tool that rewrote it) still serves no
    wrong row with check on and verification off: the gather fails [checksum] naming layer, rank and page."""
    doc = json.loads(Path(staged.path).read_text())
    r0, r1 = doc["regions"][2], doc["regions"][3]
    assert (r0["layer"], r0["rank"], r1["layer"], r1["rank"]) == (14, 0, 14, 1) and r0["pages"] == r1["pages"]
    r0["offset_bytes"], r1["offset_bytes"] = r1["offset_bytes"], r0["offset_bytes"]
    edited = Path(staged.path).with_name("edited.manifest.json")   # beside the original: the same .crc file
    edited.write_text(json.dumps(doc))
    cfg = control(SimpleNamespace(path=str(edited)), "disk", verify_reads=False, wait_timeout_ms=5000.0)
    with pytest.raises(SlackTierError) as exc:
        StepEngine.from_config(cfg)
    assert exc.value.kind is ErrorKind.CHECKSUM and "was edited since it was written" in exc.value.message
    assert "--redigest" in exc.value.fix
    doc["manifest_digest"] = manifest_digest(doc)
    edited.write_text(json.dumps(doc))
    engine = StepEngine.from_config(cfg)
    engine.begin_step(_ids_on_page(staged, 14, 1, 4))
    engine.gather(1)
    with pytest.raises(SlackTierError) as exc:
        engine.gather(14)
    assert (exc.value.kind, exc.value.layer, exc.value.rank, exc.value.page) == (ErrorKind.CHECKSUM, 14, 1, 4)
    engine.end_step()
    engine.close()


@pytest.mark.parametrize("ids,dtype", [
    (np.full((1, 2, 24), 12.7), "float64"),
    (np.full((1, 2, 24), 12.0, dtype=np.float32), "float32"),
    (np.full((1, 2, 24), 2**64 - 1, dtype=np.uint64), "uint64"),   # cast, it would be -1: the pad id, a zero row
    (np.full((1, 2, 24), 7, dtype=np.uint64), "uint64"),            # in range or not: unsigned is never cast
    (np.full((1, 2, 24), 7, dtype=np.uint32), "uint32"),
    (np.full((1, 2, 24), 7, dtype=np.int16), "int16"),
    (np.ones((1, 2, 24), dtype=bool), "bool"),
    (np.full((1, 2, 24), 7, dtype=object), "object"),
])
def test_ids_of_any_dtype_but_int64_or_int32_are_refused_naming_it(staged, ids, dtype) -> None:
    engine = StepEngine.from_config(control(staged, "disk"))
    with pytest.raises(SlackTierError) as exc:
        engine.begin_step(ids)
    assert exc.value.kind is ErrorKind.BAD_INPUT
    assert exc.value.message == f"ids are {dtype}, want int64 (or int32) row ids"
    assert not engine.in_step
    engine.close()


def test_int32_ids_serve_exactly_the_int64_rows(staged) -> None:
    engine = StepEngine.from_config(control(staged, "disk", wait_timeout_ms=5000.0))
    run = Run(engine, staged, seed=3)
    ids = run.ids()
    assert ids.max() < 2**31
    run.step(ids.astype(np.int32))
    run.step(ids)
    assert run.wrong == 0 and not run.errors and run.lookups == 2 * TOKENS * 24 * 2
    engine.close()


def test_a_cache_larger_than_memory_is_refused_before_allocating(staged) -> None:
    cfg = control(staged, "disk").replace(cache_rows=2**31 - 1, max_cache_rows=2**31 - 1)
    with pytest.raises(SlackTierError) as exc:
        StepEngine.from_config(cfg)
    assert exc.value.kind is ErrorKind.CAPACITY and "GiB" in exc.value.message


def test_the_file_checker_reads_a_truncated_file_as_an_error_not_sigbus(staged) -> None:
    """A spec without a reference is checked against its files with pread: truncation is an IO error."""
    regions = staged.runtime_regions(layer=1)
    source = DiskSource(regions)
    spec = TableSpec(layer=1, row_start=0, rows=ROWS[1], regions=regions, source=source, cache_share=1.0)
    engine = StepEngine([spec], RowCache(100), check=True, owned_sources=[source])
    ids = np.full((1, 1, 24), ROWS[1] - 1, dtype=np.int64)
    engine.begin_step(ids)
    engine.gather(1)
    engine.end_step()
    os.truncate(regions[-1].path, regions[-1].offset_bytes + PAGE_BYTES)
    engine.begin_step(ids)
    with pytest.raises(SlackTierError) as exc:
        engine.gather(1)
    assert exc.value.kind is ErrorKind.IO
    engine.end_step()
    engine.close()


@pytest.mark.slow
def test_redis_cluster_tier_survives_failover_an_empty_restart_bad_values_and_a_slow_node(staged, tmp_path,
                                                                                        caplog) -> None:
    """A real 3-master, 3-replica cluster with ACLs: >= 1M checked lookups while a master is killed (its replica
    takes over), a master and its replica die and the master comes back empty, a value is cut short, and a node
    pauses past the wait limit. Every fault is a clear error for its step, never a wrong row."""
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server binary not found (apt-get install -y redis-server; scripts/test.sh does)")
    from redis.crc import key_slot

    from slacktier.testing.redis_cluster import LocalRedisCluster

    caplog.set_level(logging.WARNING, logger="slacktier.store.redis.source")
    with LocalRedisCluster(tmp_path / "cluster", masters=3, replicas=1, node_timeout_ms=1000) as cluster:
        os.environ["ST_FAULT_LOADER_PW"] = cluster.loader.password
        os.environ["ST_FAULT_READER_PW"] = cluster.reader.password
        loader = RedisOptions(mode="cluster", url=cluster.seed_url, username=cluster.loader.name,
                              password_env="ST_FAULT_LOADER_PW",
                              nodes=tuple(f"127.0.0.1:{p}" for p in cluster.ports[1:]))
        reader = RedisOptions(mode="cluster", url=cluster.seed_url, username=cluster.reader.name,
                              password_env="ST_FAULT_READER_PW", socket_timeout_ms=1000,
                              nodes=tuple(f"127.0.0.1:{p}" for p in cluster.ports[1:]))
        load_manifest(loader, staged, tag_buckets=64)
        cfg = control(staged, "redis", reader, verify_reads="auto")
        engine = StepEngine.from_config(cfg)
        run = Run(engine, staged, seed=5)
        run.steps(40)
        prefix = default_prefix(staged.identity)
        admin = redis.cluster.RedisCluster(host="127.0.0.1", port=cluster.ports[0], username=cluster.loader.name,
                                           password=cluster.loader.password)

        def node_of(layer: int, rank: int, page: int) -> int:
            return admin.nodes_manager.get_node_from_slot(key_slot(page_key(prefix, layer, rank, page, 64))).port

        def faulted_step(ids, *kinds: ErrorKind, fault=lambda: None) -> None:
            before = len(run.errors)
            _drop_cache(engine)
            fault()
            run.step(ids)
            got = {e.kind for e in run.errors[before:]}
            assert got and got <= set(kinds), run.errors[before:]

        try:
            # 1. A value cut short: IO naming the key's layer and page; the next steps are exact.
            key = page_key(prefix, 14, 1, 7, 64)
            good = admin.get(key)
            admin.set(key, good[:100])
            faulted_step(_ids_on_page(staged, 14, 1, 7), ErrorKind.IO)
            assert run.errors[-1].layer == 14 and run.errors[-1].page == 7
            admin.set(key, good)
            run.step(_ids_on_page(staged, 14, 1, 7))
            run.steps(40)

            # 2. A slow node: paused past the engine's 300 ms wait; the step fails on time and the stall is counted.
            port = node_of(1, 0, 3)
            faulted_step(_ids_on_page(staged, 1, 0, 3), ErrorKind.TIMEOUT, ErrorKind.IO,
                         fault=lambda: cluster.pause(port, 1500))
            # a PING on the paused node is answered when the pause ends: no fixed sleep for its length
            assert cluster.client(port, socket_timeout_s=30).ping()
            def stall_logged() -> bool:   # the lane counts the late reply (or its socket timeout) on its own
                return any("slow reply" in r.getMessage() and f":{port}" in r.getMessage()   # thread, after the
                           for r in caplog.records)                                          # engine gave up
            deadline = time.monotonic() + 5
            while not stall_logged() and time.monotonic() < deadline:
                time.sleep(0.02)
            assert stall_logged()
            run.steps(40)

            # 3. A master killed mid-run: steps fail (IO or TIMEOUT) until its replica is promoted, then resume.
            victim = cluster.ports[0]    # the url's own node: later opens must get in through the other seeds
            assert victim in cluster.masters()
            cluster.kill(victim)
            promoted = None
            for _ in range(300):
                run.step()
                try:
                    promoted = cluster.wait_failover(victim, timeout_s=0.01)
                    break
                except SlackTierError:   # not promoted yet: keep serving
                    pass
            assert promoted is not None
            run.steps(3)     # the first steps after the promotion refresh the topology
            errors = len(run.errors)
            run.steps(30)
            assert len(run.errors) == errors, run.errors[errors:]

            # 4. A master and its replica die; the master comes back empty: the table is named as incomplete.
            # Not the master of the identity key's slot: losing that one reads as "no table here" (MISSING), not
            # as incomplete (docs/remote.md, "Not done").
            masters = cluster.masters()
            holder = cluster.owner(key_slot(identity_key(prefix)))
            port = next(p for p in masters if p not in (promoted, holder))
            replica = next(r for r, m in cluster.replicas().items() if m == port)
            cluster.kill(replica)
            cluster.kill(port)
            cluster.restart(port, empty=True)
            cluster.restart(replica, empty=True)
            cluster.wait_ok(timeout_s=30)
            before = len(run.errors)
            run.steps(3)    # reads of the lost groups' pages: the table is named as incomplete
            got = run.errors[before:]
            assert got and {e.kind for e in got} <= {ErrorKind.TARGET, ErrorKind.IO}, got
            target = [e for e in got if e.kind is ErrorKind.TARGET]
            assert target and staged.identity.source_digest in str(target[-1])
            with pytest.raises(SlackTierError) as info:   # and so is a control file applied now
                engine.apply(cfg.replace(cache_rows=0))
            assert info.value.kind is ErrorKind.TARGET and "restarted empty" in str(info.value)
            # Reloading rewrites only the lost groups; then everything is exact again.
            report = load_manifest(loader, staged, tag_buckets=64)
            assert 0 < report.written < report.groups
            errors = len(run.errors)
            run.steps(STEPS - 150)
            assert len(run.errors) == errors, run.errors[errors:]
        finally:
            admin.close()
            engine.close()
    run.check_clean(1_000_000)


class RefusingDisk(DiskSource):
    """The disk tier, whose open is refused while `refusing` (a device gone between the control file's writing
    and its apply); otherwise the disk tier as it is (the registry's completeness test opens every tier)."""

    refusing = False

    def __init__(self, regions, options=None, *, page_crc32c=None, identity=None) -> None:
        if RefusingDisk.refusing:
            raise SlackTierError(ErrorKind.UNAVAILABLE, "the disk went away", fix="plug it back in")
        super().__init__(regions, options, page_crc32c=page_crc32c, identity=identity)


register_tier("refusing_disk", RefusingDisk, DiskOptions)


def _served(engine: StepEngine) -> tuple:
    """What a refused apply must leave as it was: the control file, sources, timeouts, modes, cached rows."""
    cache = engine.cache
    return (engine.config, tuple(engine.table(layer).source for layer in engine.layers), engine.wait_timeout_s,
            engine.lossy, engine.check, cache.max_slots, cache.slots,
            tuple((cache.owned_slots(layer), *(a.tobytes() for a in cache.cached(layer))) for layer in engine.layers))


def test_a_refused_apply_leaves_the_engine_exactly_as_it_was(staged, o_direct_dir: Path, monkeypatch) -> None:
    """A refusal at each stage of apply (manifest, source, seen-set, lossy, cache memory, metrics) changes
    nothing: the same sources, timeouts, cache size and cached rows, and the next steps serve exactly."""
    cfg = control(staged, "disk", cache_rows=2000, max_cache_rows=20_000, wait_timeout_ms=5000.0)
    engine = StepEngine.from_config(cfg)
    run = Run(engine, staged, seed=7)
    run.steps(3)
    bad_seen = o_direct_dir / "seen.txt"
    bad_seen.write_text("1 2 3\n")

    def tables(**change) -> ControlFile:
        return ControlFile(engine=cfg.engine, tables=tuple(
            TableConfig(**(msgspec.structs.asdict(t) | (change if t.layer == 14 else {}))) for t in cfg.tables))

    refused = {
        "manifest": tables(manifest=str(o_direct_dir / "gone.manifest.json")),
        "source": tables(source="refusing_disk", options=None),
        "seen-set": tables(seen=str(bad_seen)),
        # the campaign's case: a tiny timeout and a larger cache came along with the refused lossy mode
        "lossy": cfg.replace(lossy=True, wait_timeout_ms=0.001, cache_rows=5000),
        "cache memory": cfg.replace(cache_rows=2000, max_cache_rows=MAX_CACHE_ROWS),
        "metrics": cfg.replace(metrics=True, wait_timeout_ms=0.001),
    }
    # prometheus_client picks its value class (one process, or files in PROMETHEUS_MULTIPROC_DIR) when first
    # imported: imported here with the variable set, it would stay in multiprocess mode for every later test
    import prometheus_client  # noqa: F401
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(o_direct_dir / "no-such-dir"))
    monkeypatch.setattr(RefusingDisk, "refusing", True)
    for stage, bad in refused.items():
        before = _served(engine)
        with pytest.raises(SlackTierError) as exc:
            engine.apply(bad)
        assert exc.value.kind in (ErrorKind.MISSING, ErrorKind.UNAVAILABLE, ErrorKind.BAD_INPUT,
                                  ErrorKind.CAPACITY), stage
        after = _served(engine)
        assert after == before, stage
        run.steps(2)
        assert run.errors == [] and run.wrong == 0, stage
    engine.apply(cfg.replace(cache_rows=5000))   # and an accepted one still switches
    assert engine.cache.slots == 5000
    run.steps(2)
    run.check_clean(17 * TOKENS * 24 * 2)
    assert run.errors == []
    engine.close()


# A second process staging the same target (table seed 12) with small chunks, so that it writes while the
# engine steps; "ignore-lock" stages as a process that ignores the targets' locks would.
_RESTAGE = """
import sys
from slacktier.tables import page_writer
from slacktier.tables.stage import stage_synthetic
if sys.argv[1] == "ignore-lock":
    page_writer.lock_target = lambda fd, path, exclusive: None
stage_synthetic([sys.argv[2]], {1: 30_000, 14: 45_000}, 2, 12, overwrite=True, progress=False,
                manifest_path=sys.argv[3], chunk_bytes=4 * 4096, writers=1, fillers=1)
"""


def _sha(path: str) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def test_a_restage_from_another_process_never_has_its_rows_served(staged, o_direct_dir: Path) -> None:
    """The campaign's case (disk, verify_reads and check off: 5,757 wrong rows before): `slacktier stage` on a
    target an engine serves from is refused (rc 2, one line naming the target and the fix, nothing written);
    a stage that ignores the lock, racing the engine's steps from another process, never has a row served:
    every batch read after its header changed fails [target], and every row served is the old table's,
    compared with the old table's own source. Applying the new manifest then serves the new table exactly."""
    engine = StepEngine.from_config(control(staged, "disk", verify_reads=False, check=False,
                                            wait_timeout_ms=5000.0))
    run = Run(engine, staged, seed=9)
    run.steps(3)
    target, other = staged.targets[0], o_direct_dir / "other.manifest.json"
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1] / "src"))
    before = _sha(target)
    res = subprocess.run([sys.executable, "-m", "slacktier.cli", "stage", "--synthetic", "1=30000,14=45000",
                          "--ranks", "2", "--seed", "12", "--target", target, "--manifest", str(other),
                          "--overwrite", "--no-progress"], capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 2 and res.stderr.count("\n") == 1, res.stderr
    assert f"target {target} is in use" in res.stderr and "Fix: stop the engines that serve it" in res.stderr
    assert _sha(target) == before and not other.exists()
    run.steps(2)
    assert run.errors == [] and run.wrong == 0

    racer = subprocess.Popen([sys.executable, "-c", _RESTAGE, "ignore-lock", target, str(other)], env=env)
    while racer.poll() is None:
        run.step()
    assert racer.returncode == 0
    run.steps(10)
    assert run.wrong == 0 and run.lookups >= 15 * TOKENS * 24
    assert run.errors and {e.kind for e in run.errors} == {ErrorKind.TARGET}
    assert f"target {target} was staged again under this engine" in run.errors[-1].message
    new = Manifest.load(other)
    engine.apply(control(new, "disk", verify_reads=False, check=False, wait_timeout_ms=5000.0))
    fresh = Run(engine, new, seed=10)
    fresh.steps(5)
    assert fresh.errors == [] and fresh.wrong == 0
    engine.close()


# A checkpoint-staged table served with check on; the checkpoint is truncated under the engine. Run in its own
# process: a checker that mapped the checkpoint would die of SIGBUS there, which must read as a failure here.
_TRUNCATED_CHECKPOINT = """
import os, sys
import numpy as np, torch
from safetensors.torch import save_file
from slacktier.config import ControlFile, EngineConfig, TableConfig
from slacktier.engine import StepEngine
from slacktier.errors import SlackTierError
from slacktier.tables.stage import stage_checkpoint

d = sys.argv[1]
raw = np.random.default_rng(0).integers(0, 256, size=(3000, 264), dtype=np.uint8)
t = torch.from_numpy(raw)
save_file({"layers.1.engram.embed.weight": t[:, :256].contiguous().view(torch.float8_e4m3fn),
           "layers.1.engram.embed.scale": t[:, 256:].contiguous().view(torch.float8_e8m0fnu)}, d + "/ck.safetensors")
m = stage_checkpoint(d + "/ck.safetensors", [d + "/t.bin"], 1, progress=False)
engine = StepEngine.from_config(ControlFile(engine=EngineConfig(check=True, wait_timeout_ms=5000.0, cache_rows=100),
                                            tables=(TableConfig(layer=1, manifest=m.path, cache_share=1.0),)))

def step(row):
    ids = np.full((1, 1, 24), row, dtype=np.int64)
    engine.begin_step(ids)
    try:
        engine.gather(1)   # the checker compares every row with the checkpoint's, bit for bit
        print("served", row)
    except SlackTierError as exc:
        print("refused", row, exc.kind.value, exc.message)
    engine.end_step()

step(2999)
os.truncate(d + "/ck.safetensors", 60_000)   # the scales (24 kB) and ~140 rows of weights stay
step(2999)
step(1)
engine.close()
"""


def test_a_checkpoint_truncated_under_the_checker_is_an_error_not_sigbus(o_direct_dir: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1] / "src"))
    res = subprocess.run([sys.executable, "-c", _TRUNCATED_CHECKPOINT, str(o_direct_dir)], capture_output=True,
                         text=True, env=env, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    lines = res.stdout.splitlines()
    assert lines[0].startswith("served 2999")
    assert lines[1].startswith("refused 2999 io checkpoint ") and "ends inside rows 2999..2999" in lines[1]
    assert lines[2].startswith("served 1")   # rows before the cut are still checked and served


def test_the_thread_engine_leaves_no_thread_after_close_even_after_a_timeout(staged) -> None:
    """engine = "threads" with io_threads = 4: after a step whose reads timed out and exact steps after it,
    close() joins every thread it started (the campaign found two left alive)."""
    before = set(threading.enumerate())
    engine = StepEngine.from_config(control(staged, "held_disk", DiskOptions(engine="threads", io_threads=4),
                                            wait_timeout_ms=200.0))
    run = Run(engine, staged, seed=11)
    run.steps(2)
    HeldDisk.hold()
    try:
        run.step()
    finally:
        HeldDisk.release()
    assert run.errors and all(e.kind is ErrorKind.TIMEOUT for e in run.errors)
    run.errors.clear()
    run.steps(3)
    assert run.errors == [] and run.wrong == 0
    engine.close()
    assert [t.name for t in set(threading.enumerate()) - before if t.is_alive()] == []


def test_a_step_larger_than_memory_is_refused_before_allocating(staged) -> None:
    """500,000 tokens in one step would need ~200 GB of scratch and page buffers: refused [capacity] before any
    is allocated (the campaign's 2,000,000 tokens raised OSError from the pool's mmap), and the engine serves."""
    engine = StepEngine.from_config(control(staged, "disk", wait_timeout_ms=5000.0))
    run = Run(engine, staged, seed=12)
    run.steps(2)
    with pytest.raises(SlackTierError) as exc:
        engine.begin_step(np.zeros((500_000, len(ROWS), 24), dtype=np.int64))
    assert exc.value.kind is ErrorKind.CAPACITY and "steps of 500000 tokens" in exc.value.message
    assert "GiB needed" in exc.value.message and not engine.in_step
    run.steps(3)
    assert run.errors == [] and run.wrong == 0
    engine.close()


# Run without CAP_DAC_OVERRIDE / CAP_DAC_READ_SEARCH (root otherwise reads a mode-000 file): each of target,
# manifest and checksum file made unreadable in turn, for the disk and DRAM tiers; then a target made
# unreadable while an engine serves from it.
_UNREADABLE = """
import os, sys
import numpy as np
from slacktier.config import ControlFile, EngineConfig, TableConfig
from slacktier.engine import StepEngine
from slacktier.errors import SlackTierError
from slacktier.tables.codec import dequantize_bits
from slacktier.tables.stage import SyntheticSource, stage_synthetic

d = sys.argv[1]
m = stage_synthetic([d + "/t.bin"], {1: 3000}, 1, 0, progress=False)
def cfg(tier):
    return ControlFile(engine=EngineConfig(verify_reads=True, wait_timeout_ms=5000.0),
                       tables=(TableConfig(layer=1, manifest=m.path, source=tier),))
for path in (m.targets[0], m.path, str(m.crc_path())):
    for tier in ("disk", "dram"):
        os.chmod(path, 0)
        try:
            StepEngine.from_config(cfg(tier)).close()
            print("opened", tier, path)
        except SlackTierError as exc:
            print("refused", tier, exc.kind.value, path in exc.message, exc.message)
        os.chmod(path, 0o644)
truth = SyntheticSource(m.layout, 0)
for tier in ("disk", "dram"):
    engine = StepEngine.from_config(cfg(tier))
    os.chmod(m.targets[0], 0)
    wrong = failed = 0
    rng = np.random.default_rng(0)
    for _ in range(10):
        ids = rng.integers(0, 3000, (8, 1, 24))
        engine.begin_step(ids)
        try:
            got = engine.gather(1).reshape(-1, 256).view(torch.int16).numpy()
            want = dequantize_bits(truth.rows(1, ids.reshape(-1))).view(np.int16)
            wrong += int((got != want).any(axis=1).sum())
        except SlackTierError:
            failed += 1
        engine.end_step()
    print("serving", tier, failed, wrong)
    os.chmod(m.targets[0], 0o644)
    engine.close()
""".replace("import numpy as np", "import numpy as np, torch")


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None,
                    reason="drops root's file-permission override with setpriv")
def test_unreadable_files_are_named_and_a_target_made_unreadable_while_serving_keeps_serving(o_direct_dir) -> None:
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1] / "src"))
    res = subprocess.run(["setpriv", "--bounding-set=-dac_override,-dac_read_search", sys.executable, "-c",
                          _UNREADABLE, str(o_direct_dir)], capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    lines = res.stdout.splitlines()
    refused = [line for line in lines if line.startswith("refused")]
    assert len(refused) == 6, res.stdout
    assert all(" io True " in line and "Permission denied" in line for line in refused), res.stdout
    assert "serving disk 0 0" in lines and "serving dram 0 0" in lines   # open descriptors keep serving, exactly


_METRICS_DIR = """
import sys
from slacktier.config import ControlFile, EngineConfig, TableConfig
from slacktier.engine import StepEngine
from slacktier.errors import SlackTierError
try:
    StepEngine.from_config(ControlFile(engine=EngineConfig(metrics=True),
                                       tables=(TableConfig(layer=1, manifest=sys.argv[1], source="dram"),))).close()
    print("built")
except SlackTierError as exc:
    print("refused", exc.kind.value, exc.message)
"""


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None,
                    reason="drops root's file-permission override with setpriv")
@pytest.mark.parametrize("what", ["missing", "file", "read-only"])
def test_a_bad_prometheus_multiproc_dir_is_refused_naming_it(staged, tmp_path, what) -> None:
    """PROMETHEUS_MULTIPROC_DIR set (before prometheus_client is imported) to a missing folder, a file or a
    read-only folder: the engine is refused naming it, where the first step used to crash in prometheus_client."""
    where = tmp_path / "prom"
    if what == "file":
        where.write_text("")
    elif what == "read-only":
        where.mkdir(mode=0o555)
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1] / "src"),
               PROMETHEUS_MULTIPROC_DIR=str(where))
    res = subprocess.run(["setpriv", "--bounding-set=-dac_override,-dac_read_search", sys.executable, "-c",
                          _METRICS_DIR, str(staged.path)], capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.startswith(f"refused bad_input PROMETHEUS_MULTIPROC_DIR {where} "), res.stdout


@pytest.mark.parametrize("timeout_s", [float("inf"), float("nan"), 1e10, 0.0, -1.0, True])
def test_a_wait_timeout_the_platform_cannot_wait_is_refused_at_build(staged, timeout_s) -> None:
    with pytest.raises(SlackTierError) as exc:
        StepEngine.from_config(control(staged, "disk"), wait_timeout_s=timeout_s)
    assert exc.value.kind is ErrorKind.BAD_INPUT and "wait_timeout_s" in exc.value.message


@pytest.mark.parametrize("value", ["inf", "nan", "-inf", "1e13", "0"])
def test_a_wait_timeout_the_platform_cannot_wait_is_refused_in_the_control_file(staged, tmp_path, value) -> None:
    path = tmp_path / "c.toml"
    path.write_text(f'[engine]\nwait_timeout_ms = {value}\n[[table]]\nlayer = 1\nmanifest = "{staged.path}"\n')
    with pytest.raises(SlackTierError) as exc:
        load_control(path)
    assert exc.value.kind is ErrorKind.BAD_INPUT and "wait_timeout_ms" in exc.value.message
