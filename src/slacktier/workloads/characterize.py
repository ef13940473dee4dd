"""Access characterization of a LookupTrace: hit rates per policy and capacity, n-gram order, batch reuse, miss pages.

Hit rates are over decode lookups (prefill lookups warm the cache and are not
counted), plus the all-lookups rate the paper's Table 10 reports. Capacities are
rows per layer. The miss-page curve P_l(c) is the mean number of distinct 4 KiB
pages holding the rows a decode step missed (page = (row - shard_start) // 15,
one rank: shard_start = 0), which the planner's cache split consumes. Its default
policy, CLOCK, is the served cache's own directory pass replayed step by step
(`cache.simulate`), so the curve is that of the policy the engine serves.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Iterable, Sequence

import numba
import numpy as np

from slacktier.cache.directory import SKETCHED, token_heat
from slacktier.errors import ErrorKind, SlackTierError
from slacktier.tables.layout import ROWS_PER_PAGE
from slacktier.workloads import policies as pol
from slacktier.workloads.replay import LookupTrace


@dataclass(frozen=True)
class Capacity:
    """A cache size in rows per layer, with how it was chosen ("1M rows", "1% of table", "25% of unique")."""

    rows: int
    label: str


def capacities_for(trace: LookupTrace, layer_id: int, absolute_rows: Sequence[int] = (1_000_000, 5_000_000),
                   table_shares: Sequence[float] = (0.002, 0.01, 0.05),
                   unique_shares: Sequence[float] = (0.05, 0.1, 0.25, 0.5)) -> list[Capacity]:
    """Capacities as absolute rows, as shares of the layer's table, and as shares of the trace's unique rows."""
    table = trace.table_rows[trace.layer_ids.index(layer_id)]
    unique = int(np.unique(trace.layer_rows(layer_id)).shape[0])
    caps = [Capacity(int(r), f"{r / 1e6:g}M rows") for r in absolute_rows]
    caps += [Capacity(int(round(s * table)), f"{s * 100:g}% of table") for s in table_shares]
    caps += [Capacity(int(round(s * unique)), f"{s * 100:g}% of unique") for s in unique_shares]
    return caps


@dataclass
class PreparedLayer:
    """One layer of a trace ready for the kernels."""

    workload: str
    layer_id: int
    rows: np.ndarray         # [M] int64
    ids: np.ndarray          # [M] int32 dense
    n_items: int
    decode: np.ndarray       # [M] bool
    column: np.ndarray       # [M] int8 (lookup i -> i % C)
    ranks: np.ndarray | None  # [M] int64 rank in the fit ranking (int64 max if unseen), None without a fit
    trace: LookupTrace


def prepare_layer(trace: LookupTrace, layer_id: int, ranking: tuple[np.ndarray, np.ndarray] | None = None,
                  ) -> PreparedLayer:
    """Dense ids, decode mask and fit ranks of one layer."""
    rows = trace.layer_rows(layer_id)
    uniq, inv = np.unique(rows, return_inverse=True)   # pol.densify's ids, keeping the unique rows
    ids, n_items = inv.astype(np.int32).reshape(-1), int(uniq.shape[0])
    column = np.tile(np.arange(trace.n_columns, dtype=np.int8), trace.num_tokens)
    # ranks of the unique rows (sorted: one pass over the fit ranking), spread to every lookup by its dense id;
    # the same ranks as pol.ranks_of(rows, ranking) without a search per lookup
    ranks = pol.ranks_of(uniq, ranking)[ids] if ranking is not None else None
    return PreparedLayer(trace.workload, layer_id, rows, ids, n_items, trace.lookup_decode(), column, ranks, trace)


def fit_rankings(fit_rows: np.ndarray, layer_ids: Sequence[int], layers: Sequence[int],
                 ) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """Per-layer fit rankings from `session_rows()` output [L, N] (layer axis in `layer_ids` order)."""
    return {layer: pol.rank_rows(fit_rows[list(layer_ids).index(layer)]) for layer in layers}


def with_ranking(prep: PreparedLayer, ranking: tuple[np.ndarray, np.ndarray]) -> PreparedLayer:
    """The same layer ranked by another fit, e.g. a public hot list fit on other traffic.

    The static policies (static, static_lru, belady_warm) then use that list;
    the trace and every other policy are unchanged. This is how the paper's
    "static (public list)" is measured: a ShareGPT-fit list applied to agent traffic.
    """
    return replace(prep, ranks=pol.ranks_of(prep.rows, ranking))


def step_starts(trace: LookupTrace) -> np.ndarray:
    """Lookup index where each replay step begins, then the lookup count: [S + 1] int64.

    The served cache pins every row a step uses until the step ends, so CLOCK is replayed step by step.
    Worked example: token steps [0, 1, 1, 2] with 2 columns -> [0, 2, 6, 8].
    """
    tokens = np.flatnonzero(np.diff(trace.token_step)) + 1
    return np.concatenate([[0], tokens * trace.n_columns, [trace.num_tokens * trace.n_columns]]).astype(np.int64)


def run_policy(prep: PreparedLayer, policy: str, capacity: int, static_head_share: float = 0.5,
               admission: str = "off") -> np.ndarray:
    """Hit mask [M] uint8 of `policy` at `capacity` rows on a prepared layer; admission (`cache.ADMISSIONS`,
    the engine's control-file option) applies to "clock", the served cache, and is replayed by its pass
    ("clock+RULE" is "clock" with admission RULE)."""
    if policy in pol.ADMITTED:
        policy, admission = policy.split("+", 1)
    if policy == "lru":
        return pol.lru(prep.ids, prep.n_items, capacity)
    if policy == "clock":
        heat = token_heat(admission, ~prep.decode.astype(bool))   # refuses an unknown rule; empty for "off"
        if admission in SKETCHED:   # the sketch counts row ids: replay the rows themselves, as the engine sees them
            rows = prep.rows.astype(np.int64)
            return pol.clock(rows, int(rows.max(initial=-1)) + 1, capacity, step_starts(prep.trace), heat=heat,
                             sketch=True)
        return pol.clock(prep.ids, prep.n_items, capacity, step_starts(prep.trace), heat=heat if heat.size else None)
    if policy == "s3fifo":
        return pol.s3fifo(prep.ids, prep.n_items, capacity)
    if policy == "belady":
        return pol.belady(prep.ids, prep.decode, prep.n_items, capacity)
    if policy in ("static", "static_lru", "belady_warm"):
        if prep.ranks is None:
            raise SlackTierError(ErrorKind.MISSING, f"policy {policy} needs a fit ranking",
                                 fix="pass ranking=rank_rows(fit rows) to prepare_layer")
        if policy == "static":
            return pol.static(prep.ranks, capacity)
        if policy == "belady_warm":
            return pol.belady_warm(prep.ids, prep.decode, prep.ranks, prep.n_items, capacity)
        head = int(capacity * static_head_share)
        return pol.static_lru(prep.ids, prep.ranks, prep.n_items, capacity, head)
    raise SlackTierError(ErrorKind.BAD_INPUT, f"unknown policy {policy!r}", fix=f"use one of {pol.KNOWN_POLICIES}")


@dataclass
class HitResult:
    """Hits of one (workload, layer, policy, capacity)."""

    workload: str
    batch: int
    layer: int
    policy: str
    capacity_rows: int
    capacity_label: str
    table_share: float
    decode_lookups: int
    decode_hits: int
    all_lookups: int
    all_hits: int              # Belady's counts only decode hits
    decode_hit_rate: float
    all_hit_rate: float
    order_hit_rate: dict[int, float]  # decode hit rate by n-gram order
    pages_per_decode_step: float
    seconds: float


@numba.njit(nogil=True, cache=True)
def _pages_per_step(rows, hit, token_step, token_decode, n_columns, shard_start, rows_per_page, out_pages):
    # out_pages: [n_decode_steps] int64, distinct missed pages of each decode step
    t = token_step.shape[0]
    buf = np.empty(t * n_columns, dtype=np.int64)
    k = 0
    i = 0
    while i < t:
        j = i
        while j < t and token_step[j] == token_step[i]:
            j += 1
        if token_decode[i]:
            n = 0
            for a in range(i * n_columns, j * n_columns):
                if hit[a] == 0:
                    buf[n] = (rows[a] - shard_start) // rows_per_page
                    n += 1
            if n > 0:
                s = np.sort(buf[:n])
                d = 1
                for b in range(1, n):
                    if s[b] != s[b - 1]:
                        d += 1
                out_pages[k] = d
            else:
                out_pages[k] = 0
            k += 1
        i = j
    return k


def decode_step_pages(prep: PreparedLayer, hit: np.ndarray, shard_start: int = 0,
                      rows_per_page: int = ROWS_PER_PAGE) -> np.ndarray:
    """Distinct pages read by each decode step [S] int64 given a hit mask (one rank: shard_start = 0).

    Worked example: rows 0, 14, 15 missed in one step -> pages 0, 0, 1 -> 2 pages.
    """
    tr = prep.trace
    steps = np.unique(tr.token_step[tr.token_decode])
    out = np.zeros(steps.shape[0], dtype=np.int64)
    n = _pages_per_step(prep.rows, np.ascontiguousarray(hit, dtype=np.uint8), tr.token_step,
                        tr.token_decode.astype(np.uint8), tr.n_columns, int(shard_start), int(rows_per_page), out)
    return out[:n]


def evaluate(prep: PreparedLayer, policy: str, cap: Capacity, static_head_share: float = 0.5) -> HitResult:
    """Run one policy at one capacity and summarize it."""
    t0 = time.perf_counter()
    hit = run_policy(prep, policy, cap.rows, static_head_share)
    seconds = time.perf_counter() - t0
    tr = prep.trace
    dec = prep.decode
    dec_hits = int(hit[dec].sum())
    dec_n = int(dec.sum())
    order = (prep.column // tr.heads_per_order).astype(np.int64)
    by_order = {}
    for o in range(tr.n_columns // tr.heads_per_order):
        m = dec & (order == o)
        by_order[tr.min_order + o] = float(hit[m].mean()) if m.any() else float("nan")
    pages = decode_step_pages(prep, hit) if not policy.startswith("belady") else np.zeros(0)
    table = tr.table_rows[tr.layer_ids.index(prep.layer_id)]
    all_hits = int(hit.sum())
    return HitResult(tr.workload, tr.batch, prep.layer_id, policy, cap.rows, cap.label, cap.rows / table,
                     dec_n, dec_hits, int(hit.shape[0]), all_hits, dec_hits / max(dec_n, 1),
                     all_hits / max(hit.shape[0], 1), by_order,
                     float(pages.mean()) if pages.size else float("nan"), seconds)


def hit_table(preps: Iterable[PreparedLayer], policies: Sequence[str], capacities: dict[int, list[Capacity]],
              static_head_share: float = 0.5, progress: bool = False) -> list[HitResult]:
    """evaluate() over every prepared layer, policy and capacity (capacities keyed by layer id)."""
    jobs = [(p, policy, cap) for p in preps for policy in policies for cap in capacities[p.layer_id]]
    if progress:
        from tqdm import tqdm
        jobs = tqdm(jobs, desc="policies", unit="run")
    return [evaluate(p, policy, cap, static_head_share) for p, policy, cap in jobs]


def unseen_share(prep: PreparedLayer) -> float:
    """Share of decode lookups whose row the fit split never saw."""
    if prep.ranks is None:
        raise SlackTierError(ErrorKind.MISSING, "no fit ranking", fix="prepare the layer with a ranking")
    return float((prep.ranks[prep.decode] == np.iinfo(np.int64).max).mean())


@dataclass
class BatchReuse:
    """Distinct rows / lookups among sampled decode tokens and within windows of consecutive trace tokens."""

    workload: str
    layer: int
    sample_tokens: int
    sampled_distinct: float      # mean over random samples of decode tokens
    consecutive_distinct: float  # mean over runs of consecutive decode tokens
    window_tokens: int
    window_distinct: float       # mean over non-overlapping windows of all trace tokens


def batch_reuse(prep: PreparedLayer, sample_tokens: int = 256, samples: int = 64, window_tokens: int = 8192,
                seed: int = 0) -> BatchReuse:
    """Row reuse inside a batch: the paper's 'distinct rows among 256 decode tokens' and '8K-token window'."""
    tr = prep.trace
    c = tr.n_columns
    rows = prep.rows.reshape(tr.num_tokens, c)
    dec_tok = np.flatnonzero(tr.token_decode)
    rng = np.random.default_rng(seed)
    sampled, consecutive = [], []
    if dec_tok.shape[0] >= sample_tokens:
        for _ in range(samples):
            pick = rng.choice(dec_tok, size=sample_tokens, replace=False)
            sampled.append(np.unique(rows[pick]).shape[0] / (sample_tokens * c))
            start = int(rng.integers(0, dec_tok.shape[0] - sample_tokens + 1))
            run = dec_tok[start:start + sample_tokens]
            consecutive.append(np.unique(rows[run]).shape[0] / (sample_tokens * c))
    windows = []
    for a in range(0, tr.num_tokens - window_tokens + 1, window_tokens):
        windows.append(np.unique(rows[a:a + window_tokens]).shape[0] / (window_tokens * c))
    nan = float("nan")
    return BatchReuse(tr.workload, prep.layer_id, sample_tokens, float(np.mean(sampled)) if sampled else nan,
                      float(np.mean(consecutive)) if consecutive else nan, window_tokens,
                      float(np.mean(windows)) if windows else nan)


def miss_page_curve(preps: Sequence[PreparedLayer], capacities_rows: Sequence[int], policy: str = "clock",
                    progress: bool = False) -> dict:
    """P_l(c) for the planner: {"workload", "batch", "policy", "layers": {"1": {capacity_rows, pages_per_step,
    hit_rate}}}.

    pages_per_step is the mean over decode steps of distinct pages missed (one
    rank), hit_rate the decode hit rate at the same capacity.
    """
    if not preps:
        raise SlackTierError(ErrorKind.BAD_INPUT, "no layers to draw a miss curve for", fix="pass prepared layers")
    caps = sorted({int(c) for c in capacities_rows})
    tr = preps[0].trace
    out: dict = {"workload": tr.workload, "batch": tr.batch, "policy": policy, "rows_per_page": ROWS_PER_PAGE,
                 "ranks": 1, "decode_steps": int(np.unique(tr.token_step[tr.token_decode]).shape[0]),
                 "layers": {}}
    jobs = [(p, c) for p in preps for c in caps]
    if progress:
        from tqdm import tqdm
        jobs = tqdm(jobs, desc=f"miss curve {tr.workload}", unit="run")
    for p, c in jobs:
        hit = run_policy(p, policy, c)
        pages = decode_step_pages(p, hit)
        layer = out["layers"].setdefault(str(p.layer_id), {"capacity_rows": [], "pages_per_step": [],
                                                            "hit_rate": [], "table_rows":
                                                            tr.table_rows[tr.layer_ids.index(p.layer_id)]})
        layer["capacity_rows"].append(c)
        layer["pages_per_step"].append(float(pages.mean()) if pages.size else 0.0)
        layer["hit_rate"].append(float(hit[p.decode].mean()) if p.decode.any() else float("nan"))
    return out


def write_json(path: Path, obj) -> None:
    """Write an object (dataclasses allowed) as indented JSON."""
    def default(o):
        if hasattr(o, "__dataclass_fields__"):
            return asdict(o)
        if isinstance(o, (np.integer,)):
            return int(o)
        if isinstance(o, (np.floating,)):
            return float(o)
        raise TypeError(type(o))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=1, default=default) + "\n")


class Phases:
    """Says each slow phase of a run on stderr as it starts and how long it took ("agent: replaying ... 41 s").

    The progress bars cover the loops; the phases between them (tokenizing, ranking the fit split's rows, batch
    reuse, plots) would otherwise leave a finished bar on the screen for minutes.
    """

    def __init__(self, on: bool) -> None:
        self.on = on
        self._name = ""
        self._t = 0.0

    def start(self, name: str) -> None:
        """End the phase in progress (printing its time) and announce `name`."""
        self.end()
        self._name, self._t = name, time.perf_counter()
        if self.on:
            print(f"characterize: {name} ...", file=sys.stderr, flush=True)

    def end(self) -> None:
        """Print the time of the phase in progress, if any."""
        if self._name and self.on:
            print(f"characterize: {self._name}: {time.perf_counter() - self._t:.0f} s", file=sys.stderr, flush=True)
        self._name = ""


@dataclass
class PreparedWorkload:
    """A workload's holdout replay, prepared per layer with the fit split's ranking."""

    name: str
    split: object              # Split[TokenSession]
    trace: LookupTrace
    preps: list[PreparedLayer]
    sessions_s: float          # building (or reading) and tokenizing the sessions
    replay_s: float            # replaying, hashing and preparing


def prepare_workload(name: str, corpus, replay, hasher, layers: Sequence[int], progress: bool = False,
                     phases: Phases | None = None) -> PreparedWorkload:
    """Load `name` ("agent" | "chat"), replay its holdout split, rank rows on its fit split."""
    from slacktier.workloads.corpus import load_workload
    from slacktier.workloads.replay import collect_trace, replay_steps, session_rows

    phases = phases or Phases(False)
    t0 = time.perf_counter()
    phases.start(f"{name}: reading and tokenizing the sessions")
    split = load_workload(name, corpus, progress=progress)
    t1 = time.perf_counter()
    phases.start(f"{name}: replaying the holdout split ({len(split.holdout)} sessions) through the hash")
    trace = collect_trace(replay_steps(list(split.holdout), hasher, replay), hasher, name, replay.batch,
                          progress=progress)
    phases.start(f"{name}: hashing the fit split ({len(split.fit)} sessions) and ranking its rows")
    fit_rows = session_rows(list(split.fit), hasher)
    preps = [prepare_layer(trace, layer, pol.rank_rows(fit_rows[trace.layer_ids.index(layer)])) for layer in layers]
    phases.end()
    return PreparedWorkload(name, split, trace, preps, t1 - t0, time.perf_counter() - t1)


def trace_summary(pw: PreparedWorkload) -> dict:
    """Sizes of a prepared workload's split and trace."""
    tr, split = pw.trace, pw.split
    return {
        "fit_sessions": len(split.fit), "holdout_sessions": len(split.holdout),
        "fit_sources": len(split.fit_sources), "holdout_sources": len(split.holdout_sources),
        "fit_tokens": int(sum(s.num_tokens for s in split.fit)),
        "trace_tokens": tr.num_tokens, "decode_tokens": int(tr.token_decode.sum()),
        "steps": int(tr.token_step[-1]) + 1, "lookups_per_layer": tr.num_lookups,
        "unique_rows": {str(p.layer_id): p.n_items for p in pw.preps},
        "unseen_in_fit_decode_share": {str(p.layer_id): unseen_share(p) for p in pw.preps},
        "sessions_s": pw.sessions_s, "replay_s": pw.replay_s,
    }


@dataclass(frozen=True)
class MissCurve:
    """P_l(c) of one layer: pages read per decode step at each capacity (rows), and the decode hit rate there."""

    workload: str
    batch: int
    layer: int
    capacity_rows: np.ndarray    # [K] int64, increasing
    pages_per_step: np.ndarray   # [K] float64
    hit_rate: np.ndarray         # [K] float64

    def pages_at(self, capacity_rows: float) -> float:
        """P_l(c) by linear interpolation between measured capacities (clamped at the ends)."""
        return float(np.interp(capacity_rows, self.capacity_rows, self.pages_per_step))


def read_miss_curves(path: Path) -> dict[int, MissCurve]:
    """The per-layer miss curves of a miss_curve_<workload>_B<batch>.json file, keyed by layer id."""
    try:
        doc = json.loads(Path(path).read_text())
        out = {}
        for layer, d in doc["layers"].items():
            caps = np.asarray(d["capacity_rows"], dtype=np.int64)
            order = np.argsort(caps, kind="stable")
            out[int(layer)] = MissCurve(doc["workload"], int(doc["batch"]), int(layer), caps[order],
                                        np.asarray(d["pages_per_step"], dtype=np.float64)[order],
                                        np.asarray(d["hit_rate"], dtype=np.float64)[order])
        return out
    except FileNotFoundError as exc:
        raise SlackTierError(ErrorKind.MISSING, f"no miss curve at {path}",
                             fix="run `slacktier characterize` first") from exc
    except (KeyError, ValueError, TypeError) as exc:
        raise SlackTierError(ErrorKind.BAD_INPUT, f"{path} is not a miss-curve file: {exc}",
                             fix="use a file written by `slacktier characterize`") from exc
