"""A local authenticated Redis Cluster for trying the redis tier, tests and benchmarks: real `redis-server` nodes on
loopback.

Why Debian's `redis-server` (apt-get install -y redis-server): the test suite
already needs it for the single-server tier (`testing.RedisServer`); 7.0 runs
cluster mode on loopback ports, has ACL users with per-command rules and
read-only key patterns (`%R~*`), and Debian builds it with TLS
(`tls_available()` checks the binary at hand). Nothing is downloaded or built.

Layout of `workdir` (one cluster per directory; ports are free loopback ports,
or `base_port` + i with the bus on port + 10000)::

    slacktier-reader.secret     0600, the reader's password (no newline); so for the loader and admin
    tls/                        with tls=True: ca.crt, server.crt, server.key (self-signed, 127.0.0.1)
    node-<port>/redis.conf      0600 (holds the ACL secrets): cluster on, persistence off, auth on
    node-<port>/nodes.conf      written by the node: its id and view of the cluster (kept across restart)
    node-<port>/redis.log, stderr.log, redis.pid

Topology: nodes are created masters first, then replicas; replica j follows
master j % masters. The slots are split evenly over the masters with CLUSTER
ADDSLOTSRANGE, every pair of nodes is introduced with CLUSTER MEET, and the
replicas attach with CLUSTER REPLICATE once they know their master's id. This
replaces `redis-cli --cluster create`, which needs at least 3 masters and a
password on its command line or in its environment; building the cluster by
hand works for 1 master and 0 replicas as well and takes about as long (the
wait is the 2 s a fresh master holds back before it says cluster_state:ok).

Users (`user default off`: a connection without credentials gets NOAUTH):
  - slacktier-admin: every command; the harness's own connections only.
  - slacktier-reader (`READER_RULES`): what redis-py's RedisCluster needs to
    discover the cluster and read pages (GET, MGET, EXISTS, STRLEN, also from
    replicas with READONLY), on keys it may only read (`%R~*`).
  - slacktier-loader (`LOADER_RULES`): the reader's commands plus SET, MSET, DEL.
  - slacktier-repl: what a replica sends its master (PSYNC, REPLCONF, PING);
    every node has `masteruser` / `masterauth` set to it.

Coverage: `cluster-require-full-coverage no`. With the default (yes), one
master lost without a replica to promote, or not yet replaced, stops the
whole cluster: every node answers CLUSTERDOWN for every slot. With "no", the
lost master's slots answer CLUSTERDOWN (a node loss stays visible) while all
other slots keep serving, which is what a serving tier wants and what the
failover tests check. Also: `cluster-replica-validity-factor 0` (a replica may
take over however long its link was down, so a failover test never stalls),
`cluster-allow-replica-migration no` (replicas stay where they were put),
`repl-diskless-sync-delay 0` (a replica syncs at once, not after 5 s) and
`shutdown-on-sigterm nosave now` (SIGTERM ends a node at once).

TLS (tls=True): nodes listen only on `tls-port` (`port 0`), with TLS on the
cluster bus and replication links. Server authentication only
(`tls-auth-clients no`): clients check the server's certificate against the
generated CA and authenticate with ACL passwords, no client certificates.

Secrets: passwords come from `secrets.token_hex`, live in 0600 files, and never
appear on a command line, in a log line or in an exception (log tails in
errors are scrubbed).

Worked example: masters=3, replicas=1 on ports [7000..7005] -> masters 7000
(slots 0-5460), 7001 (5461-10922), 7002 (10923-16383); 7003 follows 7000,
7004 follows 7001, 7005 follows 7002; seed_url "redis://127.0.0.1:7000".
"""

from __future__ import annotations

import functools
import logging
import os
import secrets
import shutil
import signal
import socket
import subprocess
import time
import weakref
from dataclasses import dataclass
from pathlib import Path

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from slacktier.errors import ErrorKind, SlackTierError

log = logging.getLogger(__name__)

SLOTS = 16384
HOST = "127.0.0.1"
#: the cluster bus listens on port + BUS_PORT_OFFSET when base_port is given (Redis' own convention)
BUS_PORT_OFFSET = 10000

READER = "slacktier-reader"
LOADER = "slacktier-loader"
ADMIN = "slacktier-admin"
REPLICATION = "slacktier-repl"

#: what redis-py 8.1's RedisCluster sends to discover the cluster, found by trimming until it broke
#: (ACL LOG): CLUSTER SLOTS (topology), COMMAND (key positions, once per client), READONLY (on every
#: connection when reading from replicas); PING and CLUSTER INFO for health checks. Not needed: AUTH and
#: HELLO (allowed to everyone), CLIENT SETINFO (Redis 7.2+; 7.0 answers "unknown subcommand", which
#: redis-py ignores), READWRITE, INFO, CLUSTER NODES / SHARDS. ASKING: sent before a command that follows
#: an ASK redirect, while a slot is being migrated (resharding); without it reads of that slot fail until the
#: migration ends (tests/test_store_redis_cluster.py migrates a slot mid-run).
_DISCOVERY = "+ping +cluster|slots +cluster|info +command +readonly +asking"
_READS = "+get +mget +exists +strlen"
#: serving reads only, on keys it may only read
READER_RULES = f"resetkeys %R~* resetchannels -@all {_DISCOVERY} {_READS}"
#: loading pages and the identity key: the reads plus SET, MSET, DEL; SCAN finds the loaded tables (load --list)
LOADER_RULES = f"resetkeys ~* resetchannels -@all {_DISCOVERY} {_READS} +set +mset +del +scan"
_ADMIN_RULES = "~* &* +@all"
#: what a replica sends its master (https://redis.io/docs/latest/operate/oss_and_stack/management/security/acl/)
_REPLICATION_RULES = "resetkeys resetchannels -@all +psync +replconf +ping"

#: how long one node may take to answer its first PING, and stop() to wait before SIGKILL
_NODE_START_S = 10.0
_STOP_GRACE_S = 5.0
#: cluster-node-timeout while the cluster is built (see start())
_BUILD_NODE_TIMEOUT_MS = 1000
_POLL_S = 0.05


class LocalClusterError(SlackTierError, RuntimeError):
    """The local cluster did not start, converge or stop as asked (a RuntimeError as well)."""


@dataclass(frozen=True)
class ClusterUser:
    """An ACL user of the local cluster: its name, password and rule string (as after `ACL SETUSER name on >pw`)."""

    name: str
    password: str
    rules: str

    def __repr__(self) -> str:  # the password stays out of reprs, logs and assertion messages
        return f"ClusterUser(name={self.name!r}, password='***', rules={self.rules!r})"


@dataclass(frozen=True)
class _NodeLine:
    """One line of CLUSTER NODES: who, where, role and the slot ranges it serves ([lo, hi] inclusive)."""

    node_id: str
    port: int
    flags: frozenset[str]
    master_id: str | None
    slots: tuple[tuple[int, int], ...]

    @property
    def failed(self) -> bool:
        return bool(self.flags & {"fail", "fail?", "noaddr", "handshake"})


def _parse_nodes(text: str) -> list[_NodeLine]:
    """CLUSTER NODES -> lines. "id 127.0.0.1:7001@17001 master - 0 0 2 connected 5461-10922" -> port 7001,
    slots ((5461, 10922),); migrating / importing entries ("[93->-id]") are not ownership and are skipped."""
    lines = []
    for row in text.splitlines():
        fields = row.split()
        if len(fields) < 8:
            continue
        address = fields[1].split("@")[0]
        port = int(address.rsplit(":", 1)[1]) if ":" in address else 0
        slots = []
        for item in fields[8:]:
            if item.startswith("["):
                continue
            lo, _, hi = item.partition("-")
            slots.append((int(lo), int(hi or lo)))
        lines.append(_NodeLine(fields[0], port, frozenset(fields[2].split(",")),
                               None if fields[3] == "-" else fields[3], tuple(slots)))
    return lines


def _parse_cluster_info(text: str) -> dict[str, str]:
    """CLUSTER INFO text -> fields: "cluster_state:ok\\r\\ncluster_slots_assigned:16384" -> {"cluster_state": "ok",
    "cluster_slots_assigned": "16384"}."""
    return dict(line.split(":", 1) for line in text.splitlines() if ":" in line and not line.startswith("#"))


def slot_ranges(masters: int) -> list[tuple[int, int]]:
    """Slots split evenly over `masters`, as redis-cli does: 3 -> [(0, 5460), (5461, 10922), (10923, 16383)]."""
    per = SLOTS / masters
    return [(round(i * per), round((i + 1) * per) - 1) for i in range(masters)]


@functools.cache
def tls_available() -> bool:
    """Whether the installed redis-server has TLS built in (a build without it rejects `tls-port` as a bad
    directive; a build with it starts, finds nothing to listen on and exits)."""
    binary = shutil.which("redis-server")
    if binary is None:
        return False
    probe = subprocess.run([binary, "--port", "0", "--tls-port", "0", "--logfile", ""], capture_output=True,
                           text=True, timeout=10, check=False)
    return "Bad directive" not in probe.stdout + probe.stderr


def _free_ports(count: int) -> list[int]:
    """`count` distinct free loopback ports (all held bound together, so none repeats)."""
    sockets = []
    try:
        for _ in range(count):
            s = socket.socket()
            s.bind((HOST, 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def _write_private(path: Path, text: str) -> None:
    """Write `text` to `path`, readable by this user only (0600, also where the file existed)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def _terminate(procs: dict[int, subprocess.Popen], grace_s: float) -> None:
    """SIGTERM every live process, wait up to `grace_s` in all, SIGKILL the rest and reap them (never hangs)."""
    live = [p for p in procs.values() if p.poll() is None]
    for proc in live:
        proc.send_signal(signal.SIGCONT)  # a stopped process cannot act on SIGTERM
        proc.terminate()
    deadline = time.monotonic() + grace_s
    for proc in live:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=grace_s)  # SIGKILL cannot be ignored; a bound all the same


class LocalRedisCluster:
    """`masters` masters with `replicas` replicas each, on loopback, auth on; `start()` / `stop()` or `with`.

    Everything a test needs to break it on purpose: `kill` (a crash), `restart`,
    `pause` (a stall), `wait_ok`, `wait_failover`. Nodes are plain child
    processes; `stop()` ends them by PID and so does garbage collection of an
    unstopped cluster.
    """

    def __init__(self, workdir: Path, *, masters: int = 3, replicas: int = 1, node_timeout_ms: int = 1000,
                 tls: bool = False, base_port: int | None = None) -> None:
        if masters < 1 or replicas < 0:
            raise LocalClusterError(ErrorKind.BAD_INPUT, f"need masters >= 1 and replicas >= 0, got {masters}, "
                                    f"{replicas}", fix="pass masters=1 or more")
        if node_timeout_ms < 100:
            raise LocalClusterError(ErrorKind.BAD_INPUT, f"node_timeout_ms {node_timeout_ms} is below 100",
                                    fix="use 1000 (fast failover) or more")
        self.workdir = Path(workdir).resolve()   # nodes run with their own folder as cwd
        self.node_timeout_ms = node_timeout_ms
        self.tls = tls
        self._n_masters = masters
        nodes = masters * (1 + replicas)
        if base_port is None:
            picked = _free_ports(2 * nodes)
            self.ports, self._bus_ports = picked[:nodes], picked[nodes:]
        else:
            if not (1024 <= base_port and base_port + nodes - 1 + BUS_PORT_OFFSET <= 65535):
                raise LocalClusterError(ErrorKind.BAD_INPUT, f"base_port {base_port} leaves no room for {nodes} "
                                        f"nodes and their bus ports (+{BUS_PORT_OFFSET})",
                                        fix=f"use a base_port between 1024 and {65535 - BUS_PORT_OFFSET - nodes + 1}")
            self.ports = [base_port + i for i in range(nodes)]
            self._bus_ports = [p + BUS_PORT_OFFSET for p in self.ports]
        #: replica port -> the master port it is created under
        self._planned_master = {self.ports[i]: self.ports[(i - masters) % masters] for i in range(masters, nodes)}
        self.seed_url = f"{'rediss' if tls else 'redis'}://{HOST}:{self.ports[0]}"
        self.reader = ClusterUser(READER, secrets.token_hex(16), READER_RULES)
        self.loader = ClusterUser(LOADER, secrets.token_hex(16), LOADER_RULES)
        self._admin = ClusterUser(ADMIN, secrets.token_hex(16), _ADMIN_RULES)
        self._replication = ClusterUser(REPLICATION, secrets.token_hex(16), _REPLICATION_RULES)
        self._secrets = [u.password for u in (self.reader, self.loader, self._admin, self._replication)]
        tls_dir = self.workdir / "tls"
        self.tls_ca_file = tls_dir / "ca.crt" if tls else None
        self.tls_cert_file = tls_dir / "server.crt" if tls else None
        self.tls_key_file = tls_dir / "server.key" if tls else None
        self._procs: dict[int, subprocess.Popen] = {}
        self._clients: dict[int, redis.Redis] = {}
        self._node_ids: dict[int, str] = {}
        self._slots_at_kill: dict[int, tuple[tuple[int, int], ...]] = {}
        self._state = "new"
        # ends the nodes by PID if the cluster is dropped without stop() (a test that died half way)
        self._finalizer = weakref.finalize(self, _terminate, self._procs, _STOP_GRACE_S)

    # ---- life cycle -------------------------------------------------------------------------------------

    def start(self) -> LocalRedisCluster:
        """Start the nodes, build the cluster and wait until it is ok; a no-op if already started."""
        if self._state == "started":
            return self
        if self._state == "stopped":
            raise LocalClusterError(ErrorKind.CLOSED, "this cluster was stopped", fix="make a new LocalRedisCluster")
        binary = shutil.which("redis-server")
        if binary is None:
            raise LocalClusterError(ErrorKind.UNAVAILABLE, "redis-server not found",
                                    fix="apt-get install -y redis-server (scripts/test.sh does)")
        if self.tls and not tls_available():
            raise LocalClusterError(ErrorKind.UNAVAILABLE, f"{binary} was built without TLS",
                                    fix="install a redis-server built with TLS (Debian's is: apt-get install -y "
                                        "redis-server), or use tls=False")
        began = time.monotonic()
        try:
            self.workdir.mkdir(parents=True, exist_ok=True)
            for user in (self.reader, self.loader, self._admin):
                self.secret_file(user)
            if self.tls:
                self._make_certificates()
            for port in self.ports:
                self._write_config(port)
                self._spawn(port, binary)
            for port in self.ports:
                self._wait_answering(port, time.monotonic() + _NODE_START_S)
            # Nodes learn each other's slots from pings, sent about every node_timeout / 2: a long timeout
            # (5000 ms for a restart test) would make a fresh cluster take 5 s to agree, so it is built with
            # at most _BUILD_NODE_TIMEOUT_MS and set to the asked value once ok (redis.conf has the asked
            # value, so a restarted node starts with it).
            self._set_node_timeout(min(self.node_timeout_ms, _BUILD_NODE_TIMEOUT_MS))
            self._build()
            self.wait_ok()
            self._set_node_timeout(self.node_timeout_ms)
        except BaseException:
            self.stop()
            raise
        self._state = "started"
        log.info("local Redis Cluster of %d nodes (%d masters) ready on ports %s in %.1f s", len(self.ports),
                 self._n_masters, self.ports, time.monotonic() - began)
        return self

    def stop(self) -> None:
        """End every node by PID: SIGTERM, then SIGKILL after a few seconds; safe to call twice."""
        for client in self._clients.values():
            client.close()
        self._clients.clear()
        _terminate(self._procs, _STOP_GRACE_S)
        self._state = "stopped"

    def __enter__(self) -> LocalRedisCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def pids(self) -> dict[int, int]:
        """Port -> PID of the node's current process (also of ones that have exited)."""
        return {port: proc.pid for port, proc in self._procs.items()}

    # ---- users and connections --------------------------------------------------------------------------

    def secret_file(self, user: ClusterUser) -> Path:
        """A 0600 file in workdir holding `user`'s password (no newline): pass the path, not the secret."""
        path = self.workdir / f"{user.name}.secret"
        if not path.exists() or path.read_text() != user.password:  # absent, or left by an earlier cluster
            self.workdir.mkdir(parents=True, exist_ok=True)
            _write_private(path, user.password)
        return path

    def client(self, port: int, *, admin: bool = True, socket_timeout_s: float = 5.0) -> redis.Redis:
        """A plain (non-cluster) connection to one node as admin, else as the reader; no retries (the caller
        sees every timeout and dropped connection)."""
        user = self._admin if admin else self.reader
        return redis.Redis(host=HOST, port=port, username=user.name, password=user.password,
                           socket_timeout=socket_timeout_s, socket_connect_timeout=min(socket_timeout_s, 2.0),
                           retry=Retry(NoBackoff(), 0), **self._tls_kwargs())

    def _tls_kwargs(self) -> dict:
        if not self.tls:
            return {}
        return {"ssl": True, "ssl_ca_certs": str(self.tls_ca_file), "ssl_cert_reqs": "required"}

    def _admin_client(self, port: int) -> redis.Redis:
        """The harness's own cached admin connection to `port` (answers str)."""
        if port not in self._clients:
            self._clients[port] = redis.Redis(
                host=HOST, port=port, username=self._admin.name, password=self._admin.password,
                socket_timeout=2.0, socket_connect_timeout=1.0, retry=Retry(NoBackoff(), 0),
                decode_responses=True, **self._tls_kwargs())
        return self._clients[port]

    def _command(self, port: int, *args: object) -> object:
        """One command on `port` as admin; a dropped connection is reopened on the next call."""
        return self._admin_client(port).execute_command(*args)

    # ---- topology -----------------------------------------------------------------------------------------

    def alive(self, port: int) -> bool:
        """Whether the node's process on `port` is running."""
        proc = self._procs.get(port)
        return proc is not None and proc.poll() is None

    def _live_ports(self) -> list[int]:
        return [p for p in self.ports if self.alive(p)]

    def _view(self, port: int | None = None) -> list[_NodeLine]:
        """CLUSTER NODES as seen by `port` (else by the first live node)."""
        if port is None:
            live = self._live_ports()
            if not live:
                raise LocalClusterError(ErrorKind.UNAVAILABLE, "no node of the cluster is running",
                                        fix="start() the cluster, or restart() a node")
            port = live[0]
        return _parse_nodes(str(self._command(port, "CLUSTER", "NODES")))

    def masters(self) -> list[int]:
        """Ports (in creation order) of the masters that serve slots and are not flagged failed, as the first live
        node sees it."""
        serving = {n.port for n in self._view() if "master" in n.flags and n.slots and not n.failed}
        return [p for p in self.ports if p in serving]

    def replicas(self) -> dict[int, int]:
        """Replica port -> its master's port, for replicas not flagged failed, as the first live node sees it."""
        view = self._view()
        port_of = {n.node_id: n.port for n in view}
        return {n.port: port_of[n.master_id] for n in view
                if "slave" in n.flags and not n.failed and n.master_id in port_of}

    # ---- faults ---------------------------------------------------------------------------------------------

    def kill(self, port: int) -> None:
        """SIGKILL the node on `port` (a crash); remembers the slots it served, for `wait_failover`."""
        if not self.alive(port):
            raise LocalClusterError(ErrorKind.BAD_INPUT, f"node {port} is not running", fix="restart() it first")
        self._slots_at_kill[port] = self._slots_of(port)
        self._procs[port].kill()
        self._procs[port].wait(timeout=_STOP_GRACE_S)
        self._drop_client(port)

    def _slots_of(self, port: int) -> tuple[tuple[int, int], ...]:
        """The slots the node on `port` serves, as it sees itself, else (paused, say) as another live node sees it."""
        for asked in [port, *(p for p in self._live_ports() if p != port)]:
            try:
                view = self._view(asked)
            except (redis.ConnectionError, redis.TimeoutError):
                continue
            line = [n for n in view if n.node_id == self._node_ids[port]]
            if line:
                return line[0].slots
        return ()

    def restart(self, port: int, *, empty: bool = True) -> None:
        """Start the node on `port` again with its nodes.conf (same node id); `empty` deletes its data files
        first (persistence is off, but a replica keeps the RDB of its last full sync). Returns once it answers;
        call `wait_ok` for the cluster."""
        if self.alive(port):
            raise LocalClusterError(ErrorKind.BAD_INPUT, f"node {port} is still running", fix="kill() it first")
        binary = shutil.which("redis-server")
        assert binary is not None  # it started once
        node_dir = self._node_dir(port)
        if empty:
            for pattern in ("*.rdb", "appendonly*"):
                for path in node_dir.glob(pattern):
                    if path.is_dir():
                        shutil.rmtree(path)
                    else:
                        path.unlink()
        self._drop_client(port)
        self._spawn(port, binary)
        try:
            self._wait_answering(port, time.monotonic() + _NODE_START_S)
        except BaseException:
            _terminate({port: self._procs[port]}, _STOP_GRACE_S)
            raise

    def pause(self, port: int, ms: int) -> None:
        """CLIENT PAUSE `ms` ALL on that node: it answers no client for `ms` (returns at once)."""
        self._command(port, "CLIENT", "PAUSE", int(ms), "ALL")

    # ---- slot migration (resharding) -------------------------------------------------------------------------

    def owner(self, slot: int) -> int:
        """The port of the live master that serves `slot`, as the first live node sees it."""
        for n in self._view():
            if "master" in n.flags and not n.failed and any(a <= slot <= b for a, b in n.slots):
                return n.port
        raise LocalClusterError(ErrorKind.MISSING, f"no live master serves slot {slot}", fix="wait_ok() first")

    def begin_migration(self, slot: int, to_port: int) -> int:
        """Mark `slot` IMPORTING on `to_port` and MIGRATING on its owner (clients now get ASK for keys already
        moved); returns the owner's port."""
        src = self.owner(slot)
        self._command(to_port, "CLUSTER", "SETSLOT", slot, "IMPORTING", self._node_ids[src])
        self._command(src, "CLUSTER", "SETSLOT", slot, "MIGRATING", self._node_ids[to_port])
        return src

    def migrate_keys(self, slot: int, from_port: int, to_port: int, keys: list[bytes]) -> None:
        """MIGRATE `keys` of `slot` from `from_port` to `to_port` (as the harness's admin user)."""
        if keys:
            self._command(from_port, "MIGRATE", HOST, to_port, "", 0, 10_000, "AUTH2", self._admin.name,
                          self._admin.password, "KEYS", *keys)

    def end_migration(self, slot: int, to_port: int) -> None:
        """Give `slot` to `to_port` on every live master (clients with the old map now get MOVED)."""
        for port in self._live_ports():
            if port == to_port or "master" in self._flags(port):
                self._command(port, "CLUSTER", "SETSLOT", slot, "NODE", self._node_ids[to_port])

    def _flags(self, port: int) -> set[str]:
        mine = [n for n in self._view(port) if "myself" in n.flags]
        return set(mine[0].flags) if mine else set()

    # ---- waiting --------------------------------------------------------------------------------------------

    def wait_ok(self, timeout_s: float = 30.0) -> None:
        """Wait until every live node says cluster_state:ok and sees no live node failed, all live nodes agree
        that live masters serve all 16384 slots, and every live replica's link to its master is up."""
        self._wait(self._not_ok, timeout_s, "cluster not ok")

    def wait_failover(self, dead_port: int, timeout_s: float = 30.0) -> int:
        """Wait until one live master serves all the slots `dead_port` served when `kill`ed, as every live node
        sees it, and return that master's port (the replica promoted in its place)."""
        if dead_port not in self._slots_at_kill:
            raise LocalClusterError(ErrorKind.BAD_INPUT, f"node {dead_port} was not stopped with kill()",
                                    fix="kill(port) the master, then wait_failover(port)")
        slots = self._slots_at_kill[dead_port]
        if not slots:
            raise LocalClusterError(ErrorKind.BAD_INPUT, f"node {dead_port} served no slots when killed",
                                    fix="kill a master (masters() lists them)")
        promoted: list[int] = []

        def not_failed_over() -> str | None:
            owners = set()
            for port in self._live_ports():
                view = self._view(port)
                for lo, hi in slots:
                    owner = [n for n in view if "master" in n.flags and any(a <= lo and hi <= b for a, b in n.slots)]
                    if not owner or owner[0].port == dead_port or owner[0].failed:
                        return f"node {port} sees slot {lo} on {owner[0].port if owner else 'no node'}"
                    owners.add(owner[0].port)
            if len(owners) != 1:
                return f"nodes disagree on who took over: {sorted(owners)}"
            port = owners.pop()
            role = self._admin_client(port).info("replication").get("role")
            if not self.alive(port) or role != "master":
                return f"node {port} is not a live master yet (role {role})"
            promoted.append(port)
            return None

        self._wait(not_failed_over, timeout_s, f"no failover of node {dead_port}")
        return promoted[-1]

    def _wait(self, check, timeout_s: float, what: str) -> None:
        """Poll `check` (None when done, else why not) until done or `timeout_s`; then raise with the reason."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                reason = check()
            except (redis.ConnectionError, redis.TimeoutError) as e:
                reason = f"{type(e).__name__}: {e}"
            if reason is None:
                return
            if time.monotonic() > deadline:
                raise LocalClusterError(ErrorKind.TIMEOUT, f"{what} after {timeout_s:.0f} s: {reason}",
                                        fix="read the node logs under " + str(self.workdir))
            time.sleep(_POLL_S)

    def _not_ok(self) -> str | None:
        live = self._live_ports()
        if not live:
            return "no node is running"
        ownership = None
        for port in live:
            state = _parse_cluster_info(str(self._command(port, "CLUSTER", "INFO"))).get("cluster_state")
            if state != "ok":
                return f"node {port} says cluster_state:{state}"
            view = self._view(port)
            flagged = [n.port for n in view if n.port in live and n.failed]
            if flagged:
                return f"node {port} sees live nodes {flagged} as failed or unknown"
            served = sorted((lo, hi, n.port) for n in view if "master" in n.flags for lo, hi in n.slots)
            if sum(hi - lo + 1 for lo, hi, _ in served) != SLOTS:
                return f"node {port} sees {sum(hi - lo + 1 for lo, hi, _ in served)} of {SLOTS} slots served"
            dead = {owner for _, _, owner in served if owner not in live}
            if dead:
                return f"node {port} sees slots on stopped nodes {sorted(dead)}"
            if ownership is not None and served != ownership:
                return f"nodes {live[0]} and {port} disagree on who serves which slots"
            ownership = served
            info = self._admin_client(port).info("replication")
            if info.get("role") == "slave" and info.get("master_link_status") != "up":
                return f"replica {port}: link to master {info.get('master_port')} is {info.get('master_link_status')}"
        return None

    # ---- set-up ---------------------------------------------------------------------------------------------

    def _node_dir(self, port: int) -> Path:
        return self.workdir / f"node-{port}"

    def _write_config(self, port: int) -> None:
        """node-<port>/redis.conf, 0600 since it holds the ACL secrets."""
        bus_port = self._bus_ports[self.ports.index(port)]
        listen = [f"port {port}"]
        if self.tls:
            listen = ["port 0", f"tls-port {port}", "tls-cluster yes", "tls-replication yes", "tls-auth-clients no",
                      f"tls-cert-file {self.tls_cert_file}", f"tls-key-file {self.tls_key_file}",
                      f"tls-ca-cert-file {self.tls_ca_file}"]
        users = [f"user {u.name} on >{u.password} {u.rules}"
                 for u in (self._admin, self.reader, self.loader, self._replication)]
        lines = [
            *listen, f"bind {HOST}", "protected-mode no", "daemonize no", "pidfile redis.pid", "logfile redis.log",
            f'dir "{self._node_dir(port)}"', "cluster-enabled yes", "cluster-config-file nodes.conf",
            f"cluster-port {bus_port}", f"cluster-node-timeout {self.node_timeout_ms}",
            "cluster-require-full-coverage no", "cluster-replica-validity-factor 0",
            "cluster-allow-replica-migration no", 'save ""', "appendonly no", "repl-diskless-sync-delay 0",
            "shutdown-on-sigterm nosave now", "shutdown-on-sigint nosave now", "enable-debug-command local",
            "user default off", *users, f"masteruser {REPLICATION}", f"masterauth {self._replication.password}",
        ]
        node_dir = self._node_dir(port)
        node_dir.mkdir(parents=True, exist_ok=True)
        for stale in ("nodes.conf", "dump.rdb"):  # an earlier cluster's, where a workdir or base_port is reused
            (node_dir / stale).unlink(missing_ok=True)
        _write_private(node_dir / "redis.conf", "\n".join(lines) + "\n")

    def _spawn(self, port: int, binary: str) -> None:
        node_dir = self._node_dir(port)
        with open(node_dir / "stderr.log", "ab") as stderr:
            self._procs[port] = subprocess.Popen([binary, str(node_dir / "redis.conf")], cwd=node_dir,
                                                 stdin=subprocess.DEVNULL, stdout=stderr, stderr=stderr)

    def _wait_answering(self, port: int, deadline: float) -> None:
        """Until the node on `port` answers PING as admin; raise with its log tail if it exits or times out."""
        proc = self._procs[port]
        while True:
            # an exited node is checked first: another process may hold its port and never answer
            if proc.poll() is not None or time.monotonic() > deadline:
                what = (f"exited with status {proc.returncode}" if proc.poll() is not None
                        else f"did not answer within {_NODE_START_S:.0f} s")
                raise LocalClusterError(ErrorKind.UNAVAILABLE, f"redis-server on port {port} {what}; log tail:\n"
                                        + self._log_tail(port), fix=f"see {self._node_dir(port)}")
            probe = self.client(port, socket_timeout_s=0.25)
            try:
                if probe.ping():
                    return
            except (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError):
                pass
            finally:
                probe.close()
            time.sleep(_POLL_S)

    def _log_tail(self, port: int, lines: int = 15) -> str:
        """The last lines of the node's stderr and log, with every secret replaced by ***."""
        text = ""
        for name in ("stderr.log", "redis.log"):
            path = self._node_dir(port) / name
            if path.exists():
                text += "".join(path.read_text(errors="replace").splitlines(keepends=True)[-lines:])
        for secret in self._secrets:
            text = text.replace(secret, "***")
        return text

    def _drop_client(self, port: int) -> None:
        client = self._clients.pop(port, None)
        if client is not None:
            client.close()

    def _set_node_timeout(self, ms: int) -> None:
        for port in self.ports:
            self._command(port, "CONFIG", "SET", "cluster-node-timeout", ms)

    def _build(self) -> None:
        """Slots to masters, every node meets every other, replicas attach (see the module docstring)."""
        for i, port in enumerate(self.ports):
            self._node_ids[port] = str(self._command(port, "CLUSTER", "MYID"))
            # distinct epochs up front, as redis-cli does, so no epoch collision has to be resolved
            self._command(port, "CLUSTER", "SET-CONFIG-EPOCH", i + 1)
        for port, (lo, hi) in zip(self.ports, slot_ranges(self._n_masters)):
            self._command(port, "CLUSTER", "ADDSLOTSRANGE", lo, hi)
        for i, port in enumerate(self.ports):
            for other, bus in zip(self.ports[i + 1:], self._bus_ports[i + 1:]):
                self._command(port, "CLUSTER", "MEET", HOST, other, bus)

        def not_met() -> str | None:
            for port in self.ports:
                known = [n for n in self._view(port) if not n.failed]
                if len(known) != len(self.ports):
                    return f"node {port} knows {len(known)} of {len(self.ports)} nodes"
            return None

        self._wait(not_met, 30.0, "nodes did not meet")
        for replica, master in self._planned_master.items():
            self._command(replica, "CLUSTER", "REPLICATE", self._node_ids[master])

    def _make_certificates(self) -> None:
        """A throwaway CA and a server certificate for 127.0.0.1 / localhost, with the openssl CLI."""
        openssl = shutil.which("openssl")
        if openssl is None:
            raise LocalClusterError(ErrorKind.UNAVAILABLE, "openssl not found (needed for tls=True)",
                                    fix="apt-get install -y openssl")
        assert self.tls_ca_file and self.tls_cert_file and self.tls_key_file
        tls_dir = self.tls_ca_file.parent
        tls_dir.mkdir(parents=True, exist_ok=True)
        ca_key = tls_dir / "ca.key"
        (tls_dir / "san.cnf").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
        ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
        for args in (
            ["req", "-x509", *ec, "-keyout", ca_key, "-out", self.tls_ca_file, "-days", "7",
             "-subj", "/CN=slacktier-local-ca"],
            ["req", "-new", *ec, "-keyout", self.tls_key_file, "-out", tls_dir / "server.csr",
             "-subj", "/CN=127.0.0.1"],
            ["x509", "-req", "-in", tls_dir / "server.csr", "-CA", self.tls_ca_file, "-CAkey", ca_key,
             "-CAcreateserial", "-out", self.tls_cert_file, "-days", "7", "-extfile", tls_dir / "san.cnf"],
        ):
            done = subprocess.run([openssl, *map(str, args)], capture_output=True, text=True, check=False)
            if done.returncode != 0:
                raise LocalClusterError(ErrorKind.UNAVAILABLE, f"openssl {args[0]} failed: {done.stderr.strip()}",
                                        fix="check the openssl installation")
        ca_key.chmod(0o600)
        self.tls_key_file.chmod(0o600)
