"""The Redis tier's data plane: page reads on its own sockets, one per node, with a compiled reply scan.

Why our own client and not a library: measured, valkey-glide's sync client (valkey-glide-sync, which does
cluster mode, ACL users, TLS and MGET into caller buffers) and redis-py's cluster pipeline both read the same
pages of a local 3-master cluster in well over our wall time and CPU per page, at 700 and at 3,000 pages a
batch (BENCHMARKS.md, "Redis tier", has the figures). A library within 1.2x of our time would replace this file; measure
again before replacing it, with `python -m benchmarks.tier.bench_redis_wire --rounds 9 --batches 20`
(valkey-glide-sync importable): glide's row is the whole batch in one `mget` call, which glide splits by slot.

One round (`read_round`): every node's MGETs (`Command`, one page group each,
packed by compiled code, `_resp.pack_mgets`) are written on that node's own
socket (`NodeLink`: AUTH, SELECT for a standalone db other than 0, READONLY
for replica reads, TLS when the url is rediss://) before any reply is read;
then replies are read from whichever node has bytes (select) into that node's
buffer, a compiled scan (`_resp.scan_mget_replies`) finds the values, and one
compiled pass lands each whole page in the pool and its stored CRC32C aside
(`_resp.land_values`). Redirects (MOVED, ASK, TRYAGAIN, CLUSTERDOWN, LOADING,
MASTERDOWN) and commands on a lost or late node come back for the source's
slow path to retry. A connection with a late or unread reply is closed, never
reused, so no late reply is ever read as another batch's.

On a standalone server the same code runs with one node.
"""

from __future__ import annotations

import selectors
import socket
import ssl
import time
from collections.abc import Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

import numpy as np
import redis

from slacktier.config import RedisOptions
from slacktier.errors import SlackTierError
from slacktier.store.queued import Part
from slacktier.store.redis import _resp
from slacktier.store.redis.client import Node, mask
from slacktier.store.redis.keys import VALUE_BYTES
from slacktier.tables.layout import PAGE_BYTES


@dataclass
class Command:
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


@dataclass
class Got:
    """What a batch has received so far: each read's stored CRC32C, whether it landed, and bad values."""

    stored: np.ndarray                           # [n] uint32
    have: np.ndarray                             # [n] bool
    bad: list[tuple[int, bytes | None]]          # (read, its value: None when the key is missing)


def put_value(part: Part, i: int, value: bytes | None, got: Got) -> None:
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


class NodeLink:
    """Our own connection to one node for page reads: authenticated (and READONLY for replica reads), with a
    receive buffer that replies land in whole (see _resp.py). Closed, never reused, after any error or
    timeout, so no late reply is ever read as another batch's."""

    def __init__(self, node: Node, options: RedisOptions, timeout_s: float) -> None:
        self.name = node.name
        if node.path:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(timeout_s)
            try:
                sock.connect(node.path)
            except BaseException:
                sock.close()
                raise
        else:
            sock = socket.create_connection((node.host, node.port), timeout=timeout_s)
        try:
            if not node.path:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if urlsplit(options.url).scheme == "rediss":
                ctx = ssl.create_default_context(cafile=options.tls_ca_file or None)
                ctx.check_hostname = False   # a cluster announces IPs; the CA still authenticates the node
                sock = ctx.wrap_socket(sock, server_hostname=node.host)
            hello = []
            password = options.password()
            if password is not None:
                hello.append(("AUTH", options.username or "default", password))
            if node.db:
                hello.append(("SELECT", str(node.db)))
            if node.replica:
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
                        raise redis.AuthenticationError(mask(line[1:].decode(errors="replace"), options))
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
class Heads:
    """Every group's key head, concatenated, for the compiled packer: head of group g = data[off[g]:off[g + 1]]."""

    data: np.ndarray   # uint8
    off: np.ndarray    # [G + 1] int64

    @classmethod
    def of(cls, heads: Sequence[bytes]) -> Heads:
        off = np.zeros(len(heads) + 1, np.int64)
        off[1:] = np.cumsum([len(h) for h in heads])
        return cls(np.frombuffer(b"".join(heads), np.uint8).copy(), off)


def _pack_mgets(heads: Heads, commands: list[Command], keys: np.ndarray) -> bytes:
    """The RESP of one MGET per command, packed by compiled code (bit-identical to redis' own packing)."""
    groups = np.array([c.group for c in commands], np.int64)
    pages = np.concatenate([c.pages for c in commands])
    out = np.empty(_resp.mget_bytes_bound(heads.off, groups, keys), np.uint8)
    n = _resp.pack_mgets(heads.data, heads.off, groups, keys, pages, out)
    return out[:n].tobytes()


def read_round(links: dict[str, NodeLink], options: RedisOptions, heads: Heads,
               by_node: dict[str, tuple[Node, list[Command]]], part: Part, got: Got, deadline: float,
                stall_s: float) -> tuple[list[Command], list[str], Exception | None]:
    """One round of MGETs on our own sockets: every node's pipeline written, then replies read from whichever
    node has bytes (select), scanned and landed by compiled code. Returns the commands to retry (redirected,
    or on a lost or late node), the nodes that stalled, and the first error that is not a redirect."""
    t0 = time.monotonic()
    retry: list[Command] = []
    stalled: list[str] = []
    hard: Exception | None = None
    jobs = {}
    sel = selectors.DefaultSelector()
    try:
        for name, (node, commands) in by_node.items():
            try:
                link = links.get(name)
                if link is None:
                    link = links[name] = NodeLink(node, options, max(0.001, deadline - time.monotonic()))
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
                drop(links, name)
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
                drop(links, name)
                if not (job.status[:job.done] == _resp.MALFORMED).any():
                    retry.extend(job.commands[job.done:])
            error = job.land(part, got, retry)
            if error is not None:
                drop(links, name)
                hard = hard or error
    finally:
        sel.close()
    return retry, stalled, hard


def drop(links: dict[str, NodeLink], name: str) -> None:
    link = links.pop(name, None)
    if link is not None:
        link.close()


@dataclass
class _Job:
    """One node's MGETs of one batch, and their replies as scanned so far."""

    link: NodeLink
    commands: list[Command]
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

    def land(self, part: Part, got: Got, retry: list[Command]) -> Exception | None:
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
