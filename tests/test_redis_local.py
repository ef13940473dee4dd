"""The local Redis Cluster harness against real redis-server nodes: auth, ACLs, failover, restart, pause, stop.

The shared cluster (`redis_cluster`, 3 masters + 3 replicas) is broken on
purpose only by the last test that uses it (failover), which puts it back.
"""

from __future__ import annotations

import os
import shutil
import socket
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import redis
from redis.backoff import NoBackoff
from redis.cluster import LoadBalancingStrategy, RedisCluster
from redis.retry import Retry

from slacktier.testing.redis_cluster import LocalClusterError, LocalRedisCluster, tls_available

pytestmark = pytest.mark.skipif(
    shutil.which("redis-server") is None,
    reason="redis-server binary not found (apt-get install -y redis-server; scripts/test.sh does)")


def _cluster_client(cluster: LocalRedisCluster, user: str = "reader", **kwargs: object) -> RedisCluster:
    """redis-py's cluster client as `user` ("reader" or "loader"), seeded at the cluster's first node."""
    who = cluster.reader if user == "reader" else cluster.loader
    tls = {"ssl": True, "ssl_ca_certs": str(cluster.tls_ca_file)} if cluster.tls else {}
    return RedisCluster(host="127.0.0.1", port=cluster.ports[0], username=who.name, password=who.password,
                        socket_timeout=2.0, **tls, **kwargs)


def _eventually(check: Callable[[], bool], timeout_s: float = 5.0) -> None:
    """Until `check()` is true (a Redis error counts as not yet)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if check():
                return
        except redis.RedisError:
            pass
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


def _pipelined_gets(client: RedisCluster, keys: list[str]) -> list[bytes | None]:
    """One cluster pipeline of GETs (redis-py refuses MGET in a cluster pipeline)."""
    pipe = client.pipeline()
    for key in keys:
        pipe.get(key)
    return pipe.execute()


def _replicated(cluster: LocalRedisCluster, master: int) -> bool:
    """Whether every replica of `master` has acknowledged all it was sent."""
    info = cluster.client(master).info("replication")
    offsets = [info[k]["offset"] for k in info if k.startswith("slave")]
    return bool(offsets) and all(o == info["master_repl_offset"] for o in offsets)


def _write(cluster: LocalRedisCluster, prefix: str, n: int) -> dict[str, bytes]:
    """`n` keys spread over all slots, written by the loader; returns key -> value."""
    values = {f"{prefix}:{i}": f"v{i}".encode() * 10 for i in range(n)}
    with _cluster_client(cluster, "loader") as loader:
        loader.mset_nonatomic(values)
    return values


def _keys_on(cluster: LocalRedisCluster, keys: list[str], master: int) -> list[str]:
    with _cluster_client(cluster) as reader:
        return [k for k in keys if reader.get_node_from_key(k).port == master]


def test_cluster_starts_ok(redis_cluster: LocalRedisCluster) -> None:
    masters, replicas = redis_cluster.masters(), redis_cluster.replicas()
    assert masters == redis_cluster.ports[:3]
    assert sorted(replicas) == sorted(redis_cluster.ports[3:]) and sorted(replicas.values()) == sorted(masters)
    assert redis_cluster.seed_url == f"redis://127.0.0.1:{redis_cluster.ports[0]}"
    for port in redis_cluster.ports:
        assert redis_cluster.client(port).cluster("INFO")["cluster_state"] == "ok"
    path = redis_cluster.secret_file(redis_cluster.reader)
    assert path.read_text() == redis_cluster.reader.password and (path.stat().st_mode & 0o777) == 0o600


def test_reader_reads_but_cannot_write(redis_cluster: LocalRedisCluster) -> None:
    same_slot = {f"{{page}}:{i}": bytes([i]) * 4096 for i in range(8)}
    spread = _write(redis_cluster, "r", 40)
    with _cluster_client(redis_cluster, "loader") as loader:
        loader.mset(same_slot)
    with _cluster_client(redis_cluster) as reader:
        assert reader.ping()
        assert reader.mget(list(same_slot)) == list(same_slot.values())
        assert reader.exists(*same_slot) == 8 and reader.strlen("{page}:3") == 4096
        assert _pipelined_gets(reader, list(spread)) == list(spread.values())
        for verb in (lambda: reader.set("r:0", b"x"), lambda: reader.delete("r:0"),
                     lambda: reader.execute_command("FLUSHALL", target_nodes=RedisCluster.PRIMARIES)):
            with pytest.raises(redis.exceptions.NoPermissionError):
                verb()
    for strategy in (LoadBalancingStrategy.ROUND_ROBIN_REPLICAS, LoadBalancingStrategy.RANDOM_REPLICA):
        with _cluster_client(redis_cluster, load_balancing_strategy=strategy) as from_replicas:
            # replication is asynchronous: a replica may lag the loader's writes for a moment
            _eventually(lambda: from_replicas.mget(list(same_slot)) == list(same_slot.values()))
            _eventually(lambda: _pipelined_gets(from_replicas, list(spread)) == list(spread.values()))
    # deprecated in favour of load_balancing_strategy, yet mget_nonatomic reads from replicas only with it
    with warnings.catch_warnings(action="ignore", category=DeprecationWarning), \
            _cluster_client(redis_cluster, read_from_replicas=True) as from_replicas:
        _eventually(lambda: from_replicas.mget_nonatomic(list(spread)) == list(spread.values()))
    with _cluster_client(redis_cluster) as reader:
        assert reader.get("r:0") == spread["r:0"]  # untouched by the refused writes


def test_no_or_wrong_credentials_are_refused(redis_cluster: LocalRedisCluster) -> None:
    port = redis_cluster.ports[0]
    once = Retry(NoBackoff(), 0)  # redis-py retries an AuthenticationError (a ConnectionError) by default
    with pytest.raises(redis.AuthenticationError):
        redis.Redis(port=port, socket_timeout=2, retry=once).get("x")
    with pytest.raises(redis.AuthenticationError):
        redis.Redis(port=port, username=redis_cluster.reader.name, password="wrong", socket_timeout=2,
                    retry=once).get("x")
    with pytest.raises(redis.exceptions.RedisClusterException, match="(?i)authenticat"):
        RedisCluster(host="127.0.0.1", port=port, socket_timeout=2)


def test_loader_writes(redis_cluster: LocalRedisCluster) -> None:
    with _cluster_client(redis_cluster, "loader") as loader:
        assert loader.set("t0:identity", b'{"state": "loading"}')
        loader.mset({"{t0}:1": b"a", "{t0}:2": b"b"})
        assert loader.delete("t0:identity") == 1
        with pytest.raises(redis.exceptions.NoPermissionError):
            loader.execute_command("FLUSHALL", target_nodes=RedisCluster.PRIMARIES)
    with _cluster_client(redis_cluster) as reader:
        assert reader.mget(["{t0}:1", "{t0}:2"]) == [b"a", b"b"] and reader.get("t0:identity") is None


def test_pause_stalls_reads(redis_cluster: LocalRedisCluster) -> None:
    port = redis_cluster.masters()[0]
    reader = redis_cluster.client(port, admin=False, socket_timeout_s=0.2)
    assert reader.ping()
    redis_cluster.pause(port, 700)
    with pytest.raises(redis.TimeoutError):   # the 200 ms socket timeout, well inside the 700 ms pause
        reader.ping()
    # a client that waits longer is answered when the pause ends: the node stalled, it did not fail
    assert redis_cluster.client(port, admin=False, socket_timeout_s=30).ping()


def test_no_secret_in_node_logs(redis_cluster: LocalRedisCluster) -> None:
    logs = "".join(p.read_text(errors="replace") for p in redis_cluster.workdir.glob("node-*/*.log"))
    assert logs and redis_cluster.reader.password not in logs and redis_cluster.loader.password not in logs
    assert redis_cluster.reader.password not in repr(redis_cluster.reader)


def test_failover_keeps_written_keys(redis_cluster: LocalRedisCluster) -> None:
    values = _write(redis_cluster, "f", 200)
    victim = redis_cluster.masters()[1]
    mine = _keys_on(redis_cluster, list(values), victim)
    others = [k for k in values if k not in mine]
    heir = next(r for r, m in redis_cluster.replicas().items() if m == victim)
    _eventually(lambda: _replicated(redis_cluster, victim))
    reader = _cluster_client(redis_cluster)
    reader.mget_nonatomic(others)  # connections to the survivors, opened before the crash

    redis_cluster.kill(victim)
    # other slots keep serving while the lost master's slots wait for their replica (full coverage not required)
    assert reader.mget_nonatomic(others) == [values[k] for k in others]
    assert redis_cluster.wait_failover(victim) == heir
    assert heir in redis_cluster.masters() and victim not in redis_cluster.masters()
    with _cluster_client(redis_cluster) as fresh:
        assert fresh.mget_nonatomic(mine) == [values[k] for k in mine]
    assert redis_cluster.client(heir, admin=False).get(mine[0]) == values[mine[0]]

    redis_cluster.restart(victim)  # back as a replica of its heir
    redis_cluster.wait_ok()
    # A restarted old master first rejoins as a master without slots, then learns it was replaced: the view
    # takes a moment to list it as its heir's replica (a clean run once read it too early).
    _eventually(lambda: redis_cluster.replicas().get(victim) == heir, timeout_s=30)
    assert redis_cluster.replicas()[victim] == heir


def test_restart_before_failover_comes_back_empty(tmp_path: Path) -> None:
    with LocalRedisCluster(tmp_path, masters=3, replicas=1, node_timeout_ms=5000) as cluster:
        values = _write(cluster, "e", 100)
        victim = cluster.masters()[1]
        mine = _keys_on(cluster, list(values), victim)
        cluster.kill(victim)
        cluster.restart(victim, empty=True)
        cluster.wait_ok()
        assert victim in cluster.masters()
        with _cluster_client(cluster) as reader:
            assert reader.mget_nonatomic(mine) == [None] * len(mine)
            others = [k for k in values if k not in mine]
            assert reader.mget_nonatomic(others) == [values[k] for k in others]
        pids = list(cluster.pids.values())
    assert all(not Path(f"/proc/{pid}").exists() for pid in pids)
    cluster.stop()  # twice is fine


def test_single_node_cluster_and_stop(tmp_path: Path) -> None:
    cluster = LocalRedisCluster(tmp_path, masters=1, replicas=0).start()
    assert cluster.start() is cluster
    assert cluster.masters() == cluster.ports and cluster.replicas() == {}
    with _cluster_client(cluster, "loader") as loader:
        loader.set("a", b"1")
    with _cluster_client(cluster) as reader:
        assert reader.get("a") == b"1"
    pid = cluster.pids[cluster.ports[0]]
    cluster.stop()
    assert not Path(f"/proc/{pid}").exists()
    cluster.stop()


def test_start_failure_shows_log_without_secrets(tmp_path: Path) -> None:
    with socket.socket() as taken:
        for port in range(20000, 30000, 37):  # base_port needs room for its bus port (+10000)
            try:
                taken.bind(("127.0.0.1", port))
                break
            except OSError:
                continue
        taken.listen()
        cluster = LocalRedisCluster(tmp_path, masters=1, replicas=0, base_port=port)
        with pytest.raises(LocalClusterError) as failed:
            cluster.start()
    text = str(failed.value)
    assert isinstance(failed.value, RuntimeError) and "log tail" in text and "in use" in text
    assert cluster.reader.password not in text and not any(Path(f"/proc/{p}").exists() for p in cluster.pids.values())


@pytest.mark.skipif(not tls_available(), reason="redis-server built without TLS")
def test_tls_cluster(tmp_path: Path) -> None:
    with LocalRedisCluster(tmp_path, masters=1, replicas=1, tls=True) as cluster:
        assert cluster.seed_url.startswith("rediss://") and cluster.tls_ca_file and cluster.tls_ca_file.exists()
        assert os.stat(cluster.tls_key_file).st_mode & 0o777 == 0o600
        with _cluster_client(cluster, "loader") as loader:
            loader.set("k", b"over tls")
        with _cluster_client(cluster, load_balancing_strategy=LoadBalancingStrategy.ROUND_ROBIN_REPLICAS) as reader:
            _eventually(lambda: reader.get("k") == b"over tls")  # from the replica, over TLS replication
        assert cluster.client(cluster.ports[0], admin=False).get("k") == b"over tls"
        with pytest.raises(redis.ConnectionError):  # plain text is not spoken
            redis.Redis(port=cluster.ports[0], socket_timeout=1, retry=Retry(NoBackoff(), 0)).ping()


def test_a_relative_workdir_works(tmp_path, monkeypatch):
    """Nodes run with their own folder as cwd: a relative workdir must not be resolved twice (a bug once)."""
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server binary not found")
    monkeypatch.chdir(tmp_path)
    with LocalRedisCluster(Path("rel") / "cluster", masters=1, replicas=0) as cluster:
        assert cluster.masters() == cluster.ports[:1]
