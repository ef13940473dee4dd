"""`slacktier bench`: the end-to-end replay benchmark (Table 2, Figures 3 and 5 of the paper) on this machine."""

from __future__ import annotations

import argparse
import datetime as _dt
import platform
import sys
from pathlib import Path

HELP = "replay agent/chat sessions through the V4.1-shaped model under each table placement; print Table 2"

SECTION = "## End to end"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default="runs/e2e", help="working directory: staged tables, results.json (runs/e2e)")
    p.add_argument("--quick", action="store_true", help="the short version: agent, B=4, three placements, one run")
    p.add_argument("--preset", default="bench", help="model preset: bench (8 layers), bench16, v41 (40 layers)")
    p.add_argument("--workloads", default="agent,chat", help="agent,chat")
    p.add_argument("--batch", type=int, default=8, help="B of Table 2 and Figure 3 (default 8)")
    p.add_argument("--batches", default="4,8,16", help="Figure 5's loads (default 4,8,16)")
    p.add_argument("--runs", type=int, default=3, help="runs per configuration (default 3)")
    p.add_argument("--decode-tokens", type=int, default=16, help="tokens per assistant turn (default 16)")
    p.add_argument("--cache-rows", type=int, default=32_768, help="row cache size, both layers (default 32768)")
    p.add_argument("--engram-vocab", type=int, default=100_000, help="table scale: ~24x rows per layer")
    p.add_argument("--devices", type=int, default=4, help="device files for the several-devices rows (4)")
    p.add_argument("--no-fig3", action="store_true", help="skip the cache-split sweep")
    p.add_argument("--no-fig5", action="store_true", help="skip the load sweep")
    p.add_argument("--no-delays", action="store_true", help="skip the injected-delay runs")
    p.add_argument("--png-dir", default=None, help="write the Figure 3/5 PNGs here (default: --out)")
    p.add_argument("--markdown", default=None, help="replace the '## End to end' section of this file")
    p.add_argument("--command-line", default=None, help="the command to record in --markdown")
    p.add_argument("--from-results", default=None, help="re-render the report of a results.json; run nothing")


def run(args: argparse.Namespace) -> int:
    from slacktier.serve.bench import BenchConfig, plot, report, run_bench, run_short_demo

    if args.quick:
        print(run_short_demo(args.out))
        return 0
    if args.from_results:
        import json
        results = json.loads(Path(args.from_results).read_text())
        return _render(args, results)
    cfg = BenchConfig(workdir=args.out, preset=args.preset, engram_vocab=args.engram_vocab,
                      workloads=tuple(args.workloads.split(",")), table2_batch=args.batch,
                      batches=tuple(int(b) for b in args.batches.split(",")), runs=args.runs,
                      decode_tokens=args.decode_tokens, cache_rows=args.cache_rows, devices=args.devices,
                      figure3=not args.no_fig3, figure5=not args.no_fig5,
                      **({"delays_ms": ()} if args.no_delays else {}))

    def progress(i: int, n: int, rec) -> None:
        print(f"[{i + 1}/{n}] {rec.workload} B={rec.batch} {rec.placement} run {rec.rep}: step {rec.step_ms:.1f} ms "
              f"({rec.decode_steps} full decode steps, {rec.wall_s:.0f} s)", file=sys.stderr, flush=True)

    results = run_bench(cfg, progress=False, on_run=progress)
    return _render(args, results)


def _render(args: argparse.Namespace, results: dict) -> int:
    from slacktier.serve.bench import plot, report

    text = report(results)
    pngs = plot(results, Path(args.png_dir or args.out))
    print(text)
    for p in pngs:
        print(f"wrote {p}")
    if args.markdown:
        write_section(Path(args.markdown), results, text, pngs, args.command_line or " ".join(sys.argv))
    return 0


def write_section(path: Path, results: dict, text: str, pngs: list[Path], command: str) -> None:
    """Replace (or append) the '## End to end' section of a markdown file; other sections stay untouched."""
    cfg, model = results["config"], results["model"]
    body = [SECTION, "",
            f"Command: `{command}`  ",
            f"Machine: {platform.machine()}, {_cpus()} CPUs shared with other agents (load average "
            f"{_load()} when rendered), torch {__import__('torch').__version__}, one intra-op thread; finished "
            f"{results.get('finished_utc') or _dt.datetime.now(_dt.timezone.utc).strftime('%Y-%m-%d %H:%M')} UTC"
            f"{', ' + format(results['wall_s'] / 60, '.0f') + ' min' if 'wall_s' in results else ''}.  ",
            f"Model: transformers' DeepseekV4 decoder layers ({model['layers']} layers, hidden {model['hidden_size']}, "
            f"hc_mult {model['hc_mult']}, {model['dtype']}) with Engram at layers {tuple(model['engram_layer_ids'])}; "
            f"tables of {results['table_rows'][0]:,} and {results['table_rows'][1]:,} rows (264 B) staged in "
            f"{results['stage_s']:.0f} s; row cache {cfg['cache_rows']:,} rows; B={cfg['table2_batch']} "
            f"(the paper: 128), {cfg['decode_tokens']} decode tokens per turn, held-out sessions.",
            "", "```", text, "```", ""]
    for p in pngs:
        body.append(f"![{p.stem}]({p})")
    body.append("")
    old = path.read_text() if path.exists() else ""
    lines = old.splitlines()
    start = next((i for i, l in enumerate(lines) if l.strip() == SECTION), None)
    if start is None:
        new = old.rstrip("\n") + "\n\n" + "\n".join(body) + "\n"
    else:
        end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
        new = "\n".join(lines[:start] + body + lines[end:]) + "\n"
    path.write_text(new)


def _cpus() -> int:
    import os
    return os.cpu_count() or 0


def _load() -> str:
    import os
    return ", ".join(f"{x:.1f}" for x in os.getloadavg())
