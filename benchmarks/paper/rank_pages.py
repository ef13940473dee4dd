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
from slacktier.cache.simulate import HIT, READ, REUSE_FILLED, replay_clock
from slacktier.workloads.characterize import decode_step_pages, prepare_layer, step_starts
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


def full_batch_steps(trace: LookupTrace) -> np.ndarray:
    """Indices [S] of the trace's decode steps with a full batch (`trace.batch` tokens), in step order."""
    dec_steps = np.unique(trace.token_step[trace.token_decode])
    tokens_of = np.bincount(trace.token_step[trace.token_decode], minlength=int(trace.token_step[-1]) + 1)[dec_steps]
    return dec_steps[tokens_of == trace.batch]


def _step_lookups(trace: LookupTrace, steps: np.ndarray, per: int) -> np.ndarray:
    """[T * per] bool: the lookups (token-major, `per` columns a token) of the tokens of `steps`."""
    return np.isin(trace.token_step, steps)[:, None].repeat(per, axis=1).reshape(-1)


def _rank_clock(trace: LookupTrace, layer: int, rank: int, ranks: int, capacity: int, partition: str,
                evict_ahead: bool = True):
    """The served CLOCK over `rank`'s lookups of `layer` at `capacity` rows (0: uncached), with the engine's
    evict_ahead unless told otherwise: the rank's one-layer trace, each lookup's outcome [M] int8 (cache.simulate:
    HIT, REUSE_FILLED, REUSE_BYPASS, READ), and the distinct missed pages of each decode step [S] (in step order)."""
    sub, shard_start = rank_trace(trace, layer, rank, ranks, partition)
    prep = prepare_layer(sub, layer)
    outcome = np.full(prep.ids.shape[0], READ, dtype=np.int8) if capacity == 0 else \
        replay_clock(prep.ids, step_starts(sub), prep.n_items, int(capacity), evict_ahead)
    hit = (outcome <= REUSE_FILLED).astype(np.uint8)   # the characterizer's hit (workloads.policies.clock)
    return sub, outcome, decode_step_pages(prep, hit, shard_start=shard_start)


@dataclass(frozen=True)
class StepSetHits:
    """One rank and layer over a set of decode steps under the served CLOCK."""

    hit_rate: float        # the characterizer's: the row had a slot (cached at the step's start, or filled by a
                           # read earlier in the step)
    slot_hit_rate: float   # cached at the step's start: the engine's `hits` counter (a row read earlier in the
                           # step is its `reused`)
    pages: float           # distinct missed pages per step


def rank_hit_rates(trace: LookupTrace, layer: int, rank: int, ranks: int, capacity: int,
                   step_sets: dict[str, np.ndarray], partition: str = "columns",
                   evict_ahead: bool = True) -> dict[str, StepSetHits]:
    """Per named set of decode steps (replay step indices): `rank`'s decode hit rates on `layer` under the served
    CLOCK (with the engine's evict_ahead as given) at `capacity` rows, run over the whole trace, and its mean
    missed pages per step in the set."""
    sub, outcome, pages = _rank_clock(trace, layer, rank, ranks, capacity, partition, evict_ahead)
    dec_steps = np.unique(trace.token_step[trace.token_decode])
    nan = float("nan")
    out = {}
    for name, steps in step_sets.items():
        got = outcome[_step_lookups(trace, steps, sub.n_columns)]
        per_step = pages[np.isin(dec_steps, steps)]
        out[name] = StepSetHits(float((got <= REUSE_FILLED).mean()) if got.size else nan,
                                float((got == HIT).mean()) if got.size else nan,
                                float(per_step.mean()) if per_step.size else nan)
    return out


def rank_pages(trace: LookupTrace, layer: int, rank: int, ranks: int, capacities: Sequence[int],
               partition: str = "columns") -> list[RankPages]:
    """Pages and hits of `rank`'s process on `layer` at each capacity (rows of its cache for that layer)."""
    dec_steps = np.unique(trace.token_step[trace.token_decode])
    full = np.isin(dec_steps, full_batch_steps(trace))   # [decode steps] bool: a full batch decoding
    cols = trace_partition(trace, ranks, partition).columns[rank]
    full_lookup = _step_lookups(trace, dec_steps[full], len(cols))
    orders = tuple(sorted({trace.min_order + c // trace.heads_per_order for c in cols}))
    out = []
    for cap in capacities:
        _, outcome, pages = _rank_clock(trace, layer, rank, ranks, int(cap), partition)
        hit = outcome <= REUSE_FILLED
        pages = pages[full]
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
