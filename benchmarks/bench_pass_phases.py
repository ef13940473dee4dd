"""The directory pass's phases, an earlier commit's pass beside the current one, on one engine.

`bench_pass_anatomy.py` gives every variant an engine of its own, and engines
differ: in one ad-hoc run the counting sweep, the same code in two variants,
took a median of 33 us on one engine and 147 us on another (where their 768 MB
of directories landed in memory), more than the changes being measured. Here
both passes run on one engine, so they read the same memory:
- warm: the last 30 warm-up positions are looked up again (all hits), the
  pass called directly per layer; position t of round k runs pass (t + k) mod 2,
  so each pass sees each position equally often and the two alternate step by
  step (the machine's fast and slow phases fall on both);
- fresh: decode steps of new tokens through `begin_step` (one layer at a time,
  `_one_entry` off, so the pass called is the one under test), the pass chosen
  at random per step; both are right passes, so the cache state they leave is
  the same;
- then the same engine through begin_step's one compiled entry (the path a
  server runs), each pass compiled into its own copy of `steppass.run_layers`
  (the copy's import of the pass pointed at it), warm as above and 240 more
  fresh steps: begin_step's thread CPU only (the entry's results row has no
  room for the marks).

Both passes are compiled from source with cycle-counter marks at the same four
points (after the first sweep over the ids, after the counting sweep, after the
second wave, at the end; every mark is asserted, so a pass that moved them
stops this script): the phases' sum is the pass. Beside them, per step, the
directory floor `bench_hot_path.py` quotes (one numpy gather of as many random
entries as the step has owned lookups).

    .venv/bin/python benchmarks/bench_pass_phases.py --against 0d26280 [--rounds 12] [--append]
"""

from __future__ import annotations

import argparse
import importlib.util
import random
import statistics
import sys
import tempfile
import time
import types
from pathlib import Path

import numpy as np
from numba import njit

from _common import ROOT, command_line, machine, publish, utc_stamp

sys.path.insert(0, str(Path(__file__).parent))
import _ab_worker as W  # noqa: E402
from bench_pass_anatomy import SECTION, SOURCE, SUBSECTION, compile_pass, pass_source  # noqa: E402

import slacktier.cache.rowcache as RC  # noqa: E402
import slacktier.engine.steppass as SP  # noqa: E402
from slacktier.cache.directory import C_PAGES, N_COUNTS, NO_SEEN, PassScratch  # noqa: E402
from slacktier.tables.engram_hash import EngramLayout  # noqa: E402

MARKS = N_COUNTS   # counts[MARKS:MARKS + 5]: cycle counter at the start and after each phase
ENTRY = "begin_step, one compiled entry (thread CPU)"
PHASES = ("first sweep over the ids", "counting sweep (loads, second lines' prefetches)",
          "second wave (CLOCK's next victims)", "resolving loop (hits, misses, victims)", "whole pass")
_TSC = '''
from numba.extending import intrinsic as _intrinsic
from numba import types as _types
from llvmlite import ir as _ir


@_intrinsic
def _tsc(typingctx):
    def codegen(context, builder, signature, args):
        fn = builder.module.declare_intrinsic("llvm.readcyclecounter", fnty=_ir.FunctionType(_ir.IntType(64), []))
        return builder.call(fn, [])
    return _types.int64(), codegen
'''
_POINTS = (  # (text, text with its mark): start, after the first sweep, the counting sweep, the second wave, the end
    ("    shift = 64 - hbits\n", f"    counts[{MARKS}] = _tsc()\n    shift = 64 - hbits\n"),
    ("    touch = np.int64(0)\n    n_absent = 0\n",
     f"    counts[{MARKS + 1}] = _tsc()\n    touch = np.int64(0)\n    n_absent = 0\n"),
    ("    # Second wave:", f"    counts[{MARKS + 2}] = _tsc()\n    # Second wave:"),
    ("    lstate[SPARE] = touch\n", f"    lstate[SPARE] = touch\n    counts[{MARKS + 3}] = _tsc()\n"),
    ("    lstate[HAND] = hand\n", f"    counts[{MARKS + 4}] = _tsc()\n    lstate[HAND] = hand\n"),
)


def instrumented(text: str) -> str:
    """The pass's source with its cycle-counter marks."""
    for old, new in _POINTS:
        if text.count(old) != 1:
            raise SystemExit(f"the pass changed: cannot place a mark at {old.strip().splitlines()[0]!r}")
        text = text.replace(old, new)
    head = "from __future__ import annotations\n"
    return text.replace(head, head + _TSC, 1) if head in text else _TSC + text


def sources(against: str) -> dict[str, str]:
    """Name -> source of the pass: the earlier commit's, then the current one."""
    return {f"commit {against}": pass_source(against), "current": SOURCE.read_text()}


def entries(texts: dict[str, str], tmp: Path) -> dict[str, object]:
    """Name -> `steppass.run_layers` compiled around that pass (no marks: the entry's results row holds the
    counts only), for the compiled-entry rows."""
    text = (ROOT / "src" / "slacktier" / "engine" / "steppass.py").read_text()
    line = "from slacktier.cache.directory import C_PAGES, N_COUNTS, resolve_layer\n"
    if text.count(line) != 1:
        raise SystemExit("steppass changed: cannot point its entry at another pass")
    out = {}
    for k, (name, source) in enumerate(texts.items()):
        holder = types.ModuleType(f"_phases_pass_{k}")
        holder.C_PAGES, holder.N_COUNTS = C_PAGES, N_COUNTS
        holder.resolve_layer = compile_pass(f"entry {name}", source, tmp)
        sys.modules[holder.__name__] = holder
        path = tmp / f"_phases_entry_{k}.py"
        path.write_text(text.replace(line, f"from {holder.__name__} import C_PAGES, N_COUNTS, resolve_layer\n")
                        .replace("cache=True", "cache=False"))
        spec = importlib.util.spec_from_file_location(path.stem, path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[path.stem] = mod
        spec.loader.exec_module(mod)
        out[name] = mod.run_layers
    return out


def cycles_per_us() -> float:
    """The cycle counter's rate, from 0.2 s of wall time (the counter ticks at a constant rate on this CPU)."""
    space: dict = {}
    exec(_TSC + "\n\ndef now():\n    return _tsc()\n", space)
    now = njit(space["now"])
    c0, t0 = now(), time.perf_counter_ns()
    time.sleep(0.2)
    c1, t1 = now(), time.perf_counter_ns()
    return (c1 - c0) / ((t1 - t0) / 1e3)


def _phases(counts: np.ndarray, rate: float) -> list[float]:
    m = counts[MARKS:MARKS + 5] / rate
    return [m[1] - m[0], m[2] - m[1], m[3] - m[2], m[4] - m[3], m[4] - m[0]]


def measure(against: str, rounds: int, warm_steps: int = 64, span: int = 30, fresh_steps: int = 240) -> dict:
    layout = EngramLayout.v41()
    ids = W._ids(layout, 128, warm_steps + 2 * fresh_steps)
    rate = cycles_per_us()
    out: dict[tuple[str, str], list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        texts = sources(against)
        passes = {name: compile_pass(name, instrumented(text), tmp) for name, text in texts.items()}
        names = list(passes)
        entry = entries(texts, tmp)
        engine = W.rank_engine(layout, tmp)
        engine._one_entry = False   # begin_step calls RC.resolve_layer, the pass under test, per layer
        engine._ensure_capacity(128)
        for run in engine._layers.values():   # room for the marks after the pass's counts
            run.scratch.counts = np.zeros(MARKS + 5, dtype=np.int64)
        original = RC.resolve_layer

        def step(t: int, name: str) -> float:
            """begin_step (thread CPU, us) of step t through pass `name`, then its gathers and end_step."""
            if any(run.scratch.counts.shape[0] != MARKS + 5 for run in engine._layers.values()):
                raise SystemExit("the engine replaced its scratch: the marks would be written past its counts")
            RC.resolve_layer = passes[name]
            return W.timed_step(engine, ids[t])[0]

        try:
            for t in range(warm_steps):   # the warm-up, alternating the passes (both right)
                step(t, names[t % 2])
            cache, table = engine.cache, engine.cache._table
            scratch = PassScratch(128 * 24)
            counts = np.zeros(MARKS + 5, dtype=np.int64)
            rng = np.random.default_rng(7)
            for k in range(rounds):   # warm: the pass alone, called per layer
                for t in range(warm_steps - span, warm_steps):
                    name = names[(t + k) % 2]
                    fn = passes[name]
                    sums = np.zeros(5)
                    for axis, layer in enumerate(sorted(engine.layers)):
                        geo, state = engine.table(layer).geometry, cache.layer(layer)
                        lookups = ids[t][:, axis, :]
                        bits = table.prepare(lookups.size)
                        fn(lookups, geo.row_start, geo.rows, True, geo.rank_starts, geo.rank_region, False, NO_SEEN,
                           state.key, state.directory, state.owned, state.lstate, cache.slot_layer, cache.slot_row,
                           cache.state, cache.ref, cache.fill_miss, cache.step, table.table, table.stamp, bits,
                           scratch.desc_kind, scratch.desc_idx, scratch.miss_buf, scratch.miss_inpage,
                           scratch.miss_slot, scratch.miss_row, scratch.page_region, scratch.page_no,
                           scratch.page_buf, scratch.own_pos, scratch.own_row, 0, 0, counts)
                        if counts[2] != 0:
                            raise SystemExit("a warm step missed: the warm-up did not cache every row")
                        sums += _phases(counts, rate)
                    for phase, v in zip(PHASES, sums):
                        out.setdefault(("warm", f"{name}: {phase}"), []).append(v)
                    out.setdefault(("warm", "floor"), []).append(W._directory_floor(engine, ids[t], rng))
            for t in range(warm_steps, warm_steps + fresh_steps):   # fresh: begin_step per layer
                name = random.choice(names)
                begin = step(t, name)
                sums = np.zeros(5)
                for run in engine._layers.values():
                    sums += _phases(run.scratch.counts, rate)
                for phase, v in zip(PHASES, sums):
                    out.setdefault(("fresh", f"{name}: {phase}"), []).append(v)
                out.setdefault(("fresh", f"{name}: begin_step"), []).append(begin)
            # The same engine through begin_step's compiled entry, each pass compiled into its own copy of
            # steppass.run_layers (the rows are already cached: warm positions are all hits again).
            engine._one_entry = True
            real_entry = SP.run_layers
            try:
                def entry_step(t: int, name: str) -> float:
                    SP.run_layers = entry[name]
                    return W.timed_step(engine, ids[t])[0]

                for name in names:   # compile both outside the timed steps
                    entry_step(warm_steps - 1, name)
                for k in range(rounds):
                    for t in range(warm_steps - span, warm_steps):
                        name = names[(t + k) % 2]
                        out.setdefault(("warm", f"{name}: {ENTRY}"), []).append(entry_step(t, name))
                for t in range(warm_steps + fresh_steps, warm_steps + 2 * fresh_steps):
                    name = random.choice(names)
                    out.setdefault(("fresh", f"{name}: {ENTRY}"), []).append(entry_step(t, name))
            finally:
                SP.run_layers = real_entry
        finally:
            RC.resolve_layer = original
            engine.close()
    out[("meta", "names")] = names   # type: ignore[assignment]
    return out


def report(out: dict, args: argparse.Namespace) -> str:
    old, new = out[("meta", "names")]
    lines = [
        f"#### The pass's phases, commit {args.against} beside the current pass on one engine, {utc_stamp()}",
        "",
        f"`{command_line(__file__, sys.argv[1:])}`; {machine()}; one TP4 rank of the V4.1 tables, B = 128; warm: "
        f"{args.rounds} rounds x 30 positions, the two passes alternating step by step, the pass called directly "
        f"per layer; fresh: 240 decode steps of new tokens through begin_step (per layer), the pass chosen at "
        f"random per step; then the same engine through begin_step's compiled entry, warm and 240 more fresh "
        f"steps, each pass compiled into a copy of `steppass.run_layers`. Per step (both layers), from the cycle "
        f"counter (us); begin_step in thread CPU (us).",
        "",
        f"| steps | phase | {old} (min / median / max) | current (min / median / max) | current / {old} |",
        "|---|---|---|---|---|",
    ]
    for kind in ("warm", "fresh"):
        phases = PHASES + (("begin_step",) if kind == "fresh" else ()) + (ENTRY,)
        for phase in phases:
            a, b = out[(kind, f"{old}: {phase}")], out[(kind, f"{new}: {phase}")]
            ma, mb = statistics.median(a), statistics.median(b)
            ratio = f"{mb / ma:.2f}" if ma > 0.05 else "-"
            lines.append(f"| {kind} | {phase} | {min(a):.1f} / {ma:.1f} / {max(a):.1f} | "
                         f"{min(b):.1f} / {mb:.1f} / {max(b):.1f} | {ratio} |")
        if kind == "warm":
            f = out[("warm", "floor")]
            whole_b = statistics.median(out[("warm", f"{new}: whole pass")])
            whole_a = statistics.median(out[("warm", f"{old}: whole pass")])
            lines.append(f"| warm | directory floor (numpy gather, random rows) | {min(f):.1f} / "
                         f"{statistics.median(f):.1f} / {max(f):.1f} | whole pass / floor: {old} "
                         f"{whole_a / statistics.median(f):.2f}x, current {whole_b / statistics.median(f):.2f}x | |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--against", required=True, metavar="COMMIT", help="the earlier pass, read from git")
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--append", action="store_true", help=f"append the table to BENCHMARKS.md ({SUBSECTION})")
    args = ap.parse_args()
    out = measure(args.against, args.rounds)
    return publish(report(out, args), args.append, SECTION, SUBSECTION)


if __name__ == "__main__":
    raise SystemExit(main())
