"""Admission rules against the served CLOCK, S3-FIFO and Belady (with bypass), on held-out traffic.

Per workload (agent, chat) and batch B, both halves of the source split are
replayed with B interleaved sessions: every rule's parameters are chosen on the
FIT half (the best decode hit rate of each family's grid, then the best of the
families and their combinations), and every figure printed is taken on the
HELD-OUT half, which no choice looked at. Layer 14, one rank, `--capacity` rows.

Per policy: decode hit rate, by n-gram order, and missed pages per decode step
(mean and median, one rank). The served cache's admission rule (`admission =
"prefill-cold"` in the control file) is replayed by the served pass itself
(`cache.simulate`), beside the served CLOCK without it. Beside them: Belady at the capacity and with no
capacity limit (the compulsory-miss limit), LRU (its decode hits are the decode
lookups whose reuse distance fits the cache), and CLOCK with oracle admission
(a miss is cached only when its row's next lookup is a decode one): how much of
CLOCK's gap to Belady admission alone could close; then the same oracle on prefill misses only (every decode
miss admitted), no prefill miss admitted, and prefill misses admitted only when their row had a decode lookup
before: how much of the gap is in predicting which prefill rows the model reads again.

    nice -n 5 .venv/bin/python benchmarks/paper/bench_admission.py [--batch 64,128] [--workloads agent,chat]
        [--capacity 1e6] [--out runs/bench_admission] [--log]

--log appends the tables to docs/bench-log/ under "## Admission". Hit rates
and pages are deterministic (no timing), so the shared machine does not move them.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from slacktier.cache import ADMISSIONS
from slacktier.workloads import admission as A
from slacktier.workloads import policies as pol
from slacktier.workloads.characterize import PreparedLayer, decode_step_pages, prepare_layer, run_policy, write_json
from slacktier.workloads.corpus import CorpusConfig, load_workload
from slacktier.workloads.hashing import EngramLookupHasher
from slacktier.workloads.replay import ReplayConfig, collect_trace, replay_steps

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # the repo root: benchmarks.* imports
from benchmarks._harness import append_to_section, command_line, machine, pyplot, save_figure, utc_stamp  # noqa: E402

SECTION = "## Admission"
LAYER = 14
SERVED = ADMISSIONS   # the engine's rules, "off" (plain CLOCK) first


@dataclass
class Row:
    """One policy's figures on one trace."""

    policy: str
    decode_hit_rate: float
    order_hit_rate: dict[int, float]
    pages_mean: float
    pages_median: float
    seconds: float


def summarize(prep: PreparedLayer, order: np.ndarray, name: str, hit: np.ndarray, seconds: float,
              pages: bool = True) -> Row:
    """Decode hit rate (overall and per n-gram order) and missed pages per decode step of a hit mask."""
    dec = prep.decode
    by_order = {int(o): float(hit[dec & (order == o)].mean()) for o in np.unique(order)}
    p = decode_step_pages(prep, hit) if pages else np.zeros(0)
    return Row(name, float(hit[dec].mean()), by_order, float(p.mean()) if p.size else float("nan"),
               float(np.median(p)) if p.size else float("nan"), seconds)


def run_rule(prep: PreparedLayer, order: np.ndarray, capacity: int, rule: A.AdmissionRule,
             allow: np.ndarray | None = None) -> tuple[np.ndarray, float]:
    t0 = time.perf_counter()
    hit = A.replay_admission(prep.ids, prep.decode, order, prep.n_items, capacity, rule, allow)
    return hit, time.perf_counter() - t0


def choose_on_fit(fit: PreparedLayer, capacity: int, progress) -> tuple[dict[str, A.AdmissionRule], list[dict]]:
    """The best rule of each family on the fit half, and of the families and their combinations ("best")."""
    order = A.lookup_orders(fit.column, fit.trace.heads_per_order, fit.trace.min_order)
    dec = fit.decode
    tried: list[dict] = []

    def score(rule: A.AdmissionRule) -> float:
        hit, s = run_rule(fit, order, capacity, rule)
        rate = float(hit[dec].mean())
        tried.append({"rule": rule.as_dict(), "label": rule.label(), "fit_decode_hit_rate": rate, "seconds": s})
        progress(f"fit {rule.label()}: {100 * rate:.2f}%")
        return rate

    best: dict[str, A.AdmissionRule] = {}
    rates: dict[A.AdmissionRule, float] = {}
    for family, grid in A.candidate_rules().items():
        for rule in grid:
            rates[rule] = score(rule)
        best[family] = max(grid, key=lambda r: rates[r])
    for rule in A.combinations(best):
        if rule not in rates:
            rates[rule] = score(rule)
    pool = list(best.values()) + A.combinations(best)
    best["best"] = max(pool, key=lambda r: rates[r])
    return best, tried


def reuse_facts(prep: PreparedLayer) -> dict:
    """Why decode lookups miss: first lookups of a row (compulsory), and which lookups' rows are next read at decode."""
    dec = prep.decode
    first = np.zeros(prep.ids.shape[0], dtype=bool)
    _, idx = np.unique(prep.ids, return_index=True)
    first[idx] = True
    allow = A.oracle_allow(prep.ids, dec)
    return {"decode_lookups": int(dec.sum()), "lookups": int(dec.shape[0]), "distinct_rows": prep.n_items,
            "compulsory_decode_share": float(first[dec].mean()),
            "next_read_at_decode_share_of_prefill_lookups": float(allow[~dec].mean()),
            "next_read_at_decode_share_of_decode_lookups": float(allow[dec].mean()),
            "next_read_at_decode_share_of_all_lookups": float(allow.mean())}


def seen_at_decode(prep: PreparedLayer) -> np.ndarray:
    """[M] bool: the lookup's row had a decode lookup earlier in the trace (causal: only the past is used)."""
    first = np.full(prep.n_items, np.iinfo(np.int64).max, dtype=np.int64)
    dec_at = np.flatnonzero(prep.decode)
    np.minimum.at(first, prep.ids[dec_at], dec_at)
    return first[prep.ids] < np.arange(prep.ids.shape[0])


def served_rules(preps: dict[str, PreparedLayer], capacity: int, progress) -> dict[str, dict[str, Row]]:
    """The engine's admission rules (`cache.ADMISSIONS`) replayed by the served pass on both halves, Belady with
    bypass beside them: {side: {name: Row}}."""
    out: dict[str, dict[str, Row]] = {}
    for side, prep in preps.items():
        order = A.lookup_orders(prep.column, prep.trace.heads_per_order, prep.trace.min_order)
        rows = {}
        for rule in SERVED:
            t0 = time.perf_counter()
            hit = run_policy(prep, "clock", capacity, admission=rule)
            rows[rule] = summarize(prep, order, rule, hit, time.perf_counter() - t0, True)
            progress(f"{side} served {rule}: {100 * rows[rule].decode_hit_rate:.2f}%")
        t0 = time.perf_counter()
        rows["belady"] = summarize(prep, order, "Belady with bypass", run_policy(prep, "belady", capacity),
                                   time.perf_counter() - t0, False)
        out[side] = rows
    return out


def evaluate_holdout(hold: PreparedLayer, capacity: int, best: dict[str, A.AdmissionRule], progress) -> list[Row]:
    """Every policy on the held-out half."""
    order = A.lookup_orders(hold.column, hold.trace.heads_per_order, hold.trace.min_order)
    rows: list[Row] = []

    def timed(name, fn, pages=True):
        t0 = time.perf_counter()
        hit = fn()
        rows.append(summarize(hold, order, name, hit, time.perf_counter() - t0, pages))
        progress(f"held-out {name}: {100 * rows[-1].decode_hit_rate:.2f}%")

    timed("CLOCK (served: step pins, evict-ahead)", lambda: run_policy(hold, "clock", capacity))
    for rule in SERVED[1:]:
        timed(f'served CLOCK + admission = "{rule}" (the served pass, as the engine runs it)',
              lambda rule=rule: run_policy(hold, "clock", capacity, admission=rule))
    timed("CLOCK, textbook (one lookup at a time, no rule)",
          lambda: run_rule(hold, order, capacity, A.AdmissionRule())[0])
    timed("S3-FIFO-style", lambda: run_policy(hold, "s3fifo", capacity))
    timed("LRU", lambda: run_policy(hold, "lru", capacity))
    for family in ("order", "probation", "cold", "sketch", "best"):
        rule = best[family]
        timed(f"{family}: {rule.label()}", lambda rule=rule: run_rule(hold, order, capacity, rule)[0])
    oracle = A.oracle_allow(hold.ids, hold.decode)
    timed("CLOCK + oracle admission (not realizable)",
          lambda: run_rule(hold, order, capacity, A.AdmissionRule(), oracle)[0])
    # where the gap lies: oracle on prefill misses only, no prefill row at all, and one causal prefill signal
    timed("CLOCK + oracle admission of prefill misses, all decode misses (not realizable)",
          lambda: run_rule(hold, order, capacity, A.AdmissionRule(), oracle | hold.decode)[0])
    timed("CLOCK, no prefill miss admitted",
          lambda: run_rule(hold, order, capacity, A.AdmissionRule(prefill_max_order=A.MIN_ORDER - 1))[0])
    timed("CLOCK, a prefill miss admitted only if its row had a decode lookup before",
          lambda: run_rule(hold, order, capacity, A.AdmissionRule(), hold.decode | seen_at_decode(hold))[0])
    timed("Belady with bypass", lambda: run_policy(hold, "belady", capacity), pages=False)
    timed("Belady, no capacity limit (compulsory misses only)",
          lambda: pol.belady(hold.ids, hold.decode, hold.n_items, hold.n_items), pages=False)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", default="64,128", help="comma list of B (sessions served at once)")
    ap.add_argument("--workloads", default="agent,chat")
    ap.add_argument("--capacity", type=float, default=1e6, help="cache rows of layer 14")
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--out", type=Path, default=Path("runs/bench_admission"))
    ap.add_argument("--log", action="store_true", help="append the tables to docs/bench-log/ under '## Admission'")
    ap.add_argument("--quiet", action="store_true")
    ap.add_argument("--served-only", action="store_true",
                    help="only the engine's admission rules (and Belady), on the fit and the held-out half")
    args = ap.parse_args()
    capacity = int(args.capacity)
    batches = [int(x) for x in args.batch.split(",") if x]
    workloads = [w for w in args.workloads.split(",") if w]

    def progress(msg: str) -> None:
        if not args.quiet:
            print(f"  {msg}", file=sys.stderr, flush=True)

    t_start = time.perf_counter()
    hasher = EngramLookupHasher()
    corpus = CorpusConfig()
    report: dict = {"capacity_rows": capacity, "layer": LAYER, "decode_tokens": args.decode_tokens, "runs": []}
    lines, choice_lines, fact_lines = [], [], []
    for wl in workloads:
        split = load_workload(wl, corpus)
        for b in batches:
            replay = ReplayConfig(batch=b, decode_tokens=args.decode_tokens)
            preps = {}
            for side, sessions in (("fit", split.fit), ("holdout", split.holdout)):
                trace = collect_trace(replay_steps(list(sessions), hasher, replay), hasher, wl, b)
                preps[side] = prepare_layer(trace, LAYER)
            progress(f"{wl} B={b}: fit {preps['fit'].ids.shape[0]:,} lookups, held-out "
                     f"{preps['holdout'].ids.shape[0]:,}")
            if args.served_only:
                got = served_rules(preps, capacity, progress)
                for side in ("fit", "holdout"):
                    r = got[side]
                    lines.append(f"| {wl} | {b} | {side} | " + " | ".join(
                        f"{100 * r[k].decode_hit_rate:.1f}" for k in (*SERVED, "belady")) + " | " + " | ".join(
                        f"{r[k].pages_mean:.0f}" for k in SERVED) + " |")
                report["runs"].append({"workload": wl, "batch": b, **{
                    side: {k: v.__dict__ for k, v in got[side].items()} for side in got}})
                continue
            best, tried = choose_on_fit(preps["fit"], capacity, progress)
            rows = evaluate_holdout(preps["holdout"], capacity, best, progress)
            facts = reuse_facts(preps["holdout"])
            clock = rows[0]
            for r in rows:
                orders = " | ".join(f"{100 * r.order_hit_rate[o]:.1f}" for o in sorted(r.order_hit_rate))
                pages = "-" if np.isnan(r.pages_mean) else f"{r.pages_mean:.0f} / {r.pages_median:.0f}"
                lines.append(f"| {wl} | {b} | {r.policy} | {100 * r.decode_hit_rate:.1f} | "
                             f"{100 * (r.decode_hit_rate - clock.decode_hit_rate):+.1f} | {orders} | {pages} |")
            fit_rate = {t["label"]: t["fit_decode_hit_rate"] for t in tried}
            choice_lines.append(f"| {wl} | {b} | {len(tried)} | " + " | ".join(
                f"{best[f].label()} ({100 * fit_rate[best[f].label()]:.1f})" for f in ("order", "probation", "sketch",
                                                                                          "best")) + " |")
            fact_lines.append(f"| {wl} | {b} | {len(split.fit)} / {len(split.holdout)} | {facts['lookups']:,} | "
                              f"{facts['distinct_rows']:,} | {100 * facts['compulsory_decode_share']:.1f} | "
                              f"{100 * facts['next_read_at_decode_share_of_prefill_lookups']:.1f} | "
                              f"{100 * facts['next_read_at_decode_share_of_decode_lookups']:.1f} |")
            report["runs"].append({"workload": wl, "batch": b, "fit_sessions": len(split.fit),
                                   "holdout_sessions": len(split.holdout),
                                   "fit_sources": sorted(split.fit_sources), "holdout_facts": facts,
                                   "chosen_on_fit": {k: v.as_dict() for k, v in best.items()},
                                   "fit_grid": tried, "holdout": [r.__dict__ for r in rows]})
            _plot(wl, b, rows, args.out)
    total_s = time.perf_counter() - t_start
    if args.served_only:
        write_json(args.out / "admission_served.json", report)
        print(f"Layer {LAYER}, {capacity:,} cache rows, one rank; the engine's admission rules replayed by the "
              "served pass (`cache.simulate`: step pins, evict-ahead). Decode hit % and missed pages per decode "
              "step (mean), on the fit and the held-out half of the source split.\n")
        print("| workload | B | half | " + " | ".join(f"{k} %" for k in SERVED) + " | Belady % | "
              + " | ".join(f"{k} pages" for k in SERVED) + " |")
        print("|---|---:|---|" + "---:|" * (2 * len(SERVED) + 1))
        print("\n".join(lines) + f"\n\nRun time {total_s:.0f} s.")
        return
    write_json(args.out / "admission.json", report)
    text = "\n".join([
        f"Layer {LAYER}, {capacity:,} cache rows, one rank; parameters chosen on the FIT half of the source split, "
        "every figure below on the HELD-OUT half (agent: published trajectories split by repository; chat: "
        "ShareGPT split by conversation; `split_by_source`, seed 0, half each).", "",
        "| workload | B | policy | decode hit % | vs served CLOCK | 2-gram | 3-gram | 4-gram | "
        "missed pages / decode step (mean / median) |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|", *lines, "",
        "Chosen on the fit half (fit decode hit % in brackets): best of each family's grid, and the best of those "
        "and their combinations.", "",
        "| workload | B | rules tried | n-gram order | probation | sketch | best |", "|---|---:|---:|---|---|---|---|",
        *choice_lines, "",
        "Held-out trace: sessions fit / held-out, lookups and distinct rows of layer 14, decode lookups that are a "
        "row's first lookup (compulsory, %), and lookups whose row is next read by a decode lookup (%).", "",
        "| workload | B | sessions | lookups | distinct rows | compulsory decode | next read at decode: prefill "
        "lookups | decode lookups |", "|---|---:|---|---:|---:|---:|---:|---:|", *fact_lines, "",
        f"Run time {total_s:.0f} s."])
    print(text)
    if args.log:
        block = (f"### Admission on held-out traffic ({utc_stamp()})\n\nCommand: `{command_line(__file__)}`; machine: "
                 f"{machine()} (shared); hit rates and pages are deterministic. JSON and plots: `{args.out}/`.\n\n"
                 f"{text}\n")
        append_to_section(block, SECTION)


def _plot(wl: str, batch: int, rows: list[Row], out: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    names = [r.policy.split(":")[0] for r in rows]
    ax.barh(range(len(rows)), [100 * r.decode_hit_rate for r in rows])
    ax.set_yticks(range(len(rows)), names, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel(f"decode hit rate (%), layer {LAYER}, held-out half")
    ax.set_title(f"{wl}, B={batch}: admission rules chosen on the fit half")
    ax.grid(True, axis="x", alpha=0.3)
    fig.tight_layout()
    save_figure(fig, out / f"admission_{wl}_B{batch}.png")
    plt.close(fig)


if __name__ == "__main__":
    main()
