"""`slacktier inspect`: what a manifest and/or a control file hold, in human terms (or JSON with --json).

A manifest (`*.json`): per table layer its rows, hash columns, ranks and regions
(rows, target device, pages, bytes). A control file (`*.toml`): per table its
tier, devices and rank, its cache slots (the split of cache_rows by cache_share,
as the engine makes it) and the host memory each placement takes: the table's
pages for a DRAM-tier table, nothing for disk and Redis; plus the engine's page
buffer pool and, on a CPU device, its row cache. `--tp N` says which serving
engine's TP N sharding (SGLang's, vLLM's: tables.tp_sharding) a manifest's rank
regions are, and refuses one that is neither.

With windows (`--window LAYER=MS` or a probe JSON), read-time models
(`--tiers`, a tiers file as `slacktier probe --read-fit` writes it) and miss-page
curves (`--curves`), as `slacktier plan` takes them, it also prints the planner's
predicted slowdown of the control file's placement as stated: each table on its
tier, behind the control file's cache split, submitted in its `order` (nothing
is re-optimised; plan.predict_fixed_placement, the device read model of
plan.readmodel), with each tier's read model and the planner's host memory per
placement.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Any

from slacktier.commands._args import MAX_MS, finite, whole
from slacktier.commands.plan import add_window_arguments

HELP = "describe a staged table's manifest and/or an engine control file: rows, ranks, regions, tiers, cache, memory"


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of the inspect verb."""
    p.add_argument("paths", nargs="+", metavar="PATH",
                   help="a manifest (.json), a control file (.toml), or one of each")
    p.add_argument("--tp", type=whole("--tp", 1, 1 << 16), default=0,
                   help="say which engine's sharding at this TP size (SGLang's, vLLM's) the rank regions are")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    pred = p.add_argument_group("predicted slowdown of the control file's placement (as `slacktier plan` takes)")
    add_window_arguments(pred)
    pred.add_argument("--tiers", type=Path, default=None,
                      help="tiers TOML: one [[tier]] per device queue with its read-time model (plan.tiers; "
                           "`slacktier probe --read-fit` writes it)")
    pred.add_argument("--curves", type=Path, default=None, help="miss-page curves JSON from `slacktier characterize`")
    pred.add_argument("--kappa-ms", type=finite("--kappa-ms", -MAX_MS), default=0.0,
                      help="fixed per-step cost of the tiered path")
    pred.add_argument("--resolve-ms", type=finite("--resolve-ms", -MAX_MS), default=0.0,
                      help="CPU time to resolve a step's indices (s)")


def manifest_report(path: str | Path, tp: int = 0) -> dict[str, Any]:
    """Per layer: rows, columns, ranks and regions of the manifest at `path` (checked at TP `tp` when > 0)."""
    from slacktier.errors import ErrorKind, SlackTierError
    from slacktier.tables.manifest import Manifest, check_tp_sharding
    from slacktier.tables.memfs import ram_backed
    from slacktier.tables.tp_sharding import manifest_fits

    m = Manifest.load(path)
    fits = manifest_fits(m, tp) if tp else []
    if fits and not any(f.fits for f in fits):
        check_tp_sharding(m, tp)   # its refusal names the rank count, the bounds or the rank's region
        raise SlackTierError(ErrorKind.BAD_INPUT, f"{m.path}: no serving engine's TP {tp} sharding: "
                             + "; ".join(f"{f.engine}: {f.why}" for f in fits),
                             fix=f"stage the table again with --ranks {tp} and the model's hash layout")
    layers = []
    for layer in m.layout.layer_ids:
        bounds = m.layout.column_bounds.get(layer)
        n_cols = len(bounds) - 1 if bounds else 0
        owned = (m.partition.columns if m.partition is not None else
                 [range(k * n_cols // m.ranks, (k + 1) * n_cols // m.ranks) for k in range(m.ranks)]
                 if n_cols and n_cols % m.ranks == 0 else None)
        regions = [{"rank": r.rank, "row_start": r.row_start, "rows": r.rows, "device": r.device,
                    "target": m.targets[r.device], "pages": r.pages, "bytes": r.nbytes,
                    "columns": list(owned[r.rank]) if owned is not None else None,
                    "spans": [[s.start, s.rows] for s in m.spans(layer, r.rank)]}
                   for r in sorted((r for r in m.regions if r.layer == layer), key=lambda r: r.rank)]
        layers.append({"layer": layer, "rows": m.layout.rows[layer],
                       "columns": len(bounds) - 1 if bounds else None, "ranks": m.ranks, "regions": regions,
                       "bytes": sum(r["bytes"] for r in regions)})
    return {"manifest": str(m.path or path), "ranks": m.ranks, "partition": m.partition_kind,
            "targets": list(m.targets), "targets_in_memory": [ram_backed(target) for target in m.targets],
            "source": m.source.get("kind", ""), "stage_id": m.stage_id, "tp_checked": tp or None,
            "sharding": m.sharding_rule, "tp_fits": [{"engine": f.engine, "fits": f.fits, "why": f.why} for f in fits],
            "layers": layers, "packing": _packing_report(m)}


def _packing_report(m: Any) -> dict[str, Any] | None:
    """Context packing's record (tables.packing): contexts, extra disk and index host memory per rank, budgets."""
    pk = m.packing
    if pk is None:
        return None
    meta = pk.pack_list.get("meta", {})
    return {"contexts": {str(k): v for k, v in sorted(pk.contexts.items())}, "pages_per_context": pk.pages_per_context,
            "disk_bytes_per_rank": pk.disk_bytes_per_rank, "index_bytes_per_rank": pk.index_bytes_per_rank,
            "budget_disk_bytes_per_rank": pk.budget_disk_bytes, "budget_index_bytes_per_rank": pk.budget_index_bytes,
            "pack_list": pk.pack_list.get("file", ""), "workload": meta.get("workload"), "split": meta.get("split")}


def control_report(path: str | Path, tp: int = 0) -> dict[str, Any]:
    """Per table: tier, devices, rank, cache slots and host bytes of the control file at `path`."""
    from slacktier.cache.rowcache import split_slots
    from slacktier.config import load_control, named_by, tier_facts
    from slacktier.cache.directory import SKETCHED
    from slacktier.cache.kernels import sketch_bytes
    from slacktier.cache.rowdir import entries_for
    from slacktier.engine.build import resolve_control
    from slacktier.store.registry import get_tier
    from slacktier.tables.layout import PAGE_BYTES, ROW_BYTES
    from slacktier.tables.manifest import check_tp_sharding
    from slacktier.tables.memfs import ram_backed

    cfg = load_control(path)
    with named_by(path):
        resolved = resolve_control(cfg)   # the checks the engine runs at open, the same function
        if tp:
            for t in cfg.tables:
                check_tp_sharding(resolved[t.layer].manifest, tp, [t.layer])
    eng = cfg.engine
    slots = split_slots(eng.cache_rows, {t.layer: t.cache_share for t in cfg.tables})
    tables = []
    for t in cfg.tables:
        res = resolved[t.layer]
        mine = res.regions   # the table's (or its rank's) regions, target overrides applied
        table_bytes = sum(r.nbytes for r in mine)
        # context packing: the packed regions this table reads (disk, or host memory on a DRAM tier) and the
        # index every serving process holds in host memory
        packed_bytes = sum(r.nbytes for r in res.packing.regions) if res.packing is not None else 0
        index_bytes = res.packing.index_bytes if res.packing is not None else 0
        facts = tier_facts(t.source)
        # staged files in RAM (tmpfs, a RAM disk) are host memory whichever local tier reads them
        in_memory = {r.path: ram_backed(r.path) for r in mine} if facts.device_kind == "file" or \
            facts.holds_host_copy else {}
        in_memory_bytes = sum(r.nbytes for r in mine if in_memory.get(r.path))
        directory = 8 * entries_for(slots.get(t.layer, 0))   # cache.rowdir, sized to the layer's cache rows
        # the admission rule's frequency sketch (cache.kernels.new_sketch), one byte a counter
        sketch = sketch_bytes(slots.get(t.layer, 0)) if eng.admission in SKETCHED else 0
        # what this host would read the table through (the disk tier's engine choice, made again at open)
        choice = getattr(get_tier(t.source).source_cls, "engine_choice", None)
        engine = None
        if choice is not None:
            asked = getattr(t.options, "engine", "auto")
            name, why, reads_with = choice(asked)
            engine = {"asked": asked, "engine": name, "reads_with": reads_with, "io_uring_missing": why}
        tables.append({
            "layer": t.layer, "order": t.order, "tier": t.source, "rank": t.rank if t.rank >= 0 else "all",
            "engine_here": engine,
            "manifest": t.manifest, "rows": sum(r.rows for r in mine),
            "devices": sorted({r.path for r in mine}) if tier_facts(t.source).device_kind == "file" else
            [getattr(t.options, "url", t.source)],
            "cache_share": t.cache_share, "cache_rows": slots.get(t.layer, 0),
            "table_bytes": table_bytes, "directory_bytes": directory, "sketch_bytes": sketch,
            "in_memory": sorted({what for what in in_memory.values() if what}), "in_memory_bytes": in_memory_bytes,
            "packed_bytes": packed_bytes, "packed_in_host": facts.holds_host_copy, "index_bytes": index_bytes,
            "host_bytes": (table_bytes + packed_bytes if facts.holds_host_copy else 0) + in_memory_bytes + directory
            + sketch + index_bytes,
        })
    # The engine's page buffer pool: one 4 KiB buffer per lookup of a full step, every layer (StepEngine).
    pool_bytes = eng.max_tokens * 24 * len(cfg.tables) * PAGE_BYTES
    cache_bytes = eng.max_cache_rows * ROW_BYTES
    host_total = sum(t["host_bytes"] for t in tables) + pool_bytes + (cache_bytes if eng.device == "cpu" else 0)
    return {"control": str(path), "device": eng.device, "cache_rows": eng.cache_rows,
            "max_cache_rows": eng.max_cache_rows, "cache_bytes": cache_bytes, "page_pool_bytes": pool_bytes,
            "pad_id": eng.pad_id, "owned_only": eng.owned_only, "metrics": eng.metrics, "admission": eng.admission,
            "host_bytes": host_total, "tables": tables}


def prediction_report(control: dict[str, Any], windows_ms: dict[int, float], tiers_path: str | Path,
                      curves_path: str | Path, tiers: list, curves: Any, *, kappa_ms: float = 0.0,
                      resolve_ms: float = 0.0) -> dict[str, Any]:
    """The planner's prediction for the placement of a `control_report`: its tiers, its cache split, its order.

    tiers, curves: what `plan.load_tiers` and `plan.load_miss_curves` read from those two paths."""
    from slacktier.errors import ErrorKind, SlackTierError
    from slacktier.plan import TableDemand, plan_to_dict, predict_fixed_placement

    tables = control["tables"]
    missing = [t["layer"] for t in tables if t["layer"] not in windows_ms]
    if missing:
        raise SlackTierError(ErrorKind.MISSING, f"no window for layer(s) {missing}", layer=missing[0],
                             fix="pass --window LAYER=MS per table, or a probe JSON that measured these layers")
    demands = [TableDemand(layer=t["layer"], rows=t["rows"], manifest=t["manifest"], window_ms=windows_ms[t["layer"]],
                           in_memory_bytes=t["in_memory_bytes"]) for t in tables]
    plan = predict_fixed_placement(demands, {t["layer"]: t["tier"] for t in tables},
                                   {t["layer"]: t["cache_share"] for t in tables}, tiers,
                                   curves.by_layer, control["cache_rows"],
                                   order={t["layer"]: t["order"] for t in tables}, resolve_ms=resolve_ms,
                                   kappa_ms=kappa_ms)
    doc = plan_to_dict(plan)
    for key in ("target_ms", "assignments_tried", "assignments_feasible"):   # a fixed placement: no search
        doc.pop(key)
    used = {t["tier"] for t in tables}
    models = {t.name: {**dataclasses.asdict(t.read), "fit": dataclasses.asdict(t.fit) if t.fit else None}
              for t in tiers if t.name in used}
    return {"tiers": str(tiers_path), "curves": str(curves_path), "read_models": models, **doc}


def _windows(args: argparse.Namespace) -> dict[int, float]:
    """Windows (ms) per layer, from the same flags `slacktier plan` takes."""
    from slacktier.commands.plan import windows_from_args

    return windows_from_args(args)


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"


def lines(report: dict[str, Any]) -> list[str]:
    """The report as text a person reads."""
    from slacktier.tables.partition import columns_text

    out: list[str] = []
    m = report.get("manifest_report")
    if m:
        out.append(f"manifest {m['manifest']}: {len(m['layers'])} layers, {m['ranks']} ranks, "
                   f"{len(m['targets'])} targets, source {m['source']}, rank partition {m['partition']}")
        if m["tp_checked"]:
            if all(f["fits"] for f in m["tp_fits"]):
                out.append(f"  rank regions match TP {m['tp_checked']} head sharding ({m['sharding']} regions, "
                           f"{m['partition']} partition)")
            for f in m["tp_fits"]:
                verdict = "fits" if f["fits"] else "does not fit"
                out.append(f"  TP {m['tp_checked']}: {verdict} {f['engine']}'s sharding: {f['why']}")
        for d, (target, in_memory) in enumerate(zip(m["targets"], m["targets_in_memory"])):
            out.append(f"  device {d}: {target}" + (f" (in host memory: {in_memory})" if in_memory else ""))
        for layer in m["layers"]:
            cols = f", {layer['columns']} hash columns" if layer["columns"] else ""
            out.append(f"  layer {layer['layer']}: {layer['rows']:,} rows{cols}, {_mib(layer['bytes'])}")
            stored = "stored rows" if m["partition"] != "columns" else "rows"
            for r in layer["regions"]:
                cols = f"columns {columns_text(r['columns'])}, " if r["columns"] else ""
                out.append(f"    rank {r['rank']}: {cols}{stored} [{r['row_start']:,}, {r['row_start'] + r['rows']:,}) "
                           f"on device {r['device']}, {r['pages']:,} pages, {_mib(r['bytes'])}")
        pk = m.get("packing")
        if pk:
            ctx = ", ".join(f"layer {k}: {n:,}" for k, n in pk["contexts"].items())
            out.append(f"  context packing: {ctx} contexts ({pk['pages_per_context']} page(s) each) from "
                       f"{pk['pack_list']} ({pk['workload']}, {pk['split']} half); per rank extra disk "
                       f"{_mib(pk['disk_bytes_per_rank'])} (budget {_mib(pk['budget_disk_bytes_per_rank'])}), index "
                       f"host memory {_mib(pk['index_bytes_per_rank'])} (budget "
                       f"{_mib(pk['budget_index_bytes_per_rank'])})")
    c = report.get("control_report")
    if c:
        out.append(f"control file {c['control']}: device {c['device']}, cache {c['cache_rows']:,} rows in use of "
                   f"{c['max_cache_rows']:,} reserved ({_mib(c['cache_bytes'])}), pad_id {c['pad_id']}, "
                   f"metrics {'on' if c['metrics'] else 'off'}")
        for t in c["tables"]:
            out.append(f"  layer {t['layer']} (order {t['order']}): tier {t['tier']}, rank {t['rank']}, "
                       f"{t['rows']:,} rows ({_mib(t['table_bytes'])}) on {', '.join(t['devices'])}; cache "
                       f"{t['cache_rows']:,} rows (share {t['cache_share']:g}); host memory {_mib(t['host_bytes'])} "
                       f"(directory {_mib(t['directory_bytes'])}, sized to the cache rows"
                       + (f"; frequency sketch {_mib(t['sketch_bytes'])} (admission counters+sketch)"
                          if t.get("sketch_bytes") else "")
                       + (f"; staged files in host memory {_mib(t['in_memory_bytes'])}: {', '.join(t['in_memory'])}"
                          if t["in_memory"] else "") + ")")
            e = t.get("engine_here")
            if e:
                out.append(f"    on this host: engine {e['asked']!r} reads with {e['reads_with']}"
                           + (f" (io_uring unavailable here: {e['io_uring_missing']})"
                              if e["io_uring_missing"] and e["asked"] != "threads" else ""))
            if t["index_bytes"]:
                out.append(f"    context packing: packed regions {_mib(t['packed_bytes'])} extra "
                           f"{'host memory' if t['packed_in_host'] else 'disk'}, index {_mib(t['index_bytes'])} "
                           "host memory (counted above)")
        cache_host = c["cache_bytes"] if c["device"] == "cpu" else 0
        out.append(f"  host memory in all: {_mib(c['host_bytes'])} (tables {_mib(sum(t['host_bytes'] for t in c['tables']))}"
                   f", page buffer pool {_mib(c['page_pool_bytes'])}, row cache {_mib(cache_host)})")
    p = report.get("prediction")
    if p:
        out.append(f"predicted slowdown {p['slowdown_ms']:.4f} ms per step for this placement and cache split "
                   f"(kappa {p['kappa_ms']:g} ms, resolve {p['resolve_ms']:g} ms; tiers {p['tiers']}, "
                   f"curves {p['curves']})")
        for t in p["tables"]:
            out.append(f"  layer {t['layer']} on {t['source']} (submitted {t['order']}): window "
                       f"{t['window_ms']:.4f} ms, {t['pages_per_step']:.2f} pages/step behind "
                       f"{t['cache_rows']:,.0f} cache rows, read {t['read_ms']:.4f} ms, stall {t['stall_ms']:.4f} ms"
                       f", host memory {_mib(t['host_bytes'])} (planner's model)")
        for name, m in p["read_models"].items():
            fit = m["fit"]
            quality = (f"; fitted on {fit['runs']} runs, R^2 {fit['r2']:.3f}, held-out R^2 {fit['held_out_r2']:.3f}"
                       + (f" ({fit['measured']})" if fit["measured"] else "") if fit else "")
            out.append(f"  read model of {name}: T = {m['intercept_ms']:.4f} ms + {m['page_ms'] * 1e3:.3f} us/page own"
                       f" + {m['ahead_page_ms'] * 1e3:.3f} us/page queued ahead + {m['behind_page_ms'] * 1e3:.3f} "
                       f"us/page queued behind{quality}")
        out.append(f"  host memory of the placement (planner's model): {_mib(p['host_bytes'])}")
    return out


def run(args: argparse.Namespace) -> int:
    """Describe the given manifest and/or control file."""
    from slacktier.errors import ErrorKind, SlackTierError
    from slacktier.plan import load_miss_curves, load_tiers

    report: dict[str, Any] = {}
    # the flags' files before the control file's checks, which load the engine room (torch)
    windows = _windows(args)
    inputs = (load_tiers(args.tiers), load_miss_curves(args.curves)) if args.tiers and args.curves else None
    for path in args.paths:
        key = "control_report" if str(path).endswith(".toml") else "manifest_report"
        if key in report:
            raise SlackTierError(ErrorKind.BAD_INPUT, f"two {key.split('_')[0]} files given",
                                 fix="give at most one manifest (.json) and one control file (.toml)")
        report[key] = control_report(path, args.tp) if key == "control_report" else manifest_report(path, args.tp)
    if args.tiers or args.curves or windows:
        if not (args.tiers and args.curves and "control_report" in report):
            raise SlackTierError(ErrorKind.MISSING, "a predicted slowdown needs a control file, --tiers, --curves "
                                 "and the tables' windows",
                                 fix="give the control file (.toml) with --tiers FILE --curves FILE --window LAYER=MS "
                                 "(per table), or none of these flags")
        report["prediction"] = prediction_report(report["control_report"], windows, args.tiers, args.curves, *inputs,
                                                 kappa_ms=args.kappa_ms, resolve_ms=args.resolve_ms)
    print(json.dumps(report, indent=2) if args.json else "\n".join(lines(report)))
    return 0
