"""`slacktier redknot build | run | ledger`: RedKnot-MLA artifacts, reuse prefills and the analytic ledger."""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

HELP = "RedKnot-MLA: build Local-head artifacts, run reuse prefills against full recompute, print the ledger"

log = logging.getLogger(__name__)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of the redknot verb and its sub-verbs."""
    sub = p.add_subparsers(dest="redknot_cmd", metavar="CMD")
    for name, text in (("build", "prefill each document alone at position 0 and publish its artifacts"),
                       ("run", "prefill documents + question with reuse and with full recompute; compare")):
        q = sub.add_parser(name, help=text, description=text)
        q.add_argument("--store", required=True, help="artifact directory")
        q.add_argument("--model", choices=("tiny", "bench"), default="bench",
                       help="tiny: 6 layers, vocab 512 (token ids mod 512); bench: 7 layers, real vocab")
        q.add_argument("--seed", type=int, default=0, help="weight seed (the digest binds it)")
        q.add_argument("--dtype", choices=("float32", "float64"), default="float32")
        q.add_argument("--docs", type=int, default=2, help="documents of real source text")
        q.add_argument("--doc-tokens", type=int, default=2048, help="tokens per document")
        q.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks the artifacts are split over")
        q.add_argument("--fence", default="1,1", help="fence layers front,back")
        q.add_argument("--threads", type=int, default=1,
                       help="torch intra-op threads (1: small matrices on a shared machine run faster)")
        q.add_argument("--policy", choices=("stride", "distance"), default="stride",
                       help="stride: every 8th head Global; distance: per layer the 1/8 of heads with the longest "
                            "mean attention distance on the first two documents (first 512 tokens each)")
        if name == "run":
            q.add_argument("--budget", type=float, default=0.2, help="protected share of document rows")
            q.add_argument("--source", choices=("dram", "disk"), default="dram",
                           help="the tier every reusable layer's artifact pages are read from")
            q.add_argument("--placement", default="",
                           help="control file placing each reusable layer's artifact pages on a tier (overrides "
                                "--source; schema: slacktier.redknot.placement)")
    q = sub.add_parser("ledger", help="head-row ceiling and per-operator arithmetic for Flash and Pro")
    q.add_argument("--profiles", default="flash,pro")
    q.add_argument("--context", type=int, default=262144, help="document tokens of the prefill")
    q.add_argument("--query", type=int, default=64, help="query tokens")
    q.add_argument("--budgets", default="0,0.1,0.2,0.25", help="comma list of protected shares")
    q.add_argument("--json", action="store_true", help="print JSON instead of tables")


def _service(args, docs):
    import torch

    from slacktier.config import load_control
    from slacktier.redknot.artifacts import ArtifactStore
    from slacktier.redknot.model import bench_config, build_model, tiny_config
    from slacktier.redknot.placement import artifact_placement
    from slacktier.redknot.profile import profile_for_config
    from slacktier.redknot.runner import RedKnotRunner
    from slacktier.redknot.service import RedKnotService

    cfg = tiny_config() if args.model == "tiny" else bench_config()
    dtype = torch.float64 if args.dtype == "float64" else torch.float32
    model = build_model(cfg, seed=args.seed, dtype=dtype)
    front, back = (int(x) for x in args.fence.split(","))
    profile = profile_for_config(cfg, name=f"{args.model}-{front}F{back}F", fence_front=front, fence_back=back)
    runner = RedKnotRunner(model, profile)
    if args.policy == "distance":
        from slacktier.redknot.profile import policy_from_distances
        from slacktier.redknot.runner import measure_head_distances

        samples = [list(toks[:512]) for _, toks in docs[:2]]
        runner = RedKnotRunner(model, profile, policy_from_distances(measure_head_distances(runner, samples)))
        log.info("distance policy: Global heads %s", runner.policy.global_heads)
    store = ArtifactStore(Path(args.store))
    if getattr(args, "placement", ""):
        placement = load_control(args.placement)
    else:
        placement = artifact_placement(store.root, profile.reusable, getattr(args, "source", "dram"))
    return RedKnotService(runner, store, tp_size=args.tp, placement=placement), cfg


def _docs(args, vocab: int):
    from slacktier.redknot.corpus import documents, question_tokens

    docs = documents(args.docs, args.doc_tokens)
    q = question_tokens()
    if vocab < 129_280:
        docs = [(d, tuple(t % vocab for t in toks)) for d, toks in docs]
        q = tuple(t % vocab for t in q)
    return docs, q


def run(args: argparse.Namespace) -> int:
    """Dispatch build, run or ledger."""
    cmd = getattr(args, "redknot_cmd", None)
    if cmd == "ledger":
        return _ledger(args)
    if cmd not in ("build", "run"):
        print("usage: slacktier redknot {build,run,ledger} ...  (see --help)")
        return 2
    import torch

    from slacktier.redknot.model import bench_config, tiny_config

    torch.set_num_threads(args.threads)
    docs, q = _docs(args, (tiny_config() if args.model == "tiny" else bench_config()).vocab_size)
    svc, cfg = _service(args, docs)
    if cmd == "build":
        for doc_id, toks in docs:
            t0 = time.perf_counter()
            certs = svc.build(doc_id, toks)
            c = certs[0]
            print(f"{doc_id}: {c.rows} rows, layers {list(c.covered_layers)}, generation {c.generation}, "
                  f"{len(certs)} rank(s), {sum(sum(x.region_pages) for x in certs)} pages, "
                  f"{time.perf_counter() - t0:.2f} s")
        return 0
    import torch

    from slacktier.redknot.protect import ProtectionPolicy
    from slacktier.redknot.runner import Layout, Segment

    t0 = time.perf_counter()
    try:
        rep = svc.prefill(docs, q, ProtectionPolicy(args.budget))
    finally:
        svc.close()
    t_reuse = time.perf_counter() - t0
    layout = Layout.of([Segment(d, t) for d, t in docs] + [Segment("query", q, "query")])
    t0 = time.perf_counter()
    full = svc.runner.full(layout)
    t_full = time.perf_counter() - t0
    p = torch.log_softmax(full.last_logits.double(), -1)
    r = torch.log_softmax(rep.result.last_logits.double(), -1)
    kl = float((p.exp() * (p - r)).sum())
    rel = float((rep.result.hidden[-1] - full.hidden[-1]).norm() / full.hidden[-1].norm())
    st = rep.result.stats
    print(json.dumps({"mode": st.mode, "fallback_reason": st.fallback_reason, "rows": layout.rows,
                      "reuse_s": round(t_reuse, 3), "full_s": round(t_full, 3),
                      "head_row_saving": round(st.head_row_saving, 4), "local_rows_reused": st.local_rows_reused,
                      "protected": st.protected, "pages_read": rep.reads.pages,
                      "last_hidden_rel_err": rel, "next_token_kl": kl,
                      "same_argmax": bool(full.last_logits.argmax() == rep.result.last_logits.argmax()),
                      "counters": dict(svc.counters)}, indent=1))
    return 0


def _ledger(args) -> int:
    from slacktier.redknot.ledger import (
        PROFILE_CONFIGS,
        ModelDims,
        format_ledger,
        head_row_ceiling,
        logical_head_row_saving,
        operator_ledger,
    )

    out = {}
    for name in args.profiles.split(","):
        profile, make = PROFILE_CONFIGS[name]
        dims = ModelDims.of(make())
        ceiling = head_row_ceiling(profile)
        entry = {"fences": profile.fence_layout, "local_global": f"{profile.num_heads - profile.num_heads // 8}/"
                 f"{profile.num_heads // 8}", "head_row_ceiling": ceiling, "budgets": {}}
        if not args.json:
            print(f"{name}: {profile.fence_layout}, {entry['local_global']} Local/Global heads, "
                  f"logical head-row ceiling {100 * ceiling:.2f}%")
        for b in (float(x) for x in args.budgets.split(",")):
            rows = operator_ledger(dims, profile, None, doc_rows=args.context, query_rows=args.query, budget=b)
            hr = logical_head_row_saving(profile, None, doc_rows=args.context, query_rows=args.query, budget=b)
            entry["budgets"][b] = {"logical_head_row_saving": hr, **{r.name: r.saving for r in rows}}
            if not args.json:
                print(format_ledger(f"{name}, {args.context} doc + {args.query} query tokens, budget {b:.0%}: "
                                    f"logical head-row saving {100 * hr:.2f}%", rows))
        out[name] = entry
    if args.json:
        print(json.dumps(out, indent=1))
    return 0
