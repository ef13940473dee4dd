"""RedKnot-MLA on a small DeepSeek-V4 on this CPU: prefill time with reuse vs full recompute, and deviation.

Documents are real source text (installed transformers / torch sources) tokenized
with the DeepSeek-V4 tokenizer, 2048 tokens each, plus a question. Artifacts are
built once per document (alone at position 0) into a store and read back through
a SlackTier page source. Per context length, full recompute and reuse at each
protection budget run interleaved in shuffled order, `--repeats` times; we quote
min/median/max and the median ratio. The model is transformers'
DeepseekV4ForCausalLM with random weights (bench_config: 7 layers 1F-5R-1F,
16 heads in 2 groups, window 128, CSA m=4 top-64, HCA m'=128), float32, one
intra-op thread (two threads thrash on this shared 2-core machine).

    .venv/bin/python benchmarks/bench_redknot_prefill.py --append
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
SECTION = "## RedKnot-MLA"


def _kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> float:
    p = torch.log_softmax(p_logits.double(), -1)
    q = torch.log_softmax(q_logits.double(), -1)
    return float((p.exp() * (p - q)).sum())


def _entropy(logits: torch.Tensor) -> float:
    p = torch.log_softmax(logits.double(), -1)
    return float(-(p.exp() * p).sum())


def ledger_block(contexts: list[int], budgets: list[float]) -> list[str]:
    """Markdown lines: Flash and Pro ceilings and per-operator savings."""
    from slacktier.redknot.ledger import (
        PROFILE_CONFIGS,
        ModelDims,
        head_row_ceiling,
        logical_head_row_saving,
        operator_ledger,
    )

    lines = ["| profile | fences | Local/Global | ceiling | context | budget | logical head-row | q_b | attn core "
             "| o_a | head-row ops | whole prefill |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, (profile, make) in PROFILE_CONFIGS.items():
        dims = ModelDims.of(make())
        ceiling = head_row_ceiling(profile)
        lg = f"{profile.num_heads - profile.num_heads // 8}/{profile.num_heads // 8}"
        for ctx in contexts:
            for b in budgets:
                rows = {r.name: r.saving for r in operator_ledger(dims, profile, None, doc_rows=ctx, query_rows=64,
                                                                  budget=b)}
                hr = logical_head_row_saving(profile, None, doc_rows=ctx, query_rows=64, budget=b)
                lines.append(f"| {name} | {profile.fence_layout} | {lg} | {100 * ceiling:.2f}% | {ctx // 1024}K+64 "
                             f"| {b:.0%} | {100 * hr:.2f}% | {100 * rows['q_b']:.2f}% | {100 * rows['attn']:.2f}% "
                             f"| {100 * rows['o_a']:.2f}% | {100 * rows['head-row ops']:.2f}% "
                             f"| {100 * rows['whole prefill']:.2f}% |")
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="4096,8192,16384", help="document tokens per request")
    ap.add_argument("--doc-tokens", type=int, default=2048)
    ap.add_argument("--budgets", default="0.1,0.2,0.25")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--source", choices=("dram", "disk"), default="dram")
    ap.add_argument("--store", default=str(ROOT / "runs" / "redknot_bench" / "store"))
    ap.add_argument("--png", default=str(ROOT / "runs" / "redknot_prefill.png"))
    ap.add_argument("--append", action="store_true", help="append the tables to docs/bench-log/redknot.md")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lm-head-scale", type=float, default=20.0,
                    help="scale of the random output head (1 = init std 0.02: a near-uniform next-token distribution)")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    from slacktier.redknot.artifacts import ArtifactStore
    from slacktier.redknot.corpus import documents, question_tokens
    from slacktier.redknot.ledger import ModelDims, operator_ledger
    from slacktier.redknot.model import bench_config, build_model
    from slacktier.redknot.placement import artifact_placement
    from slacktier.redknot.profile import profile_for_config
    from slacktier.redknot.protect import ProtectionPolicy
    from slacktier.redknot.runner import InMemoryLocal, Layout, RedKnotRunner, Segment
    from slacktier.redknot.service import RedKnotService

    lengths = [int(x) for x in args.lengths.split(",")]
    budgets = [float(x) for x in args.budgets.split(",")]
    cfg = bench_config()
    model = build_model(cfg, seed=args.seed, dtype=torch.float32, lm_head_scale=args.lm_head_scale)
    profile = profile_for_config(cfg, name="bench-1F1F")
    runner = RedKnotRunner(model, profile, chunk_rows=256)
    store = ArtifactStore(Path(args.store))
    svc = RedKnotService(runner, store, placement=artifact_placement(store.root, profile.reusable, args.source))
    n_docs = max(lengths) // args.doc_tokens
    docs = documents(n_docs, args.doc_tokens)
    query = question_tokens()

    build_s = []
    for doc_id, toks in docs:
        t0 = time.perf_counter()
        svc.build(doc_id, toks)
        build_s.append(time.perf_counter() - t0)
    print(f"built {len(docs)} artifacts of {args.doc_tokens} tokens: {sum(build_s):.1f} s "
          f"({statistics.median(build_s):.2f} s median each)")

    dims = ModelDims.of(cfg)
    results = []
    for length in lengths:
        req = docs[:length // args.doc_tokens]
        layout = Layout.of([Segment(d, t) for d, t in req] + [Segment("query", query, "query")])
        configs = ["full"] + [f"reuse@{b:g}" for b in budgets]
        times: dict[str, list[float]] = {c: [] for c in configs}   # CPU seconds of this process
        walls: dict[str, list[float]] = {c: [] for c in configs}   # wall seconds
        outs: dict[str, object] = {}
        rng = random.Random(args.seed + length)
        for rep in range(args.repeats):
            order = configs[:]
            rng.shuffle(order)
            for c in order:
                t0, c0 = time.perf_counter(), time.process_time()
                if c == "full":
                    out = runner.full(layout)
                else:
                    out = svc.prefill(req, query, ProtectionPolicy(float(c.split("@")[1])))
                times[c].append(time.process_time() - c0)
                walls[c].append(time.perf_counter() - t0)
                outs.setdefault(c, out)
                print(f"  {length} rep {rep} {c}: cpu {times[c][-1]:.2f} s, wall {walls[c][-1]:.2f} s", flush=True)
        # control: artifacts replaced by zeros (Local heads dropped on unprotected rows)
        has = torch.zeros(layout.rows, dtype=torch.bool)
        has[:layout.starts[-1]] = True
        zero = InMemoryLocal(has, {l: torch.zeros(layout.rows, cfg.o_groups * cfg.o_lora_rank)
                                   for l in profile.reusable})
        ctrl = runner.reuse(layout, zero, ProtectionPolicy(budgets[len(budgets) // 2]))
        full = outs["full"]
        h_full = full.hidden[-1]
        qrows = layout.query_rows()
        for c in configs:
            o = outs[c]
            res = o if c == "full" else o.result
            if c != "full":
                assert o.fallback_reason is None, o.fallback_reason
            rel = float((res.hidden[-1] - h_full).norm() / h_full.norm())
            qrel = float(((res.hidden[qrows] - full.hidden[qrows]).norm(dim=-1)
                          / full.hidden[qrows].norm(dim=-1)).mean())
            b = 0.0 if c == "full" else float(c.split("@")[1])
            analytic = {r.name: r.saving for r in operator_ledger(dims, profile, None, doc_rows=layout.starts[-1],
                                                                  query_rows=len(query), budget=b)}
            results.append(dict(length=length, rows=layout.rows, config=c, times=times[c], walls=walls[c],
                                saving=res.stats.head_row_saving, rel=rel, qrel=qrel,
                                kl=_kl(full.last_logits, res.last_logits),
                                top1=bool(full.last_logits.argmax() == res.last_logits.argmax()),
                                analytic=analytic["whole prefill"],
                                pages=0 if c == "full" else o.reads.pages,
                                read_s=0.0 if c == "full" else o.reads.wait_s))
        results.append(dict(length=length, rows=layout.rows, config="control: zero artifacts", times=[], walls=[],
                            saving=ctrl.stats.head_row_saving,
                            rel=float((ctrl.hidden[-1] - h_full).norm() / h_full.norm()),
                            qrel=float(((ctrl.hidden[qrows] - full.hidden[qrows]).norm(dim=-1)
                                        / full.hidden[qrows].norm(dim=-1)).mean()),
                            kl=_kl(full.last_logits, ctrl.last_logits),
                            top1=bool(full.last_logits.argmax() == ctrl.last_logits.argmax()), analytic=None,
                            pages=0, read_s=0.0))
        results.append(dict(length=length, entropy=_entropy(full.last_logits)))

    svc.close()
    header = ("| doc tokens | config | prefill CPU s (min / med / max) | CPU vs full | wall s (med) | wall vs full "
              "| head-rows skipped "
              "| analytic whole-prefill saving | last-row hidden rel. err | query rows rel. err "
              "| next-token KL (nats) | same top-1 | artifact pages |")
    lines = [header, "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    entropies = {}
    for r in results:
        if "entropy" in r:
            entropies[r["length"]] = r["entropy"]
            continue
        ref = next(x for x in results if x.get("length") == r["length"] and x.get("config") == "full")
        full_med, full_wall = statistics.median(ref["times"]), statistics.median(ref["walls"])
        if r["times"]:
            t = r["times"]
            tm = f"{min(t):.2f} / {statistics.median(t):.2f} / {max(t):.2f}"
            ratio = f"{statistics.median(t) / full_med:.2f}x"
            wm = statistics.median(r["walls"])
            tm += f" | {ratio} | {wm:.2f}"
            ratio = f"{wm / full_wall:.2f}x"
        else:
            tm, ratio = "- | - | -", "-"
        an = f"{100 * r['analytic']:.1f}%" if r["analytic"] is not None and r["config"] != "full" else "-"
        lines.append(f"| {r['length']} | {r['config']} | {tm} | {ratio} | {100 * r['saving']:.1f}% | {an} "
                     f"| {r['rel']:.2e} | {r['qrel']:.2e} | {r['kl']:.2e} | {'yes' if r['top1'] else 'no'} "
                     f"| {r['pages']} |")
    print("\n".join(lines))
    ent = ", ".join(f"{k}: {v:.2f}" for k, v in entropies.items())
    print(f"next-token entropy of the full recompute (nats; uniform = {torch.log(torch.tensor(129280.)):.2f}): {ent}")

    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(1, 2, figsize=(10, 4))
        for c in ["full"] + [f"reuse@{b:g}" for b in budgets]:
            xs = [r["length"] for r in results if r.get("config") == c]
            ys = [statistics.median(r["times"]) for r in results if r.get("config") == c]  # CPU s
            ax[0].plot(xs, ys, marker="o", label=c)
            if c != "full":
                ax[1].plot(xs, [r["kl"] for r in results if r.get("config") == c], marker="o", label=c)
        ax[0].set_xlabel("document tokens")
        ax[0].set_ylabel("prefill CPU s (median)")
        ax[0].legend()
        ax[1].set_xlabel("document tokens")
        ax[1].set_ylabel("next-token KL vs full (nats)")
        ax[1].set_yscale("log")
        ax[1].legend()
        fig.tight_layout()
        Path(args.png).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(args.png, dpi=100)
        print(f"wrote {args.png}")
    except ImportError:
        print("matplotlib missing: no PNG")

    ledger = ledger_block([16384, 262144], [0.0, 0.1, 0.2, 0.25])
    print("\n".join(ledger))
    if args.append:
        cmd = " ".join([".venv/bin/python benchmarks/bench_redknot_prefill.py", *sys.argv[1:]])
        stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        block = [f"### Run {stamp}", "", f"Command: `{cmd}`", "",
                 f"Machine: {platform.machine()}, {os.cpu_count()} cores (shared with other agents), "
                 f"torch {torch.__version__}, {args.threads} intra-op thread(s), float32.", "",
                 "Analytic ledger (DeepSeek-V4 Flash and Pro dims, every 8th head Global, 64 query tokens; "
                 "MAC counts, not measured time):", "", *ledger, "",
                 f"Measured on the CPU bench model (7 layers 1F-5R-1F, 16 heads / 2 groups, hidden 256, head_dim "
                 f"64, window 128, CSA m=4 top-64 with 4 index heads, HCA m'=128, random weights, output head "
                 f"x{args.lm_head_scale:g}), {args.doc_tokens}-token real-text "
                 f"documents + a {len(query)}-token question, artifacts through the `{args.source}` page source, "
                 f"{args.repeats} interleaved shuffled repeats. CPU s = this process's CPU time (one thread, "
                 "so it is the work done; wall time on this shared machine mostly measures the other agents):",
                 "", *lines, "",
                 f"Next-token entropy of the full recompute (nats; uniform 11.77): {ent}. The control row keeps "
                 "the same protected rows but replaces every stored Local contribution by zero, to show the scale "
                 "of an error reuse avoids.", ""]
        append_to_section(ROOT / "docs" / "bench-log" / "redknot.md", block)
        print("appended to its docs/bench-log/ file")
    return 0


def append_to_section(path: Path, block: list[str]) -> None:
    """Insert `block` at the end of the RedKnot-MLA section (before the next '## ' heading)."""
    text = path.read_text().splitlines()
    try:
        start = text.index(SECTION)
    except ValueError:
        text += ["", SECTION, ""]
        start = len(text) - 2
    end = next((i for i in range(start + 1, len(text)) if text[i].startswith("## ")), len(text))
    while end > start + 1 and text[end - 1].strip() == "":
        end -= 1
    new = text[:end] + [""] + block + text[end:]
    path.write_text("\n".join(new) + "\n")


if __name__ == "__main__":
    sys.exit(main())
