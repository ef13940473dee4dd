"""The Redis tier's keys and generations: one layout for a standalone server and a cluster.

A region's pages are split into `tag_buckets` (T) groups by page number modulo
T; a group's keys share one hash tag and so, on a cluster, one slot, which is
what lets one MGET fetch many of a step's pages from one node (a cluster
refuses an MGET across slots with CROSSSLOT). A standalone server ignores the
braces: the same keys, the same MGETs, one node. Keys, for prefix "t0",
layer 1, rank 3, T = 64:

    {t0:1:3:12}:76        page 76 (76 % 64 = 12): 4,096 page bytes + its CRC32C, 4 bytes little-endian
    {t0:1:3:12}:gen       the load generation that completed group 12 (same slot as its pages)
    {t0}:identity         JSON: the table (source digest, stage id), state, generation, T, regions

T is chosen at load and recorded in the identity; readers take it from there.
Small T puts more pages per MGET but fewer slots per region, so a region
spreads over fewer nodes.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Sequence

from slacktier.errors import ErrorKind, SlackTierError
from slacktier.tables.layout import PAGE_BYTES
from slacktier.tables.manifest import TableIdentity
from slacktier.tables.regions import Region

log = logging.getLogger(__name__)

#: keys per MGET: one reply of at most ~1 MiB
KEYS_PER_MGET = 256
#: a stored value: the page, then its CRC32C (uint32, little-endian)
VALUE_BYTES = PAGE_BYTES + 4
#: default hash-tag groups per region
DEFAULT_TAG_BUCKETS = 64
MAX_TAG_BUCKETS = 16384   # a cluster's hash slots: more groups per region cannot spread any further
LOADING, COMPLETE = "loading", "complete"
#: the identity record's layout name (written by every load since the cluster tier; a standalone load too)
LAYOUT = "cluster-v1"


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
                             fix="set `prefix` in [table.redis], or open the source with the manifest's identity")
    return f"st-{identity.stage_id or identity.source_digest}"


def generation_of(identity: TableIdentity, tag_buckets: int, regions: Sequence[Region]) -> str:
    """A load's generation: a digest of the table, T and the regions (the same load -> the same generation)."""
    text = json.dumps([identity.source_digest, identity.stage_id, tag_buckets,
                       sorted((r.layer, r.rank, r.pages) for r in regions)])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def buckets_for(tag_buckets: int, regions: Sequence[Region]) -> int:
    """Page groups per region: `tag_buckets`, or the smallest region's page count when that is smaller.

    Every region has T groups in the identity a source checks (group g holds pages g, g + T, ...), so a T
    above a region's pages would leave groups that no page, and so no generation key, ever fills: the load
    would report success and no source would open it. Worked example: regions of 3 and 40 pages,
    tag_buckets 64 -> 3 groups per region."""
    if not 1 <= tag_buckets <= MAX_TAG_BUCKETS:
        raise SlackTierError(ErrorKind.BAD_INPUT, f"tag_buckets {tag_buckets} outside 1..{MAX_TAG_BUCKETS}",
                             fix=f"use 1 to {MAX_TAG_BUCKETS} page groups per region (default {DEFAULT_TAG_BUCKETS})")
    smallest = min((r.pages for r in regions), default=1)
    if tag_buckets > smallest:
        log.warning("tag_buckets %d is above the smallest region's %d pages: loading %d page groups per region",
                    tag_buckets, smallest, max(1, smallest))
    return max(1, min(tag_buckets, smallest))
