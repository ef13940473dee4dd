"""Pages per rank and decode step with context packing, admission, and both, on held-out traffic.

Per workload (agent: published trajectories split by repository; chat: ShareGPT
split by conversation; `split_by_source`, seed 0, half each), both halves are
replayed with B interleaved sessions. Everything is chosen on the FIT half:

- the cache split: the planner's `best_split` of `--cache-rows` rows per rank over
  layers 1 and 14, from the fit half's served-CLOCK miss curves of the slowest
  rank (the most pages at an even split), both tables on one disk (layer 1
  pays the paper's 3.05 us per page, layer 14, queued behind it, 0.37 us:
  plan.constants); every configuration and rank uses that split (`--split-per-rule`:
  the admission rows use the split chosen from the rule's own fit curves;
  `--split-packed`: from the rule's fit curves counted with the pack list);
- the pack list: `workloads.packing.choose_contexts` on the fit half, every
  rank's savings summed (one list is staged on every rank), replayed with the
  cache each configuration serves (the served CLOCK, or the admission rule);
- the admission rule: by default the one chosen on the fit half by
  bench_admission.py's evaluation kernel (agent "cold+tinylfu", chat "cold";
  `packing.NAMED_RULES`); `--admission counters` or `prefill-cold` replays one
  the engine serves, through the served pass; `--admission counters+tinylfu`
  evaluates round two's best agent rule (bench_admission_explore.CountersSketch),
  which the engine does not serve; `--admission belady` replays Belady with
  bypass, an oracle that sees the future (the floor of any admission rule:
  with every fit-half context packed, the fewest pages these levers can reach
  on this split).

Every figure is taken on the HELD-OUT half: each TP rank's own lookups
(`--partition`, TP `--ranks`) replayed through its cache; pages per decode step
per rank = layer 1's + layer 14's (packing.step_pages: new reads deduplicated
per step; a packed token reads its one packed page). The step's pages are its
slowest rank's (a TP step waits for it); min/median/max/mean over every
decode step of the held-out replay (`--steps full`: only those with B tokens
decoding; chat's held-out half has fewer than 128 sessions, so none at B=128).
Budgets: fractions of the extra disk per rank under which staging keeps the
whole served-CLOCK list (every context whose packing saves pages on the fit
half; `PackChoice.disk_to_hold_all`), each taken as staging takes it: every
layer an equal share, a prefix of its list (`PackChoice.within`). Extra disk:
one 4 KiB page per context, rank and layer; index host memory per rank as
staging builds it (`tables.packing.index_bytes` per layer).

    nice -n 5 .venv/bin/python benchmarks/paper/bench_packing_pages.py [--workloads agent,chat] [--batch 128]
        [--cache-rows 1e6] [--fractions 0.125,0.25,0.5,1] [--steps all|full] [--chat-sessions 192]
        [--order pages|sources] [--out runs/bench_packing_pages]

Counts only, no timing: the shared machine does not move them.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from slacktier.plan.constants import PAPER_NVME_BEHIND_PAGE_MS, PAPER_NVME_PAGE_MS
from slacktier.plan.curves import MissCurve
from slacktier.plan.split import best_split
from slacktier.tables.layout import PAGE_BYTES
from slacktier.tables.packing import index_bytes as layer_index_bytes
from slacktier.workloads import packing as P
from slacktier.workloads.characterize import write_json
from slacktier.workloads.corpus import CorpusConfig, load_workload
from slacktier.workloads.hashing import EngramLookupHasher
from slacktier.workloads.policies import belady
from slacktier.workloads.replay import LookupTrace, ReplayConfig, collect_trace, replay_steps

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # the repo root: benchmarks.* imports
from benchmarks._harness import command_line, machine, utc_stamp  # noqa: E402
from benchmarks.paper.bench_admission_explore import CountersSketch  # noqa: E402

LAYERS = (1, 14)
DEFAULT_RULE = {"agent": "cold+tinylfu", "chat": "cold"}
COUNTERS_SKETCH = "counters+tinylfu"   # bench_admission_explore's CountersSketch: evaluated, not served
BELADY = "belady"                      # the oracle: no causal rule can beat it


class BeladyOracle:
    """Belady with bypass as a rule that replays itself: each row is kept while its next lookup is a decode
    lookup and evicted furthest-next-use first, so it gives the most decode hits any cache of this size can."""

    def label(self) -> str:
        return "Belady with bypass (oracle)"

    def replay(self, prep, capacity: int) -> np.ndarray:
        return belady(prep.ids, prep.decode, prep.n_items, capacity)
SPLIT_GRID = (0, 62_500, 125_000, 250_000, 375_000, 500_000, 625_000, 750_000, 875_000, 1_000_000)


@dataclass
class Row:
    """One configuration on the held-out half."""

    workload: str
    config: str
    contexts: dict[int, int]
    disk_bytes: int
    index_bytes: int
    step_pages: np.ndarray          # [S] the slowest rank's pages per counted decode step (L1 + L14)
    rank_means: list[float]         # each rank's mean pages per counted decode step (L1 + L14)
    fit_saved: float                # pages the listed contexts saved on the fit half (their scores' sum)
    full_mean: float                # the slowest rank's mean over the full-batch steps among them (nan: none)


def full_batch(trace: LookupTrace) -> np.ndarray:
    """[decode steps] bool: the decode step has a full batch (B tokens decoding)."""
    steps = P.decode_step_numbers(trace)
    tokens = np.bincount(trace.token_step[trace.token_decode], minlength=int(trace.token_step[-1]) + 1)[steps]
    return tokens == trace.batch


def full_mean(steps: np.ndarray, full: np.ndarray) -> float:
    """Mean pages over the full-batch steps among the counted ones (nan where there are none)."""
    return float(steps[full].mean()) if full.any() else float("nan")


def planner_split(fit: LookupTrace, cache_rows: int, ranks: int, partition: str, rule=None,
                  pack: dict | None = None) -> tuple[dict[int, int], dict]:
    """Rows per layer of the planner's split, from the fit half's curves of the slowest rank: served CLOCK, or
    CLOCK with `rule` (what `characterize --admission` draws for `plan`); `pack` (layer -> each fit token's
    packed context or -1) counts the curves with packing, as `characterize --pack-list` draws them."""
    grid = sorted({int(c * cache_rows / SPLIT_GRID[-1]) for c in SPLIT_GRID})
    even = cache_rows // len(LAYERS)
    pk = pack or {}
    load = {rank: sum(float(P.step_pages(lk, P.hit_mask(lk, even, rule), pk.get(lk.layer)).mean())
                      for lk in (P.rank_lookups(fit, l, rank, ranks, partition) for l in LAYERS))
            for rank in range(ranks)}
    slowest = (max(load.values()), max(load, key=lambda r: load[r]))   # the slowest rank at an even split
    curves = {}
    for layer in LAYERS:
        lk = P.rank_lookups(fit, layer, slowest[1], ranks, partition)
        curves[layer] = [float(P.step_pages(lk, P.hit_mask(lk, c, rule), pk.get(layer)).mean()) for c in grid]
    split = best_split(LAYERS, [MissCurve(tuple(map(float, grid)), tuple(curves[l])) for l in LAYERS],
                       [PAPER_NVME_PAGE_MS, PAPER_NVME_BEHIND_PAGE_MS], cache_rows)
    rows = {l: int(round(split.rows_of(l))) for l in LAYERS}
    return rows, {"rank": slowest[1], "even_split_load": {str(r): v for r, v in load.items()}, "grid": grid,
                  "curves": {str(l): curves[l] for l in LAYERS},
                  "shares": list(split.shares), "rows": {str(l): rows[l] for l in LAYERS}}


def measure(hold: LookupTrace, hits: dict, lookups: dict, pack_pos: dict | None, counts: dict[int, int] | None,
            ranks: int, full: np.ndarray) -> tuple[np.ndarray, list[float]]:
    """Per counted decode step (`full`) the slowest rank's pages (L1 + L14), and each rank's mean (the caller
    passes every decode step, or the full-batch ones)."""
    per_rank = []
    for rank in range(ranks):
        total = None
        for layer in LAYERS:
            pack = None
            if pack_pos is not None:
                pos = pack_pos[layer]
                pack = np.where((pos >= 0) & (pos < counts[layer]), pos, -1)
            pages = P.step_pages(lookups[layer, rank], hits[layer, rank], pack)[full]
            total = pages if total is None else total + pages
        per_rank.append(total)
    stack = np.stack(per_rank)
    return stack.max(axis=0), [float(r.mean()) for r in per_rank]


def run_workload(wl: str, args, hasher, progress) -> tuple[list[Row], dict]:
    """Every configuration of one workload: choose on the fit half, measure on the held-out half."""
    t0 = time.perf_counter()
    split = load_workload(wl, CorpusConfig(seed=args.seed, chat_sessions=args.chat_sessions))
    replay = ReplayConfig(batch=args.batch, decode_tokens=args.decode_tokens, seed=args.seed)
    fit = P.fit_trace(split, hasher, replay, wl)
    hold = collect_trace(replay_steps(list(split.holdout), hasher, replay), hasher, wl, args.batch)
    full_only = full_batch(hold)
    full = full_only if args.steps == "full" else np.ones(full_only.shape[0], dtype=bool)
    in_counted = full_only[full]     # which counted steps have a full batch
    progress(f"{wl}: fit {fit.num_tokens:,} tokens, held-out {hold.num_tokens:,} tokens, "
             f"{int(full.sum())} decode steps counted ({time.perf_counter() - t0:.0f} s)")
    rows_of, split_info = planner_split(fit, args.cache_rows, args.ranks, args.partition)
    progress(f"{wl}: planner split {rows_of} (from rank {split_info['rank']}'s fit curves)")
    rule_name = args.admission or DEFAULT_RULE[wl]
    rule = CountersSketch() if rule_name == COUNTERS_SKETCH else BeladyOracle() if rule_name == BELADY \
        else P.named_rule(rule_name)
    meta = P.pack_meta(wl, args.seed, args.batch, args.cache_rows, args.ranks, args.partition, "deepseek")
    out: list[Row] = []
    info = {"workload": wl, "fit_sessions": len(split.fit), "holdout_sessions": len(split.holdout),
            "fit_tokens": fit.num_tokens, "holdout_tokens": hold.num_tokens, "steps_counted": int(full.sum()),
            "full_batch_steps": int(full_only.sum()),
            "split": split_info, "admission": rule.label() if rule else "none", "configs": {}}
    sat_bytes, every = None, None
    for policy, rl in (("CLOCK", None), ("admission", rule)):
        t1 = time.perf_counter()
        if rl is not None and args.split_per_rule:   # the admission rows' own split, from the rule's fit curves
            rows_of, info["split_admission"] = planner_split(fit, args.cache_rows, args.ranks, args.partition, rl)
            progress(f"{wl}: planner split with the rule {rows_of} (from rank "
                     f"{info['split_admission']['rank']}'s fit curves)")
        choice = P.choose_contexts(fit, LAYERS, rows_of, args.ranks, None, args.partition, rl, meta,
                                   P.fit_sources(split, fit) if args.order == "sources" else None)
        if rl is not None and args.split_packed:   # the split from the fit curves counted with the list and rule
            fit_pack = {l: P.lookup_contexts(choice.ids[l], P.token_contexts(fit, l)) for l in LAYERS}
            packed_rows, info["split_packed"] = planner_split(fit, args.cache_rows, args.ranks, args.partition, rl,
                                                              fit_pack)
            progress(f"{wl}: planner split with the rule and the list {packed_rows} (from rank "
                     f"{info['split_packed']['rank']}'s fit curves)")
            if packed_rows != rows_of:   # staging would take the list chosen at the split it serves
                rows_of = packed_rows
                choice = P.choose_contexts(fit, LAYERS, rows_of, args.ranks, None, args.partition, rl, meta,
                                           P.fit_sources(split, fit) if args.order == "sources" else None)
        path = P.write_pack_list(args.out / f"pack_{wl}_{policy.lower()}.npz", choice)
        progress(f"{wl} {policy}: chose {[choice.count(l) for l in LAYERS]} contexts on the fit half "
                 f"({time.perf_counter() - t1:.0f} s) -> {path}")
        lookups = {(l, r): P.rank_lookups(hold, l, r, args.ranks, args.partition) for l in LAYERS
                   for r in range(args.ranks)}
        hits = {k: P.hit_mask(lk, rows_of[k[0]], rl) for k, lk in lookups.items()}
        pos = {l: P.lookup_contexts(choice.ids[l], P.token_contexts(hold, l)) for l in LAYERS}
        base_name = "today (served CLOCK)" if rl is None else f"admission: {rule.label()}"
        steps, means = measure(hold, hits, lookups, None, None, args.ranks, full)
        out.append(Row(wl, base_name, {l: 0 for l in LAYERS}, 0, 0, steps, means, 0.0, full_mean(steps, in_counted)))
        if sat_bytes is None:   # the budget under which staging keeps the whole served-CLOCK list
            sat_bytes = choice.disk_to_hold_all()
        for frac in args.fractions:
            b = choice.within(disk_bytes=frac * sat_bytes)
            steps, means = measure(hold, hits, lookups, pos, {l: b.count(l) for l in LAYERS}, args.ranks, full)
            name = ("packing" if rl is None else "packing + admission") + f" ({frac:g} of the fit half's fill)"
            out.append(Row(wl, name, {l: b.count(l) for l in LAYERS}, b.extra_disk_bytes(), b.index_bytes(), steps,
                           means, float(sum(b.saved[l].sum() for l in LAYERS)), full_mean(steps, in_counted)))
        # the ceiling of this split: every context the fit half holds, packed
        if every is None:
            every = {}
            for l in LAYERS:
                ctx, _ = P.context_index(P.token_contexts(fit, l))
                every[l] = P.lookup_contexts(ctx, P.token_contexts(hold, l))
                every[l, "n"] = ctx.shape[0]
        counts = {l: every[l, "n"] for l in LAYERS}
        steps, means = measure(hold, hits, lookups, {l: every[l] for l in LAYERS}, counts, args.ranks, full)
        n = sum(counts.values())
        out.append(Row(wl, ("packing" if rl is None else "packing + admission") + ", every fit-half context "
                       "(ceiling)", counts, n * choice.pages_per_context * PAGE_BYTES,
                       sum(layer_index_bytes(counts[l]) for l in LAYERS),
                       steps, means, float("nan"), full_mean(steps, in_counted)))
        progress(f"{wl} {policy}: measured ({time.perf_counter() - t1:.0f} s)")
    info["seconds"] = time.perf_counter() - t0
    return out, info


def table(rows: list[Row]) -> str:
    """Markdown table of the rows, each against its workload's today."""
    lines = ["| workload | configuration | contexts L1 / L14 | extra disk / rank | index / rank | slowest rank's "
             "pages / step: min / median / max | mean | vs today (mean) | full-batch steps: mean (vs today) | "
             "rank 0 / 1 / 2 / 3 mean | fit-half saving |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    today, today_full = {}, {}
    for r in rows:
        today.setdefault(r.workload, r.step_pages.mean())
        today_full.setdefault(r.workload, r.full_mean)
        fm = "-" if not np.isfinite(r.full_mean) else \
            f"{r.full_mean:.1f} ({100 * (r.full_mean / today_full[r.workload] - 1):+.1f}%)"
        s = r.step_pages
        ctx = " / ".join(f"{r.contexts[l]:,}" for l in LAYERS)
        saved = "-" if not np.isfinite(r.fit_saved) or r.fit_saved == 0 else f"{r.fit_saved:,.0f}"
        lines.append(f"| {r.workload} | {r.config} | {ctx} | {r.disk_bytes / 2**30:.2f} GiB | "
                     f"{r.index_bytes / 2**20:.1f} MiB | {s.min():.0f} / {np.median(s):.0f} / {s.max():.0f} | "
                     f"{s.mean():.1f} | {100 * (s.mean() / today[r.workload] - 1):+.1f}% | {fm} | "
                     + " / ".join(f"{m:.0f}" for m in r.rank_means) + f" | {saved} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workloads", default="agent,chat")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--cache-rows", type=lambda x: int(float(x)), default=1_000_000,
                    help="row cache per rank, split over layers 1 and 14 by the planner")
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--partition", default="columns")
    ap.add_argument("--fractions", default="0.125,0.25,0.5,1",
                    help="budgets as fractions of the extra disk the fit half's useful contexts fill")
    ap.add_argument("--admission", default="", help=f"a rule of {tuple(P.NAMED_RULES)}, {COUNTERS_SKETCH}, or "
                                                    f"{BELADY} (the oracle) "
                                                    f"(default: per workload {DEFAULT_RULE})")
    ap.add_argument("--split-per-rule", action="store_true",
                    help="the admission rows' cache split from the fit half's curves with the rule, as `plan` would "
                         "choose it from `characterize --admission` curves (default: every row uses CLOCK's split)")
    ap.add_argument("--split-packed", action="store_true",
                    help="the admission rows' cache split from the fit half's curves with the rule and the pack list, "
                         "as `plan` would choose it from `characterize --admission R --pack-list` curves; the "
                         "list is then chosen again at that split")
    ap.add_argument("--steps", choices=("all", "full"), default="all",
                    help="decode steps counted: every one, or those with B tokens decoding")
    ap.add_argument("--chat-sessions", type=int, default=192, help="ShareGPT conversations (both halves)")
    ap.add_argument("--order", choices=("pages", "sources"), default="pages",
                    help="the list's order: pages saved on the fit half, or first the fit sources a context saves "
                         "pages in")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("runs/bench_packing_pages"))
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args()
    args.fractions = [float(x) for x in args.fractions.split(",") if x]
    args.out.mkdir(parents=True, exist_ok=True)

    def progress(msg: str) -> None:
        if not args.quiet:
            print(f"  {msg}", file=sys.stderr, flush=True)

    t0 = time.perf_counter()
    hasher = EngramLookupHasher()
    rows, infos = [], []
    for wl in [w for w in args.workloads.split(",") if w]:
        r, info = run_workload(wl, args, hasher, progress)
        rows += r
        infos.append(info)
    text = table(rows)
    head = (f"{utc_stamp()}; `{command_line(__file__)}`; {machine()}; {time.perf_counter() - t0:.0f} s. "
            f"B={args.batch}, TP{args.ranks} `{args.partition}`, lists ordered by {args.order}, "
            f"{args.cache_rows:,} cache rows per rank split "
            + "; ".join(f"{i['workload']} L1 {i['split']['rows']['1']:,} / L14 {i['split']['rows']['14']:,} "
                        + (f" (admission rows: L1 {i['split_packed']['rows']['1']:,} / L14 "
                           f"{i['split_packed']['rows']['14']:,}, from the packed fit curves)"
                           if "split_packed" in i else "")
                        + f" ({i['fit_sessions']} / {i['holdout_sessions']} sessions fit / held-out, "
                        f"{i['steps_counted']} held-out decode steps ({args.steps}; {i['full_batch_steps']} with a "
                        f"full batch), admission "
                        f"{i['admission']})"
                        for i in infos) + ".")
    print(head + "\n\n" + text)
    write_json(args.out / "packing_pages.json", {
        "head": head, "runs": infos,
        "rows": [{"workload": r.workload, "config": r.config, "contexts": {str(k): v for k, v in r.contexts.items()},
                  "extra_disk_bytes_per_rank": r.disk_bytes, "index_bytes_per_rank": r.index_bytes,
                  "slowest_rank_pages": {"min": int(r.step_pages.min()), "median": float(np.median(r.step_pages)),
                                         "max": int(r.step_pages.max()), "mean": float(r.step_pages.mean())},
                  "full_batch_mean": r.full_mean, "rank_means": r.rank_means, "fit_saved": r.fit_saved}
                 for r in rows]})


if __name__ == "__main__":
    main()
