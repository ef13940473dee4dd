"""`slacktier plan`: windows + tier read-time models + miss-page curves + a cache budget -> an engine control file."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import msgspec

from slacktier.commands._args import MAX_MS, finite, finite_number, layer_item, whole
from slacktier.config import DiskOptions, int_range
from slacktier.errors import ErrorKind, SlackTierError

HELP = ("place each table on the tier cheapest in host memory whose predicted stall fits the target, split the "
        "cache, and write the engine control file")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of the plan verb."""
    p.add_argument("--table", action="append", required=True, metavar="LAYER=MANIFEST[:ROWS]",
                   help="a table to place (repeat per table), e.g. 1=runs/t.bin.manifest.json; ROWS defaults to "
                        "the layer's rows in the manifest")
    add_window_arguments(p)
    p.add_argument("--tiers", type=Path, required=True,
                   help="tiers TOML: one [[tier]] per device queue with its read-time model (plan.tiers; "
                        "`slacktier probe --read-fit` writes it)")
    p.add_argument("--curves", type=Path, required=True, help="miss-page curves JSON from `slacktier characterize`")
    p.add_argument("--cache-rows", type=whole("--cache-rows"), required=True, help="the cache budget C in rows")
    p.add_argument("--target-ms", type=finite("--target-ms"), required=True,
                   help="largest acceptable predicted slowdown per step")
    p.add_argument("--kappa-ms", type=finite("--kappa-ms", -MAX_MS), default=0.0, help="fixed per-step cost of the tiered path")
    p.add_argument("--resolve-ms", type=finite("--resolve-ms", -MAX_MS), default=0.0,
                   help="CPU time to resolve a step's indices (s)")
    p.add_argument("--grid", type=whole("--grid", 1, 100_000), default=200,
                   help="cache split grid (shares in steps of 1/grid)")
    p.add_argument("--refine", type=whole("--refine", 1, 100_000), default=20, help="refinement of the split grid")
    p.add_argument("--device", default="cpu", help="[engine] device")
    p.add_argument("--io-threads", type=whole("--io-threads", *int_range(DiskOptions, "io_threads")), default=1,
                   help="[table.disk] io_threads (workers per device)")
    p.add_argument("--queue-depth", type=whole("--queue-depth", *int_range(DiskOptions, "queue_depth")), default=128,
                   help="[table.disk] queue_depth (reads in flight)")
    p.add_argument("--disk-engine", default="auto", choices=("auto", "io_uring", "threads"),
                   help="[table.disk] engine")
    p.add_argument("--verify-reads", action="store_true", help="[engine] verify_reads = true")
    p.add_argument("--lossy", action="store_true", help="[engine] lossy = true")
    p.add_argument("--out", type=Path, default=Path("runs/plan/control.toml"), help="the control file to write")
    p.add_argument("--json", type=Path, default=None, help="also write the plan with its predictions as JSON")
    p.add_argument("--plot", type=Path, default=None,
                   help="the PNG of predicted stall against cache size (default: plan.png beside --out)")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG")


def _parse_tables(specs: list[str]) -> list[tuple[int, str, int | None]]:
    out = []
    for s in specs:
        layer, rest = layer_item(s, "--table", "LAYER=MANIFEST[:ROWS]")
        manifest, sep, rows = rest.rpartition(":")
        if not sep or not rows.strip().isdigit():   # no :ROWS (a path may hold ':' itself)
            manifest, rows = rest, ""
        if not manifest:
            raise SlackTierError(ErrorKind.BAD_INPUT, f"--table {s!r} names no manifest",
                                 fix="write --table LAYER=MANIFEST[:ROWS], e.g. 1=runs/t.bin.manifest.json")
        out.append((layer, manifest, int(rows) if rows else None))
    return out


def _rows_from_manifest(path: str, layer: int) -> int:
    from slacktier.tables.manifest import Manifest

    m = Manifest.load(path)
    if layer not in m.layout.rows:
        raise SlackTierError(ErrorKind.MISSING, f"manifest {path} has no layer {layer}", layer=layer,
                             fix="point the table at the manifest that holds its layer, or give :ROWS")
    return int(m.layout.rows[layer])


def _in_memory(path: str, layer: int) -> tuple[int, list[str]]:
    """Bytes of `layer`'s regions in the manifest at `path` whose target sits in host memory, and where."""
    from slacktier.tables.manifest import Manifest
    from slacktier.tables.memfs import ram_backed

    m = Manifest.load(path)
    where = {target: ram_backed(target) for target in m.targets}
    mine = [r for r in m.regions if r.layer == layer and where[r.path]]
    return sum(r.nbytes for r in mine), sorted({where[r.path] for r in mine})


def _packing(path: str, layer: int) -> tuple[int, int]:
    """(extra disk bytes, index host bytes) per rank of `layer`'s context packing in the manifest at `path`
    (tables.packing); (0, 0) where the layer is not packed."""
    from slacktier.tables.manifest import Manifest
    from slacktier.tables.packing import index_bytes

    pk = Manifest.load(path).packing
    if pk is None or layer not in pk.contexts:
        return 0, 0
    n = pk.contexts[layer]
    return n * pk.pages_per_context * 4096, index_bytes(n)


def windows_from_probe_json(path: Path, batch: int | None, step_ms: float | None) -> dict[int, float]:
    """Windows (ms) per decoder layer from a probe JSON, optionally rescaled to another step time."""
    try:
        sweeps = json.loads(path.read_bytes().decode("utf-8"))["sweeps"]
    except FileNotFoundError:
        raise SlackTierError(ErrorKind.MISSING, f"probe JSON {path} does not exist",
                             fix="run `slacktier probe` first, or pass --window LAYER=MS") from None
    except OSError as exc:
        raise SlackTierError(ErrorKind.BAD_INPUT, f"cannot read probe JSON {path}: {exc.strerror}",
                             fix="pass the JSON `slacktier probe` wrote") from None
    except UnicodeDecodeError:
        raise SlackTierError(ErrorKind.BAD_INPUT, f"{path} is not a probe JSON: not UTF-8 text",
                             fix="pass the JSON `slacktier probe` wrote") from None
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise SlackTierError(ErrorKind.BAD_INPUT, f"{path} is not a probe JSON: {exc!r}",
                             fix="pass the JSON `slacktier probe` wrote") from None
    try:
        chosen = next((s for s in sweeps if batch is None or s["batch"] == batch), None)
        if chosen is None:
            raise SlackTierError(ErrorKind.MISSING, f"no sweep at batch {batch} in {path}",
                                 fix=f"use one of {[s['batch'] for s in sweeps]}")
        out = {}
        for lw in chosen["layers"]:
            if lw.get("below_noise_floor") or (lw["window_ms"] is not None and lw["window_ms"] < 0):
                out[int(lw["layer"])] = 0.0   # under the probe's noise floor: no window a plan may count on
                continue
            if lw["window_ms"] is None:
                continue
            out[int(lw["layer"])] = float(lw["window_frac"] * step_ms if step_ms else lw["window_ms"])
    except (KeyError, TypeError, ValueError) as exc:
        raise SlackTierError(ErrorKind.BAD_INPUT, f"{path} is not a probe JSON: {exc!r}",
                             fix="pass the JSON `slacktier probe` wrote") from exc
    return out


def add_window_arguments(p) -> None:
    """--window / --windows-json / --windows-batch / --step-ms, as `windows_from_args` reads them (plan, inspect,
    redknot plan); `p` is a parser or an argument group."""
    p.add_argument("--window", action="append", default=[], metavar="LAYER=MS",
                   help="the window of a table's layer in ms (repeat per table), e.g. 1=0.27")
    p.add_argument("--windows-json", type=Path, default=None,
                   help="windows from `slacktier probe` JSON instead (decoder layer index = table layer; a window "
                        "under the probe's noise floor counts as 0 ms)")
    p.add_argument("--windows-batch", type=whole("--windows-batch", 1), default=None,
                   help="which batch of the probe JSON (default: first)")
    p.add_argument("--step-ms", type=finite("--step-ms"), default=None,
                   help="scale the probe's windows (as fractions of its step) to this step time")


def windows_from_args(args: argparse.Namespace, layers=None) -> dict[int, float]:
    """Windows (ms) per layer from --windows-json and --window (the latter wins); shared with `inspect`.

    `layers`: the layers that hold a table; only theirs are checked (a probe JSON's other layers are ignored).
    """
    windows: dict[int, float] = {}
    if args.windows_json:
        windows.update(windows_from_probe_json(args.windows_json, args.windows_batch, args.step_ms))
    for w in args.window:
        try:
            layer_text, ms = w.split("=")
            layer = int(layer_text)
        except ValueError as exc:
            raise SlackTierError(ErrorKind.BAD_INPUT, f"--window {w!r}", fix="use LAYER=MS, e.g. 14=9.35") from exc
        windows[whole("--window LAYER", 0, 2**31 - 1)(layer_text)] = finite_number(ms, f"--window {layer}=MS")
    for layer, ms in windows.items():   # the probe JSON's too: a window is a finite time
        if layers is None or layer in layers:
            finite_number(str(ms), f"the window of layer {layer} (ms)")
    return windows if layers is None else {layer: ms for layer, ms in windows.items() if layer in layers}


def run(args: argparse.Namespace) -> int:
    """Plan, print the placement and write the control file (and the plan as JSON if asked)."""
    from slacktier.config import EngineConfig, write_control
    from slacktier.plan import TableDemand, control_file, format_plan, load_miss_curves, load_tiers, make_plan, \
        plan_comment, plan_to_dict
    from slacktier.tables.manifest import Manifest

    specs = _parse_tables(args.table)
    windows = windows_from_args(args, {layer for layer, _, _ in specs})
    tiers, loaded = load_tiers(args.tiers), load_miss_curves(args.curves)   # bad inputs before manifests
    curves = loaded.by_layer
    tables = []
    for layer, manifest, rows in specs:
        if layer not in windows:
            raise SlackTierError(ErrorKind.MISSING, f"no window for layer {layer}", layer=layer,
                                 fix="pass --window LAYER=MS or a probe JSON that measured this layer")
        in_memory_bytes, in_memory = _in_memory(manifest, layer)
        if in_memory:
            print(f"layer {layer}: {in_memory_bytes / 2**20:,.1f} MiB of its staged files sit in host memory "
                  f"({', '.join(in_memory)}), counted as host memory on every tier")
        packed_disk, index_bytes = _packing(manifest, layer)
        if index_bytes:   # every serving process of the layer holds the index, whatever its tier
            in_memory_bytes += index_bytes
            print(f"layer {layer}: context packing takes {packed_disk / 2**20:,.1f} MiB extra disk and a "
                  f"{index_bytes / 2**20:,.2f} MiB index in host memory per rank (counted in its host memory)")
        tables.append(TableDemand(layer=layer, rows=rows if rows is not None else _rows_from_manifest(manifest, layer),
                                  manifest=manifest, window_ms=windows[layer], in_memory_bytes=in_memory_bytes))
    engine = EngineConfig(device=args.device, verify_reads=args.verify_reads, lossy=args.lossy)
    disk = DiskOptions(engine=args.disk_engine, queue_depth=args.queue_depth, io_threads=args.io_threads)
    plan = make_plan(tables, tiers, curves, args.cache_rows, args.target_ms, resolve_ms=args.resolve_ms,
                     kappa_ms=args.kappa_ms, grid=args.grid, refine=args.refine)
    print(format_plan(plan))
    print(f"miss-page curves: {args.curves}: {loaded.describe()}")
    # The engine opens what plan writes: each table served with the rank partition its manifest was staged
    # with, checked as the engine checks at open (one function), validated by the schema as it is written.
    cfg = control_file(plan, engine, (disk,))
    from slacktier.engine.build import resolve_control   # the engine's own room (torch): once the inputs are read

    try:
        cfg = msgspec.structs.replace(cfg, tables=tuple(
            msgspec.structs.replace(t, partition=Manifest.load(t.manifest).partition_kind) for t in cfg.tables))
        resolve_control(cfg)
    except SlackTierError as exc:
        raise SlackTierError(exc.kind, f"{args.out} not written, the engine would refuse it: {exc.message}",
                             fix=f"{exc.fix} (the --table flags name the manifests)", layer=exc.layer) from None
    write_control(cfg, args.out, comment=plan_comment(plan))
    print(f"wrote {args.out}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        doc = plan_to_dict(plan) | {"miss_curves": {"path": str(args.curves), "described": loaded.describe(),
                                                    "admission": loaded.admission, "packing": loaded.packing}}
        args.json.write_text(json.dumps(doc, indent=1))
        print(f"wrote {args.json}")
    import importlib.util

    if not args.no_plot and importlib.util.find_spec("matplotlib") is None:
        # plan works on the base install; its plot is the one part that needs an extra, so it is said, not refused
        print("no plot: matplotlib is not installed (pip install 'slacktier[workloads]', or pass --no-plot)")
    elif not args.no_plot:
        from slacktier.plan.planner import stall_by_cache
        from slacktier.plan.report import plot_plan

        # the planned budget from none to 4x, a geometric grid (a budget of 0 included: the tables uncached)
        budgets = sorted({0, *(int(round(args.cache_rows * f)) for f in (1 / 16, 1 / 8, 1 / 4, 1 / 2, 1, 2, 4))})
        points = stall_by_cache(plan, tables, tiers, curves, budgets, grid=args.grid, refine=args.refine)
        others = {f"every table on {t.name}": stall_by_cache(plan, tables, tiers, curves, budgets, grid=args.grid,
                                                             refine=args.refine, source=t.name)
                  for t in tiers if not t.holds_table and {p.source for p in plan.tables} != {t.name}}
        print(f"wrote {plot_plan(plan, points, args.plot or args.out.with_name('plan.png'), others)}")
    return 0
