"""A staged synthetic table and the row providers that serve it under any placement (plan.placement).

`TierSet` stages one synthetic table (tables.stage) on one "device" file and on
`devices` files (ranks round-robin), and turns a placement into a row provider:
the stock DRAM table with the reference gather (`dram-table`), or SlackTier's
step engine over DRAM / disk page sources. A placement becomes a
`slacktier.config.ControlFile` (`plan.placement.placement_control`); one engine
is kept and switched between placements in place (`engine.apply(cfg)`, no
files), so the process stays the same across runs; each switch starts from an
empty cache.

"Several devices" here are several files on the machine's one virtual disk,
each with its own I/O worker; they emulate separate devices' queues, not
separate hardware.
"""

from __future__ import annotations

import gc
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

from slacktier.config import ControlFile, EngineConfig, Options, tier_options_type
from slacktier.engine.step import StepEngine
from slacktier.errors import ErrorKind, SlackTierError
from slacktier.models.rows import DramRowProvider, DramTable, EngineRowProvider, RowProvider
from slacktier.plan.placement import Placement, placement_control
from slacktier.tables.manifest import Manifest
from slacktier.tables.stage import SyntheticSource, stage_synthetic, staged_layout

log = logging.getLogger(__name__)


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

    def control(self, placement: Placement) -> ControlFile:
        """The control file that serves `placement` from the staged manifests."""
        manifest = self.manifests.get(placement.devices)
        if manifest is None:
            raise SlackTierError(ErrorKind.MISSING, f"no table staged on {placement.devices} devices",
                                 fix="stage() with that placement's device count")
        by_type = {type(o): o for o in self.options}
        engine = EngineConfig(device="cpu", max_cache_rows=self.max_cache_rows, max_tokens=self.max_tokens,
                              metrics=self.metrics)
        return placement_control(placement, engine, str(manifest.path), self.layer_ids,   # model order = window order
                                 options=lambda _, tier: by_type.get(tier_options_type(tier)))

    def provider(self, placement: Placement, keep_stock: bool = False,
                 wrap: Callable[[RowProvider], RowProvider] | None = None) -> RowProvider:
        """A provider serving `placement`: the stock table, or the one engine switched in place.

        The first engine placement builds the engine (`StepEngine.from_config`); later ones `engine.apply` the
        placement's control file, first with an empty cache, so every run starts cold. The stock DRAM table is
        freed unless `keep_stock` (to compare side by side with it). `wrap` wraps the engine's provider (an
        experiment's injected hand-out delays, say).
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
        return wrap(provider) if wrap is not None else provider

    def _close_sources(self) -> None:
        if self.engine is not None:
            self.engine.close()   # closes the sources it opened from its control file
            self.engine = None

    def close(self) -> None:
        """Close the engine and every source."""
        self._close_sources()
        self.drop_stock()
