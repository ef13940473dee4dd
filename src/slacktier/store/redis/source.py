"""The Redis tier's page source: `RedisSource`, registered as tier "redis", standalone or cluster.

Reads. One worker per source. A batch's pages are grouped by (region, page
group), one MGET per group (at most `KEYS_PER_MGET` keys; keys.py), and the
MGETs are sorted by the node that serves their slot (client.py: the one
server, or the cluster's topology from redis-py's cluster client). The worker
writes every node's pipeline on its own socket and lands the replies with a
compiled scan (`_wire.read_round`; why our own client and not a library: the
top of _wire.py). A MOVED, ASK, CLUSTERDOWN or lost connection refreshes the
topology and retries the failed groups (an ASK or TRYAGAIN group key by key
through the cluster client, which follows each key's ASK), until
`socket_timeout_ms` after the batch began; then the batch fails (IO). A
master lost mid-run therefore costs a few failed or slow batches until its
replica is promoted, and reads resume without a restart.

Stalls. A node whose reply to a batch took longer than `STALL_FRACTION` of
`socket_timeout_ms` counts as a stall (`stalls`, by node, logged); a node
that does not answer within the timeout fails the batch (IO). The engine's
own bound is `wait_timeout_ms`: when it passes first, gather raises TIMEOUT
for that layer and the batch's buffers are retired, so a late reply never
lands in a buffer in use (engine/step.py).

Checks. At open (and in `verify_identity`, on a source kept across a reload):
the prefix holds the manifest's table, complete, every page group in its
generation (identity.py). That is checked once; another table can be loaded
under the same keys later (a second `slacktier load` into the prefix, live or
not). So every read value's stored CRC32C is compared with the manifest's, on
every read, whatever `verify_reads` says (`stored_crc32c`: the engine always
passes the manifest's CRC32Cs): a value of another load is refused and never
lands in a row. The stored CRC32C was written in the same value as its page,
so a value whose stored CRC32C equals the manifest's holds the manifest's
page, unless the bytes changed inside the server after the load; that is what
`verify_pages` (`verify_reads`, on by default: remote memory has no end-to-end
checksum of its own) checks, by computing each page's CRC32C. A missing page
names its key and node, and says whether its whole group is gone (a node
restarted empty).

Worked example: prefix "t0", T = 64, pages 76 and 140 of layer 1 rank 3 ->
both in group 12 -> one MGET {t0:1:3:12}:76 {t0:1:3:12}:140 to the node of
slot key_slot("t0:1:3:12").
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Sequence

import numpy as np
from redis.crc import key_slot

from slacktier.config import RedisOptions
from slacktier.errors import ErrorKind, SlackTierError
from slacktier.store.queued import Part, QueuedSource, Worker, typed_options
from slacktier.store.redis import _resp
from slacktier.store.redis._wire import Command, Got, Heads, put_value, read_round
from slacktier.store.redis.client import CLIENT_ERRORS, Control, Node, mask
from slacktier.store.redis.identity import LOAD_FIX, check_generations, verify
from slacktier.store.redis.keys import KEYS_PER_MGET, VALUE_BYTES, default_prefix, group_tag, page_key
from slacktier.store.registry import register_tier
from slacktier.tables.manifest import TableIdentity
from slacktier.tables.regions import Region

log = logging.getLogger(__name__)

#: a node reply slower than this fraction of socket_timeout_ms counts as a stall
STALL_FRACTION = 0.25


class RedisSource(QueuedSource[dict]):
    """Pages read from Redis (one server or a cluster), grouped by slot, pipelined per node, all nodes at once."""

    #: remote memory with no end-to-end checksum of its own: reads are checked against the manifest by default
    verify_by_default = True
    #: each value is the page and its CRC32C: the stored CRC32C is compared with the manifest's on every read
    stored_crc32c = True
    read_what, engine_name = "redis read", "resp-scan"

    def __init__(self, regions: Sequence[Region], options: RedisOptions | None = None, *,
                 page_crc32c: Sequence[np.ndarray] | None = None, identity: TableIdentity | None = None,
                 verify_pages: bool = True) -> None:
        self.options = typed_options(options, RedisOptions)   # a wrong options type fails before any thread starts
        self.url = self.options.url   # for logs and errors (it never holds a secret)
        super().__init__(regions, page_crc32c=page_crc32c, verify_pages=verify_pages)
        self._prefix = [self.options.prefix or default_prefix(identity)] * len(self.regions)
        self._control = Control(self.options)
        self.stalls: dict[str, int] = {}   # node -> batches whose reply from it was slow or never came
        self._stall_lock = threading.Lock()
        try:
            self._table = verify(self._control, self.regions, self._prefix, identity)
        except BaseException:
            self._control.close()
            raise
        self.tag_buckets = T = int(self._table["tag_buckets"])
        tags = [group_tag(self._prefix[i], r.layer, r.rank, g).encode() for i, r in enumerate(self.regions)
                for g in range(T)]                                      # [R * T], group = region * T + bucket
        self._group_slot = np.array([key_slot(t) for t in tags], dtype=np.int32)
        self._group_head = [b"{%s}:" % t for t in tags]
        self._heads = Heads.of(self._group_head)
        self._slot_node: dict[int, Node] = {}   # slot -> master, until the slow path refreshes the map
        self._start_workers(1)
        log.info("RedisSource: %d regions at %s (%s, %d nodes, %d page groups per region%s)", len(self.regions),
                 self.url, self.options.mode, self._control.nodes(), T,
                 ", replicas read" if self.options.read_from_replicas else "")

    @classmethod
    def verify_identity(cls, regions: Sequence[Region], options: RedisOptions | None,
                        identity: TableIdentity) -> None:
        """The deployment holds `identity`, complete, with every page group of `regions` in its generation."""
        opts = typed_options(options, RedisOptions)
        control = Control(opts)
        try:
            verify(control, regions, [opts.prefix or default_prefix(identity)] * len(regions), identity)
        finally:
            control.close()

    def _commands(self, region: np.ndarray, page: np.ndarray, positions: np.ndarray) -> list[Command]:
        T = self.tag_buckets
        group = region.astype(np.int64) * T + page % T
        order = np.argsort(group, kind="stable")
        cuts = np.flatnonzero(np.diff(group[order])) + 1
        out = []
        for idx in np.split(order, cuts):
            g = int(group[idx[0]])
            head = self._group_head[g]  # b"{t0:1:3:12}:"
            slot = int(self._group_slot[g])
            for lo in range(0, idx.shape[0], KEYS_PER_MGET):
                chunk = idx[lo:lo + KEYS_PER_MGET]
                out.append(Command(slot, head, g, page[chunk].astype(np.int64), positions[chunk]))
        return out

    def _route(self, commands: Iterable[Command]) -> dict[str, tuple[Node, list[Command]]]:
        """The commands by the node that serves their slot: the master, remembered per slot until the slow path
        refreshes the topology; with `read_from_replicas`, the client's round robin, asked each time."""
        by_node: dict[str, tuple[Node, list[Command]]] = {}
        replicas = self.options.read_from_replicas
        known = self._slot_node
        for c in commands:
            node = None if replicas else known.get(c.slot)
            if node is None:
                node = self._control.node_of_slot(c.slot)
                if not replicas:
                    known[c.slot] = node
            by_node.setdefault(node.name, (node, []))[1].append(c)
        return by_node

    def _warm(self) -> None:
        super()._warm()
        _resp.warm()   # the reply scan

    def _open_worker(self, worker: Worker[dict]) -> None:
        worker.state = {}   # node name -> NodeLink, opened on first use, on this worker's thread

    def _close_worker(self, worker: Worker[dict]) -> None:
        for link in (worker.state or {}).values():
            link.close()
        self._control.close()

    def _round(self, worker: Worker[dict], by_node, part: Part, got: Got, deadline: float,
               timeout_s: float) -> tuple[list[Command], Exception | None]:
        left, stalled, hard = read_round(worker.state, self.options, self._heads, by_node, part, got, deadline,
                                         STALL_FRACTION * timeout_s)
        self._count_stalls(stalled)
        return left, hard

    def _read(self, worker: Worker[dict], part: Part) -> SlackTierError | None:
        n = part.region.shape[0]
        got = Got(np.zeros(n, np.uint32), np.zeros(n, np.bool_), [])
        timeout_s = self.options.socket_timeout_ms / 1e3
        deadline = time.monotonic() + timeout_s
        pending = self._commands(part.region, part.page, np.arange(n))
        try:
            by_node = self._route(pending)
        except CLIENT_ERRORS:  # a slot with no known node: the slow path refreshes the topology
            by_node = None
        if by_node is not None:
            pending, hard = self._round(worker, by_node, part, got, deadline, timeout_s)
            if hard is not None:
                return self._io_error(part, pending, hard)
        moved = [c.redirect for c in pending if c.redirect in (b"MOVED", b"ASK")]
        if moved and not self._control.cluster:   # the CLUSTER INFO check at open was not allowed to this user
            return SlackTierError(ErrorKind.BAD_INPUT, f"{self._control.where} answered {moved[0].decode()}: it "
                                  "is a cluster node, and [table.redis] says mode = \"standalone\"",
                                  **self._where(int(part.region[0]), int(part.page[0])),
                                  fix='set mode = "cluster" in [table.redis]')
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
                self._control.refresh()
            except CLIENT_ERRORS as exc:
                last = exc
                continue
            # A slot being migrated (ASK, TRYAGAIN for an MGET whose keys are split between two nodes): key by
            # key through the cluster client, which follows each key's ASK. Everything else: another round.
            moving = [c for c in pending if c.redirect in (b"ASK", b"TRYAGAIN")]
            again = [c for c in pending if c.redirect not in (b"ASK", b"TRYAGAIN")]
            still: list[Command] = []
            for c in moving:
                try:
                    values = [self._control.client.execute_command("GET", k) for k in c.keys]
                except CLIENT_ERRORS as exc:
                    still.append(c)
                    last = exc
                    continue
                for j, v in zip(c.index.tolist(), values, strict=True):
                    put_value(part, j, v, got)
            if again:
                try:
                    by_node = self._route(again)
                except CLIENT_ERRORS as exc:
                    still.extend(again)
                    last = exc
                    by_node = None
                if by_node is not None:
                    for c in again:
                        c.redirect = b""
                    left, hard = self._round(worker, by_node, part, got, deadline, timeout_s)
                    if hard is not None:
                        return self._io_error(part, left, hard)
                    still.extend(left)
            pending = still
        return self._landed(part, got)

    def _count_stalls(self, nodes: list[str]) -> None:
        if not nodes:
            return
        with self._stall_lock:
            for name in nodes:
                self.stalls[name] = self.stalls.get(name, 0) + 1
        log.warning("Redis: slow reply from %s (over %.0f%% of socket_timeout_ms)", ", ".join(nodes),
                    100 * STALL_FRACTION)

    def _io_error(self, part: Part, pending: list[Command], exc: BaseException | None, *,
                  timed_out: bool = False) -> SlackTierError:
        i = int(pending[0].index[0]) if pending else 0
        what = (f"{sum(len(c.keys) for c in pending)} pages unread after {self.options.socket_timeout_ms:.0f} ms"
                if timed_out else "failed")
        text = mask(str(exc), self.options) if exc is not None else "no node answered"
        return SlackTierError(ErrorKind.IO, f"read from {self._control.where} {what}: {text}",
                              **self._where(int(part.region[i]), int(part.page[i])),
                              fix="check the server (on a cluster, CLUSTER INFO: a master down with no replica, a "
                                  "paused node), or raise socket_timeout_ms in [table.redis]")

    def _landed(self, part: Part, got: Got) -> SlackTierError | None:
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
                                      f"another load, key {self._key(part, i)!r}",
                                      **self._where(int(part.region[i]), int(part.page[i])), fix=LOAD_FIX)
        return None

    def _key(self, part: Part, i: int) -> bytes:
        r = int(part.region[i])
        reg = self.regions[r]
        return page_key(self._prefix[r], reg.layer, reg.rank, int(part.page[i]), self.tag_buckets)

    def _bad_value(self, part: Part, i: int, value: bytes | None) -> SlackTierError:
        r, page = int(part.region[i]), int(part.page[i])
        reg = self.regions[r]
        key = self._key(part, i)
        where = self._where(r, page)
        try:
            node = self._control.node_name(key)
        except CLIENT_ERRORS:
            node = "unknown"
        if value is not None:
            return SlackTierError(ErrorKind.IO, f"{self.read_what}: key {key!r} on node {node} holds {len(value)} "
                                  f"bytes, a page value is {VALUE_BYTES}", **where, fix=LOAD_FIX)
        try:  # a missing page: is it the whole group (a node restarted empty, a flush)?
            check_generations(self._control, [reg], [self._prefix[r]], self._table)
        except SlackTierError as exc:
            return exc
        return SlackTierError(ErrorKind.MISSING, f"{self.read_what}: no key {key!r} on node {node} although its "
                              "group is complete", **where, fix=LOAD_FIX)


register_tier("redis", RedisSource, RedisOptions)
