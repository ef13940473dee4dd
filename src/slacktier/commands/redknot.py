"""`slacktier redknot build | run | plan | ledger`: RedKnot-MLA artifacts, reuse prefills, their placement by
deadline and the analytic ledger."""

from __future__ import annotations

import argparse
from pathlib import Path

from slacktier.commands._args import finite
from slacktier.commands.plan import add_window_arguments
from slacktier.errors import ErrorKind, SlackTierError

HELP = ("RedKnot-MLA: build Local-head artifacts, run reuse prefills against full recompute, place the artifacts by "
        "deadline, print the ledger")


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
    text = ("place each reusable layer's artifact table on the tier cheapest in host memory whose predicted stall "
            "(Eq. 1 on the layers' windows) fits the target, and write the control file `redknot run --placement` "
            "reads")
    q = sub.add_parser("plan", help=text, description=text)
    q.add_argument("--store", required=True, type=Path, help="artifact directory (built by `redknot build`)")
    q.add_argument("--docs", default="",
                   help="comma-separated document ids one prefill reads (default: every document in the store)")
    q.add_argument("--rank", type=int, default=0, help="the tensor-parallel rank whose pages are placed")
    q.add_argument("--tiers", type=Path, required=True,
                   help="tiers TOML, as `slacktier plan` reads: one [[tier]] per tier (see plan.tiers)")
    add_window_arguments(q)   # a layer's window: when the prefill needs its artifacts
    q.add_argument("--target-ms", type=finite("--target-ms"), default=0.0,
                   help="largest acceptable predicted stall per prefill")
    q.add_argument("--wait-timeout-ms", type=float, default=None, help="[engine] wait_timeout_ms of the control file")
    q.add_argument("--out", type=Path, default=Path("runs/redknot/placement.toml"), help="the control file to write")
    q = sub.add_parser("ledger", help="head-row ceiling and per-operator arithmetic for Flash and Pro")
    q.add_argument("--profiles", default="flash,pro")
    q.add_argument("--context", type=int, default=262144, help="document tokens of the prefill")
    q.add_argument("--query", type=int, default=64, help="query tokens")
    q.add_argument("--budgets", default="0,0.1,0.2,0.25", help="comma list of protected shares")
    q.add_argument("--json", action="store_true", help="print JSON instead of tables")


def _numbers(spec: str, flag: str, kind=float) -> tuple:
    try:
        return tuple(kind(x) for x in spec.split(","))
    except ValueError as exc:
        raise SlackTierError(ErrorKind.BAD_INPUT, f"{flag} {spec!r}",
                             fix=f"give {flag} as a comma list of numbers") from exc


def run(args: argparse.Namespace) -> int:
    """Dispatch build, run or ledger: build its config from the flags and make its one call."""
    cmd = getattr(args, "redknot_cmd", None)
    if cmd == "ledger":
        from slacktier.redknot.report import LedgerConfig, ledger

        ledger(LedgerConfig(profiles=tuple(args.profiles.split(",")), context=args.context, query=args.query,
                            budgets=_numbers(args.budgets, "--budgets"), as_json=args.json))
        return 0
    if cmd == "plan":
        return plan_artifacts(args)
    if cmd not in ("build", "run"):
        print("usage: slacktier redknot {build,run,plan,ledger} ...  (see --help)")
        return 2
    from slacktier.redknot.report import RedKnotRunConfig, build_artifacts, compare_prefill

    fence = _numbers(args.fence, "--fence", int)
    if len(fence) != 2:
        raise SlackTierError(ErrorKind.BAD_INPUT, f"--fence {args.fence!r}", fix="give two counts: front,back")
    config = RedKnotRunConfig(store=Path(args.store), model=args.model, seed=args.seed, dtype=args.dtype,
                              docs=args.docs, doc_tokens=args.doc_tokens, tp=args.tp, fence=fence,
                              threads=args.threads, policy=args.policy,
                              budget=getattr(args, "budget", RedKnotRunConfig.budget),
                              source=getattr(args, "source", RedKnotRunConfig.source),
                              placement=Path(args.placement) if getattr(args, "placement", "") else None)
    if cmd == "build":
        build_artifacts(config)
    else:
        compare_prefill(config)
    return 0


def plan_artifacts(args: argparse.Namespace) -> int:
    """`redknot plan`: demands from the store's certificates, windows and tiers from files; print, write."""
    from slacktier.commands.plan import windows_from_args
    from slacktier.config import write_control
    from slacktier.plan import load_tiers
    from slacktier.plan.artifacts import ArtifactDemand, plan_artifact_placement
    from slacktier.redknot.artifacts import ArtifactStore

    if not args.store.is_dir():
        raise SlackTierError(ErrorKind.MISSING, f"artifact store {args.store} not found",
                             fix="build one with `slacktier redknot build --store DIR`")
    store = ArtifactStore(args.store)
    docs = [d for d in args.docs.split(",") if d] if args.docs else store.documents(args.rank)
    if not docs:
        raise SlackTierError(ErrorKind.MISSING, f"no document of rank {args.rank} in {args.store}",
                             fix="build the artifacts first, or pick the rank they were built for")
    pages: dict[int, int] = {}
    layers: tuple[int, ...] | None = None
    for doc in docs:
        cert = store.certificate(doc, args.rank)
        if cert is None:
            raise SlackTierError(ErrorKind.MISSING, f"document {doc!r} has no rank-{args.rank} artifact in "
                                 f"{args.store}", fix="name documents the store holds (--docs), or build them")
        if layers is not None and cert.covered_layers != layers:
            raise SlackTierError(ErrorKind.BAD_INPUT, f"document {doc!r} covers layers {list(cert.covered_layers)}, "
                                 f"others {list(layers)}", fix="plan documents built with one profile together")
        layers = cert.covered_layers
        for layer, n in zip(cert.covered_layers, cert.region_pages):
            pages[layer] = pages.get(layer, 0) + int(n)
    windows = windows_from_args(args)
    missing = [layer for layer in pages if layer not in windows]
    if missing:
        raise SlackTierError(ErrorKind.MISSING, f"no window for reusable layers {missing}",
                             fix="pass --window LAYER=MS for each, or a probe JSON that measured them")
    demands = [ArtifactDemand(layer, n, windows[layer]) for layer, n in sorted(pages.items())]
    plan = plan_artifact_placement(store.root, demands, load_tiers(args.tiers), target_ms=args.target_ms,
                                   wait_timeout_ms=args.wait_timeout_ms)
    print(f"{len(docs)} documents, rank {args.rank}: predicted stall {plan.slowdown_ms:.3f} ms "
          f"(target {args.target_ms:.3f}), host memory {plan.host_bytes / 2**20:.1f} MiB")
    print("| layer | order | window ms | pages | tier | predicted read ms | predicted stall ms |")
    print("|---|---|---|---|---|---|---|")
    for t in plan.tables:
        print(f"| {t.layer} | {t.order} | {t.window_ms:.3f} | {t.pages} | {t.source} | {t.read_ms:.3f} | "
              f"{t.stall_ms:.3f} |")
    write_control(plan.control, args.out, comment=f"redknot plan: {len(docs)} documents of {args.store}, rank "
                  f"{args.rank}, target {args.target_ms} ms")
    print(f"wrote {args.out}")
    return 0
