"""What the step engine runs beside the step when asked to: the bit-exact checker and the metrics labels.

Neither is on the step's path unless it is switched on: the checker runs in
`gather` when the engine's `check` is set (it compares every gathered row with
the reference gather of the table's own source, engine.checker), and the
metrics labels are bound when the engine has an `EngineMetrics` (at build and
after every `apply`). The step itself (engine.step) calls these functions and
nothing else of either.

Worked example: `check=True`, layer 14 gathers 3,072 rows, row 531 of rank 1
differs -> its slot is forgotten, `check_gathered` returns the CHECKSUM error
naming layer 14, rank 1, page 2, and gather raises it.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import numpy as np
import torch

from slacktier.cache import KIND_MISS, RowCache
from slacktier.config import tier_facts, tier_names
from slacktier.engine.checker import FileRowReader, RowReader, mismatching_rows, reference_gather
from slacktier.errors import ErrorKind, SlackTierError
from slacktier.tables.layout import ROWS_PER_PAGE

if TYPE_CHECKING:
    from slacktier.engine.build import Applied
    from slacktier.engine.runs import LayerRun
    from slacktier.engine.metrics import EngineMetrics

log = logging.getLogger(__name__)


def row_reader(run: LayerRun) -> RowReader:
    """The reference rows of `run`'s table: the spec's own reader, else its region files read with pread (kept
    in the run, so a layer whose regions do not change keeps its open files across an apply)."""
    spec = run.spec
    if spec.reference is not None:
        return spec.reference
    if run.reader is None:
        regions = spec.regions
        run.reader = FileRowReader(spec.layer, [r.row_start - spec.row_start for r in regions],
                                   [r.rows for r in regions], regions)
    return run.reader


def check_gathered(run: LayerRun, out: torch.Tensor, convention: str, raise_on_mismatch: bool,
                   cache: RowCache) -> SlackTierError | None:
    """Compare `out` ([n, 256] bf16, the layer's gathered rows) with the reference gather of the same ids.

    Counts checked rows and mismatches into the run's counters. A mismatch is logged; with
    `raise_on_mismatch` the slots of the wrong rows are forgotten (no later step serves them) and the
    CHECKSUM error naming the first one's rank and page is returned for the caller to raise.
    """
    res, sc = run.res, run.scratch
    kinds = sc.desc_kind[:res.lookups]
    if res.zero or res.foreign or res.padded or res.outside:
        keep = np.flatnonzero(kinds <= KIND_MISS)   # zero and foreign rows are not the table's
        ours = out[torch.from_numpy(keep)]
        local = run.ids.reshape(-1)[keep] - run.spec.row_start
    else:
        keep = np.arange(res.lookups)
        ours = out
        local = run.ids.reshape(-1) - run.spec.row_start
    ref = reference_gather(row_reader(run).read(local), convention)
    differ = mismatching_rows(ours, ref)
    bad = int(differ.sum())
    run.counters.checked_rows += int(keep.size)
    run.counters.mismatches += bad
    if not bad:
        return None
    log.error("checker: %d of %d rows of layer %d differ from the reference gather", bad, keep.size, run.spec.layer)
    if not raise_on_mismatch:
        return None
    return _refuse_mismatch(run, keep[differ.numpy()], local[differ.numpy()], bad, keep.size, cache)


def _refuse_mismatch(run: LayerRun, lookups: np.ndarray, local: np.ndarray, bad: int, checked: int,
                     cache: RowCache) -> SlackTierError:
    """The CHECKSUM error of rows the checker found wrong, naming the first one's rank and page; the slots
    those rows were cached in (hits or this step's fills) are forgotten, so no later step serves them."""
    sc = run.scratch
    kind, idx = sc.desc_kind[lookups], sc.desc_idx[lookups]
    slots = np.where(kind == KIND_MISS, sc.miss_slot[np.where(kind == KIND_MISS, idx, 0)], idx)
    cache.forget(run.spec.layer, slots.astype(np.int32))
    row = int(local[0]) + run.spec.row_start   # global row id of the first wrong row
    region = next(r for r in run.spec.regions if r.row_start <= row < r.row_start + r.rows)
    shard_row = row - region.row_start
    return SlackTierError(ErrorKind.CHECKSUM, f"{bad} of {checked} gathered rows differ from the table's source "
                          f"(first: row {row}, shard row {shard_row}); none is served", layer=run.spec.layer,
                          rank=region.rank, page=shard_row // ROWS_PER_PAGE,
                          fix="the medium or the manifest does not hold the table: run `slacktier verify` on "
                              "its manifest and stage it again")


def bind_metrics(metrics: EngineMetrics, runs: list[LayerRun], applied: Applied | None, cache: RowCache,
                 owned_only: bool) -> None:
    """Label each layer's series (`runs`, window order) with its tier and rank: the control file's when the
    engine serves one, else the source's tier (or class) and, for a one-region per-rank table, its rank."""
    from slacktier.engine.metrics import LayerLabels
    labels = []
    for run in runs:
        spec = run.spec
        layer = spec.layer
        if applied is not None and layer in applied.resolved:
            t = applied.resolved[layer].config
            tier, rank = t.source, t.rank
        else:
            tier = getattr(spec.source, "tier", None) or type(spec.source).__name__
            rank = spec.regions[0].rank if len(spec.regions) == 1 and owned_only else -1
        host = sum(r.nbytes for r in spec.regions) if tier in tier_names() and tier_facts(tier).holds_host_copy \
            else 0
        labels.append(LayerLabels(layer, tier, rank, cache.owned_slots(layer), host))
    metrics.bind(labels)
