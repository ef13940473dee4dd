"""The Redis tier's control-plane connection, one shape for both modes: `Control(options)`.

mode = "standalone": one server at `url` (redis-py's `Redis`); every slot is
that server. mode = "cluster": a cluster through the seed node in `url` (and
`nodes`), redis-py's `RedisCluster`, which discovers the nodes and follows
redirects. Either way `Control` offers what the loader, the identity checks
and the source's slow path need: `client` (get / set / mset / mget /
pipeline, the same calls on both), `node_of_slot` (where the page reads of a
slot go), `refresh` (after a redirect or a lost node) and `node_name` (for
errors). Page reads themselves go over the tier's own sockets (`_wire.py`).

A mode that does not match the server is refused at connect (BAD_INPUT):
a cluster node read as a standalone server would answer MOVED for two thirds
of the keys, a standalone server asked for its cluster topology cannot give one.

Bounded waits: every connect and reply is bounded by `socket_timeout_ms`, and
the retry policy is set here rather than left to the client version (redis-py
6+ retries timeouts three times with up to 10 s backoff): a dropped
connection is retried once, at once; a timeout is not.

Secrets: the ACL user is `RedisOptions.username`; its password comes from the
environment or a file (`RedisOptions.password`), never from the control file,
and is replaced by *** in any client error text before it is logged or raised
(errors here are raised `from None`: the client's own exception may carry it).
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlsplit

import redis
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, LoadBalancingStrategy, RedisCluster
from redis.crc import key_slot
from redis.retry import Retry

from slacktier.config import RedisOptions
from slacktier.errors import ErrorKind, SlackTierError

#: what any client call may raise on a broken, refused or redirected connection
CLIENT_ERRORS = (redis.RedisError, redis.exceptions.RedisClusterException, OSError)


def mask(text: str, options: RedisOptions) -> str:
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


def where(options: RedisOptions) -> str:
    """How errors name the deployment: "Redis at redis://..." or "Redis Cluster at redis://..."."""
    return f"Redis{' Cluster' if options.mode == 'cluster' else ''} at {options.url}"


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


@dataclass(frozen=True)
class Node:
    """Where one connection for page reads goes: a TCP host and port, or a unix socket path."""

    name: str             # "127.0.0.1:7000", or the socket path
    host: str = ""
    port: int = 0
    path: str = ""        # unix socket (standalone only)
    replica: bool = False  # send READONLY first
    db: int = 0           # standalone: SELECT it first when not 0


def _auth_error(exc: BaseException | None) -> BaseException | None:
    """The AuthenticationError (wrong password or user, NOAUTH) in `exc`'s cause chain, if any."""
    seen = 0
    while exc is not None and seen < 16:
        if isinstance(exc, redis.AuthenticationError):
            return exc
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return None


class Control:
    """One client for the options' deployment (standalone or cluster); see the module docstring."""

    def __init__(self, options: RedisOptions) -> None:
        self.options = options
        self.cluster = options.mode == "cluster"
        self.where = where(options)
        parts = urlsplit(options.url)
        if parts.scheme != "rediss" and options.tls_ca_file:
            raise SlackTierError(ErrorKind.BAD_INPUT, f"tls_ca_file is set but the url {options.url} is not "
                                 "rediss://", fix="use a rediss:// url for TLS, or drop tls_ca_file")
        try:
            self.client: redis.Redis | RedisCluster = self._cluster(parts) if self.cluster else \
                self._standalone()
        except CLIENT_ERRORS as exc:
            raise self._refusal(exc) from None
        if self.cluster:
            self._one = None
        elif parts.scheme == "unix":
            self._one = Node(parts.path, path=parts.path, db=self._db(parts))
        else:
            host, port = parts.hostname or "127.0.0.1", parts.port or 6379
            self._one = Node(f"{host}:{port}", host, port, db=self._db(parts))

    @staticmethod
    def _db(parts) -> int:
        text = parts.path.lstrip("/") if parts.scheme != "unix" else ""
        return int(text) if text.isdigit() else 0

    def _standalone(self) -> redis.Redis:
        client = redis.Redis.from_url(self.options.url, **client_kwargs(self.options))
        try:
            client.ping()
            try:
                info = client.execute_command("CLUSTER", "INFO")
            except redis.ResponseError:
                info = b""   # "cluster support disabled" (what we want), or a user not allowed to ask
            if b"cluster_state" in (info if isinstance(info, bytes) else str(info).encode()):
                raise SlackTierError(ErrorKind.BAD_INPUT, f"{self.options.url} is a Redis Cluster node, and "
                                     "[table.redis] says mode = \"standalone\"",
                                     fix='set mode = "cluster" in [table.redis] (or --mode cluster)')
        except BaseException:
            client.close()
            raise
        return client

    def _cluster(self, parts) -> RedisCluster:
        kw = client_kwargs(self.options)
        if parts.scheme == "rediss":
            kw["ssl"] = True
        elif parts.scheme == "unix":
            raise SlackTierError(ErrorKind.BAD_INPUT, f"a cluster is reached over TCP, not {self.options.url}",
                                 fix='write the url of one node, "redis://host:port"')
        kw.pop("retry")  # the cluster client's own retry object: one retry, no backoff (below)
        kw.pop("retry_on_timeout")  # deprecated for the cluster client; its retry object above decides
        if self.options.read_from_replicas:
            kw["load_balancing_strategy"] = LoadBalancingStrategy.ROUND_ROBIN
        seeds = [ClusterNode(parts.hostname or "127.0.0.1", parts.port or 6379)] + [
            ClusterNode(h, int(p)) for h, _, p in (n.rpartition(":") for n in self.options.nodes)]
        return RedisCluster(startup_nodes=seeds, require_full_coverage=False, retry=Retry(NoBackoff(), 1), **kw)

    def _refusal(self, exc: BaseException) -> SlackTierError:
        """A failed connect as UNAVAILABLE (credentials named, never the password) or BAD_INPUT (wrong mode)."""
        auth = _auth_error(exc)
        text = mask(str(exc if auth is None else auth), self.options)
        if auth is not None or "NOAUTH" in text or "Authentication" in text:
            return SlackTierError(ErrorKind.UNAVAILABLE, f"{self.where} {auth_refusal(self.options)}: {text}",
                                  fix="set username and password_env (or password_file) in [table.redis] to an "
                                      "ACL user that may read the table")
        if "Cluster mode is not enabled" in text:
            return SlackTierError(ErrorKind.BAD_INPUT, f"{self.options.url} is a standalone Redis server, and "
                                  "[table.redis] says mode = \"cluster\"",
                                  fix='set mode = "standalone" in [table.redis] (or --mode standalone)')
        return SlackTierError(ErrorKind.UNAVAILABLE, f"cannot reach {self.where}: {text}",
                              fix="start the server (or cluster) there, or pass the url of one of its nodes")

    def failure(self, exc: BaseException, what: str) -> SlackTierError:
        """A failed call as an error: a redirect on a standalone connection names the mode (BAD_INPUT; the
        user could not run the CLUSTER INFO check at connect), anything else is IO naming the deployment."""
        if not self.cluster and isinstance(exc, (redis.exceptions.MovedError, redis.exceptions.AskError)):
            return SlackTierError(ErrorKind.BAD_INPUT, f"{self.where} answered {type(exc).__name__} ({exc}) "
                                  f"while {what}: it is a cluster node, and [table.redis] says mode = \"standalone\"",
                                  fix='set mode = "cluster" in [table.redis] (or --mode cluster)')
        return SlackTierError(ErrorKind.IO, f"{what} at {self.where} failed: {mask(str(exc), self.options)}",
                              fix="check the server (or cluster) and try again")

    def node_of_slot(self, slot: int) -> Node:
        """The node that serves `slot`: the one server; a cluster's master (or, with read_from_replicas, the
        client's round robin over the slot's master and replicas)."""
        if self._one is not None:
            return self._one
        strategy = LoadBalancingStrategy.ROUND_ROBIN if self.options.read_from_replicas else None
        node = self.client.nodes_manager.get_node_from_slot(slot, load_balancing_strategy=strategy)
        return Node(node.name, node.host, int(node.port), replica=node.server_type == "replica")

    def refresh(self) -> None:
        """Learn the topology again (after MOVED, a lost node, a failover); nothing to learn on one server."""
        if self.cluster:
            self.client.nodes_manager.initialize()

    def node_name(self, key: bytes) -> str:
        """The node that holds `key`, for error messages."""
        if self._one is not None:
            return self._one.name
        return self.client.nodes_manager.get_node_from_slot(key_slot(key)).name

    def nodes(self) -> int:
        """How many nodes the client knows."""
        return len(self.client.get_nodes()) if self.cluster else 1

    def get_many(self, keys: list[bytes]) -> list[bytes | None]:
        """GET of each key, pipelined (keys in any slots)."""
        pipe = self.client.pipeline(transaction=False)
        for key in keys:
            pipe.get(key)
        return pipe.execute(raise_on_error=True)

    def close(self) -> None:
        self.client.close()
