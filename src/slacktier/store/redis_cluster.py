"""Remote memory tier on a Redis Cluster (or Valkey): one table copy, sharded over nodes, read by many engines.

Layout. A region's pages are split into `tag_buckets` (T) groups by page
number modulo T; a group's keys share one hash tag and so one slot, which is
what lets one MGET fetch many of a step's pages from one node (a cluster
refuses an MGET across slots with CROSSSLOT). Keys, for prefix "t0", layer 1,
rank 3, T = 64:

    {t0:1:3:12}:76        page 76 (76 % 64 = 12): 4,096 page bytes + its CRC32C, 4 bytes little-endian
    {t0:1:3:12}:gen       the load generation that completed group 12 (same slot as its pages)
    {t0}:identity         JSON: the table (source digest, stage id), state, generation, T, regions

T is chosen at load and recorded in the identity; readers take it from there.
Small T puts more pages per MGET but fewer slots per region, so a region
spreads over fewer nodes; BENCHMARKS.md ("Redis Cluster") measures the read
time against T and sets the default.

Generations. The loader (`load_table`) derives a generation from the table
(digest, stage id, T, regions), marks the identity "loading", writes each
group's pages with MSET, reads them back and checks every CRC32C, and only
then sets the group's `gen` key; the identity turns "complete" after the last
group. A loader killed midway leaves the identity "loading", which no source
serves; a rerun skips the groups whose `gen` key already holds the
generation (resumable), and a rerun of a complete table is a no-op. A source
checks at open that the identity is complete and every group of its regions
holds the generation; a node that restarts empty loses its groups' `gen` keys
with their pages, so a missing page later is diagnosed the same way, as a
TARGET error naming the table and the node.

Reads. One lane per source. A batch's pages are grouped by (region, group),
one MGET per group (at most `KEYS_PER_MGET` keys), and the MGETs are sorted
by the node that serves their slot, from the topology of redis-py's cluster
client (`redis.cluster.RedisCluster`, which discovers nodes and follows
redirects). The lane writes every node's pipeline on its own socket per node
(`_NodeLink`: AUTH, READONLY for replica reads, TLS when the url is rediss://)
before reading any reply, then reads whichever node has bytes (select) into
that node's buffer; a compiled scan (`store/_resp.py`) finds the values and
each MGET's pages land in the pool with one strided copy. Why not redis-py's
own path: its `ClusterPipeline` resolves every command through a generic
policy layer, and its per-node connections parse each value into a Python
bytes object that is copied twice more; BENCHMARKS.md ("Remote tier: Redis
Cluster") measures both beside ours (`hand_reader = False` runs redis-py's
per-node connections, kept for that comparison). A MOVED, ASK, CLUSTERDOWN
or lost connection refreshes the topology and retries the failed groups
through `RedisCluster.execute_command` (which follows redirects), until
`socket_timeout_ms` after the batch began; then the batch fails (IO). A
connection with a late or unread reply is closed, never reused. A master
lost mid-run therefore costs a few failed or slow batches until its replica
is promoted, and reads resume without a restart.

Stalls. A node whose reply to a batch took longer than `STALL_FRACTION` of
`socket_timeout_ms` counts as a stall (`stalls`, by node, logged); a node
that does not answer within the timeout fails the batch (IO). The engine's
own bound is `wait_timeout_ms`: when it passes first, gather raises TIMEOUT
for that layer and the batch's buffers are retired, so a late reply never
lands in a buffer in use (engine/step.py).

Security. The ACL user and its password come from the options (password from
the environment or a file, never the control file); TLS with `tls_ca_file`
and a rediss:// url. A cluster that wants credentials and gets none is
refused at open with UNAVAILABLE, naming the user.
"""

from __future__ import annotations

import hashlib
import json
import logging
import selectors
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from urllib.parse import urlsplit

import numpy as np
import redis
from redis.cluster import ClusterNode, LoadBalancingStrategy, RedisCluster
from redis.crc import key_slot
from tqdm import tqdm

from slacktier.config import RedisClusterOptions
from slacktier.errors import ErrorKind, SlackTierError
from slacktier.store import _resp
from slacktier.store._common import page_crc32c
from slacktier.store.dram import load_region_pages
from slacktier.store.queued import Lane, Part, QueuedSource, typed_options
from slacktier.store.redis_source import _mask, auth_refusal, client_kwargs
from slacktier.store.registry import register_tier
from slacktier.tables.layout import PAGE_BYTES
from slacktier.tables.manifest import Manifest, TableIdentity
from slacktier.tables.regions import Region

log = logging.getLogger(__name__)

#: keys per MGET: one reply of at most ~1 MiB
KEYS_PER_MGET = 256
#: a stored value: the page, then its CRC32C (uint32, little-endian)
VALUE_BYTES = _resp.VALUE_BYTES
#: bytes from one value to the next in an MGET reply of whole pages: "$4100\r\n" + value + "\r\n"
VALUE_STRIDE = len(b"$%d\r\n" % VALUE_BYTES) + VALUE_BYTES + 2
#: default hash-tag groups per region (see BENCHMARKS.md, "Redis Cluster: hash tags")
DEFAULT_TAG_BUCKETS = 64
MAX_TAG_BUCKETS = 16384   # a cluster's hash slots: more groups per region cannot spread any further
#: a node reply slower than this fraction of socket_timeout_ms counts as a stall
STALL_FRACTION = 0.25
LOADING, COMPLETE = "loading", "complete"
LAYOUT = "cluster-v1"


# -- keys ----------------------------------------------------------------------------------------

def group_tag(prefix: str, layer: int, rank: int, group: int) -> str:
    """Hash tag of one page group: ("t0", 1, 3, 12) -> "t0:1:3:12"."""
    return f"{prefix}:{layer}:{rank}:{group}"


def page_key(prefix: str, layer: int, rank: int, page: int, tag_buckets: int) -> bytes:
    """Key of one page: ("t0", 1, 3, 76, 64) -> b"{t0:1:3:12}:76"."""
    return f"{{{group_tag(prefix, layer, rank, page % tag_buckets)}}}:{page}".encode()


def gen_key(prefix: str, layer: int, rank: int, group: int) -> bytes:
    """Key of a group's generation marker: ("t0", 1, 3, 12) -> b"{t0:1:3:12}:gen"."""
    return f"{{{group_tag(prefix, layer, rank, group)}}}:gen".encode()


def identity_key(prefix: str) -> bytes:
    """Key of the table's identity: "t0" -> b"{t0}:identity"."""
    return f"{{{prefix}}}:identity".encode()


def default_prefix(identity: TableIdentity | None) -> str:
    """The key prefix of a table loaded without one: "st-" and its stage id (else its source digest)."""
    if identity is None:
        raise SlackTierError(ErrorKind.BAD_INPUT, "no key prefix and no table identity to derive one from",
                             fix="set `prefix` in [table.redis-cluster], or open the source with the manifest's identity")
    return f"st-{identity.stage_id or identity.source_digest}"


def generation_of(identity: TableIdentity, tag_buckets: int, regions: Sequence[Region]) -> str:
    """A load's generation: a digest of the table, T and the regions (the same load -> the same generation)."""
    text = json.dumps([identity.source_digest, identity.stage_id, tag_buckets,
                       sorted((r.layer, r.rank, r.pages) for r in regions)])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


# -- connections ---------------------------------------------------------------------------------

def connect(options: RedisClusterOptions) -> RedisCluster:
    """A cluster client through the seed node in `options.url`, every connect and reply bounded by
    `socket_timeout_ms`; UNAVAILABLE when the seed is unreachable or refuses the credentials."""
    parts = urlsplit(options.url)
    kw = client_kwargs(options)
    if parts.scheme == "rediss":
        kw["ssl"] = True
    elif options.tls_ca_file:
        raise SlackTierError(ErrorKind.BAD_INPUT, f"tls_ca_file is set but the url {options.url} is not rediss://",
                             fix="use a rediss:// url for TLS, or drop tls_ca_file")
    kw.pop("retry")  # the cluster client's own retry object: one retry, no backoff (below)
    kw.pop("retry_on_timeout")  # deprecated for the cluster client; its retry object above decides
    if options.read_from_replicas:
        kw["load_balancing_strategy"] = LoadBalancingStrategy.ROUND_ROBIN
    try:
        seeds = [ClusterNode(parts.hostname or "127.0.0.1", parts.port or 6379)] + [
            ClusterNode(h, int(p)) for h, _, p in (n.rpartition(":") for n in options.nodes)]
        client = RedisCluster(startup_nodes=seeds, require_full_coverage=False,
                              retry=redis.retry.Retry(redis.backoff.NoBackoff(), 1), **kw)
    except (redis.RedisError, redis.exceptions.RedisClusterException, OSError) as exc:
        # redis-py wraps a seed's refusal in "Redis Cluster cannot be connected ...": look down the chain
        auth = _auth_error(exc)
        text = _mask(str(exc if auth is None else auth), options)
        if auth is not None or "NOAUTH" in text or "Authentication" in text:
            raise SlackTierError(ErrorKind.UNAVAILABLE, f"Redis Cluster at {options.url} {auth_refusal(options)}: "
                                 f"{text}", fix="set username and password_env (or password_file) in "
                                 "[table.redis-cluster] to an ACL user that may read the table") from None
        raise SlackTierError(ErrorKind.UNAVAILABLE, f"cannot reach Redis Cluster at {options.url}: {text}",
                             fix="start the cluster there or pass the url of one of its nodes") from None
    return client


def _auth_error(exc: BaseException) -> BaseException | None:
    """The AuthenticationError (wrong password or user, NOAUTH) in `exc`'s cause chain, if any."""
    seen = 0
    while exc is not None and seen < 16:
        if isinstance(exc, redis.AuthenticationError):
            return exc
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return None


def _node_of_slot(client: RedisCluster, slot: int, replicas: bool) -> ClusterNode:
    strategy = LoadBalancingStrategy.ROUND_ROBIN if replicas else None
    return client.nodes_manager.get_node_from_slot(slot, load_balancing_strategy=strategy)


@dataclass
class _Command:
    """One MGET of one page group: its pages and where their values go in the part."""

    slot: int
    head: bytes        # the group's key head, b"{t0:1:3:12}:"
    group: int         # the group's index (region * T + bucket)
    pages: np.ndarray  # [k] int64 page numbers
    index: np.ndarray  # [k] positions in the part
    redirect: bytes = b""  # the error word of its last failed reply (b"MOVED", b"ASK", b"TRYAGAIN", ...)

    @property
    def keys(self) -> list[bytes]:
        """The page keys (built on demand: the fast path packs them in compiled code)."""
        return [b"%s%d" % (self.head, p) for p in self.pages.tolist()]


def _send_all(client: RedisCluster, by_node: dict[str, tuple[ClusterNode, list[_Command]]],
              replies: list[bytes | None], stall_s: float) -> tuple[list[_Command], list[str], Exception | None]:
    """Write every node's MGETs, then read every reply; fills `replies` and returns the commands to retry
    (redirected, or on a lost node), the nodes that stalled, and the first other error (a reason to stop)."""
    sent = []
    retry: list[_Command] = []
    stalled: list[str] = []
    hard: Exception | None = None
    t0 = time.monotonic()
    for name, (node, commands) in by_node.items():
        pool = client.get_redis_connection(node).connection_pool
        try:
            conn = pool.get_connection()
        except (redis.ConnectionError, redis.TimeoutError, OSError):
            retry.extend(commands)
            continue
        try:
            conn.send_packed_command(conn.pack_commands([("MGET", *c.keys) for c in commands]))
        except (redis.ConnectionError, redis.TimeoutError, OSError):
            conn.disconnect()
            pool.release(conn)
            retry.extend(commands)
            continue
        sent.append((name, pool, conn, commands))
    for name, pool, conn, commands in sent:
        read = 0
        try:
            for c in commands:
                try:
                    values = conn.read_response()
                except (redis.exceptions.MovedError, redis.exceptions.AskError, redis.exceptions.TryAgainError,
                        redis.exceptions.ClusterDownError) as exc:
                    c.redirect = {redis.exceptions.AskError: b"ASK", redis.exceptions.TryAgainError: b"TRYAGAIN"
                                  }.get(type(exc), b"MOVED")
                    retry.append(c)
                else:
                    for j, v in zip(c.index.tolist(), values, strict=True):
                        replies[j] = v
                read += 1
            if time.monotonic() - t0 > stall_s:
                stalled.append(name)
        except (redis.ConnectionError, redis.TimeoutError, OSError) as exc:
            conn.disconnect()  # replies may still be in flight: this connection is never reused
            retry.extend(commands[read:])
            if isinstance(exc, redis.TimeoutError):
                stalled.append(name)
        except redis.RedisError as exc:
            conn.disconnect()
            hard = hard or exc
        finally:
            pool.release(conn)
    return retry, stalled, hard


@dataclass
class _Got:
    """What a batch has received so far: each read's stored CRC32C, whether it landed, and bad values."""

    stored: np.ndarray                           # [n] uint32
    have: np.ndarray                             # [n] bool
    bad: list[tuple[int, bytes | None]]          # (read, its value: None when the key is missing)


def _put(part: Part, i: int, value: bytes | None, got: _Got) -> None:
    """Land one value (bytes) of read i: page into the pool, CRC32C aside; a missing or wrong-size one is bad."""
    if value is None or len(value) != VALUE_BYTES:
        got.bad.append((i, value))
        return
    part.pool.pages[part.buffer[i]] = np.frombuffer(value, dtype=np.uint8, count=PAGE_BYTES)
    got.stored[i] = int.from_bytes(value[PAGE_BYTES:], "little")
    got.have[i] = True


def _resp_command(args: Sequence[str | bytes]) -> bytes:
    """One command in RESP: ("AUTH", "u", "p") -> b"*3\\r\\n$4\\r\\nAUTH\\r\\n$1\\r\\nu\\r\\n$1\\r\\np\\r\\n"."""
    parts = [a.encode() if isinstance(a, str) else a for a in args]
    return b"*%d\r\n" % len(parts) + b"".join(b"$%d\r\n%s\r\n" % (len(p), p) for p in parts)


class _NodeLink:
    """Our own connection to one node for page reads: authenticated (and READONLY for replica reads), with a
    receive buffer that replies land in whole (see store/_resp.py). Closed, never reused, after any error or
    timeout, so no late reply is ever read as another batch's."""

    def __init__(self, host: str, port: int, options: RedisClusterOptions, readonly: bool, timeout_s: float) -> None:
        self.name = f"{host}:{port}"
        sock = socket.create_connection((host, port), timeout=timeout_s)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if urlsplit(options.url).scheme == "rediss":
                ctx = ssl.create_default_context(cafile=options.tls_ca_file or None)
                ctx.check_hostname = False   # the cluster announces IPs; the CA still authenticates the node
                sock = ctx.wrap_socket(sock, server_hostname=host)
            hello = []
            password = options.password()
            if password is not None:
                hello.append(("AUTH", options.username or "default", password))
            if readonly:
                hello.append(("READONLY",))
            if hello:   # each answer is one line: "+OK" or "-ERR ..." / "-WRONGPASS ..."
                sock.sendall(b"".join(_resp_command(c) for c in hello))
                data = b""
                while data.count(b"\r\n") < len(hello):
                    more = sock.recv(4096)
                    if not more:
                        raise ConnectionError(f"node {self.name} closed the connection during the handshake")
                    data += more
                for line in data.split(b"\r\n")[:len(hello)]:
                    if not line.startswith(b"+"):
                        raise redis.AuthenticationError(_mask(line[1:].decode(errors="replace"), options))
        except BaseException:
            sock.close()
            raise
        self.sock = sock
        self.buf = np.empty(1 << 20, np.uint8)

    def room(self, nbytes: int) -> None:
        """At least `nbytes` of receive buffer, keeping what is in it."""
        if nbytes > self.buf.shape[0]:
            grown = np.empty(max(nbytes, 2 * self.buf.shape[0]), np.uint8)
            grown[:self.buf.shape[0]] = self.buf
            self.buf = grown

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


_RETRY_ERRORS = (b"MOVED", b"ASK", b"TRYAGAIN", b"CLUSTERDOWN", b"LOADING", b"MASTERDOWN")


@dataclass(frozen=True)
class _Heads:
    """Every group's key head, concatenated, for the compiled packer: head of group g = data[off[g]:off[g + 1]]."""

    data: np.ndarray   # uint8
    off: np.ndarray    # [G + 1] int64

    @classmethod
    def of(cls, heads: Sequence[bytes]) -> _Heads:
        off = np.zeros(len(heads) + 1, np.int64)
        off[1:] = np.cumsum([len(h) for h in heads])
        return cls(np.frombuffer(b"".join(heads), np.uint8).copy(), off)


def _pack_mgets(heads: _Heads, commands: list[_Command], keys: np.ndarray) -> bytes:
    """The RESP of one MGET per command, packed by compiled code (bit-identical to redis' own packing)."""
    groups = np.array([c.group for c in commands], np.int64)
    pages = np.concatenate([c.pages for c in commands])
    out = np.empty(_resp.mget_bytes_bound(heads.off, groups, keys), np.uint8)
    n = _resp.pack_mgets(heads.data, heads.off, groups, keys, pages, out)
    return out[:n].tobytes()


def _hand_round(links: dict[str, _NodeLink], options: RedisClusterOptions, heads: _Heads,
                by_node: dict[str, tuple[ClusterNode, list[_Command]]], part: Part, got: _Got, deadline: float,
                stall_s: float) -> tuple[list[_Command], list[str], Exception | None]:
    """One round of MGETs on our own sockets: every node's pipeline written, then replies read from whichever
    node has bytes (select), scanned and landed by compiled code. Returns the commands to retry (redirected,
    or on a lost or late node), the nodes that stalled, and the first error that is not a redirect."""
    t0 = time.monotonic()
    retry: list[_Command] = []
    stalled: list[str] = []
    hard: Exception | None = None
    jobs = {}
    sel = selectors.DefaultSelector()
    try:
        for name, (node, commands) in by_node.items():
            try:
                link = links.get(name)
                if link is None:
                    link = links[name] = _NodeLink(node.host, node.port, options, node.server_type == "replica",
                                                   max(0.001, deadline - time.monotonic()))
                keys = np.array([c.pages.shape[0] for c in commands], np.int64)
                base = np.zeros(len(commands), np.int64)
                base[1:] = np.cumsum(keys)[:-1]
                total = int(keys.sum())
                link.room(total * (VALUE_BYTES + 9) + 16 * len(commands) + 64)
                link.sock.settimeout(max(0.001, deadline - time.monotonic()))
                link.sock.sendall(_pack_mgets(heads, commands, keys))
                link.sock.setblocking(False)
            except (OSError, redis.RedisError, SlackTierError) as exc:
                if isinstance(exc, (redis.AuthenticationError, SlackTierError)):
                    hard = hard or exc
                _drop(links, name)
                retry.extend(commands)
                continue
            jobs[name] = _Job(link, commands, keys, base, np.zeros(total, np.int64), np.zeros(total, np.int64),
                              np.zeros(len(commands), np.int8), np.zeros(len(commands), np.int64))
            sel.register(link.sock, selectors.EVENT_READ, name)
        while any(not j.finished for j in jobs.values()):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            for key, _ in sel.select(timeout=left):
                job = jobs[key.data]
                if not job.receive():
                    sel.unregister(job.link.sock)
                if job.finished and time.monotonic() - t0 > stall_s:
                    stalled.append(job.link.name)
        for name, job in jobs.items():
            if job.lost or not job.finished:     # lost or late: never reuse this connection
                if not job.lost:
                    stalled.append(name)
                _drop(links, name)
                if not (job.status[:job.done] == _resp.MALFORMED).any():
                    retry.extend(job.commands[job.done:])
            error = job.land(part, got, retry)
            if error is not None:
                _drop(links, name)
                hard = hard or error
    finally:
        sel.close()
    return retry, stalled, hard


def _drop(links: dict[str, _NodeLink], name: str) -> None:
    link = links.pop(name, None)
    if link is not None:
        link.close()


@dataclass
class _Job:
    """One node's MGETs of one batch, and their replies as scanned so far."""

    link: _NodeLink
    commands: list[_Command]
    keys: np.ndarray       # [c] keys per command
    base: np.ndarray       # [c] first value of each command
    off: np.ndarray        # [v] value offset in link.buf
    length: np.ndarray     # [v] value length (-1: no such key)
    status: np.ndarray     # [c] OK / ERROR / MALFORMED
    error_at: np.ndarray   # [c] offset of an error line
    got: int = 0           # bytes received
    scanned: int = 0       # bytes scanned (replies complete up to here)
    done: int = 0          # commands whose reply is complete
    lost: bool = False

    @property
    def finished(self) -> bool:
        return self.lost or self.done == len(self.commands) or bool((self.status[:self.done] == _resp.MALFORMED).any())

    def receive(self) -> bool:
        """Read what the socket has and scan it; False when the connection is gone."""
        link = self.link
        try:
            while True:
                if self.got == link.buf.shape[0]:
                    link.room(2 * link.buf.shape[0])   # a reply larger than planned (wrong-size values)
                n = link.sock.recv_into(memoryview(link.buf)[self.got:])
                if n == 0:
                    self.lost = True
                    return False
                self.got += n
                if not (isinstance(link.sock, ssl.SSLSocket) and link.sock.pending()):
                    break
        except (BlockingIOError, ssl.SSLWantReadError):
            pass
        except OSError:
            self.lost = True
            return False
        self.scanned, k = _resp.scan_mget_replies(link.buf, self.scanned, self.got, self.done, self.keys, self.base,
                                                  self.off, self.length, self.status, self.error_at)
        self.done += k
        return True

    def land(self, part: Part, got: _Got, retry: list[_Command]) -> Exception | None:
        """Land the complete OK replies (one compiled pass); redirected ones go to `retry`; the first other error
        is returned."""
        error: Exception | None = None
        buf = self.link.buf
        for c in np.flatnonzero(self.status[:self.done] != _resp.OK).tolist():
            cmd = self.commands[c]
            if self.status[c] == _resp.ERROR:
                at = int(self.error_at[c])
                line = bytes(buf[at + 1:at + 1 + 200]).split(b"\r\n", 1)[0]
                if line.startswith(_RETRY_ERRORS):
                    cmd.redirect = line.split(b" ", 1)[0]
                    retry.append(cmd)
                else:
                    error = error or redis.ResponseError(line.decode(errors="replace"))
            else:
                error = error or redis.ResponseError("a malformed reply to MGET (not RESP2 bulk strings)")
                retry.extend(self.commands[c + 1:])
                break
        if self.done == 0:
            return error
        position = np.concatenate([c.index for c in self.commands]).astype(np.int64)
        bad = np.empty(position.shape[0], np.int64)
        nbad = _resp.land_values(buf, self.done, self.keys, self.base, self.off, self.length, self.status, position,
                                 part.pool.pages, part.buffer, got.stored, got.have, bad)
        for v in bad[:nbad].tolist():   # a missing key or a value that is not a whole page
            n = int(self.length[v])
            got.bad.append((int(position[v]), None if n < 0 else bytes(buf[int(self.off[v]):int(self.off[v]) + n])))
        return error


class RedisClusterSource(QueuedSource[dict]):
    """Pages read from a Redis Cluster, grouped by slot, pipelined per node, all nodes at once."""

    read_what = "redis-cluster read"
    engine_name = "resp-scan"
    #: read replies with our own sockets and compiled scan (True), or through redis-py's per-node connections
    #: (False; kept for the side-by-side measurement in benchmarks/tier/bench_redis_cluster.py)
    hand_reader: bool = True
    #: remote memory with no end-to-end checksum of its own: reads are checked against the manifest by default
    verify_by_default = True

    def __init__(self, regions: Sequence[Region], options: RedisClusterOptions | None = None, *,
                 page_crc32c: Sequence[np.ndarray] | None = None, identity: TableIdentity | None = None) -> None:
        super().__init__(regions, page_crc32c=page_crc32c)
        self.options = typed_options(options, RedisClusterOptions)
        self.url = self.options.url
        self._prefix = [self.options.prefix or default_prefix(identity)] * len(self.regions)
        self._client = connect(self.options)
        self.stalls: dict[str, int] = {}   # node -> batches whose reply from it was slow or never came
        self._stall_lock = threading.Lock()
        try:
            self._table = _read_identity(self._client, self.options, self._prefix, identity)
            self.tag_buckets = int(self._table["tag_buckets"])
            self._check_regions_listed()
            _check_generations(self._client, self.options, self.regions, self._prefix, self._table)
        except BaseException:
            self._client.close()
            raise
        T = self.tag_buckets
        tags = [group_tag(self._prefix[i], r.layer, r.rank, g).encode() for i, r in enumerate(self.regions)
                for g in range(T)]                                      # [R * T], group = region * T + bucket
        self._group_slot = np.array([key_slot(t) for t in tags], dtype=np.int32)
        self._group_head = [b"{%s}:" % t for t in tags]
        self._heads = _Heads.of(self._group_head)
        self._slot_node: dict[int, ClusterNode] = {}   # slot -> master, until the slow path refreshes the map
        self._start_lanes(1)
        log.info("RedisClusterSource: %d regions at %s (%d nodes, %d page groups per region%s)", len(self.regions),
                 self.url, len(self._client.get_nodes()), T, ", replicas read" if self.options.read_from_replicas
                 else "")

    @classmethod
    def verify_identity(cls, regions: Sequence[Region], options: RedisClusterOptions | None,
                        identity: TableIdentity) -> None:
        """The cluster holds `identity`, complete, with every page group of `regions` in its generation."""
        opts = typed_options(options, RedisClusterOptions)
        client = connect(opts)
        try:
            prefixes = [opts.prefix or default_prefix(identity)] * len(regions)
            table = _read_identity(client, opts, prefixes, identity)
            _check_generations(client, opts, regions, prefixes, table)
        finally:
            client.close()

    def _check_regions_listed(self) -> None:
        listed = {(int(a), int(b)): int(c) for a, b, c in self._table["regions"]}
        for r in self.regions:
            if listed.get((r.layer, r.rank)) != r.pages:
                raise SlackTierError(ErrorKind.TARGET, f"Redis Cluster table {self._table['source_digest']} holds "
                                     f"{listed.get((r.layer, r.rank), 'no')} pages for this region, the manifest "
                                     f"says {r.pages}", layer=r.layer, rank=r.rank,
                                     fix="load this staging run into the cluster (slacktier.store.redis_cluster."
                                         "load_table)")

    def _commands(self, region: np.ndarray, page: np.ndarray, positions: np.ndarray) -> list[_Command]:
        T = self.tag_buckets
        group = region.astype(np.int64) * T + page % T
        order = np.argsort(group, kind="stable")
        g_sorted = group[order]
        cuts = np.flatnonzero(np.diff(g_sorted)) + 1
        out = []
        for idx in np.split(order, cuts):
            g = int(group[idx[0]])
            head = self._group_head[g]  # b"{t0:1:3:12}:"
            slot = int(self._group_slot[g])
            for lo in range(0, idx.shape[0], KEYS_PER_MGET):
                chunk = idx[lo:lo + KEYS_PER_MGET]
                out.append(_Command(slot, head, g, page[chunk].astype(np.int64), positions[chunk]))
        return out

    def _route(self, commands: Iterable[_Command]) -> dict[str, tuple[ClusterNode, list[_Command]]]:
        """The commands by the node that serves their slot: the master, remembered per slot until the slow path
        refreshes the topology; with `read_from_replicas`, the client's round robin, asked each time."""
        by_node: dict[str, tuple[ClusterNode, list[_Command]]] = {}
        replicas = self.options.read_from_replicas
        known = self._slot_node
        for c in commands:
            node = None if replicas else known.get(c.slot)
            if node is None:
                node = _node_of_slot(self._client, c.slot, replicas)
                if not replicas:
                    known[c.slot] = node
            by_node.setdefault(node.name, (node, []))[1].append(c)
        return by_node

    def _warm(self) -> None:
        super()._warm()
        _resp.warm()   # the reply scan

    def _open_lane(self, lane: Lane[dict]) -> None:
        lane.state = {}   # node name -> _NodeLink, opened on first use, on this lane's thread

    def _close_lane(self, lane: Lane[dict]) -> None:
        for link in (lane.state or {}).values():
            link.close()
        self._client.close()

    def _read(self, lane: Lane[dict], part: Part) -> SlackTierError | None:
        n = part.region.shape[0]
        got = _Got(np.zeros(n, np.uint32), np.zeros(n, np.bool_), [])
        timeout_s = self.options.socket_timeout_ms / 1e3
        deadline = time.monotonic() + timeout_s
        pending = self._commands(part.region, part.page, np.arange(n))
        try:
            by_node = self._route(pending)
        except (redis.RedisError, OSError):  # a slot with no known node: the slow path refreshes the topology
            by_node = None
        if by_node is not None:
            if self.hand_reader:
                pending, stalled, hard = _hand_round(lane.state, self.options, self._heads, by_node, part, got,
                                                     deadline, STALL_FRACTION * timeout_s)
            else:
                pending, stalled, hard = self._redis_py_round(by_node, part, got, STALL_FRACTION * timeout_s)
            self._count_stalls(stalled)
            if hard is not None:
                return self._io_error(part, pending, hard)
        last: BaseException | None = None
        tries = 0
        while pending:  # the slow path: redirects and lost nodes, until the deadline
            if time.monotonic() >= deadline:
                return self._io_error(part, pending, last, timed_out=True)
            if tries:
                time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))
            tries += 1
            try:
                self._slot_node.clear()
                self._client.nodes_manager.initialize()
            except (redis.RedisError, redis.exceptions.RedisClusterException, OSError) as exc:
                last = exc
                continue
            # A slot being migrated (ASK, TRYAGAIN for an MGET whose keys are split between two nodes): key by
            # key through the cluster client, which follows each key's ASK. Everything else: another round.
            moving = [c for c in pending if c.redirect in (b"ASK", b"TRYAGAIN")]
            again = [c for c in pending if c.redirect not in (b"ASK", b"TRYAGAIN")]
            still: list[_Command] = []
            for c in moving:
                try:
                    values = [self._client.execute_command("GET", k) for k in c.keys]
                except (redis.RedisError, redis.exceptions.RedisClusterException, OSError) as exc:
                    still.append(c)
                    last = exc
                    continue
                for j, v in zip(c.index.tolist(), values, strict=True):
                    _put(part, j, v, got)
            if again:
                try:
                    by_node = self._route(again)
                except (redis.RedisError, redis.exceptions.RedisClusterException, OSError) as exc:
                    still.extend(again)
                    last = exc
                    by_node = None
                if by_node is not None:
                    for c in again:
                        c.redirect = b""
                    if self.hand_reader:
                        left, stalled, hard = _hand_round(lane.state, self.options, self._heads, by_node, part,
                                                          got, deadline, STALL_FRACTION * timeout_s)
                    else:
                        left, stalled, hard = self._redis_py_round(by_node, part, got, STALL_FRACTION * timeout_s)
                    self._count_stalls(stalled)
                    if hard is not None:
                        return self._io_error(part, left, hard)
                    still.extend(left)
            pending = still
        return self._landed(part, got)

    def _redis_py_round(self, by_node: dict[str, tuple[ClusterNode, list[_Command]]], part: Part, got: _Got,
                        stall_s: float) -> tuple[list[_Command], list[str], Exception | None]:
        """`_hand_round` through redis-py's per-node connections (the measured alternative)."""
        replies: list[bytes | None] = [None] * part.region.shape[0]
        commands = [c for _, cs in by_node.values() for c in cs]
        left, stalled, hard = _send_all(self._client, by_node, replies, stall_s)
        failed = {id(c) for c in left}
        for c in commands:
            if id(c) not in failed:
                for i in c.index.tolist():
                    _put(part, i, replies[i], got)
        return left, stalled, hard

    def _count_stalls(self, nodes: list[str]) -> None:
        if not nodes:
            return
        with self._stall_lock:
            for name in nodes:
                self.stalls[name] = self.stalls.get(name, 0) + 1
        log.warning("Redis Cluster: slow reply from %s (over %.0f%% of socket_timeout_ms)", ", ".join(nodes),
                    100 * STALL_FRACTION)

    def _io_error(self, part: Part, pending: list[_Command], exc: BaseException | None, *,
                  timed_out: bool = False) -> SlackTierError:
        i = int(pending[0].index[0]) if pending else 0
        what = (f"{sum(len(c.keys) for c in pending)} pages unread after {self.options.socket_timeout_ms:.0f} ms"
                if timed_out else "failed")
        text = _mask(str(exc), self.options) if exc is not None else "no node answered"
        return SlackTierError(ErrorKind.IO, f"Redis Cluster read at {self.url} {what}: {text}",
                              **self._where(int(part.region[i]), int(part.page[i])),
                              fix="check the cluster (CLUSTER INFO: a master down with no replica, a paused node), "
                                  "or raise socket_timeout_ms in [table.redis-cluster]")

    def _landed(self, part: Part, got: _Got) -> SlackTierError | None:
        """The first bad value's error, else the stored CRC32Cs against the manifest's (a page of another load)."""
        if got.bad:
            i, value = min(got.bad, key=lambda bv: bv[0])
            return self._bad_value(part, i, value)
        if not got.have.all():  # every read either landed, is bad, or failed the batch before this point
            return self._bad_value(part, int(np.flatnonzero(~got.have)[0]), None)
        if self._expected is not None:
            want = self._expected[self._region_base[part.region] + part.page]
            bad = np.flatnonzero(got.stored != want)
            if bad.size:
                i = int(bad[0])
                return SlackTierError(ErrorKind.CHECKSUM, f"{self.read_what}: stored CRC32C "
                                      f"{int(got.stored[i]):#010x}, manifest says {int(want[i]):#010x}: a page of "
                                      "another load", **self._where(int(part.region[i]), int(part.page[i])),
                                      fix="load this table into the cluster again")
        return None

    def _bad_value(self, part: Part, i: int, value: bytes | None) -> SlackTierError:
        r, page = int(part.region[i]), int(part.page[i])
        reg = self.regions[r]
        key = page_key(self._prefix[r], reg.layer, reg.rank, page, self.tag_buckets)
        where = self._where(r, page)
        if value is not None:
            return SlackTierError(ErrorKind.IO, f"{self.read_what}: key {key!r} holds {len(value)} bytes, a page "
                                  f"value is {VALUE_BYTES}", **where, fix="load the table into the cluster again")
        try:  # a missing page: is it the whole group (a node restarted empty, a flush)?
            _check_generations(self._client, self.options, [reg], [self._prefix[r]], self._table)
        except SlackTierError as exc:
            return exc
        return SlackTierError(ErrorKind.MISSING, f"{self.read_what}: no key {key!r} although its group is complete",
                              **where, fix="load the table into the cluster again")


def _read_identity(client: RedisCluster, options: RedisClusterOptions, prefixes: Sequence[str],
                   identity: TableIdentity | None) -> dict:
    """The identity record of the one table under `prefixes`, checked against `identity` and complete."""
    prefixes = list(dict.fromkeys(prefixes))
    if len(prefixes) != 1:
        raise SlackTierError(ErrorKind.BAD_INPUT, f"regions under {len(prefixes)} key prefixes {prefixes}",
                             fix="set `prefix` in [table.redis-cluster]: a table is loaded under one prefix")
    prefix = prefixes[0]
    where = f"Redis Cluster at {options.url}"
    load = "load the table with slacktier.store.redis_cluster.load_table"
    try:
        value = client.get(identity_key(prefix))
    except (redis.RedisError, redis.exceptions.RedisClusterException, OSError) as exc:
        raise SlackTierError(ErrorKind.IO, f"reading the table identity from {where} failed: "
                             f"{_mask(str(exc), options)}", fix="check the cluster") from None
    if value is None:
        raise SlackTierError(ErrorKind.MISSING, f"{where} holds no table under prefix {prefix!r}", fix=load)
    try:
        table = json.loads(value)
        assert table["layout"] == LAYOUT and int(table["tag_buckets"]) >= 1
        digest, stage, state = table["source_digest"], str(table.get("stage_id") or ""), table["state"]
    except (ValueError, TypeError, KeyError, AssertionError):
        raise SlackTierError(ErrorKind.TARGET, f"{where}: {identity_key(prefix)!r} is not a SlackTier cluster table "
                             "identity", fix=load) from None
    name = f"table {digest} (prefix {prefix!r})"
    if identity is not None and digest != identity.source_digest:
        raise SlackTierError(ErrorKind.TARGET, f"{where}: prefix {prefix!r} holds another table (source {digest}, "
                             f"the manifest's {identity.source_digest})", fix=f"{load}, or use its prefix")
    if identity is not None and stage and identity.stage_id and stage != identity.stage_id:
        raise SlackTierError(ErrorKind.TARGET, f"{where}: {name} was loaded from another staging run (stage {stage}, "
                             f"the manifest's {identity.stage_id})", fix=f"{load} from the latest staging run")
    if state != COMPLETE:
        raise SlackTierError(ErrorKind.TARGET, f"{where}: {name} is {state!r}: a load did not finish, so it is "
                             "never served", fix=f"{load} again (it resumes where it stopped)")
    table["prefix"] = prefix
    return table


def _gen_values(client: RedisCluster, keys: list[bytes]) -> list[bytes | None]:
    pipe = client.pipeline(transaction=False)
    for key in keys:
        pipe.get(key)
    return pipe.execute(raise_on_error=True)


def _check_generations(client: RedisCluster, options: RedisClusterOptions, regions: Sequence[Region],
                       prefixes: Sequence[str], table: dict) -> None:
    """Every page group of `regions` carries the table's generation; else TARGET naming the table and a node."""
    T, gen = int(table["tag_buckets"]), str(table["generation"]).encode()
    keys = [gen_key(p, r.layer, r.rank, g) for p, r in zip(prefixes, regions, strict=True) for g in range(T)]
    try:
        values = _gen_values(client, keys)
    except (redis.RedisError, redis.exceptions.RedisClusterException, OSError) as exc:
        raise SlackTierError(ErrorKind.IO, f"reading generation keys from Redis Cluster at {options.url} failed: "
                             f"{_mask(str(exc), options)}", fix="check the cluster") from None
    bad = [k for k, v in zip(keys, values, strict=True) if v != gen]
    if not bad:
        return
    node = client.nodes_manager.get_node_from_slot(key_slot(bad[0])).name
    r = regions[keys.index(bad[0]) // T]
    raise SlackTierError(ErrorKind.TARGET, f"Redis Cluster at {options.url}: table {table['source_digest']} (prefix "
                         f"{table['prefix']!r}) is incomplete: {len(bad)} of {len(keys)} page groups lack generation "
                         f"{gen.decode()} (first {bad[0]!r} on node {node}: a node restarted empty or was flushed)",
                         layer=r.layer, rank=r.rank,
                         fix="load the table into the cluster again (load_table resumes, rewriting only lost groups)")


# -- loading -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class LoadReport:
    """What `load_table` did."""

    generation: str
    tag_buckets: int     # page groups per region, as loaded (at most the smallest region's pages)
    groups: int          # page groups of the table
    written: int         # groups written this run (0: the table was already complete)
    pages: int           # pages written and verified this run
    seconds: float


def load_table(options: RedisClusterOptions, regions: Sequence[Region], identity: TableIdentity, *,
               page_crc32c: Sequence[np.ndarray], prefix: str | None = None, tag_buckets: int = DEFAULT_TAG_BUCKETS,
               workers: int = 4, progress: bool = False,
               read_pages: Callable[[Region], np.ndarray] = load_region_pages) -> LoadReport:
    """Put staged regions (their files, `read_pages`) into the cluster under `prefix` (default: options.prefix,
    else `default_prefix(identity)`); see the module docstring for the generation protocol. Parallel over page
    groups, resumable, idempotent; every page is read back and its CRC32C checked before its group counts.

    The options' user must be allowed SET/MSET (a loading ACL user); a read-only serving user is refused with
    UNAVAILABLE naming the missing permission."""
    if not 1 <= tag_buckets <= MAX_TAG_BUCKETS:
        raise SlackTierError(ErrorKind.BAD_INPUT, f"tag_buckets {tag_buckets} outside 1..{MAX_TAG_BUCKETS}",
                             fix=f"use 1 to {MAX_TAG_BUCKETS} page groups per region (default {DEFAULT_TAG_BUCKETS})")
    tag_buckets = _buckets_for(tag_buckets, regions)
    if len(page_crc32c) != len(regions):
        raise SlackTierError(ErrorKind.BAD_INPUT, f"{len(page_crc32c)} CRC32C arrays for {len(regions)} regions",
                             fix="pass the manifest's page_crc32c")
    t0 = time.monotonic()
    pfx = prefix or options.prefix or default_prefix(identity)
    client = connect(options)
    generation = generation_of(identity, tag_buckets, regions)
    record = {"format": "slacktier-table", "layout": LAYOUT, "source_digest": identity.source_digest,
              "stage_id": identity.stage_id, "generation": generation, "tag_buckets": tag_buckets,
              "regions": [[r.layer, r.rank, r.pages] for r in regions]}
    groups = [(i, g) for i in range(len(regions)) for g in range(tag_buckets)]
    try:
        current = client.get(identity_key(pfx))
        keys = [gen_key(pfx, regions[i].layer, regions[i].rank, g) for i, g in groups]
        done = [v == generation.encode() for v in _gen_values(client, keys)]
        if current is not None:
            try:
                theirs = json.loads(current)
            except ValueError:
                theirs = {}
            if theirs.get("generation") == generation and theirs.get("state") == COMPLETE and all(done):
                return LoadReport(generation, tag_buckets, len(groups), 0, 0, time.monotonic() - t0)
        client.set(identity_key(pfx), json.dumps({**record, "state": LOADING}).encode())
        todo = [grp for grp, ok in zip(groups, done, strict=True) if not ok]
        cache: dict[int, np.ndarray] = {}
        cache_lock = threading.Lock()

        def pages_of(i: int) -> np.ndarray:
            with cache_lock:
                if i not in cache:
                    cache[i] = read_pages(regions[i])
                return cache[i]

        def write_group(item: tuple[int, int]) -> int:
            i, g = item
            r = regions[i]
            pages = pages_of(i)
            numbers = np.arange(g, r.pages, tag_buckets)
            want = np.asarray(page_crc32c[i], dtype=np.uint32)[numbers]
            got = page_crc32c_of(pages[numbers])
            if not np.array_equal(got, want):
                bad = int(numbers[np.flatnonzero(got != want)[0]])
                raise SlackTierError(ErrorKind.CHECKSUM, "staged page differs from its manifest CRC32C",
                                     layer=r.layer, rank=r.rank, page=bad, fix="stage the table again")
            keys = [page_key(pfx, r.layer, r.rank, int(p), tag_buckets) for p in numbers]
            values = [pages[p].tobytes() + int(c).to_bytes(4, "little") for p, c in zip(numbers, want, strict=True)]
            for lo in range(0, len(keys), KEYS_PER_MGET):
                client.mset(dict(zip(keys[lo:lo + KEYS_PER_MGET], values[lo:lo + KEYS_PER_MGET], strict=True)))
            for lo in range(0, len(keys), KEYS_PER_MGET):
                back = client.mget(keys[lo:lo + KEYS_PER_MGET])
                if back != values[lo:lo + KEYS_PER_MGET]:
                    raise SlackTierError(ErrorKind.IO, "a page read back from the cluster differs from what was "
                                         "written", layer=r.layer, rank=r.rank, fix="check the cluster and load again")
            client.set(gen_key(pfx, r.layer, r.rank, g), generation.encode())
            return len(keys)

        written = 0
        with ThreadPoolExecutor(max_workers=max(1, workers)) as pool, \
                tqdm(total=len(todo), unit="group", desc="loading into Redis Cluster", disable=not progress) as bar:
            for n in pool.map(write_group, todo):
                written += n
                bar.update(1)
        client.set(identity_key(pfx), json.dumps({**record, "state": COMPLETE}).encode())
    except redis.exceptions.NoPermissionError as exc:
        raise SlackTierError(ErrorKind.UNAVAILABLE, f"user {options.username or 'default'!r} may not load into "
                             f"Redis Cluster at {options.url}: {_mask(str(exc), options)}",
                             fix="load with the read-write (loading) ACL user") from None
    except (redis.RedisError, redis.exceptions.RedisClusterException, OSError) as exc:
        raise SlackTierError(ErrorKind.IO, f"loading into Redis Cluster at {options.url} failed: "
                             f"{_mask(str(exc), options)}", fix="check the cluster and load again (it resumes)") from None
    finally:
        client.close()
    log.info("loaded %d of %d page groups (%d pages) of table %s into %s under %r, generation %s", len(todo),
             len(groups), written, identity.source_digest, options.url, pfx, generation)
    return LoadReport(generation, tag_buckets, len(groups), len(todo), written, time.monotonic() - t0)


def _buckets_for(tag_buckets: int, regions: Sequence[Region]) -> int:
    """Page groups per region: `tag_buckets`, or the smallest region's page count when that is smaller.

    Every region has T groups in the identity a source checks (group g holds pages g, g + T, ...), so a T
    above a region's pages would leave groups that no page, and so no generation key, ever fills: the load
    reported success and no source would open it (issue 33). Worked example: regions of 3 and 40 pages,
    tag_buckets 64 -> 3 groups per region."""
    smallest = min((r.pages for r in regions), default=1)
    if tag_buckets > smallest:
        log.warning("tag_buckets %d is above the smallest region's %d pages: loading %d page groups per region",
                    tag_buckets, smallest, max(1, smallest))
    return max(1, min(tag_buckets, smallest))


def load_manifest(options: RedisClusterOptions, manifest: Manifest, **kw) -> LoadReport:
    """`load_table` for every region of a staging manifest, with its checksums and identity."""
    return load_table(options, manifest.runtime_regions(), manifest.identity,
                      page_crc32c=manifest.region_checksums(), **kw)


def page_crc32c_of(pages: np.ndarray) -> np.ndarray:
    """CRC32C of each page [n, 4096] (an empty array for none)."""
    return page_crc32c(pages) if pages.shape[0] else np.zeros(0, np.uint32)


register_tier("redis-cluster", RedisClusterSource, RedisClusterOptions)
