"""`slacktier redknot build | run | ledger`: RedKnot-MLA artifacts, reuse prefills and the analytic ledger."""

from __future__ import annotations

import argparse
from pathlib import Path

from slacktier.errors import ErrorKind, SlackTierError

HELP = "RedKnot-MLA: build Local-head artifacts, run reuse prefills against full recompute, print the ledger"


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
    if cmd not in ("build", "run"):
        print("usage: slacktier redknot {build,run,ledger} ...  (see --help)")
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
