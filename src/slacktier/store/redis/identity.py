"""The Redis tier's table checks: which table a prefix holds, and whether every page group is in its generation.

The loader (loader.py) writes the identity record "loading" before its first
page group and "complete" after its last, and each group's `gen` key after
the group's pages were read back and checked. A source (and a kept source on
reload, through `RedisSource.verify_identity`) refuses, naming the table, the
deployment and a node:
- no identity under the prefix (MISSING);
- an identity of another table or staging run, or one not "complete" (TARGET);
- a page group whose `gen` key lacks the generation (TARGET): a node restarted
  empty or was flushed, or the load stopped midway.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from slacktier.errors import ErrorKind, SlackTierError
from slacktier.store.redis.client import CLIENT_ERRORS, Control
from slacktier.store.redis.keys import COMPLETE, LAYOUT, gen_key, identity_key
from slacktier.tables.manifest import TableIdentity
from slacktier.tables.regions import Region

LOAD_FIX = "load the table with `slacktier load` (it resumes where a load stopped)"


def read_identity(control: Control, prefixes: Sequence[str], identity: TableIdentity | None) -> dict:
    """The identity record of the one table under `prefixes`, checked against `identity` and complete."""
    prefixes = list(dict.fromkeys(prefixes))
    if len(prefixes) != 1:
        raise SlackTierError(ErrorKind.BAD_INPUT, f"regions under {len(prefixes)} key prefixes {prefixes}",
                             fix="set `prefix` in [table.redis]: a table is loaded under one prefix")
    prefix = prefixes[0]
    where = control.where
    try:
        value = control.client.get(identity_key(prefix))
    except CLIENT_ERRORS as exc:
        raise control.failure(exc, "reading the table identity") from None
    if value is None:
        raise SlackTierError(ErrorKind.MISSING, f"{where} holds no table under prefix {prefix!r} (no key "
                             f"{identity_key(prefix)!r})", fix=LOAD_FIX)
    try:
        table = json.loads(value)
        assert table["layout"] == LAYOUT and int(table["tag_buckets"]) >= 1
        digest, stage, state = table["source_digest"], str(table.get("stage_id") or ""), table["state"]
    except (ValueError, TypeError, KeyError, AssertionError):
        raise SlackTierError(ErrorKind.TARGET, f"{where}: {identity_key(prefix)!r} is not a SlackTier table "
                             "identity", fix=LOAD_FIX) from None
    name = f"table {digest} (prefix {prefix!r})"
    if identity is not None and digest != identity.source_digest:
        raise SlackTierError(ErrorKind.TARGET, f"{where}: prefix {prefix!r} holds another table (source {digest}, "
                             f"the manifest's {identity.source_digest})", fix=f"{LOAD_FIX}, or use its prefix")
    if identity is not None and stage and identity.stage_id and stage != identity.stage_id:
        raise SlackTierError(ErrorKind.TARGET, f"{where}: {name} was loaded from another staging run (stage {stage}, "
                             f"the manifest's {identity.stage_id})", fix=f"{LOAD_FIX}, from the latest staging run")
    if state != COMPLETE:
        raise SlackTierError(ErrorKind.TARGET, f"{where}: {name} is {state!r}: a load did not finish, so it is "
                             "never served", fix=LOAD_FIX)
    table["prefix"] = prefix
    return table


def check_regions_listed(control: Control, table: dict, regions: Sequence[Region]) -> None:
    """Each region is in the table's record with the manifest's page count; else TARGET naming it."""
    listed = {(int(a), int(b)): int(c) for a, b, c in table["regions"]}
    for r in regions:
        if listed.get((r.layer, r.rank)) != r.pages:
            raise SlackTierError(ErrorKind.TARGET, f"{control.where}: table {table['source_digest']} (prefix "
                                 f"{table['prefix']!r}) holds {listed.get((r.layer, r.rank), 'no')} pages for this "
                                 f"region, the manifest says {r.pages}", layer=r.layer, rank=r.rank,
                                 fix=f"{LOAD_FIX}, from this staging run")


def check_generations(control: Control, regions: Sequence[Region], prefixes: Sequence[str], table: dict) -> None:
    """Every page group of `regions` carries the table's generation; else TARGET naming the table and a node."""
    T, gen = int(table["tag_buckets"]), str(table["generation"]).encode()
    keys = [gen_key(p, r.layer, r.rank, g) for p, r in zip(prefixes, regions, strict=True) for g in range(T)]
    try:
        values = control.get_many(keys)
    except CLIENT_ERRORS as exc:
        raise control.failure(exc, "reading generation keys") from None
    bad = [k for k, v in zip(keys, values, strict=True) if v != gen]
    if not bad:
        return
    r = regions[keys.index(bad[0]) // T]
    raise SlackTierError(ErrorKind.TARGET, f"{control.where}: table {table['source_digest']} (prefix "
                         f"{table['prefix']!r}) is incomplete: {len(bad)} of {len(keys)} page groups lack generation "
                         f"{gen.decode()} (first {bad[0]!r} on node {control.node_name(bad[0])}: a node restarted "
                         "empty or was flushed)", layer=r.layer, rank=r.rank,
                         fix="load the table again (`slacktier load` resumes, rewriting only lost groups)")


def verify(control: Control, regions: Sequence[Region], prefixes: Sequence[str],
           identity: TableIdentity | None) -> dict:
    """All three checks; returns the identity record (with its "prefix")."""
    table = read_identity(control, prefixes, identity)
    check_regions_listed(control, table, regions)
    check_generations(control, regions, prefixes, table)
    return table
