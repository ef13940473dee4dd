"""Loaded tables as managed objects: list what a deployment holds, and remove one table's keys.

`list_tables` finds every identity record (`{prefix}:identity`, keys.py) with SCAN (on a cluster, on every
master) and reports each table's prefix, source digest, stage id, generation, state and size: its page
values (4,100 bytes each, the page and its CRC32C) as the loader wrote them, not the server's per-key
overhead. `remove_table` deletes one table by its prefix: the identity first, so no source opens it from then
on (a source still serving it fails its next reads MISSING, naming the key), then every page and generation
key its record lists, one page group (one hash slot) per DEL. Nothing is found by pattern but the identity
records: a key of another table under a similar name is never touched.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass

from slacktier.config import RedisOptions
from slacktier.errors import ErrorKind, SlackTierError
from slacktier.store.redis.client import CLIENT_ERRORS, Control, mask, where
from slacktier.store.redis.keys import KEYS_PER_MGET, LAYOUT, VALUE_BYTES, gen_key, identity_key, page_key

log = logging.getLogger(__name__)

_IDENTITY_SUFFIX = b":identity"


@dataclass(frozen=True)
class LoadedTable:
    """One table a deployment holds, from its identity record."""

    prefix: str
    source_digest: str
    stage_id: str
    generation: str
    state: str                                   # "complete", or "loading" (a load that did not finish)
    tag_buckets: int
    regions: tuple[tuple[int, int, int], ...]    # (layer, rank, pages)

    @property
    def pages(self) -> int:
        """Pages of the table (one key each)."""
        return sum(p for _, _, p in self.regions)

    @property
    def value_bytes(self) -> int:
        """Bytes of its page values (page + CRC32C each), what the loader wrote."""
        return self.pages * VALUE_BYTES


def _record(prefix: str, value: bytes) -> LoadedTable | None:
    try:
        d = json.loads(value)
        if d.get("layout") != LAYOUT:
            return None
        return LoadedTable(prefix, str(d["source_digest"]), str(d.get("stage_id") or ""), str(d["generation"]),
                           str(d["state"]), int(d["tag_buckets"]),
                           tuple((int(a), int(b), int(c)) for a, b, c in d["regions"]))
    except (ValueError, TypeError, KeyError):
        return None


def _prefix_of(key: bytes) -> str | None:
    """b"{t0}:identity" -> "t0"; anything else None."""
    if not (key.startswith(b"{") and key.endswith(b"}" + _IDENTITY_SUFFIX)):
        return None
    return key[1:-len(_IDENTITY_SUFFIX) - 1].decode(errors="replace")


def _failure(control: Control, options: RedisOptions, exc: BaseException, what: str) -> SlackTierError:
    import redis

    if isinstance(exc, redis.exceptions.NoPermissionError):
        return SlackTierError(ErrorKind.UNAVAILABLE, f"user {options.username or 'default'!r} may not {what} on "
                              f"{control.where}: {mask(str(exc), options)}",
                              fix="use the read-write (loading) ACL user")
    return control.failure(exc, what)


def list_tables(options: RedisOptions) -> list[LoadedTable]:
    """Every SlackTier table the deployment holds, by prefix (records that are not a table's are skipped)."""
    control = Control(options)
    try:
        keys = sorted(set(control.client.scan_iter(match=b"{*}:identity", count=1000)))
        out = []
        for key in keys:
            prefix = _prefix_of(key)
            value = control.client.get(key) if prefix is not None else None
            table = _record(prefix, value) if value is not None else None
            if table is not None:
                out.append(table)
        return out
    except CLIENT_ERRORS as exc:
        raise _failure(control, options, exc, "list the loaded tables") from None
    finally:
        control.close()


def find_table(options: RedisOptions, prefix: str) -> LoadedTable | None:
    """The table under `prefix`, or None when the deployment holds none there."""
    control = Control(options)
    try:
        value = control.client.get(identity_key(prefix))
    except CLIENT_ERRORS as exc:
        raise _failure(control, options, exc, "read a table identity") from None
    finally:
        control.close()
    return None if value is None else _record(prefix, value)


def remove_table(options: RedisOptions, prefix: str) -> LoadedTable:
    """Delete the table under `prefix` (identity first, then its pages and generation keys); MISSING when the
    deployment holds no table there. Returns what was removed."""
    table = find_table(options, prefix)
    if table is None:
        raise SlackTierError(ErrorKind.MISSING, f"{where(options)} holds no table under prefix {prefix!r}",
                             fix="list the loaded tables with `slacktier load --list --url ...`")
    control = Control(options)
    client = control.client
    T = table.tag_buckets
    try:
        client.delete(identity_key(prefix))
        for layer, rank, pages in table.regions:
            for g in range(T):
                keys = [page_key(prefix, layer, rank, p, T) for p in range(g, pages, T)]
                keys.append(gen_key(prefix, layer, rank, g))
                for lo in range(0, len(keys), KEYS_PER_MGET):   # one group: one slot, so one DEL
                    client.delete(*keys[lo:lo + KEYS_PER_MGET])
    except CLIENT_ERRORS as exc:
        raise _failure(control, options, exc, "remove a table (a rerun finishes it)") from None
    finally:
        control.close()
    log.info("removed table %s (prefix %r, generation %s, %d pages) from %s", table.source_digest, prefix,
             table.generation, table.pages, options.url)
    return table


def stale_keys(old: LoadedTable, tag_buckets: int, regions: dict[tuple[int, int], int]):
    """Batches of the keys of `old` that a load of `regions` ((layer, rank) -> pages) with `tag_buckets` under the
    same prefix did not overwrite, one page group per batch: pages past the new region's end or whose group
    moved (T changed), generation keys of groups the new load does not have.
    Worked example: old T 4, region (1, 0) of 10 pages; new T 2, 6 pages -> pages 6-9 and every page p with
    p % 4 != p % 2 (2, 3, ...), and gen keys of groups 2 and 3."""
    T, prefix = old.tag_buckets, old.prefix
    for layer, rank, pages in old.regions:
        new_pages = regions.get((layer, rank), 0)
        for g in range(T):
            keys = [page_key(prefix, layer, rank, p, T) for p in range(g, pages, T)
                    if p >= new_pages or p % tag_buckets != g]
            if g >= tag_buckets or (layer, rank) not in regions:
                keys.append(gen_key(prefix, layer, rank, g))
            for lo in range(0, len(keys), KEYS_PER_MGET):
                yield keys[lo:lo + KEYS_PER_MGET]
