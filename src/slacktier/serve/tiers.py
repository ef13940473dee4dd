"""Placements of a model's lookup tables on tiers, and the row providers that serve them.

A `Placement` names the tier of each table layer and the row cache (rows and
per-layer shares): the configurations of the paper's Table 2. `TierSet` stages
one synthetic table (tables.stage) on one "device" file and on `devices`
files (ranks round-robin), and turns a placement into a row provider:
the stock DRAM table with the reference gather (`dram-table`), or SlackTier's
step engine over DRAM / disk page sources. A placement becomes a
`slacktier.config.ControlFile` (`TierSet.control`); one engine is kept and
switched between placements in place (`engine.apply(cfg)`, no files), so the
process stays the same across runs; each switch starts from an empty cache.

"Several devices" here are several files on the machine's one virtual disk,
each with its own I/O worker; they emulate separate devices' queues, not
separate hardware.
"""

from __future__ import annotations

import gc
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from slacktier.config import ControlFile, EngineConfig, Options, TableConfig, tier_names, tier_options_type
from slacktier.engine.step import StepEngine
from slacktier.errors import ErrorKind, SlackTierError
from slacktier.models.rows import DramRowProvider, DramTable, EngineRowProvider, RowProvider
from slacktier.tables.manifest import Manifest
from slacktier.tables.stage import SyntheticSource, stage_synthetic, staged_layout

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Placement:
    """Tier per table layer plus the row cache; `stock` = the DRAM table with the reference gather, no engine."""

    name: str                                     # a label for reports; code never reads meaning from it
    tiers: tuple[tuple[int, str], ...] = ()       # (layer, tier name of slacktier.config.tier_names())
    cache_rows: int = 0
    shares: tuple[tuple[int, float], ...] = ()    # (layer, share of cache_rows)
    devices: int = 1                              # disk regions spread over this many device files
    stock: bool = False
    delays_ms: tuple[tuple[int, float], ...] = ()  # (layer, ms): rows not ready before this long after issue

    def __post_init__(self) -> None:
        bad = [t for _, t in self.tiers if t not in tier_names()]
        if bad:
            raise SlackTierError(ErrorKind.BAD_INPUT, f"placement {self.name}: unknown tiers {bad}",
                                 fix=f"use one of {', '.join(tier_names())}")
        if sum(s for _, s in self.shares) > 1.0 + 1e-9:
            raise SlackTierError(ErrorKind.BAD_INPUT, f"placement {self.name}: cache shares exceed 1",
                                 fix="give the layers shares summing to at most 1")

    def tier(self, layer: int) -> str:
        """The tier serving `layer` (DRAM unless placed elsewhere)."""
        return dict(self.tiers).get(layer, "dram")

    def share(self, layer: int) -> float:
        """The share of `cache_rows` given to `layer`."""
        return dict(self.shares).get(layer, 0.0)


class DelayedRowProvider:
    """A provider whose layer l rows are not handed out before `delays_ms[l]` after begin_step (the paper's probe).

    Used to check the exposure model on read times the disk of this machine does not produce: the wrapped
    provider still reads and gathers every row; only the hand-out waits.
    """

    def __init__(self, inner: RowProvider, delays_ms: dict[int, float]) -> None:
        self.inner = inner
        self.layer_ids = tuple(inner.layer_ids)
        self.delays_ms = dict(delays_ms)
        self._t0 = 0.0

    @property
    def last_counters(self):
        return getattr(self.inner, "last_counters", None)

    def begin_step(self, ids) -> None:
        """Issue through the wrapped provider; the delay clock starts now."""
        self.inner.begin_step(ids)
        self._t0 = time.perf_counter()

    def rows(self, layer_id: int):
        """Wait until the layer's delay has passed since issue, then the wrapped provider's rows."""
        ready = self._t0 + self.delays_ms.get(layer_id, 0.0) / 1e3
        now = time.perf_counter()
        if ready > now:
            time.sleep(ready - now)
        return self.inner.rows(layer_id)

    def end_step(self) -> None:
        """Forward to the wrapped provider."""
        self.inner.end_step()


def table2_placements(first: int, second: int, cache_rows: int, devices: int = 4) -> list[Placement]:
    """The paper's Table 2 rows for lookup layers (first, second) = (1, 14): short window, then long."""
    both_disk = ((first, "disk"), (second, "disk"))
    return [
        Placement("dram-table", stock=True),
        Placement(f"l{first}-dram-l{second}-disk", ((first, "dram"), (second, "disk"))),
        Placement("disk", both_disk),
        Placement(f"disk{devices}", both_disk, devices=devices),
        Placement(f"disk-cache-l{second}", both_disk, cache_rows // 2, ((second, 1.0),)),
        Placement("disk-split", both_disk, cache_rows, ((first, 0.5), (second, 0.5))),
        Placement(f"disk{devices}-split", both_disk, cache_rows, ((first, 0.5), (second, 0.5)), devices=devices),
    ]


@dataclass
class TierSet:
    """A staged synthetic table and everything needed to serve it under any placement."""

    workdir: Path
    layout: object                   # a TableLayout (EngramLayout, PleLayout), a StagedLayout, or {layer: rows}
    seed: int
    columns: int = 24
    max_cache_rows: int = 0
    max_tokens: int = 512
    devices: int = 4
    options: Sequence[Options] = ()  # tier option structs (e.g. DiskOptions(queue_depth=64)); defaults otherwise
    metrics: bool = False            # engines publish Prometheus metrics ([engine] metrics)
    manifests: dict[int, Manifest] = field(default_factory=dict, init=False)
    engine: StepEngine | None = field(default=None, init=False)
    _stock: DramRowProvider | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        self.workdir = Path(self.workdir)
        self.table_layout = staged_layout(self.layout)
        self.layer_ids = self.table_layout.layer_ids
        self.source = SyntheticSource(self.table_layout, self.seed)

    # -- staging ----------------------------------------------------------------------------------------
    def stage(self, device_counts: tuple[int, ...] | None = None, progress: bool = False) -> None:
        """Stage the table on n device files (one rank per device) for each n (default: 1 and `devices`)."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        for n in sorted(set(device_counts or (1, self.devices))):
            targets = [self.workdir / f"table-d{n}-{i}.bin" for i in range(n)]
            self.manifests[n] = stage_synthetic(targets, self.table_layout, ranks=n, seed=self.seed, overwrite=True,
                                                manifest_path=self.workdir / f"table-d{n}.json", progress=progress)

    @property
    def table_bytes(self) -> int:
        """Bytes of all layers' rows (264 B each)."""
        return sum(self.table_layout.rows[l] for l in self.layer_ids) * 264

    # -- providers --------------------------------------------------------------------------------------
    def stock_provider(self) -> DramRowProvider:
        """The DRAM table (all layers in host memory) with the reference gather."""
        if self._stock is None:
            tables = {l: DramTable.from_source(self.source, l, self.table_layout.rows[l]) for l in self.layer_ids}
            self._stock = DramRowProvider(tables, self.layer_ids)
        return self._stock

    def drop_stock(self) -> None:
        """Free the stock DRAM table (so resident memory reflects the placement being measured)."""
        self._stock = None
        gc.collect()

    def control(self, placement: Placement, cache_rows: int | None = None) -> ControlFile:
        """The control file that serves `placement` from the staged manifests (`cache_rows` overrides its cache)."""
        manifest = self.manifests.get(placement.devices)
        if manifest is None:
            raise SlackTierError(ErrorKind.MISSING, f"no table staged on {placement.devices} devices",
                                 fix="stage() with that placement's device count")
        rows = placement.cache_rows if cache_rows is None else cache_rows
        by_type = {type(o): o for o in self.options}
        engine = EngineConfig(device="cpu", cache_rows=rows, max_cache_rows=max(self.max_cache_rows, rows),
                              max_tokens=self.max_tokens, metrics=self.metrics)
        tables = tuple(   # window order = model order: short window first
            TableConfig(layer=layer, manifest=str(manifest.path), source=placement.tier(layer),
                        options=by_type.get(tier_options_type(placement.tier(layer))),
                        cache_share=placement.share(layer), order=order)
            for order, layer in enumerate(self.layer_ids))
        return ControlFile(engine=engine, tables=tables)

    def provider(self, placement: Placement, keep_stock: bool = False) -> RowProvider:
        """A provider serving `placement`: the stock table, or the one engine switched in place.

        The first engine placement builds the engine (`StepEngine.from_config`); later ones `engine.apply` the
        placement's control file, first with an empty cache, so every run starts cold. The stock DRAM table is
        freed unless `keep_stock` (to compare side by side with it).
        """
        if placement.stock:
            if not keep_stock:
                self._close_sources()
            return self.stock_provider()
        if not keep_stock:
            self.drop_stock()
        cfg = self.control(placement)
        if self.engine is None:
            self.engine = StepEngine.from_config(cfg, ids_layers=self.layer_ids, columns=self.columns)
        else:
            self.engine.apply(cfg.replace(cache_rows=0))
            self.engine.apply(cfg)
        provider = EngineRowProvider(self.engine, self.layer_ids)
        if placement.delays_ms:
            return DelayedRowProvider(provider, dict(placement.delays_ms))
        return provider

    def _close_sources(self) -> None:
        if self.engine is not None:
            self.engine.close()   # closes the sources it opened from its control file
            self.engine = None

    def close(self) -> None:
        """Close the engine and every source."""
        self._close_sources()
        self.drop_stock()
