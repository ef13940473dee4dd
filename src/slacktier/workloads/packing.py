"""Context packing, the traffic side: which contexts to pack (chosen on the fit half), and pages per step with them.

A *context* at a table layer is the C row ids the hasher gives one token there
(Engram: 24 = 3 orders x 8 heads); they fix every row the token reads, so a
packed context is keyed exactly by them. Staging stores, per rank, each packed
context's owned rows side by side in one extra page (`packed_pages_per_context`:
ceil(owned columns / 15), one page at TP4 where a rank owns 6 of the 24); a
token whose context is packed and that misses a row reads that page instead of
its missing rows' own pages. The pack list is the one interface with staging
(written by `write_pack_list`, read by `slacktier.tables.packing.read_pack_list`;
tables/ may not import workloads/): an `.npz` of `layers` [L] int64, per layer
`ids_<layer>` [n, C] int64 (contexts best first) and `saved_<layer>` [n] float64
(the pages each saved on the fit half), and `meta`, a 0-d str array of JSON
(`pack_meta`). Staging takes contexts in file order until its budget is met.

Packing does not change what the cache holds (the rows read are filled into it
the same way), so one replay of the cache (the served CLOCK of `cache.simulate`,
or an admission rule of `workloads.admission`) gives the hit mask, and pages
follow from it. Per decode step, with the engine's in-step dedup:

- a *new read* is a missed lookup whose row no earlier lookup of the step
  missed (a later miss of the same row reuses that read, as `begin_step` does);
- a new read of a token whose context is packed reads the context's packed
  page(s), once per step however many of its rows or tokens need it; any other
  new read reads its row's page (row - shard_start) // 15, once per step.

Worked example (one rank owning 6 columns, pages of 15 rows, one decode step):
token A misses rows 0, 30, 60 (pages 0, 2, 4), token B misses rows 14 and 90
(pages 0, 6). Today: pages {0, 2, 4, 6} = 4. With A's context packed: A reads
its packed page, B pages 0 and 6 -> 3 pages. A's saving on its own is its
new-read pages no other token of the step reads (2 and 4: page 0 is B's too)
minus its packed page: 2 - 1 = 1.

Choosing (`choose_contexts`): each fit-half context scores the sum over its
decode-step occurrences of that saving (the pages packing it alone saves,
on the rank(s) measured), and contexts with a positive score are listed best
first. Everything here is fit on one half of a source split and measured on the
other (`workloads.split.split_by_source`): `choose_contexts` takes the fit
half's trace only, `step_pages` measures any trace.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Mapping, Sequence

import numba
import numpy as np

from slacktier.errors import ErrorKind, SlackTierError
from slacktier.tables.layout import PAGE_BYTES, ROWS_PER_PAGE
from slacktier.tables.packing import contexts_within
from slacktier.tables.packing import index_bytes as layer_index_bytes
from slacktier.tables.partition import RankPartition, stored_spans
from slacktier.workloads import admission as A
from slacktier.workloads.replay import LookupTrace

PACK_FORMAT = "slacktier-pack-list"
PACK_VERSION = 1
PACK_META_KEYS = ("format", "version", "workload", "split", "seed", "batch", "cache_rows", "ranks", "partition",
                  "tokens")

@dataclass(frozen=True)
class ServedRule:
    """One of the engine's admission rules (`cache.ADMISSIONS`), replayed by the served pass itself."""

    admission: str

    def label(self) -> str:
        """Short text for tables."""
        return f'"{self.admission}" (served)'


#: admission rules by name, as `--admission` takes them. "prefill-cold" and "counters" are the engine's own
#: (the control file's `admission`), replayed by the served pass; "cold" and "cold+tinylfu" are the rules chosen
#: on the fit half of each workload by the evaluation kernel (benchmarks/paper/bench_admission.py: "cold" for
#: chat, "cold+tinylfu" for agent), which the engine does not serve as such.
NAMED_RULES = {
    "none": None,
    "prefill-cold": ServedRule("prefill-cold"),
    "counters": ServedRule("counters"),
    "counters+sketch": ServedRule("counters+sketch"),
    "cold": A.AdmissionRule(prefill_insert="cold"),
    "cold+tinylfu": A.AdmissionRule(prefill_insert="cold", sketch="prefill", sketch_width=1.0, sketch_reset=40.0),
}


def named_rule(name: str) -> A.AdmissionRule | ServedRule | None:
    """The admission rule called `name` in NAMED_RULES (None: the served CLOCK alone)."""
    if name not in NAMED_RULES:
        raise SlackTierError(ErrorKind.BAD_INPUT, f"unknown admission rule {name!r}",
                             fix=f"use one of {', '.join(NAMED_RULES)}")
    return NAMED_RULES[name]


def packed_pages_per_context(owned_columns: int, rows_per_page: int = ROWS_PER_PAGE) -> int:
    """Pages one packed context takes on a rank owning `owned_columns` of the context's rows.

    Worked example: TP4 owns 6 of 24 -> 1 page; one rank owning all 24 -> 2 pages (24 rows of 264 B > 4 KiB).
    """
    if owned_columns < 1:
        raise SlackTierError(ErrorKind.BAD_INPUT, f"{owned_columns} owned columns", fix="a rank owns >= 1 column")
    return -(-int(owned_columns) // int(rows_per_page))


# ---- one rank's lookups ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RankLookups:
    """One rank's lookups of one layer: a one-layer trace in the rank region's stored rows, and where it starts."""

    trace: LookupTrace            # n_columns = the rank's owned columns
    layer: int
    rank: int
    ranks: int
    partition: str
    columns: tuple[int, ...]      # the hash columns the rank owns
    shard_start: int              # the region's first stored row: page = (row - shard_start) // 15

    @property
    def orders(self) -> np.ndarray:
        """n-gram order [M] int8 of each lookup (its global column's order)."""
        tr = self.trace
        per_col = (np.asarray(self.columns) // tr.heads_per_order + tr.min_order).astype(np.int8)
        return np.tile(per_col, tr.num_tokens)


def rank_lookups(trace: LookupTrace, layer: int, rank: int, ranks: int, partition: str = "columns") -> RankLookups:
    """The lookups of `rank`'s columns of `layer` (the engine's owned_only), in its region's stored rows.

    Under `columns` rank k owns columns [k C/R, (k+1) C/R) and its region starts at the first of them; under
    `balanced` each owned column's rows shift to where its span is stored (tables.partition). Worked example:
    24 columns, rank 3 of 4, columns partition -> columns 18..23, the 4-gram heads 2..7.
    """
    c = trace.n_columns
    if ranks < 1 or c % ranks or not 0 <= rank < ranks:
        raise SlackTierError(ErrorKind.BAD_INPUT, f"rank {rank} of {ranks} over {c} hash columns",
                             fix="use a rank count that divides the column count, and a rank below it")
    part = RankPartition.make(partition, c, ranks, trace.heads_per_order)
    cols = tuple(int(x) for x in part.columns[rank])
    li = trace.layer_ids.index(layer) if layer in trace.layer_ids else -1
    if li < 0:
        raise SlackTierError(ErrorKind.BAD_INPUT, f"layer {layer} not in the trace's layers {trace.layer_ids}",
                             fix=f"pick among {trace.layer_ids}")
    bounds = trace.column_bounds[li] if trace.column_bounds else None
    spans = stored_spans(part, bounds, trace.table_rows[li], ranks)[rank]
    lo = spans[0].stored_start
    hi = spans[-1].stored_start + spans[-1].rows
    rows = trace.layer_rows(layer).reshape(trace.num_tokens, c)[:, list(cols)]
    if partition != "columns":   # column j's rows move by its span's shift (hash ids of column j lie in it)
        shift = np.array([next(s.stored_start - s.start for s in spans if s.start <= bounds[j] < s.start + s.rows)
                          for j in cols], dtype=np.int64)
        rows = rows + shift[None, :]
    sub = LookupTrace(trace.workload, trace.batch, (layer,), (hi - lo,), len(cols), trace.heads_per_order,
                      trace.min_order, np.ascontiguousarray(rows).reshape(1, -1), trace.token_step,
                      trace.token_decode, trace.token_session)
    return RankLookups(sub, layer, rank, ranks, partition, cols, lo)


def hit_mask(lookups: RankLookups, capacity: int, rule: A.AdmissionRule | ServedRule | None = None) -> np.ndarray:
    """Hit mask [M] uint8 of the rank's cache of `capacity` rows for this layer: the served CLOCK (step pins,
    evict-ahead; `cache.simulate`) alone or with a served rule, CLOCK with an evaluated `rule`'s admission
    (`admission.replay_admission`), or a rule that replays itself: any object with a `replay(prep, capacity)`
    method returning the hit mask of `characterize.prepare_layer`'s lookups (an experiment's own kernel)."""
    from slacktier.workloads.characterize import prepare_layer, run_policy

    prep = prepare_layer(lookups.trace, lookups.layer)
    if rule is None or isinstance(rule, ServedRule):
        return run_policy(prep, "clock", int(capacity), admission="off" if rule is None else rule.admission)
    if callable(getattr(rule, "replay", None)):
        return rule.replay(prep, int(capacity))
    return A.replay_admission(prep.ids, prep.decode, lookups.orders, prep.n_items, int(capacity), rule)


# ---- contexts ------------------------------------------------------------------------------------------------


@numba.njit(nogil=True, cache=True)
def _row_digests(ids, out):
    # ids: [T, C] int64; out: [T] int64, a splitmix64-style digest of each row (exactness is checked afterwards)
    for t in range(ids.shape[0]):
        h = np.uint64(0x9E3779B97F4A7C15)
        for j in range(ids.shape[1]):
            h ^= np.uint64(ids[t, j]) + np.uint64(0x9E3779B97F4A7C15) + (h << np.uint64(6)) + (h >> np.uint64(2))
            h ^= h >> np.uint64(30)
            h *= np.uint64(0xBF58476D1CE4E5B9)
            h ^= h >> np.uint64(27)
            h *= np.uint64(0x94D049BB133111EB)
            h ^= h >> np.uint64(31)
        out[t] = np.int64(h)


def _digests(ids: np.ndarray) -> np.ndarray:
    out = np.empty(ids.shape[0], dtype=np.int64)
    _row_digests(np.ascontiguousarray(ids, dtype=np.int64), out)
    return out


def token_contexts(trace: LookupTrace, layer: int) -> np.ndarray:
    """Each token's context at `layer`: its row ids [T, C] int64."""
    return trace.layer_rows(layer).reshape(trace.num_tokens, trace.n_columns)


def context_index(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The distinct contexts of `ids` [T, C] ([K, C], first-seen order) and each row's index into them [T] int64.

    Rows are grouped by a 64-bit digest, then every row is compared with its group's first row, so the grouping
    is exact (a digest collision between distinct contexts is refused, never merged).
    """
    ids = np.ascontiguousarray(ids, dtype=np.int64)
    if ids.shape[0] == 0:
        return ids.reshape(0, ids.shape[1] if ids.ndim == 2 else 0), np.zeros(0, dtype=np.int64)
    dig = _digests(ids)
    _, first, inv = np.unique(dig, return_index=True, return_inverse=True)
    inv = inv.reshape(-1)
    if not np.array_equal(ids, ids[first[inv]]):
        raise SlackTierError(ErrorKind.BAD_INPUT, "two distinct contexts share a 64-bit digest",
                             fix="report it; the contexts cannot be grouped by digest")
    # renumber in first-seen order, so the listing does not depend on digest order
    order = np.argsort(first, kind="stable")
    rank_of = np.empty_like(order)
    rank_of[order] = np.arange(order.shape[0])
    return ids[first[order]], rank_of[inv].astype(np.int64)


def lookup_contexts(packed: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """For each row of `ids` [T, C], its index in the packed contexts [n, C] (file order), or -1 if not packed."""
    packed = np.ascontiguousarray(packed, dtype=np.int64)
    ids = np.ascontiguousarray(ids, dtype=np.int64)
    out = np.full(ids.shape[0], -1, dtype=np.int64)
    if packed.shape[0] == 0 or ids.shape[0] == 0:
        return out
    if packed.shape[1] != ids.shape[1]:
        raise SlackTierError(ErrorKind.BAD_INPUT, f"packed contexts hold {packed.shape[1]} ids, tokens "
                             f"{ids.shape[1]}", fix="use a pack list of the same table layer")
    pd = _digests(packed)
    order = np.argsort(pd, kind="stable")
    sd = pd[order]
    if np.any(sd[1:] == sd[:-1]):
        dup = np.flatnonzero(sd[1:] == sd[:-1])
        a, b = order[dup], order[dup + 1]
        if np.any(np.all(packed[a] == packed[b], axis=1)):
            raise SlackTierError(ErrorKind.BAD_INPUT, "a context is listed twice in the pack list",
                                 fix="write the pack list with write_pack_list (one row per context)")
        raise SlackTierError(ErrorKind.BAD_INPUT, "two packed contexts share a 64-bit digest",
                             fix="report it; the contexts cannot be told apart by digest")
    td = _digests(ids)
    pos = np.minimum(np.searchsorted(sd, td), sd.shape[0] - 1)
    cand = order[pos]
    same = (sd[pos] == td) & np.all(packed[cand] == ids, axis=1)
    out[same] = cand[same]
    return out


# ---- pages per step ------------------------------------------------------------------------------------------


@numba.njit(nogil=True, cache=True)
def _step_pages(rows, hit, token_step, token_decode, token_pack, n_columns, shard_start, rows_per_page, pack_pages,
                out_pages, token_saved):
    # rows: [M] int64 stored rows; hit: [M] uint8; token_step: [T] int32; token_decode: [T] uint8;
    # token_pack: [T] int64 packed-context index or -1; out_pages: [decode steps] int64;
    # token_saved: [T] float64 (or [0]: not wanted), the pages packing the token's context alone would save
    t = token_step.shape[0]
    want_saved = token_saved.shape[0] > 0
    k = 0
    i = 0
    while i < t:
        j = i
        while j < t and token_step[j] == token_step[i]:
            j += 1
        if token_decode[i]:
            a = i * n_columns
            b = j * n_columns
            n = 0
            for x in range(a, b):
                if hit[x] == 0:
                    n += 1
            miss = np.empty(n, dtype=np.int64)
            n = 0
            for x in range(a, b):
                if hit[x] == 0:
                    miss[n] = x
                    n += 1
            # new reads: the first missed lookup of each row (stable sort keeps lookup order within a row)
            order = np.argsort(rows[miss], kind="mergesort")
            keys = np.empty(n, dtype=np.int64)      # row page >= 0, or -(packed context + 1)
            nk = 0
            page_tok = np.empty((n, 2), dtype=np.int64)
            for q in range(n):
                x = miss[order[q]]
                if q > 0 and rows[x] == rows[miss[order[q - 1]]]:
                    continue
                tok = x // n_columns
                page = (rows[x] - shard_start) // rows_per_page
                pk = token_pack[tok]
                keys[nk] = -(pk + 1) if pk >= 0 else page
                page_tok[nk, 0] = page
                page_tok[nk, 1] = tok
                nk += 1
            total = 0
            if nk > 0:
                s = np.sort(keys[:nk])
                for q in range(nk):
                    if q == 0 or s[q] != s[q - 1]:
                        total += pack_pages if s[q] < 0 else 1
            out_pages[k] = total
            k += 1
            if want_saved and nk > 0:
                # per page, the distinct tokens with a new read on it; a page only one token reads is its own
                comb = page_tok[:nk, 0] * (j - i + 1) + (page_tok[:nk, 1] - i)
                cs = np.sort(comb)
                q = 0
                while q < nk:
                    page = cs[q] // (j - i + 1)
                    r = q
                    n_tok = 0
                    last = -1
                    while r < nk and cs[r] // (j - i + 1) == page:
                        tk = cs[r] % (j - i + 1)
                        if tk != last:
                            n_tok += 1
                            last = tk
                        r += 1
                    if n_tok == 1:
                        token_saved[i + last] += 1.0
                    q = r
                seen = np.zeros(j - i, dtype=np.uint8)
                for q in range(nk):
                    tk = page_tok[q, 1] - i
                    if seen[tk] == 0:
                        seen[tk] = 1
                        token_saved[i + tk] -= pack_pages
        i = j
    return k


def _run_pages(lookups: RankLookups, hit: np.ndarray, token_pack: np.ndarray | None,
               want_saved: bool) -> tuple[np.ndarray, np.ndarray]:
    tr = lookups.trace
    if hit.shape[0] != tr.num_lookups:
        raise SlackTierError(ErrorKind.BAD_INPUT, f"hit mask of {hit.shape[0]} lookups, the rank has "
                             f"{tr.num_lookups}", fix="replay the same rank's lookups (hit_mask)")
    steps = np.unique(tr.token_step[tr.token_decode])
    out = np.zeros(steps.shape[0], dtype=np.int64)
    pack = np.full(tr.num_tokens, -1, dtype=np.int64) if token_pack is None else \
        np.ascontiguousarray(token_pack, dtype=np.int64)
    saved = np.zeros(tr.num_tokens if want_saved else 0, dtype=np.float64)
    n = _step_pages(np.ascontiguousarray(tr.rows[0], dtype=np.int64), np.ascontiguousarray(hit, dtype=np.uint8),
                    tr.token_step, tr.token_decode.astype(np.uint8), pack, tr.n_columns, int(lookups.shard_start),
                    ROWS_PER_PAGE, packed_pages_per_context(tr.n_columns), out, saved)
    return out[:n], saved


def step_pages(lookups: RankLookups, hit: np.ndarray, token_pack: np.ndarray | None = None) -> np.ndarray:
    """Pages [S] int64 the rank reads at each decode step (step order), given the hit mask and each token's packed
    context index (`lookup_contexts`; None or -1: not packed). See the module docstring for the counting."""
    return _run_pages(lookups, hit, token_pack, False)[0]


def token_savings(lookups: RankLookups, hit: np.ndarray) -> np.ndarray:
    """[T] float64: the decode-step pages packing each token's context alone would save at that token (its
    new-read pages no other token of the step reads, minus its packed pages; 0 for prefill tokens)."""
    return _run_pages(lookups, hit, None, True)[1]


def decode_step_numbers(trace: LookupTrace) -> np.ndarray:
    """The replay step index [S] of each decode step, in the order `step_pages` returns them."""
    return np.unique(trace.token_step[trace.token_decode])


# ---- choosing ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PackChoice:
    """Contexts to pack per layer, best first, with the pages each saved on the fit half (summed over ranks)."""

    layers: tuple[int, ...]
    ids: dict[int, np.ndarray]      # layer -> [n, C] int64
    saved: dict[int, np.ndarray]    # layer -> [n] float64, in list order (decreasing when ordered by pages)
    pages_per_context: int          # packed pages per context and rank
    meta: dict

    def count(self, layer: int) -> int:
        """Contexts listed for `layer`."""
        return int(self.ids[layer].shape[0])

    def extra_disk_bytes(self) -> int:
        """Extra disk per rank for every listed context of every layer."""
        return sum(self.count(l) for l in self.layers) * self.pages_per_context * PAGE_BYTES

    def index_bytes(self) -> int:
        """Index host memory per rank for every listed context: each layer's index as staging builds it
        (`tables.packing.index_bytes`: a power of two of 12 B entries, at most half full)."""
        return sum(layer_index_bytes(self.count(l)) for l in self.layers if self.count(l))

    def within(self, disk_bytes: float | None = None, index_bytes: float | None = None) -> PackChoice:
        """The contexts staging keeps within per-rank budgets: as `stage --pack-list` takes them, every layer
        gets an equal share of each budget and keeps the longest prefix of its list (file order) that fits."""
        if disk_bytes is not None and disk_bytes < 0 or index_bytes is not None and index_bytes < 0:
            raise SlackTierError(ErrorKind.BAD_INPUT, f"budget {disk_bytes} disk / {index_bytes} index bytes",
                                 fix="pass budgets >= 0")
        n_max = max([self.count(l) for l in self.layers] + [0])
        if disk_bytes is not None:
            n_max = min(n_max, int(disk_bytes // len(self.layers)) // (self.pages_per_context * PAGE_BYTES))
        if index_bytes is not None:
            n_max = min(n_max, contexts_within(int(index_bytes // len(self.layers))))
        return replace(self, ids={l: self.ids[l][:n_max] for l in self.layers},
                       saved={l: self.saved[l][:n_max] for l in self.layers})

    def disk_to_hold_all(self) -> int:
        """The smallest extra-disk budget per rank under which staging keeps every listed context (equal shares)."""
        return len(self.layers) * max([self.count(l) for l in self.layers] + [0]) * self.pages_per_context * \
            PAGE_BYTES


def choose_contexts(fit: LookupTrace, layers: Sequence[int], cache_rows: Mapping[int, int], ranks: int = 4,
                    measured_ranks: Sequence[int] | None = None, partition: str = "columns",
                    rule: A.AdmissionRule | ServedRule | None = None, meta: Mapping | None = None,
                    token_groups: np.ndarray | None = None) -> PackChoice:
    """Contexts of the FIT half's trace worth packing, per layer, best first.

    Each rank in `measured_ranks` (None: all) replays its cache of `cache_rows[layer]` rows (the served CLOCK, or
    `rule`'s admission) over its own lookups; a context's score is the decode-step pages packing it alone saves
    there (`token_savings`), summed over its occurrences and the ranks. Contexts scoring above 0 are kept, most
    pages first; with `token_groups` ([T] int, e.g. each token's fit source), first by the number of groups in
    which the context saves pages, then by pages (a context useful across sources may carry to unseen ones).
    Pass the held-out half to nothing here: the measurement is `step_pages` on the other half.
    """
    measured = tuple(range(ranks)) if measured_ranks is None else tuple(int(r) for r in measured_ranks)
    ids, saved = {}, {}
    per_ctx_pages = packed_pages_per_context(fit.n_columns // ranks) if ranks >= 1 and fit.n_columns % ranks == 0 \
        else packed_pages_per_context(1)
    for layer in layers:
        if layer not in cache_rows:
            raise SlackTierError(ErrorKind.MISSING, f"no cache size for layer {layer}",
                                 fix="pass cache_rows for every layer chosen", layer=layer)
        ctx, of_token = context_index(token_contexts(fit, layer))
        per_token = np.zeros(fit.num_tokens, dtype=np.float64)
        for rank in measured:
            lk = rank_lookups(fit, layer, rank, ranks, partition)
            per_token += token_savings(lk, hit_mask(lk, cache_rows[layer], rule))
        score = np.bincount(of_token, weights=per_token, minlength=ctx.shape[0])
        keep = np.flatnonzero(score > 0)
        if token_groups is None:
            order = keep[np.argsort(-score[keep], kind="stable")]
        else:
            groups = np.asarray(token_groups, dtype=np.int64)
            if groups.shape != (fit.num_tokens,) or (groups.size and groups.min() < 0):
                raise SlackTierError(ErrorKind.BAD_INPUT, f"token groups of shape {groups.shape}",
                                     fix=f"give one group id >= 0 per token ({fit.num_tokens})")
            g = int(groups.max()) + 1 if groups.size else 1
            pair, inv = np.unique(of_token * g + groups, return_inverse=True)
            useful = np.bincount(inv.reshape(-1), weights=per_token, minlength=pair.shape[0]) > 0
            n_groups = np.bincount(pair[useful] // g, minlength=ctx.shape[0])
            order = keep[np.lexsort((-score[keep], -n_groups[keep]))]
        ids[int(layer)] = ctx[order]
        saved[int(layer)] = score[order]
    return PackChoice(tuple(int(l) for l in layers), ids, saved, per_ctx_pages, dict(meta or {}))


def fit_trace(split, hasher, replay, workload: str) -> LookupTrace:
    """The replay of the FIT half of a source split (`workloads.split.Split`): the only traffic choosing may see."""
    from slacktier.workloads.replay import collect_trace, replay_steps

    if not split.fit:
        raise SlackTierError(ErrorKind.BAD_INPUT, "the split's fit half holds no session",
                             fix="split more sources (split_by_source) so both halves hold sessions")
    return collect_trace(replay_steps(list(split.fit), hasher, replay), hasher, workload, replay.batch)


def choose_for_split(split, hasher, replay, workload: str, layers: Sequence[int], cache_rows: Mapping[int, int],
                     ranks: int = 4, measured_ranks: Sequence[int] | None = None, partition: str = "columns",
                     rule: A.AdmissionRule | ServedRule | None = None, tokens: str = "deepseek", seed: int = 0,
                     by_sources: bool = False) -> PackChoice:
    """`choose_contexts` on the fit half of `split` (replayed with `replay`), with the pack list's meta;
    `by_sources`: ordered first by the fit sources a context saves pages in (`fit_sources`)."""
    meta = pack_meta(workload, seed, replay.batch, sum(int(cache_rows[l]) for l in layers), ranks, partition, tokens)
    fit = fit_trace(split, hasher, replay, workload)
    return choose_contexts(fit, layers, cache_rows, ranks, measured_ranks, partition, rule, meta,
                           fit_sources(split, fit) if by_sources else None)


def fit_sources(split, fit: LookupTrace) -> np.ndarray:
    """[T] int64: the source (repository, conversation) of each token of the fit half's replay, numbered."""
    names = sorted({s.source for s in split.fit})
    of_session = np.array([names.index(s.source) for s in split.fit], dtype=np.int64)
    return of_session[fit.token_session]


# ---- the pack list file --------------------------------------------------------------------------------------


def pack_meta(workload: str, seed: int, batch: int, cache_rows: int, ranks: int, partition: str,
              tokens: str) -> dict:
    """The pack list's `meta` object (the chosen half is always the fit half)."""
    return {"format": PACK_FORMAT, "version": PACK_VERSION, "workload": str(workload), "split": "fit",
            "seed": int(seed), "batch": int(batch), "cache_rows": int(cache_rows), "ranks": int(ranks),
            "partition": str(partition), "tokens": str(tokens)}


def write_pack_list(path: str | Path, choice: PackChoice) -> Path:
    """Write the pack list `.npz`: layers, ids_<layer> [n, C] int64 best first, saved_<layer> [n] float64 and a
    0-d str `meta` holding the JSON of `pack_meta` (written to a temporary name, then renamed into place)."""
    meta = dict(choice.meta)
    missing = [k for k in PACK_META_KEYS if k not in meta]
    if missing or meta.get("format") != PACK_FORMAT or meta.get("split") != "fit":
        raise SlackTierError(ErrorKind.BAD_INPUT, f"pack list meta lacks {missing} or is not a fit-half list",
                             fix="build the meta with pack_meta(...)")
    arrays: dict[str, np.ndarray] = {"layers": np.asarray(choice.layers, dtype=np.int64)}
    for layer in choice.layers:
        ids = np.ascontiguousarray(choice.ids[layer], dtype=np.int64)
        saved = np.ascontiguousarray(choice.saved[layer], dtype=np.float64)
        if ids.ndim != 2 or saved.shape != (ids.shape[0],):
            raise SlackTierError(ErrorKind.BAD_INPUT, f"layer {layer}: ids {ids.shape}, saved {saved.shape}",
                                 fix="one saved value per context row")
        arrays[f"ids_{layer}"] = ids
        arrays[f"saved_{layer}"] = saved
    arrays["meta"] = np.array(json.dumps({k: meta[k] for k in PACK_META_KEYS}))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        np.savez(f, **arrays)
    os.replace(tmp, path)
    return path


# ---- held-out pages and curves -------------------------------------------------------------------------------


def packing_summary(choice: PackChoice | None, path: str | Path | None = None) -> dict | None:
    """What a curve was computed with: contexts per layer, extra disk and index bytes per rank (None: no packing)."""
    if choice is None:
        return None
    return {"pack_list": str(path) if path is not None else None, "chosen_on": "fit",
            "contexts": {str(l): choice.count(l) for l in choice.layers},
            "pages_per_context": choice.pages_per_context, "extra_disk_bytes_per_rank": choice.extra_disk_bytes(),
            "index_bytes_per_rank": choice.index_bytes()}


def rank_miss_curves(trace: LookupTrace, layers: Sequence[int], capacities_rows: Sequence[int], rank: int,
                     ranks: int, partition: str = "columns", choice: PackChoice | None = None,
                     rule: A.AdmissionRule | ServedRule | None = None,
                     pack_path: str | Path | None = None) -> tuple[dict, dict]:
    """P_l(c) of one rank without and with packing (`choice`; None: both without), admission `rule` where given,
    in the characterizer's miss-curve format (mean pages per decode step and decode hit rate at each capacity),
    each saying what it was computed with. One cache replay per (layer, capacity) serves both curves."""
    if not layers:
        raise SlackTierError(ErrorKind.BAD_INPUT, "no layers to draw a miss curve for", fix="pass layers")
    caps = sorted({int(c) for c in capacities_rows})

    def head(packing: dict | None) -> dict:
        return {"workload": trace.workload, "batch": trace.batch, "policy": "clock",
                "admission": rule.label() if rule is not None else "none", "rows_per_page": ROWS_PER_PAGE,
                "ranks": ranks, "rank": rank, "partition": partition, "packing": packing,
                "decode_steps": int(decode_step_numbers(trace).shape[0]), "layers": {}}

    plain, packed = head(None), head(packing_summary(choice, pack_path))
    for layer in layers:
        lk = rank_lookups(trace, layer, rank, ranks, partition)
        pack = lookup_contexts(choice.ids[layer], token_contexts(trace, layer)) if choice is not None else None
        dec = lk.trace.lookup_decode()
        for doc in (plain, packed):
            doc["layers"][str(layer)] = {"capacity_rows": [], "pages_per_step": [], "hit_rate": [],
                                         "table_rows": int(lk.trace.table_rows[0])}
        for c in caps:
            hit = hit_mask(lk, c, rule)
            rate = float(hit[dec].mean()) if dec.any() else float("nan")
            for doc, tp in ((plain, None), (packed, pack)):
                pages = step_pages(lk, hit, tp)
                d = doc["layers"][str(layer)]
                d["capacity_rows"].append(c)
                d["pages_per_step"].append(float(pages.mean()) if pages.size else 0.0)
                d["hit_rate"].append(rate)
    return plain, packed


@dataclass(frozen=True)
class PackConfig:
    """`characterize --pack-list`: choose contexts on the fit half, write the list and one rank's miss curves."""

    out: Path                                   # the pack list (.npz)
    cache_rows: tuple[int, ...] = (500_000,)    # rows per layer of one rank's cache (one value: every layer)
    disk_gb: float | None = None                # extra disk per rank (1e9 bytes); None: every useful context
    ranks: int = 4
    partition: str = "columns"
    rank: int | None = None                     # the rank whose curves are written (None: the last one)
    admission: str = "none"                     # a NAMED_RULES entry
    order: str = "pages"                        # "pages" saved on the fit half, or "sources" first (choose_contexts)

    def __post_init__(self) -> None:
        named_rule(self.admission)
        if self.order not in ("pages", "sources"):
            raise SlackTierError(ErrorKind.BAD_INPUT, f"pack list order {self.order!r}", fix="use pages or sources")
        if self.ranks < 1 or any(c < 0 for c in self.cache_rows) or not self.cache_rows or (
                self.disk_gb is not None and self.disk_gb < 0) or (
                self.rank is not None and not 0 <= self.rank < self.ranks):
            raise SlackTierError(ErrorKind.BAD_INPUT, f"pack config {self}",
                                 fix="ranks >= 1, cache rows >= 0, a disk budget >= 0 and a rank below ranks")

    def rows_of(self, layers: Sequence[int]) -> dict[int, int]:
        """Cache rows per layer: one value for every layer, or one per layer in `layers` order."""
        if len(self.cache_rows) == 1:
            return {int(l): int(self.cache_rows[0]) for l in layers}
        if len(self.cache_rows) != len(layers):
            raise SlackTierError(ErrorKind.BAD_INPUT, f"{len(self.cache_rows)} cache sizes for layers {tuple(layers)}",
                                 fix="give one size for every layer, or one per layer in --layers order")
        return {int(l): int(c) for l, c in zip(layers, self.cache_rows)}


def characterize_packing(split, trace: LookupTrace, hasher, replay, layers: Sequence[int], config: PackConfig,
                         capacities_rows: Sequence[int], out_dir: Path, tokens: str, seed: int) -> dict:
    """Choose on `split`'s fit half, write the pack list, and write the rank's miss curves on the held-out `trace`
    without and with it: miss_curve_<wl>_B<b>_rank<r>.json and ..._rank<r>_packed.json. Returns their paths."""
    from slacktier.workloads.characterize import write_json

    rule = named_rule(config.admission)
    rows = config.rows_of(layers)
    choice = choose_for_split(split, hasher, replay, trace.workload, layers, rows, config.ranks, None,
                              config.partition, rule, tokens, seed, by_sources=config.order == "sources")
    if config.disk_gb is not None:
        choice = choice.within(disk_bytes=config.disk_gb * 1e9)
    path = write_pack_list(config.out, choice)
    rank = config.ranks - 1 if config.rank is None else config.rank
    plain, packed = rank_miss_curves(trace, layers, capacities_rows, rank, config.ranks, config.partition, choice,
                                     rule, path)
    stem = f"miss_curve_{trace.workload}_B{trace.batch}_rank{rank}"
    paths = {"pack_list": str(path), "curve": str(out_dir / f"{stem}.json"),
             "packed_curve": str(out_dir / f"{stem}_packed.json"), "packing": packing_summary(choice, path)}
    write_json(Path(paths["curve"]), plain)
    write_json(Path(paths["packed_curve"]), packed)
    return paths
