"""Gather throughput of the step engine against a plain torch index_select + dequant from DRAM.

One table layer of ~1M rows (the V4.1 Engram hash scaled down:
EngramLayout.scaled(42_000), layer 1) in host DRAM; row ids are real decode
steps (B sessions of real Python source, DeepSeek-V4 tokenizer), ids [B, 24].
Four ways to turn the same ids into bf16 rows [B, 24, 256], interleaved in a
shuffled order, `--repeats` rounds of `--steps` steps:

- engine, warm: every row in the device row cache (all hits).
- engine, cold: no cache; rows come from the DRAM source's page buffers
  (timed after the reads landed: the counters' gather_us, the fill+dequant pass).
- torch: `table.index_select(0, ids)` then `codec.reference_dequant` (the plain
  torch host-table gather; the limit to beat, target >= 1.0x).
- torch+lut: `index_select` then `codec.dequantize` (the codec's exact table);
  the floor the cold gather is held to (issue 14: >= 1.0x), in the last column.

    .venv/bin/python benchmarks/bench_engine_gather.py [--append] [--png runs/gather.png]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

from slacktier.cache import RowCache
from slacktier.engine.step import StepEngine
from slacktier.engine.tables import TableSpec, rank_regions_for
from slacktier.testing.engine import pack_pages, real_text
from slacktier.tables.regions import Region
from slacktier.store.dram import DramSource
from slacktier.tables.codec import dequantize, reference_dequant, split_raw, synthetic_rows
from slacktier.tables.engram_hash import EngramHasher, EngramLayout
from slacktier.tables.layout import ROW_BYTES
from slacktier.tables.tokenizer import encode

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # the repo root: benchmarks.* imports
from benchmarks._harness import (append_to_section, command_line, machine, pyplot, save_figure,  # noqa: E402
                                 utc_stamp, write_result)
from benchmarks.engine.bench_engine_begin_step import SECTION, SUBSECTION  # noqa: E402

LAYER = 1


def decode_steps(layout: EngramLayout, batch: int, steps: int) -> list[np.ndarray]:
    """`steps` decode steps of `batch` sessions: each [batch, 1, 24] layer-1 row ids of real text."""
    need = batch * (steps + 16)
    text_bytes = need * 4
    tokens: list[int] = []
    while len(tokens) < need:
        tokens = encode(real_text(text_bytes, start_file=50))
        text_bytes *= 2
    hasher = EngramHasher(layout)
    toks = np.asarray(tokens[:need], dtype=np.int64).reshape(batch, steps + 16)
    ids = np.stack([hasher.prefill(t) for t in toks])[:, 16:, 0, :]     # [B, steps, 24], skip the start
    return [np.ascontiguousarray(ids[:, k][:, None, :]) for k in range(steps)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="8,128,256")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--vocab", type=int, default=42_000, help="scaled engram_vocab_size (rows ~ 24x)")
    ap.add_argument("--torch-threads", type=int, default=1,
                    help="torch intra-op threads (1: on a shared 2-core machine, more threads only wait on each other; "
                         "our gather pass is single-threaded too)")
    ap.add_argument("--append", action="store_true")
    ap.add_argument("--png", default="")
    args = ap.parse_args()
    torch.set_num_threads(args.torch_threads)
    batches = [int(b) for b in args.batches.split(",")]
    layout = EngramLayout.scaled(args.vocab, layer_ids=(LAYER,))
    rows = layout.rows(0)
    raw = synthetic_rows(3, 0, rows)                                     # [rows, 264] host table
    table = torch.from_numpy(raw)
    region = Region(layer=LAYER, rank=0, path="", offset_bytes=0, pages=(rows + 14) // 15)
    source = DramSource([region], pages=[pack_pages(raw)])
    spec = lambda share: TableSpec(layer=LAYER, row_start=0, rows=rows, source=source, cache_share=share,  # noqa
                                   regions=rank_regions_for(LAYER, rows, [region]))
    print(f"table: {rows:,} rows ({rows * ROW_BYTES / 2**20:.0f} MiB)", flush=True)

    results: dict[tuple[int, str], list[float]] = {}
    for b in batches:
        steps = decode_steps(layout, b, args.steps)
        warm = StepEngine([spec(1.0)], RowCache(b * 24 * args.steps), max_tokens=b)
        cold = StepEngine([spec(0.0)], RowCache(0), max_tokens=b)
        for ids in steps:                                                 # warm the cache with every step's rows
            warm.begin_step(ids)
            warm.gather(LAYER)
            warm.end_step()

        def engine_warm(ids: np.ndarray) -> float:
            warm.begin_step(ids)
            t0 = time.perf_counter_ns()
            warm.gather(LAYER)
            t1 = time.perf_counter_ns()
            c = warm.end_step().layers[LAYER]
            assert c.hits == c.lookups
            return (t1 - t0) / 1e3

        def engine_cold(ids: np.ndarray) -> float:
            cold.begin_step(ids)
            cold.gather(LAYER)
            return cold.end_step().layers[LAYER].gather_us

        def torch_ref(ids: np.ndarray) -> float:
            t0 = time.perf_counter_ns()
            picked = table.index_select(0, torch.from_numpy(ids.reshape(-1)))
            out = reference_dequant(*split_raw(picked)).view(ids.shape[0], 24, 256)
            t1 = time.perf_counter_ns()
            assert out.dtype == torch.bfloat16
            return (t1 - t0) / 1e3

        def torch_lut(ids: np.ndarray) -> float:
            t0 = time.perf_counter_ns()
            out = dequantize(table.index_select(0, torch.from_numpy(ids.reshape(-1)))).view(ids.shape[0], 24, 256)
            t1 = time.perf_counter_ns()
            assert out.dtype == torch.bfloat16
            return (t1 - t0) / 1e3

        # Same rows, same bits: check once before timing.
        warm.begin_step(steps[0])
        ours = warm.gather(LAYER)
        warm.end_step()
        ref = reference_dequant(*split_raw(table.index_select(0, torch.from_numpy(steps[0].reshape(-1)))))
        assert torch.equal(ours.reshape(-1, 256).view(torch.int16), ref.view(torch.int16))

        ways = {"engine warm (cache hits)": engine_warm, "engine cold (page buffers)": engine_cold,
                "torch index_select + reference_dequant": torch_ref, "torch index_select + codec LUT": torch_lut}
        rng = random.Random(b)
        for _ in range(args.repeats):
            order = list(ways)
            rng.shuffle(order)
            for name in order:
                times = [ways[name](ids) for ids in steps]
                results.setdefault((b, name), []).append(statistics.median(times))
        warm.close()
        cold.close()
    source.close()

    base = "torch index_select + reference_dequant"
    lines = ["| B | rows per gather | way | us per gather (min / med / max of round medians) | GB/s of bf16 out "
             "| speed-up vs torch (median) | vs torch + codec LUT, the target's floor (median; target >= 1.0x) |",
             "|---:|---:|---|---|---:|---:|---:|"]
    for b in batches:
        ref_med = statistics.median(results[(b, base)])
        lut_med = statistics.median(results[(b, "torch index_select + codec LUT")])
        for name in ["engine warm (cache hits)", "engine cold (page buffers)", base, "torch index_select + codec LUT"]:
            r = sorted(results[(b, name)])
            med = statistics.median(r)
            gbs = b * 24 * 512 / (med * 1e-6) / 1e9
            lines.append(f"| {b} | {b * 24} | {name} | {r[0]:.0f} / {med:.0f} / {r[-1]:.0f} | {gbs:.2f} | "
                         f"{ref_med / med:.2f}x | {lut_med / med:.2f}x |")
    table_md = "\n".join(lines)
    print(table_md)
    lut = "torch index_select + codec LUT"
    write_result("micro.engine_gather", {
        f"{way}_over_torch_lut_B{b}": statistics.median(results[(b, lut)]) / statistics.median(results[(b, name)])
        for b in batches
        for way, name in (("warm", "engine warm (cache hits)"), ("cold", "engine cold (page buffers)"))})
    if args.png:
        fig, ax = pyplot().subplots(figsize=(7, 4))
        names = ["engine warm (cache hits)", "engine cold (page buffers)", base, "torch index_select + codec LUT"]
        width = 0.2
        for k, name in enumerate(names):
            ax.bar([i + k * width for i in range(len(batches))],
                   [statistics.median(results[(b, name)]) for b in batches], width, label=name)
        ax.set_xticks([i + 1.5 * width for i in range(len(batches))], [f"B={b}" for b in batches])
        ax.set_ylabel("us per gather (median)")
        ax.set_yscale("log")
        ax.legend(fontsize=7)
        save_figure(fig, args.png, bbox_inches="tight")
    if args.append:
        text = (f"**gather throughput vs a plain torch index_select + dequant from DRAM** - {utc_stamp()}, "
                f"{machine()} (shared with other jobs), torch {torch.__version__}, {torch.get_num_threads()} "
                f"torch threads. Command: `{command_line(__file__)}`. One layer of {rows:,} rows in host DRAM, "
                f"real-token decode ids [B, 24]; {args.repeats} rounds x {args.steps} steps, ways "
                f"interleaved in shuffled order; GB/s counts the bf16 output (512 B per row). Target: engine "
                f">= 1.0x the torch gather with the codec's LUT (last column).\n\n" + table_md)
        append_to_section(text, SECTION, SUBSECTION)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
