"""`slacktier whatif`: a placement's decode cost on emulated devices (slacktier.whatif)."""

from __future__ import annotations

import argparse

from slacktier.commands._args import finite, finite_number, whole
from slacktier.config import ADMISSION_RULES, tier_facts
from slacktier.errors import ErrorKind, SlackTierError

HELP = ("what-if: run the step timeline for every TP rank with tables on emulated devices (nvme-paper, rdma-paper, "
        "this-disk or a TOML model) and print the Table 2-shaped result beside Eq. 1's prediction")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of the whatif verb."""
    p.add_argument("--profile", default="v41_paper", help="device compute profile (default v41_paper)")
    p.add_argument("--workload", default="chat", choices=("chat", "agent"), help="built-in traffic (default chat)")
    p.add_argument("--batch", type=whole("--batch", 1, 4096), default=32, help="B, sessions per step (default 32)")
    p.add_argument("--ranks", type=whole("--ranks", 1, 24), default=4, help="TP ranks (default 4)")
    p.add_argument("--model", default="nvme-paper",
                   help="device model of every emulated table: nvme-paper, rdma-paper, this-disk, or a TOML file "
                        "(default nvme-paper)")
    p.add_argument("--table", action="append", default=[], metavar="LAYER=MODEL",
                   help="put LAYER on an emulated device with MODEL (repeatable); with none of --table/--real/"
                        "--dram, Table 2's six placements run")
    p.add_argument("--real", action="append", default=[], metavar="LAYER",
                   help="put LAYER on this machine's disk (one rank only)")
    p.add_argument("--dram", action="append", default=[], metavar="LAYER", help="keep LAYER in host DRAM")
    p.add_argument("--disks", default="shared", choices=("shared", "per-rank"),
                   help="ranks to emulated disks: one shared disk (the paper's '1 disk') or one per rank ('4 disks')")
    p.add_argument("--cache-rows", type=whole("--cache-rows", 0, 2**31 - 1), default=0,
                   help="row cache per rank (default 0)")
    p.add_argument("--share", action="append", default=[], metavar="LAYER=F",
                   help="share of the cache for LAYER (repeatable)")
    p.add_argument("--vocab", type=whole("--vocab", 1000, 16_000_000), default=50_000,
                   help="staged table's rows per hash head (V4.1: 16M; default 50000)")
    p.add_argument("--steps", type=whole("--steps", 1, 100_000), default=16, help="timed TP steps per run")
    p.add_argument("--runs", type=whole("--runs", 1, 100), default=3,
                   help="runs per placement, shuffled (default 3: the verdict needs a spread to say which "
                        "placements cannot be told apart)")
    p.add_argument("--max-session-tokens", type=whole("--max-session-tokens", 16), default=1024,
                   help="sessions clipped to this many tokens (default 1024)")
    p.add_argument("--this-disk", default="", metavar="TIERS",
                   help="tiers file with this disk's read fit (slacktier probe --read-fit), for model this-disk")
    p.add_argument("--host-pass-ms", type=finite("--host-pass-ms", 0.0, 1000.0), default=None,
                   metavar="MS", help="state the host pass s of your host (ms per rank) instead of measuring this "
                   "machine's begin_step; the report's first line says so (default: measured)")
    p.add_argument("--pack-list", default="", metavar="NPZ",
                   help="context packing: stage the table with this pack list's packed regions (a list made for "
                        "the same --vocab table, chosen on the fit half of the traffic)")
    p.add_argument("--pack-disk-gb", type=finite("--pack-disk-gb", 1e-6, 1e6), default=1.0,
                   help="with --pack-list: extra disk per rank for packed pages (default 1.0)")
    p.add_argument("--pack-index-mb", type=finite("--pack-index-mb", 1e-6, 1e6), default=64.0,
                   help="with --pack-list: host memory per rank for the packing index (default 64.0)")
    p.add_argument("--admission", default="off", choices=ADMISSION_RULES,
                   help="the ranks' cache admission rule, as the control file's [engine] admission (default off); "
                        "prefill chunks are flagged as prefill, decode steps as decode")
    p.add_argument("--out", default="runs/whatif", help="working directory (default runs/whatif)")
    p.add_argument("--plot", default=None, help="the PNG of each placement's stall (default: whatif.png in --out)")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG")


def _pairs(items: list[str], flag: str, value) -> dict[int, object]:
    out: dict[int, object] = {}
    for item in items:
        layer, sep, v = item.partition("=")
        if not sep or not layer.strip().isdigit():
            raise SlackTierError(ErrorKind.BAD_INPUT, f"{flag} {item!r}", fix=f"write {flag} LAYER=VALUE")
        if int(layer) in out:
            raise SlackTierError(ErrorKind.BAD_INPUT, f"{flag} names layer {layer} twice", fix="name it once")
        out[int(layer)] = value(v, flag)
    return out


def _layers(items: list[str], flag: str) -> list[int]:
    if any(not x.strip().isdigit() for x in items):
        raise SlackTierError(ErrorKind.BAD_INPUT, f"{flag} {items}", fix=f"write {flag} LAYER")
    return [int(x) for x in items]


def placements_from_args(args: argparse.Namespace) -> list:
    """The placements the flags ask for (refusing one table on two devices, by layer)."""
    from slacktier.plan.placement import Placement
    from slacktier.whatif.run import table2_placements

    emulated = _pairs(args.table, "--table", lambda v, f: v.strip())
    shares = _pairs(args.share, "--share", lambda v, f: finite_number(v, f"{f} share", 0.0, 1.0))
    real, dram = _layers(args.real, "--real"), _layers(args.dram, "--dram")
    if not (emulated or real or dram):
        if shares or args.cache_rows:
            raise SlackTierError(ErrorKind.BAD_INPUT, "--cache-rows/--share without a placement",
                                 fix="place the tables with --table/--real/--dram, or drop them for Table 2's rows")
        return table2_placements(args.model)
    seen: dict[int, str] = {}
    tiers = []
    for layers, tier in ((list(emulated), "emulated"), (real, "disk"), (dram, "dram")):
        for layer in layers:
            if layer in seen:
                raise SlackTierError(ErrorKind.BAD_INPUT, f"layer {layer} placed on {seen[layer]} and on {tier}",
                                     fix="place each table on one device: emulated (--table), this disk (--real) "
                                         "or DRAM (--dram)", layer=layer)
            seen[layer] = tier
            tiers.append((layer, tier))
    name = ", ".join(f"L{l} {t if tier_facts(t).device_kind != 'model' else emulated[l]}" for l, t in sorted(tiers))
    return [Placement(name, tuple(sorted(tiers)), models=tuple(sorted(emulated.items())), cache_rows=args.cache_rows,
                      shares=tuple(sorted(shares.items())), disks=args.disks)]


def run(args: argparse.Namespace) -> int:
    """Check every argument, then stage (or reuse) the table, run, and print the report."""
    from slacktier.whatif.report import report
    from slacktier.whatif.run import WhatIfConfig, run_whatif

    placements = placements_from_args(args)
    cfg = WhatIfConfig(workdir=args.out, profile=args.profile, workload=args.workload, batch=args.batch,
                       ranks=args.ranks, engram_vocab=args.vocab, decode_steps=args.steps,
                       max_session_tokens=args.max_session_tokens, this_disk=args.this_disk,
                       host_pass_ms=args.host_pass_ms, pack_list=args.pack_list,
                       pack_disk_gb=args.pack_disk_gb, pack_index_mb=args.pack_index_mb,
                       admission=args.admission)
    profile, runs = run_whatif(cfg, placements, runs=args.runs, progress=True)
    print(report(cfg, profile, runs))
    import importlib.util
    from pathlib import Path

    if not args.no_plot and importlib.util.find_spec("matplotlib") is None:
        # whatif works on the base install; its plot is the one part that needs an extra: said, not refused
        print("no plot: matplotlib is not installed (pip install 'slacktier[workloads]', or pass --no-plot)")
    elif not args.no_plot:
        from slacktier.whatif.report import plot_whatif

        print(f"wrote {plot_whatif(cfg, runs, args.plot or Path(args.out) / 'whatif.png')}")
    return 0
