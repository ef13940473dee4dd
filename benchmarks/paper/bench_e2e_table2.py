"""End to end: the paper's Table 2, Figures 3 and 5 on this machine (the harness is benchmarks/e2e/).

    .venv/bin/python benchmarks/bench_e2e_table2.py            # full run, updates docs/bench-log/e2e.md
    .venv/bin/python benchmarks/bench_e2e_table2.py --quick    # the demo's short version (slacktier demo)

Prints the Table 2 analog, writes docs/img/e2e_fig3_cache_split.png and docs/img/e2e_fig5_load.png,
and replaces the '## End to end' section of docs/bench-log/e2e.md (--markdown) with the numbers it printed.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # the repo root: benchmarks.* imports
from benchmarks.e2e.config import E2EConfig  # noqa: E402
from benchmarks.e2e.markdown import report, write_section  # noqa: E402
from benchmarks.e2e.plots import plot  # noqa: E402
from benchmarks.e2e.run import load, run_all  # noqa: E402
from slacktier.serve.runs import RigConfig  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The harness's flags."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="runs/e2e", help="working directory: staged tables, results.json (runs/e2e)")
    p.add_argument("--quick", action="store_true", help="the demo's short version: agent, B=4, three placements")
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
    p.add_argument("--png-dir", default=str(ROOT / "docs/img"), help="write the Figure 3/5 PNGs here (docs/img)")
    p.add_argument("--markdown", default=str(ROOT / "docs" / "bench-log" / "e2e.md"),
                   help="replace this file's '## End to end'")
    p.add_argument("--no-markdown", action="store_true", help="print only; leave the markdown file alone")
    p.add_argument("--from-results", default=None, help="re-render the report of a results.json; run nothing")
    return p.parse_args(argv)


def config(args: argparse.Namespace) -> E2EConfig:
    """The E2EConfig the flags describe."""
    batches = tuple(int(b) for b in args.batches.split(","))
    rig = RigConfig(workdir=args.out, preset=args.preset, engram_vocab=args.engram_vocab,
                    max_batch=max(batches + (args.batch,)), decode_tokens=args.decode_tokens,
                    cache_rows=args.cache_rows, devices=args.devices)
    return E2EConfig(rig=rig, workloads=tuple(args.workloads.split(",")), table2_batch=args.batch, batches=batches,
                     runs=args.runs, figure3=not args.no_fig3, figure5=not args.no_fig5,
                     **({"delays_ms": ()} if args.no_delays else {}))


def main(argv: list[str] | None = None) -> int:
    """Run (or re-read) the benchmark, print the report, write the PNGs and the markdown section."""
    args = parse_args(argv)
    if args.quick:
        from slacktier.serve.demo import replay_demo
        print(replay_demo(args.out))
        return 0
    if args.from_results:
        results = load(Path(args.from_results))
    else:
        def progress(i: int, n: int, rec) -> None:
            print(f"[{i + 1}/{n}] {rec.workload} B={rec.batch} {rec.placement} run {rec.rep}: step "
                  f"{rec.step_ms:.1f} ms ({rec.decode_steps} full decode steps, {rec.wall_s:.0f} s)",
                  file=sys.stderr, flush=True)
        results = run_all(config(args), on_run=progress)
    text = report(results)
    pngs = plot(results, Path(args.png_dir))
    print(text)
    for p in pngs:
        print(f"wrote {p}")
    if not args.no_markdown:
        command = " ".join([".venv/bin/python", "benchmarks/bench_e2e_table2.py", *(argv or sys.argv[1:])])
        write_section(Path(args.markdown), results, text, pngs, command)
    return 0


if __name__ == "__main__":
    sys.exit(main())
