"""Per-rank misses under a rank partition: what each tensor-parallel rank's process reads per decode step.

An experiment's counting beside its benchmarks (full_rank.py, bench_full_rank.py pages, bench_rank_partition.py),
not the package: no verb uses it (issue 29).

Under the engines' column (head) sharding (`columns`), rank k of `ranks` owns hash columns
[k * C/ranks, (k+1) * C/ranks) of every layer (tables.layout.shard_bounds), so
its process resolves only those columns' lookups (the engine's `owned_only`)
against its own cache; `balanced` gives each rank as many heads of each order
(tables.partition). On V4.1 (24 columns = 3 orders x 8 heads, TP4) rank 0
owns 2-gram heads 0..5, rank 1 2-gram 6..7 and 3-gram 0..3, rank 2 3-gram
4..7 and 4-gram 0..1, rank 3 4-gram heads 2..7: the ranks are not alike, and a
TP step waits for its slowest rank.
Rows are counted in the rank region's stored rows (tables.partition.stored_spans),
so pages are the region's own.

`rank_pages` replays the served CLOCK (cache.simulate, pins per step) over one
rank's lookups of one layer at a capacity (0: uncached) and counts the distinct
4 KiB pages of the rank's region missed by each full-batch decode step (page =
(row - shard_start) // 15). Worked example: 24 columns, rank 3 of 4, a token
whose 4-gram head 7 hashes to global row 1,000,099 and whose rank-3 shard
starts at row 1,000,000 -> shard row 99 -> page 6.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from slacktier.errors import ErrorKind, SlackTierError
from slacktier.tables.partition import RankPartition, stored_spans
from slacktier.workloads.characterize import decode_step_pages, prepare_layer, run_policy
from slacktier.workloads.replay import LookupTrace


@dataclass(frozen=True)
class RankPages:
    """One (rank, layer, capacity) on a trace: pages per full-batch decode step and the decode hit rate."""

    workload: str
    batch: int
    rank: int
    layer: int
    capacity_rows: int
    columns: tuple[int, ...]      # hash columns the rank owns
    orders: tuple[int, ...]       # n-gram orders of those columns
    steps: int                    # full-batch decode steps counted
    pages_mean: float             # distinct missed pages per full-batch decode step
    pages_p99: float
    lookups_per_step: float
    hit_rate: float               # over the decode lookups of those steps
    partition: str = "columns"


def trace_partition(trace: LookupTrace, ranks: int, kind: str = "columns") -> RankPartition:
    """The partition `kind` of the trace's hash columns over `ranks` ranks (refused where it does not split)."""
    return RankPartition.make(kind, trace.n_columns, ranks, trace.heads_per_order)


def rank_trace(trace: LookupTrace, layer: int, rank: int, ranks: int,
               partition: str = "columns") -> tuple[LookupTrace, int]:
    """The lookups of `rank`'s columns of `layer` as a one-layer trace in the rank region's stored rows, and the
    region's first stored row.

    Refuses a column count the rank count does not divide (no whole heads per rank).
    """
    c = trace.n_columns
    if ranks < 1 or c % ranks or not 0 <= rank < ranks:
        raise SlackTierError(ErrorKind.BAD_INPUT, f"rank {rank} of {ranks} over {c} hash columns",
                             fix="use a rank count that divides the column count, and a rank below it")
    part = trace_partition(trace, ranks, partition)
    cols = list(part.columns[rank])
    li = trace.layer_ids.index(layer)
    bounds = trace.column_bounds[li] if trace.column_bounds else None
    spans = stored_spans(part, bounds, trace.table_rows[li], ranks)[rank]
    lo = spans[0].stored_start
    hi = spans[-1].stored_start + spans[-1].rows
    rows = trace.layer_rows(layer).reshape(trace.num_tokens, c)[:, cols]
    if partition != "columns":   # column j's rows move by its span's shift (hash ids of column j lie in it)
        shift = np.array([next(s.stored_start - s.start for s in spans if s.start <= bounds[j] < s.start + s.rows)
                          for j in cols], dtype=np.int64)
        rows = rows + shift[None, :]
    sub = LookupTrace(trace.workload, trace.batch, (layer,), (hi - lo,), len(cols), trace.heads_per_order,
                      trace.min_order, np.ascontiguousarray(rows).reshape(1, -1), trace.token_step,
                      trace.token_decode, trace.token_session)
    return sub, lo


def rank_pages(trace: LookupTrace, layer: int, rank: int, ranks: int, capacities: Sequence[int],
               partition: str = "columns") -> list[RankPages]:
    """Pages and hits of `rank`'s process on `layer` at each capacity (rows of its cache for that layer)."""
    sub, shard_start = rank_trace(trace, layer, rank, ranks, partition)
    prep = prepare_layer(sub, layer)
    per = sub.n_columns
    dec_steps = np.unique(trace.token_step[trace.token_decode])
    tokens_of = np.bincount(trace.token_step[trace.token_decode], minlength=int(trace.token_step[-1]) + 1)[dec_steps]
    full = tokens_of == trace.batch                    # [decode steps] bool: a full batch decoding
    full_lookup = np.isin(trace.token_step, dec_steps[full])[:, None].repeat(per, axis=1).reshape(-1)
    cols = trace_partition(trace, ranks, partition).columns[rank]
    orders = tuple(sorted({trace.min_order + c // trace.heads_per_order for c in cols}))
    out = []
    for cap in capacities:
        hit = np.zeros(prep.ids.shape[0], dtype=np.uint8) if cap == 0 else run_policy(prep, "clock", int(cap))
        pages = decode_step_pages(prep, hit, shard_start=shard_start)[full]
        n = int(full_lookup.sum())
        out.append(RankPages(trace.workload, trace.batch, rank, layer, int(cap), tuple(cols), orders,
                             int(pages.shape[0]), float(pages.mean()) if pages.size else float("nan"),
                             float(np.percentile(pages, 99)) if pages.size else float("nan"),
                             n / max(1, int(full.sum())), float(hit[full_lookup].sum()) / max(1, n), partition))
    return out


def slowest_rank(results: Sequence[RankPages], capacity_rows: int, layer: int | None = None) -> int:
    """The rank with the most pages per step at `capacity_rows` (summed over layers, or on one `layer`)."""
    total: dict[int, float] = {}
    for r in results:
        if r.capacity_rows == capacity_rows and (layer is None or r.layer == layer):
            total[r.rank] = total.get(r.rank, 0.0) + r.pages_mean
    if not total:
        raise SlackTierError(ErrorKind.MISSING, f"no result at {capacity_rows} rows",
                             fix="pass results measured at that capacity")
    return max(total, key=lambda k: total[k])
