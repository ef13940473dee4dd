"""Adaptive sparse MoE on the trained retrieval DeepSeek-V4, alone and with RedKnot head reuse.

Per held-out sample (the quality benchmark's samples: 1024-token documents with
two records each, then the question), four prefills, interleaved in shuffled order:
full recompute; full + adaptive MoE; reuse (every 8th head Global, budget 20%);
reuse + adaptive MoE. Quality against full recompute (exact match of the answer,
next-token KL, top-1), routed experts kept, analytic multiply-accumulates of the
whole prefill (ledger.py's count plus the routed experts actually run) and this
process's CPU time (one thread). Artifacts come from each document's canonical
prefill (runner.full alone at position 0), held in memory.

    .venv/bin/python benchmarks/bench_redknot_sparse_moe.py --samples 20 --append
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # the repo root: benchmarks.* imports

ROOT = Path(__file__).resolve().parents[2]


def _kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> float:
    p = torch.log_softmax(p_logits.double(), -1)
    q = torch.log_softmax(q_logits.double(), -1)
    return float((p.exp() * (p - q)).sum())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(ROOT / "models" / "redknot" / "retrieval-v4.pt"))
    ap.add_argument("--length", type=int, default=4096)
    ap.add_argument("--samples", type=int, default=20)
    ap.add_argument("--doc-tokens", type=int, default=1024)
    ap.add_argument("--thresholds", default="0.6,0.8")
    ap.add_argument("--budget", type=float, default=0.2)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--append", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)

    from slacktier.redknot.ledger import ModelDims, operator_ledger
    from slacktier.redknot.profile import profile_for_config
    from slacktier.redknot.protect import ProtectionPolicy
    from slacktier.redknot.runner import InMemoryLocal, Layout, RedKnotRunner, Segment
    from benchmarks.redknot.sparse_moe import adaptive_moe, moe_fences
    from benchmarks.redknot.train import eval_task, load_model

    model, vocab, card = load_model(Path(args.model))
    cfg = model.config
    cfg._experts_implementation = "eager"   # the adaptive path needs eager; every config uses it (fair times)
    profile = profile_for_config(cfg, name="retrieval-1F1F")
    runner = RedKnotRunner(model, profile, chunk_rows=256)
    task = eval_task(vocab)
    thresholds = [float(t) for t in args.thresholds.split(",")]
    configs = ["full", "reuse"] + [f"{m}+moe@{t:g}" for t in thresholds for m in ("full", "reuse")]
    rng = random.Random(args.seed + args.length)
    order_rng = random.Random(args.seed)
    n_docs = args.length // args.doc_tokens
    dims = ModelDims.of(cfg)
    expert_macs = 3 * dims.hidden * dims.moe_inter
    res: dict[str, dict[str, list]] = {c: {"em": [], "kl": [], "top1": [], "cpu": [], "kept": [], "saving": [],
                                           "macs": []} for c in configs}
    t_start = time.perf_counter()
    for i in range(args.samples):
        s = task.eval_sample(rng, n_docs, args.doc_tokens, 2)
        task.eval_sample(rng, n_docs, args.doc_tokens, 2)   # keep the quality benchmark's sample stream
        layout = Layout.of([Segment(f"d{j}", d) for j, d in enumerate(s.documents)]
                           + [Segment("q", s.query, "query")])
        has = torch.zeros(layout.rows, dtype=torch.bool)
        has[:layout.starts[-1]] = True
        z = {l: [] for l in profile.reusable}
        for d in s.documents:
            cap = runner.full(Layout.of([Segment("doc", d)]), capture_layers=profile.reusable).captured
            for l in profile.reusable:
                z[l].append(cap[l])
        zoff = {l: torch.cat(z[l] + [torch.zeros(len(s.query), z[l][0].shape[1])]) for l in profile.reusable}
        local = InMemoryLocal(has, zoff)
        doc_rows, q_rows = layout.starts[-1], len(s.query)
        base = {r.name: r.full_macs for r in operator_ledger(dims, profile, None, doc_rows=doc_rows,
                                                              query_rows=q_rows, budget=args.budget)}
        reuse_rows = {r.name: r.reuse_macs for r in operator_ledger(dims, profile, None, doc_rows=doc_rows,
                                                                     query_rows=q_rows, budget=args.budget)}
        outs = {}
        order = configs[:]
        order_rng.shuffle(order)
        for c in order:
            thr = float(c.split("@")[1]) if "@" in c else None
            ctx = adaptive_moe(model, thr) if thr is not None else contextlib.nullcontext(None)
            c0 = time.process_time()
            with ctx as stats:
                out = runner.full(layout) if c.startswith("full") else runner.reuse(layout, local,
                                                                                   ProtectionPolicy(args.budget))
            res[c]["cpu"].append(time.process_time() - c0)
            outs[c] = out
            macs = (reuse_rows if c.startswith("reuse") else base)["whole prefill"]
            if stats is not None:
                macs -= (stats.routed_native - stats.routed_kept) * expert_macs
                res[c]["kept"].append(stats.routed_kept / max(stats.routed_native, 1) * cfg.num_experts_per_tok)
                res[c]["saving"].append(stats.saving)
            res[c]["macs"].append(1.0 - macs / base["whole prefill"])
        full = outs["full"].last_logits
        for c in configs:
            lg = outs[c].last_logits
            res[c]["em"].append(int(lg.argmax()) == s.answer)
            res[c]["kl"].append(_kl(full, lg))
            res[c]["top1"].append(int(lg.argmax()) == int(full.argmax()))
        print(f"sample {i + 1}/{args.samples} ({time.perf_counter() - t_start:.0f} s): EM "
              f"{ {c: sum(res[c]['em']) for c in configs} }", flush=True)

    fences = moe_fences(model)
    full_cpu = statistics.median(res["full"]["cpu"])
    lines = ["| config | exact match | next-token KL vs full (mean / median) | top-1 agreement | routed experts per "
             "token (adaptive layers) | routed-expert work skipped (adaptive layers) | analytic whole-prefill MAC "
             "saving | CPU s (median) | CPU vs full |", "|---|---|---|---|---|---|---|---|---|"]
    for c in configs:
        r = res[c]
        n = len(r["em"])
        kept = f"{statistics.mean(r['kept']):.2f} of {cfg.num_experts_per_tok}" if r["kept"] else \
            f"{cfg.num_experts_per_tok} (native)"
        sv = f"{100 * statistics.mean(r['saving']):.1f}%" if r["saving"] else "0%"
        cpu = statistics.median(r["cpu"])
        lines.append(f"| {c} | {sum(r['em']) / n:.3f} ({sum(r['em'])}/{n}) | {statistics.mean(r['kl']):.4f} / "
                     f"{statistics.median(r['kl']):.4f} | {sum(r['top1']) / n:.3f} | {kept} | {sv} "
                     f"| {100 * statistics.mean(r['macs']):.2f}% | {cpu:.2f} | {cpu / full_cpu:.2f}x |")
    print("\n".join(lines))
    if args.append:
        from benchmarks.redknot.bench_redknot_prefill import append_to_section

        cmd = " ".join([".venv/bin/python benchmarks/bench_redknot_sparse_moe.py", *sys.argv[1:]])
        stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        block = [f"### Adaptive sparse MoE on the trained model, {stamp}", "",
                 f"Command: `{cmd}` ({(time.perf_counter() - t_start) / 60:.0f} min, one thread, float32). "
                 f"Same tiny CPU-trained model and held-out {args.length}-token samples as the quality table; "
                 f"MoE fence layers {list(fences)} (the hash-routed layer, the first and the last top-6 routed "
                 "layer) keep native top-6. Rule (`benchmarks/redknot/sparse_moe.py`): per token keep the fewest "
                 "of the native top-6 experts (at least 3) whose normalised router weights sum to the threshold, "
                 "renormalise the kept weights; the shared expert always runs; every config runs transformers' eager "
                 "expert loop. reuse = every 8th head Global, "
                 f"budget {args.budget:.0%}. CPU s: this process's CPU time per prefill.", "", *lines, ""]
        append_to_section(ROOT / "docs" / "bench-log" / "redknot.md", block)
        print("appended to its docs/bench-log/ file")
    return 0


if __name__ == "__main__":
    sys.exit(main())
