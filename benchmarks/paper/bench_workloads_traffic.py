"""Our analog of the paper's Table 1 and Table 10: decode hit rates of Engram layers 14 and 1, sessions interleaved.

Builds (or reads from data/workloads) the agent and chat workloads, replays each
holdout split with B interleaved sessions (N tokens regenerated per turn), fits
static hot sets on the fit split, and reports per layer and policy the decode
hit rate at 1M and 5M rows (the paper's sizes) and at capacities proportional to
the trace's distinct rows, Belady's ceilings, the n-gram-order breakdown, batch
reuse and the share of rows never seen in the fit split. "Static (public list)"
is the paper's public hot list: rows ranked on --public-sessions ShareGPT
conversations (chat traffic) and applied to the agent trace. With --ple it also
replays the same sessions in Qwen's format and tokens through Qwen3.8's PLE hash
(`slacktier characterize --table ple`) at --ple-capacities. Writes
runs/bench_workloads/*.json (miss-page curves included) and PNG plots; --append
adds the tables to docs/bench-log/traffic.md under "## Traffic: access characterization".

    .venv/bin/python benchmarks/bench_workloads_traffic.py [--batch 64,128] [--layers 14,1] [--ple] [--append]
        [--workloads agent,chat] [--agent-source published|template] [--agent-dir DIR]

Agent traffic is the vendored published-trajectory sample unless --agent-dir
names a downloaded set (SWE-agent .traj, mini-swe-agent .traj.json, OpenHands
output.jsonl files); --agent-source template gives the synthetic sessions.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

from slacktier.workloads.characterize import (Capacity, batch_reuse, evaluate, fit_rankings, miss_page_curve,
                                              prepare_workload, trace_summary, unseen_share, with_ranking,
                                              write_json)
from slacktier.workloads.corpus import CorpusConfig, chat_token_sessions
from slacktier.workloads.hashing import EngramLookupHasher
from slacktier.workloads.replay import ReplayConfig, session_rows

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # the repo root: benchmarks.* imports
from benchmarks._harness import append_to_section, command_line, machine, utc_stamp  # noqa: E402

SECTION = "## Traffic: access characterization"
PAPER_T1 = {  # paper Table 1, layer 14, 64 sessions: (1M, 5M) rows
    ("agent", "lru"): (74.0, 81.0), ("agent", "s3fifo"): (74.5, 78.7), ("agent", "static"): (51.3, 59.5),
    ("agent", "static_public"): (29.2, 39.0),
    ("chat", "lru"): (34.8, 41.7), ("chat", "s3fifo"): (32.7, 39.2), ("chat", "static"): (17.7, 26.4),
    ("chat", "static_public"): (8.0, 12.3),
}
PAPER_T10 = {"agent": (62, 78, 86, 86), "chat": (30, 45, 53, 47)}  # LRU all lookups @0.2/1/5%, decode @5%
POLICIES = ("lru", "clock", "s3fifo", "static", "static_public", "static_lru", "belady", "belady_warm")
NAMES = {"lru": "LRU", "clock": "CLOCK", "s3fifo": "S3-FIFO-style", "static": "Static (fit split)",
         "static_public": "Static (public list: ShareGPT fit)", "static_lru": "Static head + LRU",
         "belady": "Belady (cold, ceiling)", "belady_warm": "Belady (fit rows preloaded)"}
PLE_POLICIES = ("lru", "s3fifo", "belady")
PLE_TABLE_ROWS = 320_000_000  # Qwen3.8 PLE rows (PleLayout.qwen38)


def pct(x: float) -> str:
    return f"{100 * x:.1f}"


def ints(text: str) -> list[int]:
    """'64,128' -> [64, 128]; '1e6' style is accepted (int(float(x)))."""
    return [int(float(x)) for x in text.split(",") if x]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", default="64", help="comma list of B (sessions served at once)")
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--layers", default="14,1", help="Engram layers to characterize (comma list of 1, 14)")
    ap.add_argument("--out", type=Path, default=Path("runs/bench_workloads"))
    ap.add_argument("--append", action="store_true")
    ap.add_argument("--sweep", action="store_true", help="also sweep B (8..64) and staggered starts")
    ap.add_argument("--workloads", default="agent,chat", help="comma list of agent, chat")
    ap.add_argument("--agent-source", default="published", choices=("published", "template"))
    ap.add_argument("--agent-dir", type=Path, default=None, help="downloaded trajectories (default: vendored sample)")
    ap.add_argument("--public-sessions", type=int, default=512,
                    help="ShareGPT conversations the public hot list is fit on (0: no public list)")
    ap.add_argument("--ple", action="store_true", help="also PLE hit rates on Qwen ids (Qwen3.8, layer 1)")
    ap.add_argument("--ple-capacities", default="1e6,3.2e6,5e6,16e6",
                    help="PLE cache rows (default 1M, 1%% of the table, 5M, 5%% of the table)")
    args = ap.parse_args()
    workloads = [w for w in args.workloads.split(",") if w]
    batches = ints(args.batch)
    layers = ints(args.layers)
    t_start = time.perf_counter()

    hasher = EngramLookupHasher()
    corpus = CorpusConfig(agent_source=args.agent_source, agent_dir=args.agent_dir)
    args.out.mkdir(parents=True, exist_ok=True)
    public, public_info = None, {}
    if args.public_sessions > 0 and "agent" in workloads:
        t0 = time.perf_counter()
        pub = chat_token_sessions(args.public_sessions, corpus.chat_min_replies, corpus.chat_max_turns,
                                  corpus.chat_max_tokens)
        public = fit_rankings(session_rows(pub, hasher), hasher.spec.layer_ids, layers)
        public_info = {"sessions": len(pub), "tokens": int(sum(s.num_tokens for s in pub)),
                       "seconds": time.perf_counter() - t0}
        print(f"public hot list: {public_info['sessions']} ShareGPT conversations, {public_info['tokens']:,} tokens, "
              f"{public_info['seconds']:.0f} s", flush=True)
    t1_lines, t10_lines, order_lines, reuse_lines, size_lines, time_lines = [], [], [], [], [], []
    for b in batches:
        replay = ReplayConfig(batch=b, decode_tokens=args.decode_tokens)
        report: dict = {"agent_source": args.agent_source, "agent_dir": str(args.agent_dir or "vendored sample"),
                        "batch": b, "decode_tokens": args.decode_tokens, "layers": layers,
                        "public_list": public_info, "workloads": {}}
        for wl in workloads:
            pw = prepare_workload(wl, corpus, replay, hasher, layers, progress=True)
            t_eval = time.perf_counter()
            summ = trace_summary(pw)
            wl_report: dict = {"summary": summ, "results": [], "batch_reuse": []}
            for prep in sorted(pw.preps, key=lambda p: layers.index(p.layer_id)):
                L = prep.layer_id
                u = prep.n_items
                caps = [Capacity(1_000_000, "1M rows"), Capacity(5_000_000, "5M rows"),
                        Capacity(u // 10, "10% of distinct"), Capacity(u // 4, "25% of distinct")]
                pub_prep = with_ranking(prep, public[L]) if (public is not None and wl == "agent") else None
                res = {}
                for p in POLICIES:
                    if p == "static_public":
                        if pub_prep is None:
                            continue
                        for c in caps:
                            res[(p, c.label)] = replace(evaluate(pub_prep, "static", c), policy=p)
                    else:
                        for c in caps:
                            res[(p, c.label)] = evaluate(prep, p, c)
                for p in POLICIES:
                    if (p, caps[0].label) not in res:
                        continue
                    paper = PAPER_T1.get((wl, p))
                    cells = " | ".join(pct(res[(p, c.label)].decode_hit_rate) for c in caps)
                    ptxt = f"{paper[0]} / {paper[1]}" if paper and L == 14 and b == 64 else "-"
                    t1_lines.append(f"| {wl} | {b} | {L} | {NAMES[p]} | {cells} | {ptxt} |")
                # Table 10: LRU, all lookups, share of the table
                tab = pw.trace.table_rows[pw.trace.layer_ids.index(L)]
                r10 = [evaluate(prep, "lru", Capacity(int(round(s * tab)), f"{s:g}")) for s in (0.002, 0.01, 0.05)]
                rp = [evaluate(prep, "lru", Capacity(int(u * s), f"{s:g}u")) for s in (0.05, 0.1, 0.25)]
                bel = evaluate(prep, "belady", Capacity(int(round(0.05 * tab)), "0.05"))
                t10_lines.append(
                    f"| {wl} | {b} | {L} | " + " | ".join(pct(r.all_hit_rate) for r in r10)
                    + f" | {pct(r10[2].decode_hit_rate)} | {pct(bel.decode_hit_rate)} | "
                    + " | ".join(pct(r.all_hit_rate) for r in rp)
                    + f" | {' / '.join(str(v) for v in PAPER_T10[wl])} |")
                for p in ("lru", "static", "static_public", "belady"):
                    for c in caps[:2]:
                        r = res.get((p, c.label))
                        if r is not None:
                            order_lines.append(f"| {wl} | {b} | {L} | {NAMES[p]} | {c.label} | "
                                               + " | ".join(pct(r.order_hit_rate[o]) for o in (2, 3, 4)) + " |")
                br = batch_reuse(prep, seed=0)
                unseen_pub = pct(unseen_share(pub_prep)) if pub_prep is not None else "-"
                reuse_lines.append(f"| {wl} | {b} | {L} | {pct(br.sampled_distinct)} | "
                                   f"{pct(br.consecutive_distinct)} | "
                                   f"{pct(br.window_distinct)} | {pct(summ['unseen_in_fit_decode_share'][str(L)])} | "
                                   f"{unseen_pub} |")
                wl_report["results"] += [asdict(r) for r in res.values()]
                wl_report["batch_reuse"].append(asdict(br))
                if L == layers[0]:
                    size_lines.append(f"| {wl} | {b} | {summ['holdout_sessions']} "
                                      f"({summ['holdout_sources']} sources) | "
                                      f"{summ['fit_sessions']} ({summ['fit_sources']} sources, "
                                      f"{summ['fit_tokens']:,} tokens) | {summ['trace_tokens']:,} | "
                                      f"{summ['decode_tokens']:,} | {pw.trace.num_lookups:,} | "
                                      f"{u:,} ({100 * u / tab:.2f}% of table) |")
                    _plot(wl, prep, res, caps, args.out, b)
            umax = max(p.n_items for p in pw.preps)
            curve = miss_page_curve(pw.preps, [0, umax // 100, umax // 20, umax // 10, umax // 4, umax // 2, umax,
                                               1_000_000, 5_000_000], "clock")
            write_json(args.out / f"miss_curve_{wl}_B{b}.json", curve)
            eval_s = time.perf_counter() - t_eval
            time_lines.append(f"| {wl} | {b} | {pw.sessions_s:.0f} | {pw.replay_s:.0f} | {eval_s:.0f} |")
            wl_report["seconds"] = {"sessions": pw.sessions_s, "replay": pw.replay_s, "characterize": eval_s}
            report["workloads"][wl] = wl_report
            print(f"{wl} B={b}: sessions {pw.sessions_s:.0f} s, replay {pw.replay_s:.0f} s, "
                  f"characterize {eval_s:.0f} s", flush=True)
            del pw
        write_json(args.out / f"traffic_B{b}.json", report)

    ple_lines, ple_reuse_lines = [], []
    if args.ple:
        from slacktier.workloads.report import CharacterizeConfig, characterize

        ple_caps = tuple(ints(args.ple_capacities))
        for b in batches:
            t0 = time.perf_counter()
            cfg = CharacterizeConfig(corpus=replace(corpus, tokens="qwen"),
                                     replay=ReplayConfig(batch=b, decode_tokens=args.decode_tokens),
                                     workloads=tuple(workloads), policies=PLE_POLICIES, table="ple",
                                     capacities_rows=ple_caps, out=args.out / f"ple_B{b}")
            ch = characterize(cfg)
            keyed = {(r.workload, r.policy, r.capacity_rows): r for r in ch.hits}
            for wl in workloads:
                for p in PLE_POLICIES:
                    cells = " | ".join(pct(keyed[(wl, p, c)].decode_hit_rate) for c in ple_caps)
                    ple_lines.append(f"| {wl} | {b} | {NAMES[p]} | {cells} |")
            for r in ch.reuse:
                ple_reuse_lines.append(f"| {r['workload']} | {b} | {pct(r['sampled_distinct'])} | "
                                       f"{pct(r['consecutive_distinct'])} | {pct(r['window_distinct'])} |")
            for wl, s in ch.summary.items():
                time_lines.append(f"| {wl} (PLE, Qwen ids) | {b} | {s['sessions_s']:.0f} | {s['replay_s']:.0f} | "
                                  f"{s['characterize_s']:.0f} |")
            print(f"PLE B={b}: {time.perf_counter() - t0:.0f} s", flush=True)

    # interleaving: batch size, and sessions starting staggered instead of all at step 0
    sweep_lines = []
    if args.sweep:
        for wl in workloads:
            for b, spread in ((8, 0), (16, 0), (32, 0), (64, 0), (64, 2000)):
                rc = ReplayConfig(batch=b, decode_tokens=args.decode_tokens, start_spread_steps=spread)
                pw = prepare_workload(wl, corpus, rc, hasher, [layers[0]])
                prep = pw.preps[0]
                cells = []
                for c in (Capacity(prep.n_items // 10, "10%"), Capacity(1_000_000, "1M")):
                    for p in ("lru", "s3fifo", "belady"):
                        cells.append(pct(evaluate(prep, p, c).decode_hit_rate))
                br = batch_reuse(prep, seed=0)
                sweep_lines.append(f"| {wl} | {b} | {spread} | " + " | ".join(cells)
                                   + f" | {pct(br.consecutive_distinct)} |")

    total_s = time.perf_counter() - t_start
    cap_head = "1M rows | 5M rows | 10% of distinct | 25% of distinct"
    pub_txt = (f" Public list: rows ranked on {public_info['sessions']} ShareGPT conversations "
               f"({public_info['tokens']:,} DeepSeek tokens), applied to agent traffic." if public_info else "")
    text = "\n".join([
        f"Workloads (holdout replayed with B interleaved sessions, N={args.decode_tokens} "
        f"teacher-forced decode tokens per assistant turn, prefill warms the cache):", "",
        "| workload | B | holdout sessions | fit sessions | trace tokens | decode tokens | lookups / layer | "
        f"distinct rows L{layers[0]} |", "|---|---:|---|---|---:|---:|---:|---:|", *size_lines, "",
        "**Table 1 analog**: decode-lookup hit rate (%) per Engram layer. Paper column: the paper's Table 1 "
        f"(layer 14, B=64, 1M / 5M rows; OpenHands agent, WildChat chat).{pub_txt}", "",
        f"| workload | B | layer | policy | {cap_head} | paper 1M / 5M |",
        "|---|---:|---:|---|---:|---:|---:|---:|---:|", *t1_lines, "",
        "**Table 10 analog**: LRU hit rate (%, all lookups) at a share of the table, decode-only at 5% and "
        "Belady's decode ceiling at 5%, then at shares of the trace's distinct rows. Paper: 256 sessions, "
        "0.2% / 1% / 5% / decode @5%.", "",
        "| workload | B | layer | 0.2% | 1% | 5% | decode @5% | Belady decode @5% | 5% of distinct | "
        "10% of distinct | 25% of distinct | paper |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
        *t10_lines, "",
        "**By n-gram order** (decode hit rate %):", "",
        "| workload | B | layer | policy | capacity | 2-gram | 3-gram | 4-gram |",
        "|---|---:|---:|---|---|---:|---:|---:|",
        *order_lines, "",
        "**Batch reuse** (% of row lookups that are distinct) and rows never seen in the fit split / the public "
        "list (% of decode lookups). Paper: 95-99.6% among 256 sampled decode tokens, 33% (agent) to 71% "
        "(chat) in an 8K window; unseen 7-11% agent, 14-23% chat (75M fit tokens).", "",
        "| workload | B | layer | 256 sampled decode tokens | 256 consecutive decode tokens | 8K-token window | "
        "unseen in fit | unseen in public list |", "|---|---:|---:|---:|---:|---:|---:|---:|", *reuse_lines,
    ] + ([
        "", "**PLE (Qwen3.8, layer 1) on Qwen ids**: decode-lookup hit rate (%) at "
        + ", ".join(f"{c:,}" for c in ints(args.ple_capacities)) + " rows (table: 320M rows). Paper: agent "
        "LRU 86-87%, chat 54-60%, \"depending on capacity\".", "",
        "| workload | B | policy | " + " | ".join(f"{c / 1e6:g}M ({100 * c / PLE_TABLE_ROWS:.2g}%)"
                                                for c in ints(args.ple_capacities)) + " |",
        "|---|---:|---|" + "---:|" * len(ints(args.ple_capacities)), *ple_lines, "",
        "| workload | B | PLE: 256 sampled decode tokens | 256 consecutive | 8K-token window |",
        "|---|---:|---:|---:|---:|", *ple_reuse_lines] if ple_lines else []) + ([
        "", f"**Interleaving** (layer {layers[0]}, decode hit rate %): batch size B, and the first B sessions "
        "starting at uniform random delays in [0, spread) decode steps instead of all at step 0.", "",
        "| workload | B | spread | LRU 10% | S3-FIFO 10% | Belady 10% | LRU 1M | S3-FIFO 1M | Belady 1M | "
        "distinct in 256 consecutive decode tokens |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        *sweep_lines] if sweep_lines else []) + [
        "", f"**Run time** (seconds; total {total_s:.0f} s):", "",
        "| workload | B | sessions | replay + hash + fit | characterize |", "|---|---:|---:|---:|---:|", *time_lines])
    print(text)
    if args.append:
        block = (f"### Table 1 / Table 10 analog ({utc_stamp()})\n\nCommand: `{command_line(__file__)}`; "
                 f"machine: {machine()} (shared with other jobs); hit rates are deterministic (no timing). Plots and "
                 f"JSON: `{args.out}/`.\n\n{text}\n")
        append_to_section(block, SECTION)


def _plot(wl, prep, res, caps, out: Path, batch: int) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for p in POLICIES:
        if (p, caps[0].label) not in res:
            continue
        pts = sorted((c.rows, res[(p, c.label)].decode_hit_rate) for c in caps)
        ax.plot([x for x, _ in pts], [100 * y for _, y in pts], marker="o", label=NAMES[p])
    ax.set_xscale("log")
    ax.set_xlabel(f"cache rows (layer {prep.layer_id})")
    ax.set_ylabel("decode hit rate (%)")
    ax.set_title(f"{wl}, B={batch}: {prep.n_items:,} distinct rows in the trace")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / f"hit_rate_{wl}_B{batch}_L{prep.layer_id}.png", dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
