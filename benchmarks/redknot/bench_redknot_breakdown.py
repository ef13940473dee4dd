"""Where the CPU prefill time of the RedKnot bench model goes at long contexts: full recompute vs reuse, per operator.

Operators (CPU seconds of this process, one intra-op thread), each timed where
it runs: the compressors (CSA and HCA entries), the Lightning Indexer (its own
compression, query projection, scoring and top-k), our attention core split
by job (every head: full recompute, and the fence layers in reuse; Global
heads on every row and Local heads on protected rows of reusable layers in
reuse; "key gather" is the rest of the core: the
window key gathers and concatenation), the MoE blocks, the projections
(q_a, kv, wo_a grouped, wo_b; q_b runs inside the attention jobs), and the
rest (norms, hyper-connections, embeddings, protected-row selection,
assembling artifact rows). "artifact wait" is the wall time reuse waited for
artifact pages (DRAM source, opened and loaded before timing by
`RedKnotService.warm`), inside "other".

Same model, real-text documents and artifacts as bench_redknot_prefill.py.
The CSA indexer runs row-chunked (`--indexer-chunk-rows`, redknot/indexer.py:
the model's own module materializes [S, 4, S/4] float32 scores, 16 GiB per
copy at 64K); `--indexer-chunk-rows 0` runs the model's module. Per length,
full and reuse alternate, `--repeats` times; medians. The analytic ledger
(redknot/ledger.py, MACs) is printed beside: the bench shape at the measured
lengths and beyond, and DeepSeek-V4 Flash at 64K-440K next to the summary's
hot-artifact TTFT speedups.

    flock /tmp/slacktier-bench.lock nice -n -5 .venv/bin/python benchmarks/bench_redknot_breakdown.py --append
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch


sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # the repo root: benchmarks.* imports
from benchmarks._harness import ROOT, append_to_section, command_line, machine, pyplot, save_figure, utc_stamp  # noqa: E402

KEYS = ["total", "compressor", "indexer", "attn all heads", "attn Global", "attn Local", "key gather", "moe",
        "projections", "other"]
# the summary's archived hot-artifact TTFT speedups on Flash
PAPER_TTFT = {64: 2.91, 128: 3.20, 256: 2.02, 440: 3.84}


class Timers:
    """Accumulates CPU seconds per operator; nested timers are subtracted from their parent."""

    def __init__(self) -> None:
        self.acc: dict[str, float] = {}
        self.stack: list[list] = []   # [name, start, child seconds]

    def start(self, name: str) -> None:
        self.stack.append([name, time.process_time(), 0.0])

    def stop(self) -> None:
        name, t0, child = self.stack.pop()
        dt = time.process_time() - t0
        self.acc[name] = self.acc.get(name, 0.0) + dt - child
        if self.stack:
            self.stack[-1][2] += dt

    def wrap(self, name_of, fn):
        def timed(*a, **k):
            self.start(name_of(*a, **k) if callable(name_of) else name_of)
            try:
                return fn(*a, **k)
            finally:
                self.stop()
        return timed

    def hook(self, module: torch.nn.Module, name: str) -> None:
        module.register_forward_pre_hook(lambda *_: self.start(name))
        module.register_forward_hook(lambda *_: self.stop())


def instrument(runner, timers: Timers) -> None:
    """Time every operator of the runner's prefill (module hooks and wrapped functions)."""
    import slacktier.redknot.indexer as indexer_mod
    import slacktier.redknot.runner as runner_mod

    for layer in runner.model.model.layers:
        attn = layer.self_attn
        if attn.compressor is not None:
            timers.hook(attn.compressor, "compressor")
            if getattr(attn.compressor, "indexer", None) is not None:
                timers.hook(attn.compressor.indexer, "indexer")
        for proj in (attn.q_a_proj, attn.kv_proj, attn.o_b_proj):
            timers.hook(proj, "projections")
        timers.hook(layer.mlp, "moe")
    indexer_mod.indexer_select = timers.wrap("indexer", indexer_mod.indexer_select)
    indexer_mod.csa_compress = timers.wrap("compressor", indexer_mod.csa_compress)
    runner_mod.grouped_projection = timers.wrap("projections", runner_mod.grouped_projection)
    runner._attend_jobs = timers.wrap("key gather", runner._attend_jobs)
    all_heads = runner.heads

    def chunk_name(ctx, rotary, chunk, kidx, valid, keys, kframe, heads, wq, collect):
        if len(heads) == all_heads:
            return "attn all heads"
        return "attn Global" if bool(torch.isin(heads, torch.tensor(runner.policy.globals_of(
            ctx.attn.layer_idx))).all()) else "attn Local"

    runner._attend_chunk = timers.wrap(chunk_name, runner._attend_chunk)


def ledger_lines(bench_cfg, bench_profile, lengths: list[int], budget: float, query_rows: int) -> list[str]:
    """The analytic ledger: predicted full/reuse MAC ratio and what bounds it, bench shape and Flash."""
    from slacktier.redknot.ledger import FLASH, ModelDims, flash_config, head_row_ceiling, operator_ledger

    out = ["| model | context | budget | predicted full / reuse (MACs) | compressor + indexer share | attention core "
           "share | MoE share | head-row ops share | bound if all of a prefill were head-row ops | summary's TTFT "
           "speedup |", "|---|---|---|---|---|---|---|---|---|---|"]
    shapes = [("bench (7 layers, 1F-5R-1F)", ModelDims.of(bench_cfg), bench_profile,
               sorted(set(lengths) | {131072, 262144, 1 << 20})),
              ("DeepSeek-V4 Flash (3F-37R-3F)", ModelDims.of(flash_config()), FLASH, [k * 1024 for k in PAPER_TTFT])]
    for name, dims, profile, ctxs in shapes:
        for budget_ in sorted({0.0, budget}):
            ceiling = head_row_ceiling(profile) * (1 - budget_)
            for ctx in ctxs:
                rows = {r.name: r for r in operator_ledger(dims, profile, None, doc_rows=ctx, query_rows=query_rows,
                                                           budget=budget_)}
                tot = rows["whole prefill"]
                share = lambda *ns: sum(rows[n].full_macs for n in ns) / tot.full_macs  # noqa: E731
                paper = PAPER_TTFT.get(ctx // 1024) if "Flash" in name else None
                out.append(f"| {name} | {ctx // 1024}K+{query_rows} | {budget_:.0%} | "
                           f"**{tot.full_macs / tot.reuse_macs:.2f}x** | {100 * share('compress'):.0f}% | "
                           f"{100 * share('attn'):.0f}% | {100 * share('moe'):.0f}% | "
                           f"{100 * share('q_b', 'attn', 'o_a'):.0f}% | {1 / (1 - ceiling):.2f}x | "
                           f"{f'{paper:.2f}x' if paper else '-'} |")
    return out


def plot(rows, path: str) -> None:
    """Stacked CPU seconds per operator, full and reuse side by side per context."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(9, 4.5))
    labels = [f"{r[0] // 1024}K\n{r[1]}" for r in rows]
    bottom = [0.0] * len(rows)
    for k in KEYS[1:]:
        vals = [r[3].get(k, 0.0) for r in rows]
        ax.bar(labels, vals, bottom=bottom, label=k)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_ylabel("prefill CPU s (median)")
    ax.set_title("RedKnot bench model: where the prefill time goes (one thread)")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    save_figure(fig, path)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="16384,32768,65536")
    ap.add_argument("--doc-tokens", type=int, default=2048)
    ap.add_argument("--budget", type=float, default=0.2)
    ap.add_argument("--repeats", default="2", help="runs per config: one number, or one per length (2,2,1)")
    ap.add_argument("--indexer-chunk-rows", type=int, default=64, help="0: the model's own CSA module")
    ap.add_argument("--json", default="", help="also keep the measured rows here; with --merge, add them to the "
                    "rows already there (split a long sweep over several locked runs, append one table)")
    ap.add_argument("--merge", action="store_true")
    ap.add_argument("--png", default="", help="write a stacked-bar PNG of the breakdown (all rows, merged too)")
    ap.add_argument("--store", default=str(ROOT / "runs" / "redknot_bench" / "store"))
    ap.add_argument("--append", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)

    from slacktier.redknot.artifacts import ArtifactStore
    from slacktier.redknot.corpus import documents, question_tokens
    from slacktier.redknot.model import bench_config, build_model
    from slacktier.redknot.profile import profile_for_config
    from slacktier.redknot.protect import ProtectionPolicy
    from slacktier.redknot.runner import Layout, RedKnotRunner, Segment
    from slacktier.redknot.service import RedKnotService

    cfg = bench_config()
    model = build_model(cfg, seed=0, dtype=torch.float32, lm_head_scale=20.0)
    profile = profile_for_config(cfg, name="bench-1F1F")
    runner = RedKnotRunner(model, profile, chunk_rows=256, indexer_chunk_rows=args.indexer_chunk_rows or None)
    svc = RedKnotService(runner, ArtifactStore(Path(args.store)))
    lengths = [int(x) for x in args.lengths.split(",")]
    reps = [int(x) for x in args.repeats.split(",")]
    reps = reps * len(lengths) if len(reps) == 1 else reps
    docs = documents(max(lengths) // args.doc_tokens, args.doc_tokens)
    query = question_tokens()
    t0 = time.perf_counter()
    built = 0
    for doc_id, toks in docs:  # reuse the artifacts already in the store when they are there and valid
        if svc.store.certificate(doc_id, 0) is None:
            svc.build(doc_id, toks)
            built += 1
    print(f"built {built} of {len(docs)} artifacts in {time.perf_counter() - t0:.0f} s", flush=True)
    t0 = time.perf_counter()
    svc.warm(docs)  # open every document's DRAM source before timing: a one-off load, not a prefill's work
    print(f"opened their DRAM sources in {time.perf_counter() - t0:.1f} s", flush=True)

    timers = Timers()
    instrument(runner, timers)
    rows = []
    for length, n_rep in zip(lengths, reps):
        req = docs[:length // args.doc_tokens]
        layout = Layout.of([Segment(d, t) for d, t in req] + [Segment("query", query, "query")])
        names = ["full", f"reuse@{args.budget:g}"]
        per: dict[str, list[dict[str, float]]] = {n: [] for n in names}
        for rep in range(n_rep):
            for name in (names if rep % 2 == 0 else names[::-1]):
                timers.acc.clear()
                c0, w0 = time.process_time(), time.perf_counter()
                if name == "full":
                    res = runner.full(layout)
                    wait = 0.0
                else:
                    rep_ = svc.prefill(req, query, ProtectionPolicy(args.budget))
                    assert rep_.fallback_reason is None, rep_.fallback_reason
                    res, wait = rep_.result, rep_.reads.wait_s
                parts = dict(timers.acc)
                parts["total"] = time.process_time() - c0
                parts["other"] = parts["total"] - sum(timers.acc.values())
                parts["wall"] = time.perf_counter() - w0
                parts["artifact wait"] = wait
                parts["head-rows skipped"] = res.stats.head_row_saving
                per[name].append(parts)
                print(f"  {length} {name}: " + ", ".join(f"{k} {v:.2f}" for k, v in parts.items()), flush=True)
        for name, runs in per.items():
            if not runs:
                continue
            keys = set().union(*runs)
            rows.append((length, name, len(runs), {k: statistics.median(r.get(k, 0.0) for r in runs) for k in keys}))
    svc.close()

    measured = sorted({r[0] for r in rows})
    runs_meta = [{"command": f"flock /tmp/slacktier-bench.lock nice -n -5 {command_line(__file__)}",
                  "finished": utc_stamp(), "lengths": measured}] if measured else []
    if args.json:
        path = Path(args.json)
        if args.merge and path.exists():
            old = json.loads(path.read_text())
            mine = set(measured)
            rows = [tuple(r) for r in old["rows"] if r[0] not in mine] + rows
            runs_meta = old["runs"] + runs_meta
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"rows": rows, "runs": runs_meta}, indent=1))
    rows.sort(key=lambda r: (r[0], r[1] != "full"))
    lengths = sorted({r[0] for r in rows})

    lines = ["| context | config | runs | " + " | ".join(f"{k} CPU s" for k in KEYS) + " | CPU vs full | wall s "
             "| artifact wait s | head-rows skipped |", "|---|---|---|" + "---|" * (len(KEYS) + 4)]
    full_of = {r[0]: r[3]["total"] for r in rows if r[1] == "full"}
    for length, name, n, med in rows:
        cells = [f"{med.get(k, 0.0):.2f} ({100 * med.get(k, 0.0) / med['total']:.0f}%)" if k != "total"
                 else f"**{med['total']:.2f}**" for k in KEYS]
        lines.append(f"| {length // 1024}K+{len(query)} | {name} | {n} | " + " | ".join(cells)
                     + f" | **{med['total'] / full_of[length]:.2f}x** | {med['wall']:.1f} "
                     f"| {med['artifact wait']:.3f} | {100 * med['head-rows skipped']:.1f}% |")
    if args.png:
        plot(rows, args.png)
        print(f"wrote {args.png}")
    ledger = ledger_lines(cfg, profile, lengths, args.budget, len(query))
    print("\n".join(lines))
    print("\n".join(ledger))
    if args.append:
        chunk = (f"row-chunked ({args.indexer_chunk_rows} rows, redknot/indexer.py)" if args.indexer_chunk_rows
                 else "the model's own module")
        block = [f"### Long-context prefill time and where it goes (issue 17 item 4), {utc_stamp()}", "",
                 "Commands (locked runs, lengths, finished):", "",
                 *[f"- `{m['command']}` ({', '.join(f'{x // 1024}K' for x in m['lengths'])}; {m['finished']})"
                   for m in runs_meta], "",
                 f"Machine: {machine()}; torch {torch.__version__}, one intra-op thread, float32; other agents "
                 "share the 2 cores, so CPU seconds of this process are quoted (wall time mostly measures the "
                 "neighbours).", "",
                 f"Bench model (random weights; 7 layers sliding, CSA, HCA, CSA, HCA, CSA, HCA with fences 1F-5R-1F; "
                 f"16 heads / 2 groups, every 8th Global; hidden 256, head_dim 64, window 128, CSA m=4 top-64 with 4 "
                 f"index heads, HCA m'=128), {args.doc_tokens}-token real-text documents + a {len(query)}-token "
                 f"question, artifacts through the DRAM page source, protection budget {args.budget:.0%}; CSA "
                 f"indexer {chunk}; medians of the runs shown, full and reuse alternating:", "", *lines, "",
                 "Analytic ledger (MACs, `slacktier.redknot.ledger`; not time) for the same budget and for 0%: "
                 "the predicted full / reuse ratio, the shares of the full prefill's MACs, and the bound "
                 "1 / (1 - ceiling x (1 - budget)) a prefill made only of head-row operators would reach:", "",
                 *ledger, ""]
        append_to_section("\n".join(block), "## RedKnot-MLA")
        print("appended to its docs/bench-log/ file")
    return 0


if __name__ == "__main__":
    sys.exit(main())
