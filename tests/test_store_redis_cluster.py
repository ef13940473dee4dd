"""The Redis tier in cluster mode against a real local cluster (3 masters, 3 replicas, ACLs on): exact pages, the
loader's generation protocol, refusal without credentials, and many serving processes reading one copy.

Faults with >= 1M checked lookups are in test_faults.py."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import redis

from slacktier.config import RedisOptions
from slacktier.errors import ErrorKind, SlackTierError
from slacktier.store.base import PageBufferPool, PageReads
from slacktier.store.redis.keys import (COMPLETE, LOADING, VALUE_BYTES, default_prefix, gen_key, identity_key,
                                        page_key)
from slacktier.store.redis.loader import load_manifest
from slacktier.store.redis.source import RedisSource
from slacktier.store.registry import verify_identity
from slacktier.testing.store import stage_synthetic

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def options(cluster, user, **kw) -> RedisOptions:
    env = f"ST_TEST_PW_{user.name.replace('-', '_').upper()}"
    os.environ[env] = user.password
    return RedisOptions(mode="cluster", url=cluster.seed_url, username=user.name, password_env=env, **kw)


def crcs_of(manifest) -> list[np.ndarray]:
    return manifest.region_checksums()


@pytest.fixture(scope="module")
def table(tmp_path_factory):
    return stage_synthetic(tmp_path_factory.mktemp("cluster-table"), layers=(1, 14), ranks=2, rows=2000)


def read_all(src: RedisSource, staged, n: int = 600, seed: int = 0) -> tuple[np.ndarray, np.ndarray, bool]:
    rng = np.random.default_rng(seed)
    region = rng.integers(0, len(staged.specs), n).astype(np.int32)
    page = np.array([rng.integers(0, staged.specs[r].pages) for r in region], dtype=np.int64)
    pool = PageBufferPool(n)
    src.wait(src.submit(PageReads(region, page, np.arange(n, dtype=np.int32)), pool), timeout_s=30)
    exact = all(np.array_equal(pool.pages[i], staged.pages[region[i]][page[i]]) for i in range(n))
    return region, page, exact


def test_pages_read_from_the_cluster_are_exact_and_a_second_load_is_a_no_op(redis_cluster, table) -> None:
    loader = options(redis_cluster, redis_cluster.loader)
    first = load_manifest(loader, table.manifest, tag_buckets=16)   # the first test of the module loads the table
    assert first.written == first.groups == 4 * 16 and first.pages == sum(r.pages for r in table.specs)
    again = load_manifest(loader, table.manifest, tag_buckets=16)
    assert again.written == 0 and again.pages == 0 and again.generation == first.generation
    for replicas in (False, True):
        src = RedisSource(table.specs, options(redis_cluster, redis_cluster.reader, read_from_replicas=replicas),
                                 page_crc32c=crcs_of(table.manifest), identity=table.manifest.identity)
        try:
            assert src.tag_buckets == 16
            for seed in range(3):
                assert read_all(src, table, seed=seed)[2]
        finally:
            src.close()
    verify_identity("redis", table.specs, options(redis_cluster, redis_cluster.reader),
                    table.manifest.identity)


def test_keys_share_a_slot_within_a_group_and_spread_over_every_master(redis_cluster, table) -> None:
    from redis.crc import key_slot
    pfx = default_prefix(table.manifest.identity)
    assert key_slot(page_key(pfx, 1, 0, 3, 16)) == key_slot(page_key(pfx, 1, 0, 19, 16)) == \
        key_slot(gen_key(pfx, 1, 0, 3))
    assert page_key("t0", 1, 3, 76, 64) == b"{t0:1:3:12}:76"
    load_manifest(options(redis_cluster, redis_cluster.loader), table.manifest, tag_buckets=16)
    owners = set()
    client = redis.cluster.RedisCluster(host="127.0.0.1", port=redis_cluster.ports[0],
                                        username=redis_cluster.reader.name, password=redis_cluster.reader.password)
    try:
        for r in table.specs:
            for g in range(16):
                owners.add(client.nodes_manager.get_node_from_slot(key_slot(gen_key(pfx, r.layer, r.rank, g))).name)
        value = client.get(page_key(pfx, 1, 0, 0, 16))
    finally:
        client.close()
    assert len(owners) == len(redis_cluster.masters())
    assert len(value) == VALUE_BYTES
    assert int.from_bytes(value[-4:], "little") == int(crcs_of(table.manifest)[0][0])


def test_without_credentials_or_with_the_reader_as_loader_it_is_refused(redis_cluster, table) -> None:
    anonymous = RedisOptions(mode="cluster", url=redis_cluster.seed_url)
    with pytest.raises(SlackTierError) as info:
        RedisSource(table.specs, anonymous, identity=table.manifest.identity)
    assert info.value.kind is ErrorKind.UNAVAILABLE
    assert "wants credentials (user 'default' sent no password)" in info.value.message
    os.environ["ST_TEST_WRONG"] = "not-the-password"
    wrong = RedisOptions(mode="cluster", url=redis_cluster.seed_url, username=redis_cluster.reader.name,
                         password_env="ST_TEST_WRONG")
    with pytest.raises(SlackTierError) as info:
        RedisSource(table.specs, wrong, identity=table.manifest.identity)
    assert info.value.kind is ErrorKind.UNAVAILABLE and "not-the-password" not in f"{info.value} {info.value.fix}"
    # issue 34: said "cannot reach Redis Cluster ... start the cluster there"
    assert f"refused the credentials of user {redis_cluster.reader.name!r}" in info.value.message
    assert "cannot reach" not in info.value.message and "ACL user" in info.value.fix
    with pytest.raises(SlackTierError) as info:
        load_manifest(options(redis_cluster, redis_cluster.reader), table.manifest, prefix="reader-may-not")
    assert info.value.kind is ErrorKind.UNAVAILABLE and "may not load" in str(info.value)


def _half_load(seed_url: str, user: str, password: str, manifest_path: str, prefix: str, groups_in) -> None:
    """Run in a child process: load a table one group at a time; once the first region's groups are in (the
    loader asks for the second region's pages), set `groups_in` and block until the parent kills the process."""
    import threading

    from slacktier.store.dram import load_region_pages
    from slacktier.store.redis.loader import load_table
    from slacktier.tables.manifest import Manifest
    manifest = Manifest.load(manifest_path)
    os.environ["ST_CHILD_PW"] = password
    opts = RedisOptions(mode="cluster", url=seed_url, username=user, password_env="ST_CHILD_PW")
    asked = [0]

    def pages_then_block(region):   # one worker: region 1's pages are asked for after region 0's 16 groups
        asked[0] += 1
        if asked[0] == 2:
            groups_in.set()
            threading.Event().wait()   # never set: SIGKILL ends it here
        return load_region_pages(region)
    load_table(opts, manifest.runtime_regions(), manifest.identity, prefix=prefix, workers=1,
               page_crc32c=manifest.region_checksums(), tag_buckets=16, read_pages=pages_then_block)


def test_a_loader_killed_midway_is_never_served_and_a_rerun_resumes(redis_cluster, table, tmp_path) -> None:
    prefix = "killed"
    ctx = mp.get_context("spawn")
    groups_in = ctx.Event()
    child = ctx.Process(
        target=_half_load, args=(redis_cluster.seed_url, redis_cluster.loader.name, redis_cluster.loader.password,
                                 str(table.manifest.path), prefix, groups_in))
    child.start()
    reader = options(redis_cluster, redis_cluster.reader, prefix=prefix)
    client = redis.cluster.RedisCluster(host="127.0.0.1", port=redis_cluster.ports[0],
                                        username=redis_cluster.reader.name, password=redis_cluster.reader.password)
    try:
        loaded = groups_in.wait(timeout=120)   # a bound on a hang, not a speed check
        os.kill(child.pid, signal.SIGKILL)
        child.join()
        assert loaded, f"the loader never finished the first region (exit code {child.exitcode})"
        done = sum(client.get(gen_key(prefix, r.layer, r.rank, g)) is not None for r in table.specs
                   for g in range(16))
        assert done == 16   # killed before the second region: exactly the first region's 16 groups are marked done
        state = json.loads(client.get(identity_key(prefix)))["state"]
    finally:
        client.close()
    assert state == LOADING
    with pytest.raises(SlackTierError) as info:
        RedisSource(table.specs, reader, identity=table.manifest.identity)
    assert info.value.kind is ErrorKind.TARGET and "never served" in str(info.value)
    report = load_manifest(options(redis_cluster, redis_cluster.loader), table.manifest, prefix=prefix,
                           tag_buckets=16)
    assert 0 < report.written < report.groups        # resumed: the groups finished before the kill are kept
    src = RedisSource(table.specs, reader, page_crc32c=crcs_of(table.manifest), identity=table.manifest.identity)
    try:
        assert read_all(src, table)[2]
    finally:
        src.close()


def test_a_table_of_another_staging_run_or_tag_layout_is_refused(redis_cluster, table, tmp_path) -> None:
    other = stage_synthetic(tmp_path / "other", layers=(1, 14), ranks=2, rows=2000, seed=99)
    load_manifest(options(redis_cluster, redis_cluster.loader), other.manifest, prefix="shared-prefix")
    with pytest.raises(SlackTierError) as info:
        RedisSource(table.specs, options(redis_cluster, redis_cluster.reader, prefix="shared-prefix"),
                    identity=table.manifest.identity)
    assert info.value.kind is ErrorKind.TARGET
    with pytest.raises(SlackTierError) as info:
        RedisSource(table.specs, options(redis_cluster, redis_cluster.reader, prefix="nothing-here"),
                    identity=table.manifest.identity)
    assert info.value.kind is ErrorKind.MISSING


def _instance(seed_url: str, user: str, password: str, manifest_path: str, steps: int, out) -> None:
    """One serving process: its own engine and row cache over the shared cluster copy, the checker on."""
    from slacktier.config import ControlFile, EngineConfig, TableConfig
    from slacktier.engine import StepEngine
    os.environ["ST_INST_PW"] = password
    opts = RedisOptions(mode="cluster", url=seed_url, username=user, password_env="ST_INST_PW")
    cfg = ControlFile(engine=EngineConfig(cache_rows=2000, check=True, verify_reads=True), tables=tuple(
        TableConfig(layer=layer, manifest=manifest_path, source="redis", options=opts,
                    cache_share=0.5, order=i) for i, layer in enumerate((1, 14))))
    engine = StepEngine.from_config(cfg)
    rng = np.random.default_rng(os.getpid())
    try:
        for _ in range(steps):
            ids = rng.integers(0, 4000, (32, 2, 24))
            engine.begin_step(ids)
            for layer in engine.ids_layers:
                engine.gather(layer)
            engine.end_step()
        out.put(("ok", sum(c.mismatches for c in engine.totals.values())))
    except Exception as exc:   # reported to the parent, which fails the test with it
        out.put(("error", repr(exc)))
    finally:
        engine.close()


def test_four_serving_processes_read_one_cluster_copy_exactly(redis_cluster, table) -> None:
    load_manifest(options(redis_cluster, redis_cluster.loader), table.manifest)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_instance, args=(redis_cluster.seed_url, redis_cluster.reader.name,
                                                 redis_cluster.reader.password, str(table.manifest.path), 20, out))
             for _ in range(4)]
    for p in procs:
        p.start()
    results = [out.get(timeout=240) for _ in procs]
    for p in procs:
        p.join(timeout=30)
    assert results == [("ok", 0)] * 4, results


def test_a_corrupted_or_foreign_value_is_caught_when_read(redis_cluster, table) -> None:
    loader = options(redis_cluster, redis_cluster.loader)
    load_manifest(loader, table.manifest, prefix="corrupt", tag_buckets=16)
    src = RedisSource(table.specs, options(redis_cluster, redis_cluster.reader, prefix="corrupt"),
                      page_crc32c=crcs_of(table.manifest), identity=table.manifest.identity)
    client = redis.cluster.RedisCluster(host="127.0.0.1", port=redis_cluster.ports[0],
                                        username=redis_cluster.loader.name, password=redis_cluster.loader.password)
    r = table.specs[1]
    key = page_key("corrupt", r.layer, r.rank, 9, 16)
    good = client.get(key)
    pool = PageBufferPool(2)
    reads = PageReads(np.array([0, 1], np.int32), np.array([3, 9], np.int64), np.array([0, 1], np.int32))
    try:
        # One bit of the page flipped, its stored CRC32C kept: the page's own checksum differs from the manifest's.
        client.set(key, bytes([good[0] ^ 1]) + good[1:])
        with pytest.raises(SlackTierError) as info:
            src.wait(src.submit(reads, pool))
        assert info.value.kind is ErrorKind.CHECKSUM and (info.value.layer, info.value.page) == (r.layer, 9)
        # Another table's page under this key (intact, with its own CRC32C): refused by the stored CRC32C.
        other = bytes(4096) + (0).to_bytes(4, "little")
        client.set(key, other)
        with pytest.raises(SlackTierError) as info:
            src.wait(src.submit(reads, pool))
        assert info.value.kind is ErrorKind.CHECKSUM and "another load" in str(info.value)
        client.set(key, good)
        src.wait(src.submit(reads, pool))
        assert np.array_equal(pool.pages[1], table.pages[1][9])
    finally:
        client.close()
        src.close()


def test_the_load_verb_loads_then_says_it_is_complete(redis_cluster, table, capsys) -> None:
    from slacktier.cli import main
    os.environ["ST_CLI_LOADER_PW"] = redis_cluster.loader.password
    argv = ["load", str(table.manifest.path), "--url", redis_cluster.seed_url, "--mode", "cluster",
            "--user", redis_cluster.loader.name, "--password-env", "ST_CLI_LOADER_PW", "--prefix", "cli",
            "--tag-buckets", "8", "--no-progress"]
    assert main(argv) == 0
    assert "loaded 32 of 32 page groups" in capsys.readouterr().out
    assert main(argv) == 0
    assert "already complete" in capsys.readouterr().out
    anonymous = ["load", str(table.manifest.path), "--url", redis_cluster.seed_url, "--mode", "cluster",
                 "--prefix", "cli2", "--no-progress"]
    assert main(anonymous) == 2   # no credentials: refused, in one line
    assert "credentials" in capsys.readouterr().err
    standalone = argv[:4] + argv[6:]   # no --mode: a cluster node read as one server is refused, naming the key
    assert main(standalone) == 2
    assert 'mode = "cluster"' in capsys.readouterr().err
    src = RedisSource(table.specs, options(redis_cluster, redis_cluster.reader, prefix="cli"),
                      page_crc32c=crcs_of(table.manifest), identity=table.manifest.identity)
    try:
        assert src.tag_buckets == 8 and read_all(src, table)[2]
    finally:
        src.close()
    creds = argv[2:8]   # --url, --mode, --user; the loading user may SCAN every master for identity records
    assert main(["load", "--list", *creds, "--password-env", "ST_CLI_LOADER_PW"]) == 0
    out = capsys.readouterr().out
    assert f"'cli': table {table.manifest.source_digest}" in out and "32 page groups" not in out
    assert main(["load", "--remove", "cli", *creds, "--password-env", "ST_CLI_LOADER_PW"]) == 0
    assert capsys.readouterr().out.startswith("removed 'cli'")
    assert main(["load", "--list", *creds, "--password-env", "ST_CLI_LOADER_PW"]) == 0
    assert "'cli'" not in capsys.readouterr().out


def test_reads_stay_exact_while_a_slot_is_migrated_to_another_node(redis_cluster, table) -> None:
    """Resharding mid-run: ASK while the slot's keys are split between two nodes (TRYAGAIN for a split MGET, then
    key by key), MOVED once the slot is given away; every read is exact and nothing is restarted."""
    from redis.crc import key_slot
    load_manifest(options(redis_cluster, redis_cluster.loader), table.manifest, prefix="moving", tag_buckets=16)
    src = RedisSource(table.specs, options(redis_cluster, redis_cluster.reader, prefix="moving"),
                      page_crc32c=crcs_of(table.manifest), identity=table.manifest.identity)
    r = table.specs[2]
    pages_of_group = np.arange(5, r.pages, 16)          # group 5 of region 2: one slot
    slot = key_slot(gen_key("moving", r.layer, r.rank, 5))
    keys = [page_key("moving", r.layer, r.rank, int(p), 16) for p in pages_of_group] + \
        [gen_key("moving", r.layer, r.rank, 5)]
    pool = PageBufferPool(len(pages_of_group) + 50)

    def read_group_and_more() -> None:
        extra = np.arange(50) % table.specs[0].pages
        region = np.r_[np.full(len(pages_of_group), 2, np.int32), np.zeros(50, np.int32)]
        page = np.r_[pages_of_group, extra].astype(np.int64)
        src.wait(src.submit(PageReads(region, page, np.arange(region.shape[0], dtype=np.int32)), pool), timeout_s=30)
        for i in range(region.shape[0]):
            assert np.array_equal(pool.pages[i], table.pages[region[i]][page[i]])

    try:
        read_group_and_more()
        owner = redis_cluster.owner(slot)
        target = next(p for p in redis_cluster.masters() if p != owner)
        redis_cluster.begin_migration(slot, target)
        read_group_and_more()                                             # nothing moved yet: served as before
        redis_cluster.migrate_keys(slot, owner, target, keys[: len(keys) // 2])
        read_group_and_more()                                             # split: TRYAGAIN, then ASK per key
        redis_cluster.migrate_keys(slot, owner, target, keys[len(keys) // 2:])
        read_group_and_more()                                             # all moved: ASK
        redis_cluster.end_migration(slot, target)
        read_group_and_more()                                             # MOVED, then the new map
        read_group_and_more()
        assert redis_cluster.owner(slot) == target
    finally:
        src.close()


def test_tls_cluster_serves_exact_pages_and_a_cluster_gone_fails_within_the_timeout(tmp_path, table) -> None:
    """Over TLS (rediss://, the CA file): exact pages. Then every node stopped: the open source fails its batch
    with IO within about socket_timeout_ms, and a new source is refused with UNAVAILABLE."""
    import shutil

    from slacktier.testing.redis_cluster import LocalRedisCluster, tls_available
    if shutil.which("redis-server") is None or not tls_available():
        pytest.skip("redis-server with TLS not available")
    with LocalRedisCluster(tmp_path / "tls", masters=3, replicas=0, tls=True) as cluster:
        loader = options(cluster, cluster.loader, tls_ca_file=str(cluster.tls_ca_file))
        load_manifest(loader, table.manifest, tag_buckets=8)
        reader = options(cluster, cluster.reader, tls_ca_file=str(cluster.tls_ca_file), socket_timeout_ms=500)
        assert reader.url.startswith("rediss://")
        src = RedisSource(table.specs, reader, page_crc32c=crcs_of(table.manifest),
                          identity=table.manifest.identity)
        try:
            assert read_all(src, table)[2]
            cluster.stop()
            with pytest.raises(SlackTierError) as info:
                read_all(src, table)
            assert info.value.kind is ErrorKind.IO
        finally:
            src.close()
        with pytest.raises(SlackTierError) as info:
            RedisSource(table.specs, reader, identity=table.manifest.identity)
        assert info.value.kind is ErrorKind.UNAVAILABLE


@pytest.mark.parametrize("pages,tag_buckets", [(1, 64), (2, 64), (3, 64), (5, 64), (17, 16), (63, 64), (64, 64),
                                               (65, 64), (100, 64), (1, 16384), (40, 16384)])
def test_a_load_of_any_region_size_serves_exactly(redis_cluster, tmp_path, pages, tag_buckets) -> None:
    """Regions from 1 page up, tag_buckets above and below their pages: the loader records at most the smallest
    region's pages as its groups, so a load that returned always serves (issue 33: more buckets than pages
    left groups no load could complete, and a rerun said complete); every page read back is exact."""
    staged = stage_synthetic(tmp_path / "small", layers=(1,), ranks=2, rows=pages * 15, seed=pages)
    prefix = f"small-{pages}-{tag_buckets}"
    loader = options(redis_cluster, redis_cluster.loader)
    first = load_manifest(loader, staged.manifest, prefix=prefix, tag_buckets=tag_buckets)
    assert first.tag_buckets == min(tag_buckets, pages) and first.written == first.groups == 2 * first.tag_buckets
    assert first.pages == 2 * pages
    again = load_manifest(loader, staged.manifest, prefix=prefix, tag_buckets=tag_buckets)
    assert again.written == 0 and again.generation == first.generation
    src = RedisSource(staged.specs, options(redis_cluster, redis_cluster.reader, prefix=prefix),
                      page_crc32c=crcs_of(staged.manifest), identity=staged.manifest.identity)
    try:
        assert read_all(src, staged, n=4 * pages)[2]
    finally:
        src.close()


@pytest.mark.parametrize("tag_buckets", [0, -1, 16385])
def test_a_tag_bucket_count_outside_the_slots_is_refused(redis_cluster, table, tag_buckets) -> None:
    with pytest.raises(SlackTierError) as exc:
        load_manifest(options(redis_cluster, redis_cluster.loader), table.manifest, prefix="never",
                      tag_buckets=tag_buckets)
    assert exc.value.kind is ErrorKind.BAD_INPUT and "tag_buckets" in exc.value.message


def test_a_cluster_read_as_one_server_is_refused_naming_the_mode(redis_cluster, table, monkeypatch) -> None:
    """mode = "standalone" on a cluster node: refused at open (CLUSTER INFO says cluster_state); and for a user not
    allowed CLUSTER INFO, at the first read a MOVED names the mode instead of being retried until the timeout."""
    load_manifest(options(redis_cluster, redis_cluster.loader), table.manifest, prefix="one-node", tag_buckets=16)
    standalone = options(redis_cluster, redis_cluster.reader, prefix="one-node")
    standalone = RedisOptions(**{**{f: getattr(standalone, f) for f in standalone.__struct_fields__},
                                 "mode": "standalone"})
    with pytest.raises(SlackTierError) as info:
        RedisSource(table.specs, standalone, identity=table.manifest.identity)
    assert info.value.kind is ErrorKind.BAD_INPUT and 'mode = "cluster"' in info.value.fix
    user, password = "slacktier-no-info", "no-info-pw"
    for port in redis_cluster.ports:   # the reader's rules less CLUSTER INFO, on every node
        redis_cluster.client(port).execute_command("ACL", "SETUSER", user, "on", f">{password}", "resetkeys", "%R~*",
                                                   "-@all", "+ping", "+get", "+mget", "+exists")
    monkeypatch.setenv("ST_TEST_NO_INFO_PW", password)
    blind = RedisOptions(url=redis_cluster.seed_url, username=user, password_env="ST_TEST_NO_INFO_PW",
                         prefix="one-node")
    pages = np.arange(table.specs[0].pages, dtype=np.int64)   # every group: most live on other nodes than the url's

    def open_and_read() -> None:   # MOVED at open (the identity or a generation key elsewhere) or at the read
        src = RedisSource(table.specs[:1], blind, identity=table.manifest.identity)
        try:
            src.wait(src.submit(PageReads(np.zeros(pages.shape[0], np.int32), pages,
                                          np.arange(pages.shape[0], dtype=np.int32)), PageBufferPool(pages.shape[0])))
        finally:
            src.close()
    with pytest.raises(SlackTierError) as info:
        open_and_read()
    assert info.value.kind is ErrorKind.BAD_INPUT and 'mode = "cluster"' in info.value.fix, info.value
