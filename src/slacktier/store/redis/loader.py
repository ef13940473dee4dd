"""Loading a staged table into Redis (standalone or cluster): the one loader, behind `slacktier load`.

Generations. `load_table` derives a generation from the table (digest, stage
id, T, regions; keys.py), marks the identity "loading", writes each page
group with MSET, reads it back and checks every CRC32C, and only then sets
the group's `gen` key; the identity turns "complete" after the last group. A
loader killed midway leaves the identity "loading", which no source serves; a
rerun skips the groups whose `gen` key already holds the generation
(resumable), and a rerun of a complete table is a no-op.

The options' user must be allowed SET/MSET (a loading ACL user); a read-only
serving user is refused with UNAVAILABLE naming the missing permission.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import redis
from tqdm import tqdm

from slacktier.config import RedisOptions
from slacktier.errors import ErrorKind, SlackTierError
from slacktier.store._common import page_crc32c as crc32c_of_pages
from slacktier.store.dram import load_region_pages
from slacktier.store.redis.admin import LoadedTable, find_table, stale_keys
from slacktier.store.redis.client import CLIENT_ERRORS, Control, mask
from slacktier.store.redis.keys import (COMPLETE, DEFAULT_TAG_BUCKETS, KEYS_PER_MGET, LAYOUT, LOADING,
                                        buckets_for, default_prefix, gen_key, generation_of, identity_key,
                                        page_key)
from slacktier.tables.manifest import Manifest, TableIdentity
from slacktier.tables.regions import Region

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadReport:
    """What `load_table` did."""

    prefix: str
    generation: str
    tag_buckets: int     # page groups per region, as loaded (at most the smallest region's pages)
    groups: int          # page groups of the table
    written: int         # groups written this run (0: the table was already complete)
    pages: int           # pages written and verified this run
    seconds: float
    replaced: LoadedTable | None = None   # the other table (or generation) the prefix held, now overwritten


def load_table(options: RedisOptions, regions: Sequence[Region], identity: TableIdentity, *,
               page_crc32c: Sequence[np.ndarray], prefix: str | None = None, tag_buckets: int = DEFAULT_TAG_BUCKETS,
               workers: int = 4, progress: bool = False,
               read_pages: Callable[[Region], np.ndarray] = load_region_pages) -> LoadReport:
    """Put staged regions (their files, `read_pages`) under `prefix` (default: options.prefix, else
    `default_prefix(identity)`); see the module docstring. Parallel over page groups, resumable, idempotent;
    every page is read back and its CRC32C checked before its group counts."""
    tag_buckets = buckets_for(tag_buckets, regions)
    if len(page_crc32c) != len(regions):
        raise SlackTierError(ErrorKind.BAD_INPUT, f"{len(page_crc32c)} CRC32C arrays for {len(regions)} regions",
                             fix="pass the manifest's page_crc32c")
    t0 = time.monotonic()
    pfx = prefix or options.prefix or default_prefix(identity)
    control = Control(options)
    client = control.client
    generation = generation_of(identity, tag_buckets, regions)
    record = {"format": "slacktier-table", "layout": LAYOUT, "source_digest": identity.source_digest,
              "stage_id": identity.stage_id, "generation": generation, "tag_buckets": tag_buckets,
              "regions": [[r.layer, r.rank, r.pages] for r in regions]}
    groups = [(i, g) for i in range(len(regions)) for g in range(tag_buckets)]
    replaced: LoadedTable | None = None
    try:
        current = client.get(identity_key(pfx))
        done = [v == generation.encode() for v in
                control.get_many([gen_key(pfx, regions[i].layer, regions[i].rank, g) for i, g in groups])]
        if current is not None:
            try:
                theirs = json.loads(current)
            except ValueError:
                theirs = {}
            if theirs.get("generation") == generation and theirs.get("state") == COMPLETE and all(done):
                return LoadReport(pfx, generation, tag_buckets, len(groups), 0, 0, time.monotonic() - t0)
            replaced = find_table(options, pfx)
            if replaced is not None and replaced.generation == generation:
                replaced = None   # this load's own generation, resumed
            if replaced is not None:
                log.warning("%s: prefix %r holds table %s (stage %s, generation %s, %d pages, %.1f MiB, %s); this "
                            "load replaces it in place", control.where, pfx, replaced.source_digest,
                            replaced.stage_id, replaced.generation, replaced.pages, replaced.value_bytes / 2**20,
                            replaced.state)
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
            got = crc32c_of_pages(pages[numbers]) if numbers.shape[0] else np.zeros(0, np.uint32)
            if not np.array_equal(got, want):
                bad = int(numbers[np.flatnonzero(got != want)[0]])
                raise SlackTierError(ErrorKind.CHECKSUM, "staged page differs from its manifest CRC32C",
                                     layer=r.layer, rank=r.rank, page=bad, fix="stage the table again")
            keys = [page_key(pfx, r.layer, r.rank, int(p), tag_buckets) for p in numbers]
            values = [pages[p].tobytes() + int(c).to_bytes(4, "little") for p, c in zip(numbers, want, strict=True)]
            for lo in range(0, len(keys), KEYS_PER_MGET):
                client.mset(dict(zip(keys[lo:lo + KEYS_PER_MGET], values[lo:lo + KEYS_PER_MGET], strict=True)))
            for lo in range(0, len(keys), KEYS_PER_MGET):
                if client.mget(keys[lo:lo + KEYS_PER_MGET]) != values[lo:lo + KEYS_PER_MGET]:
                    raise SlackTierError(ErrorKind.IO, f"a page read back from {control.where} differs from what "
                                         "was written", layer=r.layer, rank=r.rank,
                                         fix="check the server and load again")
            client.set(gen_key(pfx, r.layer, r.rank, g), generation.encode())
            return len(keys)

        written = 0
        with ThreadPoolExecutor(max_workers=max(1, workers)) as pool, \
                tqdm(total=len(todo), unit="group", desc="loading into Redis", disable=not progress) as bar:
            for n in pool.map(write_group, todo):
                written += n
                bar.update(1)
        if replaced is not None:   # keys of the replaced table this load did not overwrite
            shape = {(r.layer, r.rank): r.pages for r in regions}
            for keys in stale_keys(replaced, tag_buckets, shape):
                client.delete(*keys)
        client.set(identity_key(pfx), json.dumps({**record, "state": COMPLETE}).encode())
    except redis.exceptions.NoPermissionError as exc:
        raise SlackTierError(ErrorKind.UNAVAILABLE, f"user {options.username or 'default'!r} may not load into "
                             f"{control.where}: {mask(str(exc), options)}",
                             fix="load with the read-write (loading) ACL user") from None
    except CLIENT_ERRORS as exc:
        raise control.failure(exc, "loading (a rerun resumes)") from None
    finally:
        control.close()
    log.info("loaded %d of %d page groups (%d pages) of table %s into %s under %r, generation %s", len(todo),
             len(groups), written, identity.source_digest, control.where, pfx, generation)
    return LoadReport(pfx, generation, tag_buckets, len(groups), len(todo), written, time.monotonic() - t0, replaced)


def load_manifest(options: RedisOptions, manifest: Manifest, **kw) -> LoadReport:
    """`load_table` for every region of a staging manifest, with its checksums and identity."""
    return load_table(options, manifest.runtime_regions(), manifest.identity,
                      page_crc32c=manifest.region_checksums(), **kw)
