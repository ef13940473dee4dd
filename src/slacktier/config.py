"""The control file as data: one typed schema at the bottom of the package.

A control file says which tier serves each table, how large the row cache is
and how it is split, and in which order the tables' reads are issued. It is
TOML; this module parses it into frozen msgspec structs, validates it, and
dumps it back (`parse_control(dump_control(cfg)) == cfg`, exactly). Everything
else builds or reads these objects: the planner and the benchmarks build them,
`StepEngine.apply(cfg)` applies one in place between steps, and files appear
only at the edges (the CLI, `StepEngine.from_control(path)`).

Why msgspec (not pydantic): strict typing is its default, so a quoted boolean
(`lossy = "false"`) or a float where an integer belongs (`cache_rows = 1e11`)
is an error naming the key, not a silent coercion; it is small, has no runtime
dependencies, and its frozen structs compare and hash by value, which is what
`apply` needs to tell what changed. SGLang uses it for the same reasons.

Schema (every key but `layer` and `manifest` has a default):

    [engine]
    device = "cpu"          # "cpu" | "cuda" | "cuda:N"
    cache_rows = 0          # cache slots in use, split over tables by cache_share
    max_cache_rows = 0      # slots reserved on the device (>= cache_rows; 0 = cache_rows)
    max_tokens = 256        # tokens per step the buffers are sized for (grown on demand)
    wait_timeout_ms = 5000.0  # longest a gather waits for its layer's reads before failing the step
    verify_reads = "auto"   # check read pages' CRC32C against the manifest: true, false, or "auto" (each
                            # tier's default: on where the tier has no end-to-end checksum of its own)
    lossy = false           # rows outside a table's seen-set are not read and come out as zeros
    check = false           # run the reference gather beside ours on every lookup; a row that differs
                            # from the table's source is never served (gather fails [checksum])
    owned_only = false      # per-rank process: ids outside its rows come out as -0.0, not errors
    pad_id = -1             # ids equal to it (negative: never a row) come out as zero rows, read nothing
    evict_ahead = true      # end_step empties the slots the next step's misses will take (RowCache.evict_ahead):
                            # their evictions leave begin_step; false runs CLOCK exactly as the characterizer
    admission = "off"       # "off" | "prefill-cold" | "counters" | "counters+sketch": "prefill-cold", rows a
                            # prefill token misses enter the cache with CLOCK's reference bit clear; "counters",
                            # 2-bit reference counts that decode lookups raise and prefill lookups do not;
                            # "counters+sketch", the same with a frequency sketch per layer (4-8 B per cache row
                            # of host memory) that a prefill miss must pass to take a slot (the adapters flag
                            # prefill tokens; begin_step(ids, decode=...); `characterize` compares them)
    metrics = false         # publish Prometheus metrics at each end_step (slacktier.engine.metrics)

    [[table]]
    layer = 1               # table layer id (Engram: 1 and 14)
    manifest = "t.manifest.json"   # the staged table (relative paths: from the control file's folder)
    source = "disk"         # a registered tier: "dram" | "disk" | "redis" | a plug-in's name
    rank = -1               # serve only this rank's region (-1: every rank); pair with owned_only
    partition = "columns"   # the rank partition the manifest was staged with: "columns" | "balanced"
                            # (tables.partition); another than the manifest's is refused at open
    targets = []            # optional: replace the manifest's target paths, by device index ("" keeps one)
    cache_share = 0.0       # fraction of cache_rows for this layer (shares sum to <= 1)
    order = 0               # lower is resolved and submitted first (short window first)
    seen = ""               # lossy: .npy of integer local row ids, or a packed uint8 bitmap of ceil(rows/8) bytes

    [table.disk]            # options of the table's own tier, typed by that tier
    engine = "auto"         # "auto" | "io_uring" | "threads"
    queue_depth = 128       # reads in flight per worker (engine "threads": worker threads, at most 64)
    io_threads = 1          # workers per device

    [table.redis]           # tier "redis": one server or a cluster (store/redis/)
    mode = "standalone"     # "standalone" | "cluster" (a mode the server does not match is refused)
    url = "redis://127.0.0.1:6379/0"   # the server, or one seed node of the cluster; no password here (refused)
    nodes = []              # cluster: more seeds, "host:port" (a new engine starts while the url's node is down)
    read_from_replicas = false   # cluster: spread reads over each slot's master and its replicas
    prefix = ""             # key prefix (default: "st-" + the manifest's stage id, as `slacktier load` writes)
    socket_timeout_ms = 5000.0   # socket and connect timeout: a stopped server fails a batch, never blocks it
    username = ""           # ACL user (empty: the default user)
    password_env = ""       # name of the environment variable holding the password
    password_file = ""      # or a file whose first line is the password
    tls_ca_file = ""        # CA bundle: TLS on (use a rediss:// url)

    The tier "redis-cluster" of earlier releases is refused by name, with the fix: `source = "redis"` and
    `mode = "cluster"` in [table.redis] (one tier for both modes, with one key layout and one loader).

Paths: in a file, a relative path (`manifest`, `seen`, `targets`, `password_file`, `tls_ca_file`) is read
from the control file's folder, whoever reads it and wherever they run; `load_control` makes them absolute.
In memory (a ControlFile built as data) a path means what it means to this process, and `write_control`
writes a relative one relative to the file it writes, so a file and the object it was written from name the
same files. Errors in a file name the file and, where the key is found, its line; an unknown key suggests
the nearest known one.

Worked example: two tables, layer 1 (order 0, share 0.7) and layer 14 (order 1,
share 0.3), cache_rows = 1,000,000 -> layer 1 owns 700,000 slots and its pages
are submitted before layer 14 is resolved.

A tier registers its option struct with `register_tier_options` (the store's
registry does it for every tier it registers); the built-in tiers' options
live here because the planner, which may import only this module, builds them.
"""

from __future__ import annotations

import contextlib
import difflib
import os
import re
import urllib.parse
import tomllib
from dataclasses import dataclass
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal, get_args

import msgspec
import tomli_w

from slacktier.errors import ErrorKind, SlackTierError

#: most slots one cache may hold: slots are int32 indices
MAX_CACHE_ROWS = 2**31 - 1
#: the cache's admission rules, as the control file names them (cache.ADMISSIONS holds each one's heat codes)
Admission = Literal["off", "prefill-cold", "counters", "counters+sketch"]
ADMISSION_RULES: tuple[str, ...] = get_args(Admission)


def _bad(message: str, fix: str, **where: Any) -> SlackTierError:
    return SlackTierError(ErrorKind.BAD_INPUT, f"control file: {message}", fix=fix, **where)


class Options(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Base of every tier's option table (`[table.<tier>]`), and the tier's facts (class attributes), which code
    outside `store/` reads instead of comparing the tier's name (`tier_facts`)."""

    #: the whole table lives in host memory (the stock engines' own path: their plug-ins leave such layers alone)
    holds_host_copy: ClassVar[bool] = False
    #: what the tier's devices are: "host" (this process's memory), "file" (local files or block devices, the
    #: manifest's targets), "remote" (servers named by the options' url), "model" (no medium of its own: reads
    #: land when a device model says, over a host copy of the table; slacktier.whatif's "emulated" tier)
    device_kind: ClassVar[str] = "file"
    #: the options that hold file paths: relative ones are read from the control file's folder
    path_keys: ClassVar[tuple[str, ...]] = ()


class DramOptions(Options, frozen=True):
    """`[table.dram]`: what copies the pages from host memory.

    `engine = "auto"` takes the C device queue's worker when the C helper builds (compiled code hands a batch
    over, no Python on the copy's path; a copy needs no io_uring ring) and otherwise a Python thread that
    copies with a compiled loop (begin_step then submits DRAM batches from Python), logged and counted;
    "io_uring" (the C worker) refuses to open without the helper, and "threads" always takes the thread.
    """

    holds_host_copy: ClassVar[bool] = True
    device_kind: ClassVar[str] = "host"

    engine: Literal["auto", "io_uring", "threads"] = "auto"


class DiskOptions(Options, frozen=True):
    """`[table.disk]`: how the O_DIRECT reads are driven.

    `queue_depth` and `io_threads` belong to the device's one queue (store/devqueue.py): the first table to
    open it sets them.

    `engine = "auto"` takes io_uring where a ring can be set up and otherwise "threads", logged and counted
    (a container's default seccomp profile refuses io_uring). "threads" reads with pread on queue_depth C
    threads per io_thread (at most 64) where the C helper builds, the same device queue and lane as
    io_uring's, and on Python threads without it.

    There is no I/O priority class per table: putting the short-window layer's reads in the real-time class
    (mq-deadline honours classes) did not shorten them, measured with four TP rank processes sharing one disk,
    because ranks that step together each hold their later layer back until their earlier one landed.
    """

    engine: Literal["auto", "io_uring", "threads"] = "auto"
    queue_depth: Annotated[int, msgspec.Meta(ge=1, le=4096)] = 128
    io_threads: Annotated[int, msgspec.Meta(ge=1, le=64)] = 1


class RedisOptions(Options, frozen=True):
    """`[table.redis]`: where the pages are kept, a standalone server or a Redis Cluster (or Valkey) reached
    through one seed node in `url` (the others are discovered). Secrets never go in the control file.

    `read_from_replicas` (cluster) spreads reads over each slot's master and replicas (a replica may trail
    its master by the replication lag; pages are only ever rewritten by a new load, which the table's
    generation check guards).

    The password comes from the environment (`password_env` names the
    variable) or from a file (`password_file`, its first line); a url with a
    password in it is refused. `username` is the ACL user (empty: the default
    user). `tls_ca_file` turns TLS on (rediss://) with that CA bundle.
    `socket_timeout_ms` bounds every connect and every reply: a stopped or
    unreachable server fails the batch within about twice it, whatever the
    client version's own defaults.
    """

    device_kind: ClassVar[str] = "remote"
    path_keys: ClassVar[tuple[str, ...]] = ("password_file", "tls_ca_file")
    mode: Literal["standalone", "cluster"] = "standalone"
    url: str = "redis://127.0.0.1:6379/0"
    nodes: tuple[str, ...] = ()     # cluster: more seed nodes, "host:port"
    read_from_replicas: bool = False
    prefix: str = ""
    socket_timeout_ms: Annotated[float, msgspec.Meta(gt=0, le=3_600_000)] = 5000.0
    username: str = ""
    password_env: str = ""
    password_file: str = ""
    tls_ca_file: str = ""

    def __post_init__(self) -> None:
        scheme, sep, rest = self.url.partition("://")
        if not sep or scheme not in ("redis", "rediss", "unix"):
            raise _bad(f"redis url {self.url!r}", 'write it as "redis://host:port" (or rediss:// for TLS)')
        if scheme != "unix":   # host and port as redis-py will read them: a bad one fails here, naming the url
            try:
                parsed = urllib.parse.urlsplit(self.url)
                parsed.port   # ValueError: not a number, or outside 0..65535
                if not parsed.hostname:
                    raise ValueError("no host")
            except ValueError as exc:
                raise _bad(f"redis url {self.url!r}: {exc}", 'write it as "redis://host:port" with a port in '
                           '1..65535 (an IPv6 host in brackets: "redis://[::1]:6379")') from None
        userinfo = rest.split("/", 1)[0].rpartition("@")[0]
        if ":" in userinfo or "password=" in self.url.lower():
            raise _bad("the redis url carries a password", "put the secret in the environment "
                       "(password_env = \"VAR\") or in a file (password_file), and the user in `username`")
        if self.password_env and self.password_file:
            raise _bad("both password_env and password_file are set", "give the password one way")
        if self.mode == "standalone" and (self.nodes or self.read_from_replicas):
            raise _bad("nodes / read_from_replicas are set on a standalone Redis", 'set mode = "cluster" (they '
                       "are a cluster's), or drop them")
        for node in self.nodes:
            host, sep, port = node.rpartition(":")
            if not sep or not host or not port.isdigit():
                raise _bad(f"redis seed node {node!r}", 'write seed nodes as "host:port"')

    @property
    def masked_url(self) -> str:
        """`url` as logged: it never carries a secret (refused above), so it is shown as is."""
        return self.url

    def password(self) -> str | None:
        """The secret from `password_env` or `password_file` (None when neither is set); UNAVAILABLE when the
        variable is unset or the file unreadable. Never logged."""
        if self.password_env:
            value = os.environ.get(self.password_env)
            if not value:
                raise SlackTierError(ErrorKind.UNAVAILABLE, f"password_env names {self.password_env}, which is "
                                     "not set in this process's environment",
                                     fix=f"export {self.password_env}=<the Redis user's password>")
            return value
        if self.password_file:
            try:
                with open(self.password_file, encoding="utf-8") as f:
                    value = f.readline().rstrip("\r\n")
            except OSError as exc:
                raise SlackTierError(ErrorKind.UNAVAILABLE, f"cannot read password_file {self.password_file}: "
                                     f"{exc.strerror}", fix="point password_file at a readable file") from None
            if not value:
                raise SlackTierError(ErrorKind.UNAVAILABLE, f"password_file {self.password_file} is empty",
                                     fix="write the Redis user's password on its first line")
            return value
        return None


_TIER_OPTIONS: dict[str, type[Options]] = {"dram": DramOptions, "disk": DiskOptions, "redis": RedisOptions}
#: tier names of earlier releases, refused with what to write instead
RETIRED_TIERS: dict[str, str] = {
    "redis-cluster": 'write source = "redis" and mode = "cluster" in [table.redis] (one Redis tier serves both '
                     "modes; keys, loader and options are the same)"}


#: tiers that a room above the store registers when it is imported, and that module: a control file naming one
#: is refused until the module is imported, with a message that says so (the store does not know these tiers)
TIER_MODULES: dict[str, str] = {"emulated": "slacktier.whatif"}


def register_tier_options(name: str, options: type[Options]) -> None:
    """Make `[table.<name>]` parse into `options` (a frozen Options subclass)."""
    if not (isinstance(options, type) and issubclass(options, Options)):
        raise SlackTierError(ErrorKind.BAD_INPUT, f"tier {name!r}: options must subclass slacktier.config.Options",
                             fix="declare the tier's options as `class MyOptions(Options, frozen=True)`")
    known = _TIER_OPTIONS.get(name)
    if known is not None and known is not options:
        raise SlackTierError(ErrorKind.BAD_INPUT, f"tier {name!r} is already registered with {known.__name__}",
                             fix="give the new tier another name")
    _TIER_OPTIONS[name] = options


def int_range(kind: type, key: str) -> tuple[int, int]:
    """The schema's range of integer key `key` of struct `kind`, for a flag that sets it
    (`int_range(DiskOptions, "queue_depth")` -> (1, 4096)), so the flag and the file refuse the same values."""
    import msgspec.inspect

    for f in msgspec.inspect.type_info(kind).fields:
        if f.encode_name == key and isinstance(f.type, msgspec.inspect.IntType):
            lo = f.type.ge if f.type.ge is not None else (f.type.gt + 1 if f.type.gt is not None else -2**63)
            hi = f.type.le if f.type.le is not None else (f.type.lt - 1 if f.type.lt is not None else 2**63 - 1)
            return lo, hi
    raise SlackTierError(ErrorKind.BAD_INPUT, f"{kind.__name__} has no integer key {key!r}",
                         fix=f"use one of {', '.join(_keys(kind))}")


def tier_names() -> tuple[str, ...]:
    """Names of the tiers a control file may name, built-in first."""
    return tuple(_TIER_OPTIONS)


def tier_facts(name: str) -> type[Options]:
    """Tier `name`'s facts (`Options.holds_host_copy`, `Options.device_kind`); BAD_INPUT for an unknown tier."""
    return tier_options_type(name)


def tier_options_type(name: str) -> type[Options]:
    """The option struct of tier `name`; raises BAD_INPUT naming the registered tiers (or, for a retired name,
    what to write instead)."""
    if name in RETIRED_TIERS:
        raise _bad(f"tier {name!r} is retired", RETIRED_TIERS[name])
    if name in TIER_MODULES and name not in _TIER_OPTIONS:
        raise _bad(f"tier {name!r} is registered by {TIER_MODULES[name]}, which is not imported",
                   f"import {TIER_MODULES[name]} before loading the control file (`slacktier whatif` does)")
    try:
        return _TIER_OPTIONS[name]
    except KeyError:
        raise _bad(f"unknown tier {name!r}", f"choose one of {', '.join(tier_names())}, or import the module "
                   "that registers it") from None


class EngineConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """The [engine] section."""

    device: str = "cpu"
    cache_rows: Annotated[int, msgspec.Meta(ge=0, le=MAX_CACHE_ROWS)] = 0
    max_cache_rows: Annotated[int, msgspec.Meta(ge=0, le=MAX_CACHE_ROWS)] = 0
    max_tokens: Annotated[int, msgspec.Meta(ge=1, le=1 << 20)] = 256
    # at most a day: a larger value (inf, 1e13 ms) would overflow the first wait's timeout
    wait_timeout_ms: Annotated[float, msgspec.Meta(gt=0, le=86_400_000)] = 5000.0
    verify_reads: bool | Literal["auto"] = "auto"
    lossy: bool = False
    check: bool = False
    owned_only: bool = False
    pad_id: Annotated[int, msgspec.Meta(le=-1)] = -1
    evict_ahead: bool = True
    admission: Admission = "off"   # cache.ADMISSIONS
    metrics: bool = False

    def __post_init__(self) -> None:
        if not (self.device == "cpu" or self.device == "cuda" or
                (self.device.startswith("cuda:") and self.device[5:].isdigit())):
            raise _bad(f"device {self.device!r}", 'use "cpu", "cuda" or "cuda:N"')
        if self.max_cache_rows == 0:
            msgspec.structs.force_setattr(self, "max_cache_rows", self.cache_rows)
        if self.cache_rows > self.max_cache_rows:
            raise _bad(f"cache_rows {self.cache_rows} above max_cache_rows {self.max_cache_rows}",
                       "reserve at least cache_rows")


class TableConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """One [[table]] entry; `options` is its tier's option struct (`[table.<source>]`)."""

    layer: int
    manifest: str
    source: str = "disk"
    options: Options | None = None
    rank: Annotated[int, msgspec.Meta(ge=-1)] = -1
    partition: Literal["columns", "balanced"] = "columns"   # tables.partition.PARTITIONS
    targets: tuple[str, ...] = ()
    cache_share: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] = 0.0
    order: int = 0
    seen: str = ""

    def __post_init__(self) -> None:
        kind = tier_options_type(self.source)
        if self.options is None:
            msgspec.structs.force_setattr(self, "options", kind())
        elif type(self.options) is not kind:
            raise _bad(f"layer {self.layer}: {type(self.options).__name__} given for tier {self.source!r}",
                       f"give {kind.__name__} (or no options)", layer=self.layer)
        if not self.manifest:
            raise _bad(f"layer {self.layer} has no manifest", "point `manifest` at the staged table "
                       "(slacktier stage writes one)", layer=self.layer)


class ControlFile(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """A whole control file; `tables` sorted by window order (order, then layer)."""

    engine: EngineConfig = EngineConfig()
    tables: tuple[TableConfig, ...] = ()

    def __post_init__(self) -> None:
        if not self.tables:
            raise _bad("no [[table]] entries", "list at least one table")
        layers = [t.layer for t in self.tables]
        if len(set(layers)) != len(layers):
            raise _bad(f"layers {layers}: a layer is listed twice", "give each layer once")
        shares = sum(t.cache_share for t in self.tables)
        if shares > 1.0 + 1e-9:
            raise _bad(f"cache shares sum to {shares:.6g}, above 1", "make the shares fractions of one cache")
        if self.engine.cache_rows > 0 and shares <= 0.0:
            raise _bad(f"cache_rows = {self.engine.cache_rows} but every cache_share is 0, so no row would "
                       "be cached", "give the tables cache shares, or set cache_rows = 0")
        msgspec.structs.force_setattr(self, "tables", tuple(sorted(self.tables, key=lambda t: (t.order, t.layer))))

    def table(self, layer: int) -> TableConfig:
        """The entry of `layer`."""
        for t in self.tables:
            if t.layer == layer:
                return t
        raise SlackTierError(ErrorKind.MISSING, f"control file has no layer {layer}", layer=layer,
                             fix=f"use one of {[t.layer for t in self.tables]}")

    def replace(self, **changes: Any) -> ControlFile:
        """A copy with [engine] keys changed (`cache_rows=0`), validated again."""
        engine = _convert(msgspec.to_builtins(self.engine) | changes, EngineConfig, ("engine",))
        return ControlFile(engine=engine, tables=self.tables)


@dataclass(frozen=True)
class _Origin:
    """Where a control file's keys come from, for its errors: the file's path and its text (either may be empty)."""

    path: str = ""
    text: str = ""

    def at(self, section: tuple, key: str | None = None) -> str:
        """"control file PATH, line N": the line of `key` in `section` (the section's own line without a key)."""
        where = f"control file {self.path}" if self.path else "control file"
        line = _key_line(self.text, section, key) if self.text and section is not None else None
        return f"{where}, line {line}" if line else where

    def error(self, section: tuple | None, key: str | None, message: str, fix: str, **where: Any) -> SlackTierError:
        """BAD_INPUT naming the file, the line where it is found, and the section."""
        name = f", {_section_name(section)}" if section else ""
        return SlackTierError(ErrorKind.BAD_INPUT, f"{self.at(section, key)}{name}: {message}", fix=fix, **where)


_HEADER = re.compile(r'^\s*(\[\[?)\s*([A-Za-z0-9_.\-" ]+?)\s*\]\]?\s*(#.*)?$')
_KEY = re.compile(r"^\s*([A-Za-z0-9_\-]+)\s*=")


def _key_line(text: str, section: tuple, key: str | None) -> int | None:
    """The 1-based line of `key` in `section` of TOML `text` (of the section's header when `key` is None), or None.

    Sections are ("engine",), ("table", i) for the i-th [[table]] (from 1) and ("table", i, tier) for its
    [table.<tier>]; () is the top level. Keys written as dotted keys or inline tables are not found (None).
    Worked example: "[engine]\ncache_row = 1\n" -> ("engine",), "cache_row" -> line 2.
    """
    current: tuple = ()
    tables = 0
    for n, line in enumerate(text.splitlines(), 1):
        header = _HEADER.match(line)
        if header:
            parts = tuple(header.group(2).replace('"', "").replace(" ", "").split("."))
            if header.group(1) == "[[":
                tables += parts == ("table",)
                current = ("table", tables) if parts == ("table",) else parts
            else:
                current = ("table", tables, *parts[1:]) if parts[0] == "table" else parts
            if key is None and current == section:
                return n
            continue
        found = _KEY.match(line)
        if key is not None and current == section and found and found.group(1) == key:
            return n
    return None


def _section_name(section: tuple) -> str:
    if section[0] != "table":
        return f"[{'.'.join(section)}]"
    return f"[[table]] #{section[1]}" + (f" [table.{section[2]}]" if len(section) > 2 else "")


def _keys(kind: type) -> tuple[str, ...]:
    return tuple(f.encode_name for f in msgspec.structs.fields(kind))


def _nearest(key: str, known: tuple[str, ...]) -> str:
    near = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
    return f"did you mean `{near[0]}`?" if near else "remove it"


def _named_key(message: str, known: tuple[str, ...]) -> str | None:
    """The known key a check's message names first ("cache_rows 10 above max_cache_rows 5" -> cache_rows)."""
    hits = [(m.start(), k) for k in known for m in [re.search(rf"(?<!\w){re.escape(k)}(?!\w)", message)] if m]
    return min(hits)[1] if hits else None


def _convert(raw: Any, kind: type, section: tuple, origin: _Origin = _Origin(),
             known: tuple[str, ...] | None = None) -> Any:
    """`raw` as struct `kind`, or BAD_INPUT naming the file, line, section and key (an unknown key: the nearest
    known one)."""
    known = _keys(kind) if known is None else known
    if isinstance(raw, dict):
        for key in raw:
            if key not in known:
                raise origin.error(section, key, f"unknown key `{key}`", f"{_nearest(key, known)} "
                                   f"({_section_name(section)} keys: {', '.join(known)})")
    try:
        return msgspec.convert(raw, kind, strict=True)
    except msgspec.ValidationError as exc:
        at = re.search(r"at `\$\.([A-Za-z0-9_\-]+)", str(exc))
        raise origin.error(section, at.group(1) if at else None, str(exc),
                           "fix the value's type or range (booleans are true/false, unquoted)") from None
    except SlackTierError as exc:   # a struct's own check (__post_init__)
        message = exc.message.removeprefix("control file: ")
        raise origin.error(section, _named_key(message, known), message, exc.fix, layer=exc.layer) from None


def _from_file(value: str, base_dir: Path | None) -> str:
    """A path as written in the control file, as this process opens it (relative: from `base_dir`)."""
    if not value or base_dir is None or os.path.isabs(value):
        return value
    return os.path.abspath(os.path.join(base_dir, value))


def _to_file(value: str, folder: str) -> str:
    """A path as this process opens it, as a control file in `folder` writes it (relative: from `folder`)."""
    if not value or os.path.isabs(value):
        return value
    return os.path.relpath(os.path.abspath(value), folder)


def _with_paths(cfg: ControlFile, convert: Any) -> ControlFile:
    """`cfg` with `convert` applied to every path it holds (`_from_file` / `_to_file`)."""
    tables = []
    for t in cfg.tables:
        files = tier_options_type(t.source).device_kind == "file"   # elsewhere a target is a key prefix or a name
        options = t.options
        if options is not None and options.path_keys:
            options = msgspec.structs.replace(options, **{k: convert(getattr(options, k))
                                                          for k in options.path_keys})
        tables.append(msgspec.structs.replace(
            t, manifest=convert(t.manifest), seen=convert(t.seen), options=options,
            targets=tuple(convert(p) for p in t.targets) if files else t.targets))
    return msgspec.structs.replace(cfg, tables=tuple(tables))


def from_dict(doc: dict[str, Any], base_dir: str | Path | None = None, *, _origin: _Origin = _Origin()) -> ControlFile:
    """A ControlFile from a parsed TOML document; relative paths resolve against `base_dir` (made absolute)."""
    origin = _origin
    if not isinstance(doc, dict):
        raise origin.error(None, None, "the document is not a table", "write [engine] and [[table]] sections")
    for name in doc:
        if name not in ("engine", "table"):
            where = ((name,), None) if isinstance(doc[name], dict) else ((), name)
            raise SlackTierError(ErrorKind.BAD_INPUT, f"{origin.at(*where)}: unknown section `{name}`",
                                 fix=f"{_nearest(name, ('engine', 'table'))} (a control file has [engine] and "
                                     "[[table]] sections)")
    engine = _convert(doc.get("engine", {}), EngineConfig, ("engine",), origin)
    raw_tables = doc.get("table", [])
    if not isinstance(raw_tables, list):
        raise origin.error(None, None, "`table` must be an array of tables", "write each table as [[table]]")
    tables = []
    table_keys = tuple(k for k in _keys(TableConfig) if k != "options")
    for i, raw in enumerate(raw_tables):
        section = ("table", i + 1)
        if not isinstance(raw, dict):
            raise origin.error(section, None, "not a table", "write each table as [[table]]")
        raw = dict(raw)
        source = raw.get("source", "disk")
        if not isinstance(source, str):
            raise origin.error(section, "source", f"source {source!r}", f"choose one of {', '.join(tier_names())}")
        try:
            kind = tier_options_type(source)
        except SlackTierError as exc:
            raise origin.error(section, "source", exc.message.removeprefix("control file: "), exc.fix) from None
        retired = sorted(k for k in raw if k in RETIRED_TIERS)
        if retired:
            raise origin.error((*section, retired[0]), None, "a retired tier", RETIRED_TIERS[retired[0]])
        others = sorted(k for k in raw if k in _TIER_OPTIONS and k != source)
        if others:
            raise origin.error((*section, others[0]), None, f"options for {others} on a {source!r} table",
                               f"put options under [table.{source}]")
        if "options" in raw:
            raise origin.error(section, "options", "no key `options`", f"put the tier's options under [table.{source}]")
        options = _convert(raw.pop(source, {}), kind, (*section, source), origin)
        table = _convert(raw, TableConfig, section, origin, known=table_keys + (source,))
        tables.append(msgspec.structs.replace(table, options=options))
    try:
        cfg = ControlFile(engine=engine, tables=tuple(tables))
    except SlackTierError as exc:
        raise origin.error(None, None, exc.message.removeprefix("control file: "), exc.fix) from None
    if base_dir is None:
        return cfg
    base = Path(base_dir)
    return _with_paths(cfg, lambda value: _from_file(value, base))


def to_dict(cfg: ControlFile) -> dict[str, Any]:
    """Plain data for TOML: every key written, each table's options under its tier's name."""
    tables = []
    for t in cfg.tables:
        d = msgspec.to_builtins(t)
        options = d.pop("options")
        d["targets"] = list(t.targets)
        d[t.source] = options
        tables.append(d)
    return {"engine": msgspec.to_builtins(cfg.engine), "table": tables}


def parse_control(text: str, path: str | Path = "") -> ControlFile:
    """A ControlFile from TOML text (`path` names it in errors and anchors relative paths)."""
    origin = _Origin(str(path), text)
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise SlackTierError(ErrorKind.BAD_INPUT, f"{origin.at(None)}: {path or 'text'} is not TOML: {exc}",
                             fix="fix the syntax") from exc
    return from_dict(doc, Path(path).parent if path else None, _origin=origin)


def dump_control(cfg: ControlFile, comment: str = "") -> str:
    """TOML text for `cfg`, `comment` lines first (each prefixed with '# '), after checking it with the schema a
    reader checks (a struct built in code skips the range checks: `DiskOptions(queue_depth=10**6)`)."""
    data = to_dict(cfg)
    from_dict(data)
    head = "".join(f"# {line}\n" if line else "#\n" for line in comment.splitlines())
    return head + tomli_w.dumps(data)


def load_control(path: str | Path) -> ControlFile:
    """Read and validate a control file; its relative paths are read from its folder (and made absolute)."""
    p = Path(path)
    if not p.is_file():
        raise SlackTierError(ErrorKind.MISSING, f"control file {p} does not exist",
                             fix="write one (schema: slacktier.config), or let `slacktier plan` write it")
    try:
        text = p.read_text()
    except UnicodeDecodeError as exc:
        raise _bad(f"{p} is not TOML text: {exc}", "pass the control file (.toml) itself") from None
    except OSError as exc:
        raise SlackTierError(ErrorKind.IO, f"cannot read control file {p}: {exc.strerror}",
                             fix="check the path and its permissions") from None
    return parse_control(text, p)


def write_control(cfg: ControlFile, path: str | Path, comment: str = "") -> Path:
    """Write `cfg` to `path` atomically (a reader sees the old file or the new one, never half of one); a relative
    path of `cfg` (this process's) is written relative to the file's folder, so `load_control` reads the same
    files from anywhere. Nothing is written when `cfg` fails the schema (BAD_INPUT naming the file)."""
    p = Path(path)
    try:
        text = dump_control(_with_paths(cfg, lambda value: _to_file(value, os.path.abspath(p.parent))), comment)
    except SlackTierError as exc:
        raise SlackTierError(exc.kind, f"{p} not written: {exc.message}", fix=exc.fix, layer=exc.layer) from None
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(f".{p.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, p)
    return p


@contextlib.contextmanager
def named_by(path: str | Path) -> Iterator[None]:
    """A SlackTierError raised inside names the control file at `path` first: what a file it names holds (a
    manifest missing, a partition that differs) is that file's error, and one process may read one per rank."""
    try:
        yield
    except SlackTierError as exc:
        prefix = f"control file {path}"
        if exc.message.startswith(prefix):
            raise
        raise SlackTierError(exc.kind, f"{prefix}: {exc.message}", fix=exc.fix, layer=exc.layer, rank=exc.rank,
                             page=exc.page) from exc
