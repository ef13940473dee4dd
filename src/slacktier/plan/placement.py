"""A placement: the tier of each lookup table, the row cache and its split, and the control file that serves it.

`Placement` is the one value every placement in the package is written as (the
demo's, the step timeline's, a what-if's); `placement_control` is the one way it
becomes a `slacktier.config.ControlFile` the engine loads.

Tiers are named as a control file names them (`slacktier.config.tier_names()`),
and what the code needs to know of a tier it asks the tier's facts
(`slacktier.config.tier_facts`), never its name. A tier whose devices are
emulated (`device_kind == "model"`) is registered by the module that provides it,
so a placement naming one is refused, with that advice, until that module is
imported.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import msgspec

from slacktier.config import ControlFile, EngineConfig, Options, TableConfig, tier_facts
from slacktier.errors import ErrorKind, SlackTierError

#: how ranks map to emulated devices: one device all ranks share, or one per rank
DISK_MAPS = ("shared", "per-rank")


@dataclass(frozen=True)
class Placement:
    """Tier per table layer, the device model of each emulated layer, and the row cache and its per-layer shares.

    A layer not placed is served from DRAM. `stock` marks the engines' own DRAM table with the reference gather
    (no SlackTier engine at all): the baseline a placement is compared with.
    """

    name: str                                      # a label for reports; code never reads meaning from it
    tiers: tuple[tuple[int, str], ...] = ()        # (layer, tier name as a control file names it)
    cache_rows: int = 0                            # rows of the row cache (per rank)
    shares: tuple[tuple[int, float], ...] = ()     # (layer, share of cache_rows)
    devices: int = 1                               # a file tier's regions spread over this many device files
    models: tuple[tuple[int, str], ...] = ()       # (layer, device model name) of each emulated layer
    disks: str = "shared"                          # emulated layers: one of DISK_MAPS
    stock: bool = False

    def __post_init__(self) -> None:
        placed = dict(self.tiers)
        models = dict(self.models)
        for layer, tier in self.tiers:
            try:
                tier_facts(tier)
            except SlackTierError as exc:
                raise SlackTierError(ErrorKind.BAD_INPUT, f"placement {self.name}: layer {layer} on {tier!r}",
                                     fix=exc.fix, layer=layer) from None
        for layer in models:
            if layer not in placed or tier_facts(placed[layer]).device_kind != "model":
                raise SlackTierError(ErrorKind.BAD_INPUT, f"placement {self.name}: layer {layer} has device model "
                                     f"{models[layer]} but is placed on {placed.get(layer, 'dram')}",
                                     fix="a table is read from one device: either emulated with a model or real, "
                                         "not both", layer=layer)
        for layer, tier in self.tiers:
            if tier_facts(tier).device_kind == "model" and layer not in models:
                raise SlackTierError(ErrorKind.BAD_INPUT, f"placement {self.name}: layer {layer} is on emulated "
                                     f"tier {tier!r} without a device model", fix="name its device model",
                                     layer=layer)
        if self.disks not in DISK_MAPS:
            raise SlackTierError(ErrorKind.BAD_INPUT, f"placement {self.name}: disks {self.disks!r}",
                                 fix=f"use one of {', '.join(DISK_MAPS)}")
        if self.cache_rows < 0 or self.devices < 1:
            raise SlackTierError(ErrorKind.BAD_INPUT, f"placement {self.name}: {self.cache_rows} cache rows on "
                                 f"{self.devices} devices", fix="cache_rows >= 0 and devices >= 1")
        if sum(s for _, s in self.shares) > 1.0 + 1e-9 or any(s < 0 for _, s in self.shares):
            raise SlackTierError(ErrorKind.BAD_INPUT, f"placement {self.name}: cache shares {self.shares}",
                                 fix="give the layers shares >= 0 summing to at most 1")

    def tier(self, layer: int) -> str:
        """The tier serving `layer` (DRAM unless placed elsewhere)."""
        return dict(self.tiers).get(layer, "dram")

    def share(self, layer: int) -> float:
        """The share of `cache_rows` given to `layer`."""
        return dict(self.shares).get(layer, 0.0)

    def model(self, layer: int) -> str | None:
        """The device model of an emulated `layer` (None for a layer on a real device)."""
        return dict(self.models).get(layer)


#: a table's tier options: (layer, tier) -> the option struct, or None for the tier's defaults
OptionsFor = Callable[[int, str], "Options | None"]


def placement_control(placement: Placement, engine: EngineConfig, manifest: str, layer_ids: Sequence[int], *,
                      options: OptionsFor | None = None, rank: int = -1,
                      engine_layers_only: bool = False) -> ControlFile:
    """The control file that serves `placement` from the staged table `manifest`.

    `layer_ids` are the lookup layers in window order (the shortest window first): that is the order the engine
    submits their reads in. The engine section is `engine` with the placement's cache (`max_cache_rows` raised to
    hold it). `options(layer, tier)` gives a table's tier options (default: the tier's own defaults); `rank` >= 0
    serves that rank's share of each table alone; `engine_layers_only` leaves out the layers whose tier holds a
    host copy (the serving engines' plug-ins leave those to the engines' own path). Worked example: layers
    (1, 14), layer 1 on dram and 14 on disk, `engine_layers_only` -> one table, layer 14 on disk, order 0.
    """
    if placement.stock:
        raise SlackTierError(ErrorKind.BAD_INPUT, f"placement {placement.name} is the stock DRAM table",
                             fix="serve the stock table without an engine; a control file is for SlackTier's engine")
    layers = [l for l in layer_ids if not (engine_layers_only and tier_facts(placement.tier(l)).holds_host_copy)]
    eng = EngineConfig(**(msgspec.structs.asdict(engine) | {   # built again: its checks run on the new cache
        "cache_rows": placement.cache_rows, "max_cache_rows": max(engine.max_cache_rows, placement.cache_rows)}))
    tables = tuple(
        TableConfig(layer=l, manifest=str(manifest), source=placement.tier(l),
                    options=options(l, placement.tier(l)) if options else None, rank=rank,
                    cache_share=placement.share(l), order=order)
        for order, l in enumerate(layers))
    return ControlFile(engine=eng, tables=tables)
