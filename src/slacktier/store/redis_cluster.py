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
by the node that serves their slot. The lane writes every node's commands
before reading any reply, so all nodes work at once, each pipelined. The
client is redis-py (hiredis parser): `redis.cluster.RedisCluster` discovers
the topology and owns the per-node connections; this module only routes
(slot -> node from that client's table) and sends, because redis-py's
`ClusterPipeline` resolves every command through its generic policy layer,
which costs more per MGET than the read itself (BENCHMARKS.md measures both).
A MOVED, ASK, CLUSTERDOWN or lost connection refreshes the topology and
retries the failed groups through `RedisCluster.execute_command` (which
follows redirects), until `socket_timeout_ms` after the batch began; then the
batch fails (IO). A master lost mid-run therefore costs a few failed or slow
batches until its replica is promoted, and reads resume without a restart.

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

from slacktier.config import RedisClusterOptions
from slacktier.errors import ErrorKind, SlackTierError
from slacktier.store._common import page_crc32c
from slacktier.store.dram import load_region_pages
from slacktier.store.queued import Lane, Part, QueuedSource, typed_options
from slacktier.store.redis_source import _mask, client_kwargs
from slacktier.store.registry import register_tier
from slacktier.tables.layout import PAGE_BYTES
from slacktier.tables.manifest import Manifest, TableIdentity
from slacktier.tables.regions import Region

log = logging.getLogger(__name__)

#: keys per MGET: one reply of at most ~1 MiB
KEYS_PER_MGET = 256
#: a stored value: the page, then its CRC32C (uint32, little-endian)
VALUE_BYTES = PAGE_BYTES + 4
#: default hash-tag groups per region (see BENCHMARKS.md, "Redis Cluster: hash tags")
DEFAULT_TAG_BUCKETS = 64
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
        client = RedisCluster(host=parts.hostname or "127.0.0.1", port=parts.port or 6379,
                              require_full_coverage=False,
                              retry=redis.retry.Retry(redis.backoff.NoBackoff(), 1), **kw)
    except redis.AuthenticationError as exc:
        raise SlackTierError(ErrorKind.UNAVAILABLE, f"Redis Cluster at {options.url} refused the credentials of "
                             f"user {options.username or 'default'!r}: {_mask(str(exc), options)}",
                             fix="set username and password_env (or password_file) in [table.redis-cluster] to an "
                                 "ACL user that may read the table") from None
    except (redis.RedisError, redis.exceptions.RedisClusterException, OSError) as exc:
        text = _mask(str(exc), options)
        if "NOAUTH" in text or "Authentication" in text or "auth" in text.lower():
            raise SlackTierError(ErrorKind.UNAVAILABLE, f"Redis Cluster at {options.url} wants credentials: {text}",
                                 fix="set username and password_env (or password_file) in [table.redis-cluster]"
                                 ) from None
        raise SlackTierError(ErrorKind.UNAVAILABLE, f"cannot reach Redis Cluster at {options.url}: {text}",
                             fix="start the cluster there or pass the url of one of its nodes") from None
    return client


def _node_of_slot(client: RedisCluster, slot: int, replicas: bool) -> ClusterNode:
    strategy = LoadBalancingStrategy.ROUND_ROBIN if replicas else None
    return client.nodes_manager.get_node_from_slot(slot, load_balancing_strategy=strategy)


@dataclass
class _Command:
    """One MGET of one page group: where its keys' values go in the part."""

    slot: int
    keys: list[bytes]
    index: np.ndarray  # [k] positions in the part


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
                        redis.exceptions.ClusterDownError):
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


class RedisClusterSource(QueuedSource[None]):
    """Pages read from a Redis Cluster, grouped by slot, pipelined per node, all nodes at once."""

    read_what = "redis-cluster read"
    engine_name = "redis-cluster-mget"
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

    def _close_lane(self, lane: Lane[None]) -> None:
        self._client.close()

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
                keys = [b"%s%d" % (head, p) for p in page[chunk].tolist()]
                out.append(_Command(slot, keys, positions[chunk]))
        return out

    def _route(self, commands: Iterable[_Command]) -> dict[str, tuple[ClusterNode, list[_Command]]]:
        by_node: dict[str, tuple[ClusterNode, list[_Command]]] = {}
        replicas = self.options.read_from_replicas
        for c in commands:
            node = _node_of_slot(self._client, c.slot, replicas)
            by_node.setdefault(node.name, (node, []))[1].append(c)
        return by_node

    def _read(self, lane: Lane[None], part: Part) -> SlackTierError | None:
        n = part.region.shape[0]
        replies: list[bytes | None] = [None] * n
        timeout_s = self.options.socket_timeout_ms / 1e3
        deadline = time.monotonic() + timeout_s
        pending = self._commands(part.region, part.page, np.arange(n))
        try:
            by_node = self._route(pending)
        except (redis.RedisError, OSError):  # a slot with no known node: the slow path refreshes the topology
            by_node = None
        if by_node is not None:
            pending, stalled, hard = _send_all(self._client, by_node, replies, STALL_FRACTION * timeout_s)
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
                self._client.nodes_manager.initialize()
            except (redis.RedisError, OSError) as exc:
                last = exc
                continue
            still = []
            for c in pending:
                if time.monotonic() >= deadline:
                    still.append(c)
                    continue
                try:
                    values = self._client.execute_command("MGET", *c.keys)
                except (redis.RedisError, OSError) as exc:
                    still.append(c)
                    last = exc
                    continue
                for j, v in zip(c.index.tolist(), values, strict=True):
                    replies[j] = v
            pending = still
        return self._land(part, replies)

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

    def _land(self, part: Part, replies: list[bytes | None]) -> SlackTierError | None:
        for i, value in enumerate(replies):
            if value is None or len(value) != VALUE_BYTES:
                return self._bad_value(part, i, value)
        arr = np.frombuffer(b"".join(replies), dtype=np.uint8).reshape(len(replies), VALUE_BYTES)  # type: ignore[arg-type]
        if self._expected is not None:
            stored = arr[:, PAGE_BYTES:].copy().view("<u4").ravel()
            want = self._expected[self._region_base[part.region] + part.page]
            bad = np.flatnonzero(stored != want)
            if bad.size:
                i = int(bad[0])
                return SlackTierError(ErrorKind.CHECKSUM, f"{self.read_what}: stored CRC32C {int(stored[i]):#010x}, "
                                      f"manifest says {int(want[i]):#010x}: a page of another load",
                                      **self._where(int(part.region[i]), int(part.page[i])),
                                      fix="load this table into the cluster again")
        part.pool.pages[part.buffer] = arr[:, :PAGE_BYTES]
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
    except (redis.RedisError, OSError) as exc:
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
    except (redis.RedisError, OSError) as exc:
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
    if tag_buckets < 1:
        raise SlackTierError(ErrorKind.BAD_INPUT, f"tag_buckets {tag_buckets}", fix="use 1 or more")
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
    groups = [(i, g) for i in range(len(regions)) for g in range(min(tag_buckets, regions[i].pages) or 1)]
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
                return LoadReport(generation, len(groups), 0, 0, time.monotonic() - t0)
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
        bar = _progress(len(todo), progress)
        with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
            for n in pool.map(write_group, todo):
                written += n
                bar(1)
        client.set(identity_key(pfx), json.dumps({**record, "state": COMPLETE}).encode())
    except redis.exceptions.NoPermissionError as exc:
        raise SlackTierError(ErrorKind.UNAVAILABLE, f"user {options.username or 'default'!r} may not load into "
                             f"Redis Cluster at {options.url}: {_mask(str(exc), options)}",
                             fix="load with the read-write (loading) ACL user") from None
    except (redis.RedisError, OSError) as exc:
        raise SlackTierError(ErrorKind.IO, f"loading into Redis Cluster at {options.url} failed: "
                             f"{_mask(str(exc), options)}", fix="check the cluster and load again (it resumes)") from None
    finally:
        client.close()
    log.info("loaded %d of %d page groups (%d pages) of table %s into %s under %r, generation %s", len(todo),
             len(groups), written, identity.source_digest, options.url, pfx, generation)
    return LoadReport(generation, len(groups), len(todo), written, time.monotonic() - t0)


def load_manifest(options: RedisClusterOptions, manifest: Manifest, **kw) -> LoadReport:
    """`load_table` for every region of a staging manifest, with its checksums and identity."""
    every = manifest.checksums()
    crcs = [every[r.crc_first_page:r.crc_first_page + r.pages] for r in manifest.regions]
    return load_table(options, manifest.runtime_regions(), manifest.identity, page_crc32c=crcs, **kw)


def page_crc32c_of(pages: np.ndarray) -> np.ndarray:
    """CRC32C of each page [n, 4096] (an empty array for none)."""
    return page_crc32c(pages) if pages.shape[0] else np.zeros(0, np.uint32)


def _progress(total: int, on: bool) -> Callable[[int], None]:
    if not on or total == 0:
        return lambda k: None
    from tqdm import tqdm
    bar = tqdm(total=total, unit="group", desc="loading into Redis Cluster")

    def step(k: int) -> None:
        bar.update(k)
        if bar.n >= total:
            bar.close()
    return step


register_tier("redis-cluster", RedisClusterSource, RedisClusterOptions)
