"""Which document rows get their Local heads recomputed online (protected rows).

Always protected (correctness, not budgeted): query rows, new rows (no artifact)
and dirty rows (caller says the stored value is invalid). Budgeted, in priority
order, up to `budget_fraction` of the candidate rows (rows that have an artifact):
1. boundary rows: the first `boundary_rows` (default: the sliding window, 128 in
   V4) rows of every document that does not start the request - their window
   reaches into the previous segment, which the offline prefill never saw;
   ranked by distance from the boundary, interleaved across documents;
2. indexer rows (CSA layers): rows of the compressed blocks the Lightning
   Indexer selects for the query rows, most-selected first;
3. recent tail: the candidate rows just before the query, nearest first.
Protected rows replace the stored value (never added on top of it).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from slacktier.errors import ErrorKind, SlackTierError


@dataclass(frozen=True)
class ProtectionPolicy:
    """Budget and class sizes for protected rows."""

    budget_fraction: float = 0.2
    boundary_rows: int | None = None  # None: the model's sliding window
    tail_rows: int | None = None      # None: the model's sliding window
    use_indexer: bool = True

    def __post_init__(self) -> None:
        if not 0.0 <= self.budget_fraction <= 1.0:
            raise SlackTierError(ErrorKind.BAD_INPUT, f"budget_fraction {self.budget_fraction} not in [0, 1]",
                                 fix="use 0.10, 0.20 or 0.25 (the paper's operating points) or 1.0 for exact")


@dataclass
class ProtectedRows:
    """One layer's protected rows and how many came from each class."""

    rows: torch.Tensor  # [n] int64, sorted, unique
    counts: dict[str, int] = field(default_factory=dict)


def _take(ranked: torch.Tensor, chosen: torch.Tensor, room: int) -> int:
    """Mark up to `room` rows of `ranked` (in rank order) not chosen yet; return how many were marked."""
    if room <= 0 or ranked.numel() == 0:
        return 0
    taken = 0
    for r in ranked.tolist():
        if not chosen[r]:
            chosen[r] = True
            taken += 1
            if taken >= room:
                break
    return taken


def select_protected(*, has_artifact: torch.Tensor, dirty: torch.Tensor, query_rows: torch.Tensor,
                     doc_starts: list[int], doc_ends: list[int], window: int, policy: ProtectionPolicy,
                     indexer_entries: torch.Tensor | None = None, compress_rate: int = 0) -> ProtectedRows:
    """Protected rows of one layer.

    has_artifact/dirty: [S] bool; query_rows: [q] int64; doc_starts/doc_ends: row
    ranges of documents with artifacts, in request order; indexer_entries: [k]
    int64 compressed entries the indexer picked for the query rows, most-picked
    first (entry w covers rows [w*m, (w+1)*m) with m = compress_rate).
    """
    rows_total = has_artifact.numel()
    chosen = torch.zeros(rows_total, dtype=torch.bool)
    mandatory = (~has_artifact) | dirty
    mandatory[query_rows] = True
    chosen |= mandatory
    counts = {"mandatory": int(mandatory.sum())}
    candidates = int(has_artifact.sum())
    budget = int(policy.budget_fraction * candidates + 1e-9)
    used = 0

    boundary_n = window if policy.boundary_rows is None else policy.boundary_rows
    ranked = []
    for k in range(boundary_n):
        for start, end in zip(doc_starts, doc_ends):
            if start > 0 and start + k < end:
                ranked.append(start + k)
    ranked_t = torch.tensor(ranked, dtype=torch.long)
    ranked_t = ranked_t[has_artifact[ranked_t]] if ranked_t.numel() else ranked_t
    n = _take(ranked_t, chosen, budget - used)
    used += n
    counts["boundary"] = n

    n = 0
    if policy.use_indexer and indexer_entries is not None and compress_rate > 0 and indexer_entries.numel():
        rows = (indexer_entries[:, None] * compress_rate + torch.arange(compress_rate)[None, :]).reshape(-1)
        rows = rows[rows < rows_total]
        rows = rows[has_artifact[rows]]
        n = _take(rows, chosen, budget - used)
        used += n
    counts["indexer"] = n

    tail_n = window if policy.tail_rows is None else policy.tail_rows
    first_query = int(query_rows.min()) if query_rows.numel() else rows_total
    cand_before = torch.nonzero(has_artifact[:first_query]).flatten().flip(0)[:tail_n]
    n = _take(cand_before, chosen, budget - used)
    used += n
    counts["tail"] = n
    counts["budget"] = budget
    return ProtectedRows(torch.nonzero(chosen).flatten(), counts)
