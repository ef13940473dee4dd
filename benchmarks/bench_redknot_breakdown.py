"""Where the CPU prefill time of the RedKnot bench model goes: full recompute vs reuse, per component.

Components (CPU seconds of this process, one intra-op thread): the model's own
compressor + Lightning Indexer modules (unchanged by reuse), our per-head
attention core (what reuse shrinks), the MoE blocks, and the rest (projections,
norms, hyper-connections, artifact reads). Same model, documents and artifacts
as bench_redknot_prefill.py; `--repeats` interleaved runs, medians.

    .venv/bin/python benchmarks/bench_redknot_breakdown.py --append
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="4096,16384")
    ap.add_argument("--doc-tokens", type=int, default=2048)
    ap.add_argument("--budget", type=float, default=0.2)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--store", default=str(ROOT / "runs" / "redknot_bench" / "store"))
    ap.add_argument("--append", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)

    from bench_redknot_prefill import append_to_section

    from slacktier.redknot.artifacts import ArtifactStore
    from slacktier.redknot.corpus import documents, question_tokens
    from slacktier.redknot.model import bench_config, build_model
    from slacktier.redknot.profile import profile_for_config
    from slacktier.redknot.protect import ProtectionPolicy
    from slacktier.redknot.runner import Layout, RedKnotRunner, Segment
    from slacktier.redknot.service import RedKnotService

    cfg = bench_config()
    model = build_model(cfg, seed=0, dtype=torch.float32, lm_head_scale=20.0)
    profile = profile_for_config(cfg, name="bench-1F1F")
    runner = RedKnotRunner(model, profile, chunk_rows=256)
    svc = RedKnotService(runner, ArtifactStore(Path(args.store)))
    lengths = [int(x) for x in args.lengths.split(",")]
    docs = documents(max(lengths) // args.doc_tokens, args.doc_tokens)
    query = question_tokens()
    for doc_id, toks in docs:  # reuse the prefill bench's artifacts when they are there and valid
        if svc.store.certificate(doc_id, 0) is None:
            svc.build(doc_id, toks)

    acc: dict[str, float] = {}
    stack: list[tuple[str, float]] = []

    def pre(name):
        def f(*_):
            stack.append((name, time.process_time()))
        return f

    def post(*_):
        name, t0 = stack.pop()
        acc[name] = acc.get(name, 0.0) + time.process_time() - t0

    for layer in model.model.layers:
        if layer.self_attn.compressor is not None:
            layer.self_attn.compressor.register_forward_pre_hook(pre("compressor+indexer"))
            layer.self_attn.compressor.register_forward_hook(post)
        layer.mlp.register_forward_pre_hook(pre("moe"))
        layer.mlp.register_forward_hook(post)
    inner = runner._attend_jobs

    def timed_attend(*a, **k):
        t0 = time.process_time()
        try:
            return inner(*a, **k)
        finally:
            acc["attention core"] = acc.get("attention core", 0.0) + time.process_time() - t0

    runner._attend_jobs = timed_attend

    rows = []
    for length in lengths:
        req = docs[:length // args.doc_tokens]
        layout = Layout.of([Segment(d, t) for d, t in req] + [Segment("query", query, "query")])
        per: dict[str, list[dict[str, float]]] = {"full": [], f"reuse@{args.budget:g}": []}
        for rep in range(args.repeats):
            for name in (list(per) if rep % 2 == 0 else list(per)[::-1]):
                acc.clear()
                c0 = time.process_time()
                if name == "full":
                    runner.full(layout)
                else:
                    rep_ = svc.prefill(req, query, ProtectionPolicy(args.budget))
                    assert rep_.fallback_reason is None
                total = time.process_time() - c0
                parts = dict(acc)
                parts["total"] = total
                parts["other"] = total - sum(v for k, v in acc.items())
                per[name].append(parts)
                print(f"  {length} {name}: " + ", ".join(f"{k} {v:.2f}" for k, v in parts.items()), flush=True)
        for name, runs in per.items():
            med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
            rows.append((length, name, med))

    keys = ["total", "compressor+indexer", "attention core", "moe", "other"]
    lines = ["| doc tokens | config | " + " | ".join(f"{k} CPU s" for k in keys) + " |",
             "|---|---|" + "---|" * len(keys)]
    for length, name, med in rows:
        cells = [f"{med.get(k, 0.0):.2f} ({100 * med.get(k, 0.0) / med['total']:.0f}%)" if k != "total"
                 else f"{med['total']:.2f}" for k in keys]
        lines.append(f"| {length} | {name} | " + " | ".join(cells) + " |")
    print("\n".join(lines))
    if args.append:
        cmd = " ".join([".venv/bin/python benchmarks/bench_redknot_breakdown.py", *sys.argv[1:]])
        stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        append_to_section(ROOT / "BENCHMARKS.md", [
            f"### CPU time breakdown, {stamp}", "", f"Command: `{cmd}` (same machine, model and artifacts; "
            f"medians of {args.repeats} alternating runs, one thread):", "", *lines, ""])
        print("appended to BENCHMARKS.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
