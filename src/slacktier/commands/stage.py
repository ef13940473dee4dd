"""`slacktier stage`: write a table's (layer, rank) regions onto files or raw block devices, O_DIRECT."""

from __future__ import annotations

import argparse
import time
from typing import TYPE_CHECKING

from slacktier.commands._args import finite, layer_item, whole
from slacktier.errors import ErrorKind, SlackTierError

if TYPE_CHECKING:
    from slacktier.tables.engram_hash import EngramLayout

HELP = "stage a table (safetensors checkpoint or seeded synthetic) onto files or block devices, O_DIRECT"


def _whole_number(text: str) -> int:
    """'1000000' or '1e6' -> 1000000; '1.5', 'nan', 'inf' and '' are refused (ValueError)."""
    try:
        return int(text)
    except ValueError:
        value = float(text)  # ValueError for non-numbers
        if not value.is_integer():  # nan, inf, 1.5
            raise ValueError(f"{text!r} is not a whole number") from None
        return int(value)


def parse_layer_rows(text: str) -> dict[int, int]:
    """'1=1000000,14=1000000' -> {1: 1000000, 14: 1000000} (the older '1:1000000' read with a warning); a layer
    listed twice or a non-number is refused."""
    out: dict[int, int] = {}
    fix = "write LAYER=ROWS,LAYER=ROWS with each layer once, e.g. 1=1000000,14=1000000"
    if not text.strip():
        raise SlackTierError(ErrorKind.BAD_INPUT, "--synthetic is empty", fix=fix)
    try:
        for item in text.split(","):
            layer, rows_text = layer_item(item, "--synthetic", "LAYER=ROWS,...")
            rows = _whole_number(rows_text)
            if layer in out:
                raise SlackTierError(ErrorKind.BAD_INPUT, f"layer {layer} is listed twice in {text!r}", fix=fix,
                                     layer=layer)
            if layer < 0 or rows <= 0:
                raise SlackTierError(ErrorKind.BAD_INPUT, f"layer {layer} with {rows} rows in {text!r}: layer ids "
                                     "are >= 0 and rows >= 1", fix=fix)
            out[layer] = rows
    except ValueError as exc:
        raise SlackTierError(ErrorKind.BAD_INPUT, f"cannot read layers {text!r}: {exc}", fix=fix) from exc
    return out


def parse_layers(text: str) -> list[int]:
    """'1,14' -> [1, 14]; anything but distinct non-negative integers is refused."""
    fix = "write checkpoint layer ids separated by commas, e.g. --layers 1,14"
    try:
        layers = [int(x) for x in text.split(",")]
    except ValueError as exc:
        raise SlackTierError(ErrorKind.BAD_INPUT, f"cannot read --layers {text!r}: {exc}", fix=fix) from exc
    if len(set(layers)) != len(layers) or min(layers) < 0 or max(layers) > 2**31 - 1:
        raise SlackTierError(ErrorKind.BAD_INPUT, f"--layers {text!r} lists a layer twice, a negative one or one "
                             "past 2147483647", fix=fix)
    return layers


def parse_ranks(text: str, ranks: int) -> list[int]:
    """'3' or '0,3' -> [3] / [0, 3], each below `ranks`; anything else is refused."""
    fix = f"write ranks below --ranks {ranks} separated by commas, e.g. --only-ranks 3"
    if not text.strip():   # an unset shell variable: refused, never read as "every rank"
        raise SlackTierError(ErrorKind.BAD_INPUT, f"--only-ranks {text!r} names no rank",
                             fix=fix + ", or leave the flag out to stage every rank")
    try:
        out = [int(x) for x in text.split(",")]
    except ValueError as exc:
        raise SlackTierError(ErrorKind.BAD_INPUT, f"cannot read --only-ranks {text!r}: {exc}", fix=fix) from exc
    if len(set(out)) != len(out) or min(out) < 0 or max(out) >= ranks:
        raise SlackTierError(ErrorKind.BAD_INPUT, f"--only-ranks {text!r} lists a rank twice or one outside "
                             f"0..{ranks - 1}", fix=fix)
    return out


def engram_layout(spec: str) -> EngramLayout:
    """'v41' -> DeepSeek-V4.1's EngramLayout; an integer >= 2 -> EngramLayout.scaled(that engram vocab size)."""
    from slacktier.tables.engram_hash import EngramLayout

    if spec.lower() == "v41":
        return EngramLayout.v41()
    fix = "pass v41 or an engram vocab size of at least 2, such as 100000"
    try:
        vocab = _whole_number(spec)
    except ValueError as exc:
        raise SlackTierError(ErrorKind.BAD_INPUT, f"cannot read --engram {spec!r}: {exc}", fix=fix) from exc
    if vocab < 2:
        raise SlackTierError(ErrorKind.BAD_INPUT, f"--engram {spec}: an engram vocab size must be at least 2",
                             fix=fix)
    return EngramLayout.scaled(vocab)


def checkpoint_layout(args: argparse.Namespace) -> EngramLayout | None:
    """The checkpoint's hash layout: --engram, --config, or the config.json beside it; None where there is none
    and one rank takes the whole table (its regions need no column bounds).

    The serving engines shard each layer by whole hash columns (tables.tp_sharding): a table staged for several
    ranks, or under another partition, without the layout's column bounds would hold no engine's shards, so it
    is refused before anything is written."""
    from slacktier.tables.stage import config_beside, is_ple_checkpoint, layout_from_model_config

    if is_ple_checkpoint(args.checkpoint):   # a PLE table's layout is its own config's (PleCheckpointSource)
        return None
    if args.engram:
        return engram_layout(args.engram)
    config = args.config or config_beside(args.checkpoint)
    if config is not None:
        return layout_from_model_config(config)
    if args.ranks > 1 or args.partition != "columns":
        raise SlackTierError(ErrorKind.BAD_INPUT, f"staging {args.checkpoint[0]} for {args.ranks} ranks "
                             f"(--partition {args.partition}) needs the model's hash-column bounds, which a "
                             "checkpoint's tensors do not hold, and there is no config.json beside it",
                             fix="pass --config MODEL/config.json (the model's own, with engram_* keys), or "
                                 "--engram v41 for DeepSeek-V4.1")
    return None


def add_arguments(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group()
    src.add_argument("--checkpoint", nargs="+", metavar="PATH",
                     help="safetensors file(s) or directory with layers.{L}.engram.embed.weight/.scale (DeepSeek "
                          "Engram), or a Qwen4Exp (Qwen3.8) model directory: its ...layers.{L}.ple.ple_embedding."
                          "ngram_embedding.shard_{I}.weight tables, head sizes from its config.json")
    src.add_argument("--synthetic", metavar="LAYER=ROWS,...",
                     help="a seeded synthetic table, e.g. 1=8000000,14=8000000")
    p.add_argument("--engram", metavar="VOCAB|v41",
                   help="a seeded synthetic table in an Engram layout (hash-column sharding): 'v41' for "
                        "DeepSeek-V4.1's (384M rows per layer), or an engram vocab size for a scaled one; with "
                        "--checkpoint, the checkpoint's hash layout (instead of its config.json)")
    p.add_argument("--config", metavar="CONFIG_JSON",
                   help="with --checkpoint: the model's config.json, whose engram_* keys give the hash-column "
                        "bounds the serving engines shard by (default: config.json in the checkpoint's directory)")
    p.add_argument("--layers", metavar="L,L", help="checkpoint layers to stage (default: every Engram or PLE layer "
                   "found; a PLE layer is its decoder layer, the N of model.layers.N.ple)")
    p.add_argument("--seed", type=whole("--seed", 0, 2**63 - 1), default=0, help="synthetic table seed (default 0)")
    p.add_argument("--target", action="append", required=True, metavar="PATH",
                   help="a file or raw block device; repeat for several (ranks map round-robin)")
    p.add_argument("--ranks", type=whole("--ranks", 1, 1 << 16), default=1,
                   help="tensor-parallel ranks: shards per layer (default 1)")
    p.add_argument("--only-ranks", metavar="R,R",
                   help="write only these ranks' shards (cut for --ranks ranks), as one rank's machine holds them; "
                        "e.g. --ranks 4 --only-ranks 3")
    p.add_argument("--partition", choices=("columns", "balanced"), default="columns",
                   help="which hash columns each rank's region holds: columns (the engines' own contiguous head "
                        "shards, default) or balanced (as many heads of each n-gram order per rank; serve it with "
                        'partition = "balanced" in each [[table]])')
    p.add_argument("--manifest", metavar="PATH", help="manifest path (default <first target>.manifest.json)")
    p.add_argument("--max-bytes", type=whole("--max-bytes", 1), metavar="N",
                   help="refuse if a file target would exceed N bytes")
    p.add_argument("--overwrite", action="store_true", help="replace a target that holds another table")
    p.add_argument("--chunk-mib", type=whole("--chunk-mib", 1, 1024), default=4, help="write chunk in MiB (default 4)")
    p.add_argument("--writers", type=whole("--writers", 1, 64), default=None,
                   help="O_DIRECT writes in flight, one writer thread each (default: the stager's, 4)")
    p.add_argument("--buffered", action="store_true",
                   help="write through the page cache instead of O_DIRECT (logged; for filesystems without O_DIRECT)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--pack-list", metavar="NPZ",
                   help="context packing: a pack list (workloads.packing.write_pack_list, chosen on the fit half of "
                        "the traffic); its contexts, in file order, get a packed region per (layer, rank) within "
                        "--pack-disk-gb and --pack-index-mb, each layer an equal share")
    p.add_argument("--pack-disk-gb", type=finite("--pack-disk-gb", 1e-6, 1e6), metavar="GB",
                   help="with --pack-list: extra disk per rank for packed pages, all layers together (GB = 1e9 B)")
    p.add_argument("--pack-index-mb", type=finite("--pack-index-mb", 1e-6, 1e6), metavar="MB",
                   help="with --pack-list: host memory per rank for the packing index, all layers together "
                        "(MB = 1e6 B); an index that cannot fit is refused")


def run(args: argparse.Namespace) -> int:
    from slacktier.tables.layout import PAGE_BYTES, binary_bytes
    from slacktier.tables.stage import stage_checkpoint, stage_synthetic

    if not (args.checkpoint or args.synthetic is not None or args.engram):
        raise SlackTierError(ErrorKind.BAD_INPUT, "nothing to stage", fix="pass --checkpoint, --synthetic or --engram")
    if args.engram and args.synthetic is not None:
        raise SlackTierError(ErrorKind.BAD_INPUT, "--engram and --synthetic both give a synthetic table's layers",
                             fix="pass one of them")
    if args.config and not args.checkpoint:
        raise SlackTierError(ErrorKind.BAD_INPUT, "--config gives a checkpoint's hash layout",
                             fix="pass it with --checkpoint (a synthetic Engram table: --engram VOCAB|v41)")
    if args.config and args.engram:
        raise SlackTierError(ErrorKind.BAD_INPUT, "--config and --engram both give the checkpoint's hash layout",
                             fix="pass one of them")
    if args.layers and not args.checkpoint:
        raise SlackTierError(ErrorKind.BAD_INPUT, "--layers picks checkpoint layers; a synthetic table takes its "
                             "layers from --synthetic or --engram", fix="drop --layers, or stage a --checkpoint")
    layers = parse_layers(args.layers) if args.layers else None
    common = dict(manifest_path=args.manifest, max_bytes=args.max_bytes, chunk_bytes=args.chunk_mib << 20,
                  buffered=args.buffered, progress=not args.no_progress)
    if args.writers is not None:
        common["writers"] = args.writers
    if args.only_ranks is not None:
        common["only_ranks"] = parse_ranks(args.only_ranks, args.ranks)
    common["partition"] = args.partition
    pack_flags = (args.pack_disk_gb, args.pack_index_mb)
    if args.pack_list is not None:
        if None in pack_flags:
            raise SlackTierError(ErrorKind.BAD_INPUT, "--pack-list needs its budgets",
                                 fix="pass --pack-disk-gb GB and --pack-index-mb MB (per rank) with --pack-list")
        from slacktier.tables.packing import PackRequest, read_pack_list

        common["pack"] = PackRequest(read_pack_list(args.pack_list), int(args.pack_disk_gb * 1e9),
                                     int(args.pack_index_mb * 1e6))
    elif pack_flags != (None, None):
        raise SlackTierError(ErrorKind.BAD_INPUT, "--pack-disk-gb and --pack-index-mb budget a --pack-list",
                             fix="pass --pack-list NPZ too, or drop the budgets")
    t0 = time.perf_counter()
    if args.synthetic is not None:
        m = stage_synthetic(args.target, parse_layer_rows(args.synthetic), args.ranks, args.seed,
                            overwrite=args.overwrite, **common)
    elif not args.checkpoint:
        layout = engram_layout(args.engram)
        m = stage_synthetic(args.target, layout, args.ranks, args.seed, overwrite=args.overwrite,
                            heads_per_order=layout.n_heads, **common)
    else:
        layout = checkpoint_layout(args)
        if layout is not None:
            common["heads_per_order"] = layout.n_heads
        m = stage_checkpoint(args.checkpoint, args.target, args.ranks, layers=layers, overwrite=args.overwrite,
                             expected=layout, **common)
    dt = time.perf_counter() - t0
    nbytes = m.total_pages * PAGE_BYTES
    print(f"staged {len(m.regions)} regions ({sum(r.rows for r in m.regions)} rows, {m.total_pages} pages, "
          f"{binary_bytes(nbytes)}) in {dt:.1f} s ({binary_bytes(nbytes / dt)}/s)")
    if m.packing is not None:
        pk = m.packing
        per_layer = ", ".join(f"layer {k}: {n}" for k, n in sorted(pk.contexts.items()))
        print(f"packed {sum(pk.contexts.values())} contexts ({per_layer}): {binary_bytes(pk.disk_bytes_per_rank)} "
              f"extra disk and a {binary_bytes(pk.index_bytes_per_rank)} index per rank")
    print(f"source {m.source_digest}")
    print(f"manifest {m.path}")
    return 0
