"""Placing RedKnot artifact tables by their layers' windows.

Artifact tables are ordinary control-file tables (redknot.placement builds and
checks them); this is their planner. From each reusable layer's artifact pages
and window in one prefill and the tiers' read-time models
(`plan.tiers.TierSpec`: plan.readmodel per tier), `plan_artifact_placement`
picks the placement with the least host memory whose Eq. 1 stall
(`plan.exposure`) stays within a target, and writes the window order into the
control file's `order`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from slacktier.config import ControlFile, EngineConfig, Options, TableConfig, tier_options_type
from slacktier.errors import ErrorKind, SlackTierError
from slacktier.plan.exposure import device_exposure
from slacktier.plan.readmodel import DeviceReadModel, LayerPages

@dataclass(frozen=True)
class ArtifactDemand:
    """One reusable layer's artifact reads in one prefill: pages (every document, this rank) and window."""

    layer: int
    pages: int
    window_ms: float   # from the prefill's start (when every read is submitted) until the layer needs its pages

    def __post_init__(self) -> None:
        if self.pages < 0 or self.window_ms < 0:
            raise _bad(f"layer {self.layer}: pages {self.pages}, window {self.window_ms} ms",
                       "pages and windows are >= 0", layer=self.layer)


@dataclass(frozen=True)
class ArtifactTablePlan:
    """Where one layer's artifacts go and what the read-time model predicts for them."""

    layer: int
    source: str
    order: int           # submission order: window order
    window_ms: float
    pages: int
    read_ms: float       # T_l: its tier's queue up to and including its own pages
    stall_ms: float      # d_l (plan.exposure, coupled)
    host_bytes: int      # pages held in host memory for this prefill's documents


@dataclass(frozen=True)
class ArtifactPlan:
    """A placement of every reusable layer's artifact table, its prediction, and the control file that serves it."""

    tables: tuple[ArtifactTablePlan, ...]
    slowdown_ms: float
    host_bytes: int
    control: ControlFile


class ReadModel(Protocol):
    """A tier as the artifact planner sees it (the fields of plan.tiers.TierSpec it uses)."""

    name: str                  # the tier: a source name of the control file
    read: DeviceReadModel      # T_l = a + b P_l + c (pages queued ahead) + c_behind (pages queued behind)
    holds_table: bool          # the tier keeps the pages in host memory


def plan_artifact_placement(store_root: str | Path, demands: Sequence[ArtifactDemand], tiers: Sequence[ReadModel],
                            *, target_ms: float = 0.0, options: Sequence[Options] = (),
                            wait_timeout_ms: float | None = None, page_bytes: int = 4096) -> ArtifactPlan:
    """The placement with the least host memory whose predicted stall stays within `target_ms`.

    Every artifact read of a prefill is submitted at its start in window order
    (service._start_reads), so a layer's read time on a tier is the device model's
    T_l = a + b * P_l + c * sum_{j<l, same tier} P_j + c_behind * sum_{j>l, same tier} P_j
    (plan.readmodel); stalls follow Eq. 1 (`plan.exposure`). Windows grow with
    depth, so the candidates are the splits "layers before k on tier F, the rest
    on tier S" for every ordered pair of tiers (F = S included): the earliest
    layers, whose windows are shortest, stay on the faster tier. Host memory
    counts the pages a tier that holds tables (DRAM) keeps for these documents, at `page_bytes` each (the
    tier's 4 KiB page, tables.layout.PAGE_BYTES; plan imports nothing but config).

    Worked example: layers 1..5 of 256 pages each, windows 100, 200, ..., 500 ms,
    DRAM (a=0, b=c=c_behind=0.001 ms) and disk (a=0.3, b=c=c_behind=0.01 ms): disk alone gives T_1 =
    0.3 + 0.01*256 + 0.01*1024 = 13.1 ms < 100 ms (T_5 = 0.3 + 0.01*1280 too), so every layer goes to disk and
    no page is held in host memory.
    """
    if not demands or not tiers:
        raise _bad("nothing to place or nowhere to place it", "give at least one layer and one tier")
    if len({d.layer for d in demands}) != len(demands):
        raise _bad("two demands for one layer", "give each reusable layer once")
    ordered = sorted(demands, key=lambda d: (d.window_ms, d.layer))
    best: ArtifactPlan | None = None
    closest = None
    for fast in tiers:
        for slow in tiers:
            for k in range(len(ordered) + 1):
                if fast is slow and k not in (0, len(ordered)):
                    continue
                plan = _predict_artifacts(store_root, ordered, [fast] * k + [slow] * (len(ordered) - k),
                                          options, wait_timeout_ms, page_bytes)
                if closest is None or plan.slowdown_ms < closest.slowdown_ms:
                    closest = plan
                if plan.slowdown_ms <= target_ms + 1e-12 and (
                        best is None or (plan.host_bytes, plan.slowdown_ms) < (best.host_bytes, best.slowdown_ms)):
                    best = plan
    if best is None:
        raise SlackTierError(ErrorKind.CAPACITY,
                             f"artifact placement: no split meets the {target_ms:.3f} ms target; the best predicts "
                             f"{closest.slowdown_ms:.3f} ms", fix="raise the target or add a faster tier")
    return best


def _predict_artifacts(store_root, ordered: Sequence[ArtifactDemand], chosen: Sequence[ReadModel],
                       options: Sequence[Options], wait_timeout_ms: float | None, page_bytes: int) -> ArtifactPlan:
    by_type = {type(o): o for o in options}
    rows = []
    exp = device_exposure([LayerPages(d.layer, t.name, d.pages, i) for i, (d, t) in enumerate(zip(ordered, chosen))],
                          {d.layer: d.window_ms for d in ordered}, {t.name: t.read for t in chosen})
    reads_ms = [exp.reads[exp.layers.index(d.layer)].read_ms for d in ordered]
    stalls = [exp.stall_of(d.layer) for d in ordered]
    for i, (d, tier) in enumerate(zip(ordered, chosen)):
        rows.append(ArtifactTablePlan(layer=d.layer, source=tier.name, order=i, window_ms=d.window_ms,
                                      pages=d.pages, read_ms=reads_ms[i], stall_ms=stalls[i],
                                      host_bytes=d.pages * page_bytes if tier.holds_table else 0))
    root = str(Path(store_root).resolve())
    tables = tuple(TableConfig(layer=p.layer, manifest=root, source=p.source, order=p.order,
                               options=by_type.get(tier_options_type(p.source))) for p in rows)
    engine = EngineConfig(verify_reads=True) if wait_timeout_ms is None else \
        EngineConfig(verify_reads=True, wait_timeout_ms=wait_timeout_ms)
    return ArtifactPlan(tuple(rows), sum(stalls), sum(p.host_bytes for p in rows),
                        ControlFile(engine=engine, tables=tables))


def _bad(message: str, fix: str, **where) -> SlackTierError:
    return SlackTierError(ErrorKind.BAD_INPUT, f"artifact placement: {message}", fix=fix, **where)
