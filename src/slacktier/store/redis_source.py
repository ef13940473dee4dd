"""Remote memory tier: pages in a Redis server, one copy shared by many serving instances.

Layout: one key per page, ``{prefix}:{layer}:{rank}:{page}`` holding the 4096
raw bytes (the prefix is `RedisOptions.prefix`, else the region's `Region.path`). Why not pack a region
into large values and read with GETRANGE: GETRANGE reads one range per command,
so a batch of 3,000 scattered pages is 3,000 commands either way, while MGET
fetches hundreds of pages per command with one round trip; a key per page
costs ~2% extra server memory (about 70 B of key and object header per 4 KiB),
and a page can be rewritten or checked alone.

One worker lane (store/queued.py) sends one pipeline of MGETs
(`KEYS_PER_MGET` keys each) per batch and copies the replies into the pool.

Identity: the loader writes ``{prefix}:identity``, JSON with the manifest's
source digest and stage id and a state: "loading" before the first page,
"complete" after the last (a load without an identity deletes the key). A
source given an identity refuses, at open or in `verify_identity`, a prefix
whose key is absent (MISSING), names another table or staging run, or says
"loading" (TARGET).

Bounded waits: every connect and reply is bounded by
`RedisOptions.socket_timeout_ms`, and the retry policy is set here rather
than left to the client version (redis-py 6+ retries timeouts three times
with up to 10 s backoff): a dropped connection is retried once, at once; a
timeout is not. A stopped server fails the batch (IO) in at most about twice
the timeout.

Secrets: the ACL user is `RedisOptions.username`; its password comes from the
environment or a file (`RedisOptions.password`), never from the control file
(a url with a password is refused), and is replaced by *** in any client
error text before it is logged or raised. TLS: `tls_ca_file` with a rediss://
url.

Pages are checked against the manifest's CRC32Cs by default
(`verify_by_default`): remote memory, with no end-to-end checksum of its own.

Worked example: page 12 of layer 1, rank 3 under prefix "t0" -> key "t0:1:3:12";
that table's identity -> key "t0:identity".
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Sequence

import numpy as np
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from slacktier.config import RedisOptions
from slacktier.errors import ErrorKind, SlackTierError
from slacktier.store.dram import load_region_pages
from slacktier.store.queued import Lane, Part, QueuedSource, typed_options
from slacktier.store.registry import register_tier
from slacktier.tables.layout import PAGE_BYTES
from slacktier.tables.manifest import TableIdentity
from slacktier.tables.regions import Region

log = logging.getLogger(__name__)

#: keys per MGET command: one round trip fetches up to 1 MiB of pages, small enough not to stall the server
KEYS_PER_MGET = 256
#: states of a prefix's identity key
LOADING, COMPLETE = "loading", "complete"


def page_key(prefix: str, layer: int, rank: int, page: int) -> bytes:
    """Redis key of one page: ("t0", 1, 3, 12) -> b"t0:1:3:12"."""
    return f"{prefix}:{layer}:{rank}:{page}".encode()


def identity_key(prefix: str) -> bytes:
    """Redis key of the identity of the table under `prefix`: "t0" -> b"t0:identity"."""
    return f"{prefix}:identity".encode()


def _identity_value(identity: TableIdentity, state: str) -> bytes:
    return json.dumps({"format": "slacktier-table", "source_digest": identity.source_digest,
                       "stage_id": identity.stage_id, "state": state}).encode()


def _mask(text: str, options: RedisOptions) -> str:
    """`text` with the options' password replaced by ***, wherever it appears."""
    try:
        secret = options.password()
    except SlackTierError:
        return text
    return text.replace(secret, "***") if secret else text


def auth_refusal(options: RedisOptions) -> str:
    """How a server's authentication refusal reads: naming the user, never the password."""
    user = options.username or "default"
    try:
        sent = options.password() is not None
    except SlackTierError:
        sent = False
    return f"refused the credentials of user {user!r}" if sent else \
        f"wants credentials (user {user!r} sent no password)"


def as_options(url_or_options: str | RedisOptions) -> RedisOptions:
    """Options from a url (no credentials) or the options themselves."""
    return url_or_options if isinstance(url_or_options, RedisOptions) else RedisOptions(url=url_or_options)


def client_kwargs(options: RedisOptions) -> dict:
    """redis-py keywords for `options`: timeouts, retry policy, ACL user, password, TLS."""
    timeout_s = options.socket_timeout_ms / 1e3
    kw: dict = {"decode_responses": False, "socket_timeout": timeout_s, "socket_connect_timeout": timeout_s,
                "retry_on_timeout": False, "retry": Retry(NoBackoff(), 1, supported_errors=(redis.ConnectionError,))}
    if options.username:
        kw["username"] = options.username
    password = options.password()
    if password is not None:
        kw["password"] = password
    if options.tls_ca_file:
        kw["ssl_ca_certs"] = options.tls_ca_file
    return kw


def _connect(options: RedisOptions) -> redis.Redis:
    """A client whose connects and replies are bounded by `socket_timeout_ms`, after a PING (UNAVAILABLE).

    Errors here and below are raised `from None`: the client's own exception
    may carry the url, and so the password, in its text or arguments.
    """
    client = redis.Redis.from_url(options.url, **client_kwargs(options))
    try:
        client.ping()
    except redis.AuthenticationError as exc:
        client.close()
        what = auth_refusal(options)
        raise SlackTierError(ErrorKind.UNAVAILABLE, f"Redis at {options.url} {what}: {_mask(str(exc), options)}",
                             fix="set username and password_env (or password_file) in [table.redis] to an ACL "
                                 "user that may read the table") from None
    except redis.RedisError as exc:
        client.close()
        raise SlackTierError(ErrorKind.UNAVAILABLE, f"cannot reach Redis at {options.url}: "
                             f"{_mask(str(exc), options)}",
                             fix="start redis-server there or pass the right url") from None
    return client


def _check_pages(pages: np.ndarray, layer: int, rank: int) -> None:
    if pages.dtype != np.uint8 or pages.ndim != 2 or pages.shape[1] != PAGE_BYTES or pages.shape[0] == 0:
        raise SlackTierError(ErrorKind.BAD_INPUT, f"pages must be [P>0, {PAGE_BYTES}] uint8, got {pages.shape} "
                             f"{pages.dtype}", layer=layer, rank=rank, fix="pack rows into pages first")


def _write_region(client: redis.Redis, prefix: str, layer: int, rank: int, pages: np.ndarray,
                  pages_per_command: int) -> None:
    pipe = client.pipeline(transaction=False)
    for lo in range(0, pages.shape[0], pages_per_command):
        hi = min(lo + pages_per_command, pages.shape[0])
        pipe.mset({page_key(prefix, layer, rank, p): pages[p].tobytes() for p in range(lo, hi)})
    pipe.execute()


def _load(options: RedisOptions, prefixes: Sequence[str], identity: TableIdentity | None,
          write: Callable[[redis.Redis], None]) -> None:
    """Mark each prefix loading (or drop its identity), run `write(client)`, then mark them complete."""
    client = _connect(options)
    try:
        for prefix in dict.fromkeys(prefixes):
            if identity is None:  # pages of an unnamed table: no stale identity may vouch for them
                client.delete(identity_key(prefix))
            else:
                client.set(identity_key(prefix), _identity_value(identity, LOADING))
        write(client)
        if identity is not None:
            for prefix in dict.fromkeys(prefixes):
                client.set(identity_key(prefix), _identity_value(identity, COMPLETE))
    except redis.RedisError as exc:
        raise SlackTierError(ErrorKind.IO, f"loading pages into Redis at {options.url} failed: "
                             f"{_mask(str(exc), options)}", fix="check the Redis server and load again") from None
    finally:
        client.close()


def store_region_pages(url: str | RedisOptions, prefix: str, layer: int, rank: int, pages: np.ndarray, *, device: int = 0,
                       pages_per_command: int = 256, identity: TableIdentity | None = None) -> Region:
    """Write one region's pages [P, 4096] uint8 under `prefix` (and, with `identity`, the prefix's identity key,
    complete once the pages are in); return the Redis region spec."""
    _check_pages(pages, layer, rank)
    _load(as_options(url), [prefix], identity,
          lambda client: _write_region(client, prefix, layer, rank, pages, pages_per_command))
    return Region(layer=layer, rank=rank, path=prefix, offset_bytes=0, pages=int(pages.shape[0]), device=device)


def load_regions_into_redis(url: str | RedisOptions, regions: Sequence[Region], prefix: str, *,
                            identity: TableIdentity | None = None) -> list[Region]:
    """Copy staged regions (files) into Redis under `prefix`, with the table's `identity` (`Manifest.identity`)
    written last; return the Redis region specs, same order."""
    def write(client: redis.Redis) -> None:
        for spec in regions:
            _write_region(client, prefix, spec.layer, spec.rank, load_region_pages(spec), 256)

    options = as_options(url)
    _load(options, [prefix], identity, write)
    log.info("loaded %d regions (%d pages) into Redis at %s under %r%s", len(regions),
             sum(s.pages for s in regions), options.url, prefix,
             "" if identity is None else f", table {identity.source_digest} stage {identity.stage_id}")
    return [Region(layer=s.layer, rank=s.rank, path=prefix, offset_bytes=0, pages=s.pages, device=s.device)
            for s in regions]


def _check_identity(client: redis.Redis, options: RedisOptions, prefixes: Sequence[str],
                    identity: TableIdentity) -> None:
    """Each prefix's identity key names `identity`, complete; else MISSING (no key) or TARGET."""
    prefixes = list(dict.fromkeys(prefixes))
    where = f"Redis at {options.url}"
    load = "load the table with load_regions_into_redis(..., identity=manifest.identity)"
    try:
        values = client.mget([identity_key(p) for p in prefixes])
    except redis.RedisError as exc:
        raise SlackTierError(ErrorKind.IO, f"reading table identities from {where} failed: "
                             f"{_mask(str(exc), options)}", fix="check the Redis server") from None
    for prefix, value in zip(prefixes, values, strict=True):
        if value is None:
            raise SlackTierError(ErrorKind.MISSING, f"{where} holds no table identity under prefix {prefix!r}",
                                 fix=load)
        try:
            theirs = json.loads(value)
            digest, stage, state = theirs["source_digest"], str(theirs.get("stage_id") or ""), theirs["state"]
        except (ValueError, TypeError, KeyError):
            raise SlackTierError(ErrorKind.TARGET, f"{where}: identity key of prefix {prefix!r} is not a "
                                 "SlackTier table identity", fix=load) from None
        if digest != identity.source_digest:
            raise SlackTierError(ErrorKind.TARGET, f"{where}: prefix {prefix!r} holds another table (source "
                                 f"{digest}, the manifest's {identity.source_digest})",
                                 fix=f"{load}, or use the prefix that holds this table")
        if stage and identity.stage_id and stage != identity.stage_id:
            raise SlackTierError(ErrorKind.TARGET, f"{where}: prefix {prefix!r} was loaded from another staging run "
                                 f"(stage {stage}, the manifest's {identity.stage_id})",
                                 fix=f"{load} from the latest staging run")
        if state != COMPLETE:
            raise SlackTierError(ErrorKind.TARGET, f"{where}: prefix {prefix!r} is in state {state!r}: a load did "
                                 "not finish", fix=f"{load} and let it complete")


class RedisSource(QueuedSource[None]):
    """Pages read from a shared Redis server with pipelined MGET."""

    read_what = "redis read"
    engine_name = "redis-mget"
    #: remote memory with no end-to-end checksum of its own: reads are checked against the manifest by default
    verify_by_default = True

    def __init__(self, regions: Sequence[Region], options: RedisOptions | None = None, *,
                 page_crc32c: Sequence[np.ndarray] | None = None, identity: TableIdentity | None = None) -> None:
        super().__init__(regions, page_crc32c=page_crc32c)
        self.options = typed_options(options, RedisOptions)
        self.url = self.options.url  # for logs and errors (it never holds a secret)
        self._prefix = [self.options.prefix or r.path for r in self.regions]  # [R] key prefix of each region
        self._client = _connect(self.options)
        try:
            if identity is not None:
                _check_identity(self._client, self.options, self._prefix, identity)
            self._check_regions_present()
        except BaseException:
            self._client.close()
            raise
        self._start_lanes(1)
        log.info("RedisSource: engine %s, %d regions at %s, socket timeout %.0f ms", self.engine_name,
                 len(self.regions), self.url, self.options.socket_timeout_ms)

    @classmethod
    def verify_identity(cls, regions: Sequence[Region], options: RedisOptions | None,
                        identity: TableIdentity) -> None:
        """Each key prefix of `regions` carries `identity`, complete (one MGET on a fresh connection)."""
        opts = typed_options(options, RedisOptions)
        client = _connect(opts)
        try:
            _check_identity(client, opts, [opts.prefix or r.path for r in regions], identity)
        finally:
            client.close()

    def _key(self, region: int, page: int) -> bytes:
        r = self.regions[region]
        return page_key(self._prefix[region], r.layer, r.rank, page)

    def _check_regions_present(self) -> None:
        # The first and last page of each region: catches a region never loaded or loaded short.
        keys = [self._key(i, page) for i, r in enumerate(self.regions) for page in (0, r.pages - 1)]
        pipe = self._client.pipeline(transaction=False)
        for key in keys:
            pipe.exists(key)
        try:
            found = pipe.execute()
        except redis.RedisError as exc:
            raise SlackTierError(ErrorKind.IO, f"checking regions at Redis {self.url} failed: "
                                 f"{_mask(str(exc), self.options)}", fix="check the Redis server") from None
        for i, r in enumerate(self.regions):
            for j, page in enumerate((0, r.pages - 1)):
                if not found[2 * i + j]:
                    raise SlackTierError(ErrorKind.MISSING, f"Redis at {self.url} has no key {keys[2 * i + j]!r}",
                                         layer=r.layer, rank=r.rank, page=page,
                                         fix="load the region with load_regions_into_redis")

    def _close_lane(self, lane: Lane[None]) -> None:
        self._client.close()

    def _read(self, lane: Lane[None], part: Part) -> SlackTierError | None:
        keys = [self._key(r, p) for r, p in zip(part.region.tolist(), part.page.tolist(), strict=True)]
        try:
            pipe = self._client.pipeline(transaction=False)
            for lo in range(0, len(keys), KEYS_PER_MGET):
                pipe.mget(keys[lo:lo + KEYS_PER_MGET])
            values = [v for reply in pipe.execute() for v in reply]
        except redis.RedisError as exc:  # named by the batch's first page; the connection is dropped, no late reply
            timed_out = isinstance(exc, redis.TimeoutError)
            what = f"no reply within {self.options.socket_timeout_ms:.0f} ms" if timed_out else "failed"
            return SlackTierError(ErrorKind.IO, f"Redis read of {len(keys)} pages at {self.url} {what}: "
                                  f"{_mask(str(exc), self.options)}",
                                  **self._where(int(part.region[0]), int(part.page[0])),
                                  fix="check the Redis server (a stopped or overloaded server), or raise "
                                      "socket_timeout_ms in [table.redis]")
        for i, value in enumerate(values):
            if value is None or len(value) != PAGE_BYTES:
                where = self._where(int(part.region[i]), int(part.page[i]))
                if value is None:
                    return SlackTierError(ErrorKind.MISSING, f"Redis has no key {keys[i]!r}", **where,
                                          fix="load the region again with load_regions_into_redis")
                return SlackTierError(ErrorKind.IO, f"short read: key {keys[i]!r} holds {len(value)} of "
                                      f"{PAGE_BYTES} bytes", **where, fix="load the region again")
        part.pool.pages[part.buffer] = np.frombuffer(b"".join(values), dtype=np.uint8).reshape(len(values), PAGE_BYTES)
        return None


register_tier("redis", RedisSource, RedisOptions)
