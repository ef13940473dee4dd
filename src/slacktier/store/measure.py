"""Measuring a tier's reads of two table layers on a staged table: what the read fit (plan.readfit) is fitted to.

Per run it draws a page count for each layer (uniform and independent),
submits the first layer's pages and then the second's to the tier's page
sources, opened as the engine opens them, and times each layer from the first
submit to its last completion: the source's own clock, as the engine reports
it, plus the later submit's lag. A disk tier's sources of both layers attach to
the device's one deadline-ordered queue (store/devqueue.py), so the second
layer's reads only fill the depth the first layer's leave, as in a served step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from slacktier.errors import ErrorKind, SlackTierError


@dataclass(frozen=True)
class ReadRuns:
    """Measured runs of one tier: per run each layer's pages and read time, layers in submission order."""

    tier: str
    layers: tuple[int, ...]   # submission order
    pages: np.ndarray         # [runs, layers] pages read
    read_ms: np.ndarray       # [runs, layers] ms from the first submit to the layer's last completion

    def csv(self) -> str:
        """The runs as CSV: run, then pages and read_ms per layer."""
        head = ["run"] + [f"pages_l{l}" for l in self.layers] + [f"read_ms_l{l}" for l in self.layers]
        rows = [",".join(head)]
        for i, (p, t) in enumerate(zip(self.pages, self.read_ms)):
            rows.append(",".join([str(i), *(f"{x:.0f}" for x in p), *(f"{x:.6f}" for x in t)]))
        return "\n".join(rows) + "\n"


def measure_reads(tier: str, manifest, layers: Sequence[int], *, runs: int,
                  max_pages: Sequence[int] = (3000, 3000), options=None, seed: int = 0, rank: int = 0) -> ReadRuns:
    """`runs` runs over `manifest`'s rank-`rank` regions of `layers` (submitted in that order), random pages.

    Each source is opened as the engine opens it: checked against the manifest's identity (a Redis prefix
    defaults to the one `slacktier load` writes), and a tier that compares stored CRC32Cs on every read (Redis)
    is given the manifest's, with its page check as under `verify_reads = "auto"`."""
    from slacktier.store.base import PageBufferPool
    from slacktier.store.registry import get_tier, open_source

    if len(layers) != len(max_pages) or len(layers) < 2:
        raise SlackTierError(ErrorKind.BAD_INPUT, f"layers {list(layers)} with max pages {list(max_pages)}",
                             fix="give two or more layers and one page maximum per layer")
    regions = [manifest.runtime_regions(layer=l, rank=rank) for l in layers]
    sources = []
    try:
        cls = get_tier(tier).source_cls
        sums = dict(zip(((r.layer, r.rank) for r in manifest.regions), manifest.region_checksums(), strict=True))
        for r in regions:
            crcs = [sums[(x.layer, x.rank)] for x in r] if cls.stored_crc32c else None
            sources.append(open_source(tier, r, options, page_crc32c=crcs, identity=manifest.identity,
                                       verify_pages=cls.verify_by_default))
        pools = [PageBufferPool(m) for m in max_pages]
        rng = np.random.default_rng(seed)
        pages_drawn, t_ms = [], []
        for pool in pools:   # every buffer's first touch now, not in the timed run that first reaches it
            pool.pages.fill(0)
        for _ in range(3):   # warm-up: threads, rings, first reads
            for src, reg, pool in zip(sources, regions, pools):
                src.wait(src.submit(random_reads(min(64, reg[0].pages, pool.capacity), reg[0].pages, rng), pool))
        for _ in range(runs):
            counts = [int(rng.integers(1, min(m, r[0].pages) + 1)) for m, r in zip(max_pages, regions)]
            reads = [random_reads(n, r[0].pages, rng) for n, r in zip(counts, regions)]
            t0 = time.perf_counter()
            tickets = []
            for src, q, pool in zip(sources, reads, pools):
                lag = time.perf_counter() - t0   # a later layer is submitted after the earlier ones: same clock
                tickets.append((src.submit(q, pool), lag))
            t_ms.append([src.wait(t).read_us / 1e3 + lag * 1e3 for src, (t, lag) in zip(sources, tickets)])
            pages_drawn.append(counts)
    finally:
        for src in sources:
            src.close()
    return ReadRuns(tier, tuple(int(l) for l in layers), np.asarray(pages_drawn, dtype=np.float64),
                    np.asarray(t_ms, dtype=np.float64))


def random_reads(n: int, region_pages: int, rng: np.random.Generator):
    """`n` distinct pages of a region of `region_pages` pages, ascending, one buffer each (store.base.PageReads)."""
    from slacktier.store.base import PageReads

    pages = np.sort(rng.choice(region_pages, size=n, replace=False)).astype(np.int64)
    return PageReads(region=np.zeros(n, dtype=np.int32), page=pages, buffer=np.arange(n, dtype=np.int32))
