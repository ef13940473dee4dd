"""Where begin_step's time goes: the directory pass beside cut-down copies of itself, in one process.

Each ablation is compiled from `cache/directory.py`'s own source with one part
cut out (every cut is asserted, so a change to the pass stops this script
instead of measuring something else). Each variant drives its own engine (one
TP4 rank of the V4.1 tables, B = 128, the same cache and sparse disk regions
as `_ab_worker.py begin_step`), and every step runs once per engine in
shuffled order, so the machine's drift falls on all variants alike. The cuts
are wrong on purpose (descriptors not filled as foreign first) and run on
warm steps only, where every lookup is a hit; what each saves bounds what a
pass without that part could gain. (A first version also cut the hits' slot
state; the pass now leaves a warm step's pins to step end, see
`cache.directory`.) Beside them, in the
same rounds:
- the directory floor: one numpy gather of as many random directory entries as
  the step has owned lookups (what `bench_hot_path.py` quotes);
- right passes with one part changed, not ablations: the first wave without
  its directory prefetch (the loads of the counting sweep come first; the pass
  before commit dc3681f did the same), and without the hits' reference-bit
  prefetch;
- an ablation without the hits' reference bit at all (no prefetch, no store):
  CLOCK would lose recency, but it shows what the second random line of each
  hit (a byte of `ref`; the directory floor counts only the first) costs;
- begin_step with a compiled stub in place of the pass (the pass's 35
  arguments, returns at once): all of begin_step's Python and numba's
  dispatch, without the pass's work (no gather follows it);
- with `--against COMMIT`, that commit's pass, read from git and compiled
  beside the current one (a pass from before the own_pos / own_row scratch is
  called through a wrapper that drops them).

These engines run begin_step one layer at a time from Python (`_one_entry`
off), the path each cut replaces the pass of. One more engine runs the pass as
is inside begin_step's one compiled entry (`engine.steppass`, every layer's
pass and io_uring submission in one call): its row beside "as is" is what the
entry saves, in warm and in `--fresh` steps.

`--fresh` runs decode steps of new tokens instead (misses, CLOCK victims, pages
submitted), each step once per engine, with the right passes only: as is, the
first wave without its prefetch, without the hash-table prefetches for misses
(their row's and page's lines, added in commits 298c67d and a00b770), without
the hits' reference-bit prefetch, without the slot-state prefetch of hits after
a miss, and without any prefetch waves.

    .venv/bin/python benchmarks/bench_pass_anatomy.py [--rounds 4] [--fresh] [--against COMMIT] [--append]
"""

from __future__ import annotations

import argparse
import importlib.util
import random
import statistics
import sys
import tempfile
from pathlib import Path

import numpy as np
from numba import njit

from _common import ROOT, command_line, git_show, machine, publish, utc_stamp

sys.path.insert(0, str(Path(__file__).parent))
import _ab_worker as W  # noqa: E402

import slacktier.cache.rowcache as RC  # noqa: E402
from slacktier.engine.step import StepEngine  # noqa: E402
from slacktier.tables.engram_hash import EngramLayout  # noqa: E402

SECTION = "## The tier: page sources, cache and step engine"
SUBSECTION = "### Hot path against issue 14's targets"
STUB = "stub"
ENTRY = "one compiled entry"
LOADS = "first wave without its directory prefetch (loads first, as before commit dc3681f)"
NO_HTAB = "no hash-table prefetches for misses (the pass before commit 298c67d)"
NO_REF = "no reference-bit prefetch for hits"
NO_REF_LINE = "no reference bit for hits at all (neither its prefetch nor its store)"
NO_STATE = "no slot-state prefetch for hits after a miss"
SOURCE = ROOT / "src" / "slacktier" / "cache" / "directory.py"

_WAVES_END = "    lstate[SPARE] = touch"
_COUNT_SWEEP = "    # Count the misses"
_DIR_PREFETCH = "                prefetch(directory, r)\n"
_FOREIGN = """    desc_kind[:n] = KIND_FOREIGN
    desc_idx[:n] = -1
"""
_FOREIGN_BARE = ""
_REF_PREFETCH = """        if s >= 0:
            prefetch(ref, s)
"""
_STATE_PREFETCH = """            if n_absent > 0:
                prefetch(state, s)
"""
_REF_STORE = ("                ref[s] = 1    # CLOCK's reference bit now, a store: the pin itself only matters "
              "within the step\n")
# a miss's prefetches of its two probes' lines: from the first line to the count after them
_MISS_PREFETCH = "            prefetch(hflat, np.int64((np.uint64(r) * _GOLDEN)"
_MISS_COUNTED = "            n_absent += 1\n"


def _cut(text: str, start: str, end: str, put: str) -> str:
    a, b = text.index(start), text.index(end)
    return text[:a] + put + text[b:]


def _replace(text: str, old: str, new: str) -> str:
    if text.count(old) != 1:
        raise SystemExit(f"the pass changed: cannot find the part to cut ({old.strip().splitlines()[0]!r})")
    return text.replace(old, new)


def pass_source(commit: str) -> str:
    """The directory pass's source (`cache/directory.py`) at `commit`, from git."""
    return git_show(commit, "src/slacktier/cache/directory.py")


def variants(fresh: bool = False, against: str | None = None) -> dict[str, str]:
    """Name -> source of the pass with one part cut out ("as is" untouched); fresh: only the cuts that leave a
    right pass (prefetches), which may run on steps with misses; `against`: also that commit's pass."""
    src = SOURCE.read_text()
    for marker in (_WAVES_END, _COUNT_SWEEP, _MISS_PREFETCH, _MISS_COUNTED):
        if src.count(marker) != 1:
            raise SystemExit(f"the pass changed: marker {marker!r} not found once")
    no_foreign = _replace(src, _FOREIGN, _FOREIGN_BARE)
    by_loads = _replace(src, _DIR_PREFETCH, "")
    no_waves = _cut(by_loads, _COUNT_SWEEP, _WAVES_END, "    touch = np.int64(0)\n")
    no_htab = _cut(src, _MISS_PREFETCH, _MISS_COUNTED, "")
    no_ref = _replace(src, _REF_PREFETCH, "        if s >= 0:\n")
    no_ref_line = _replace(no_ref, _REF_STORE, "")
    no_state = _replace(src, _STATE_PREFETCH, "")
    old = {f"of commit {against}": pass_source(against)} if against else {}
    if fresh:
        return {"as is": src, **old, LOADS: by_loads, NO_HTAB: no_htab, NO_REF: no_ref, NO_STATE: no_state,
                "no prefetch waves": no_waves}
    return {"as is": src, **old, LOADS: by_loads, NO_REF: no_ref, NO_REF_LINE: no_ref_line,
            "no foreign descriptors": no_foreign, "no prefetch waves": no_waves}


def compile_pass(name: str, text: str, tmp: Path):
    path = tmp / f"pass_{abs(hash(name))}.py"
    path.write_text(text.replace("cache=True", "cache=False"))
    spec = importlib.util.spec_from_file_location(path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = mod   # its dataclasses look themselves up there
    spec.loader.exec_module(mod)
    fn = mod.resolve_layer
    if fn.py_func.__code__.co_argcount == _ARGS_BEFORE_OWN:   # before commit <this round>: no own_pos / own_row
        return _without_own(fn)
    return fn


_ARGS_BEFORE_OWN = 33


def _without_own(fn):
    """A pass of the current signature that calls `fn`, an earlier pass without the own_pos / own_row scratch."""
    args = ", ".join(fn.py_func.__code__.co_varnames[:30])
    space: dict = {"fn": fn}
    exec(f"def call({args}, own_pos, own_row, buf_base, pad_id, counts):\n"
         f"    return fn({args}, buf_base, pad_id, counts)\n", space)
    return njit(nogil=True, cache=False)(space["call"])


@njit(nogil=True, cache=False)
def _stub(ids, row_start, rows, owned_only, rank_starts, rank_region, lossy, seen,
          layer_key, directory, owned, lstate, slot_layer, slot_row, state, ref, fill_miss, step,
          htab, stamp, hbits, desc_kind, desc_idx, miss_buf, miss_inpage, miss_slot, miss_row,
          page_region, page_no, page_buf, own_pos, own_row, buf_base, pad_id, counts):   # pragma: no cover
    counts[:] = 0   # every lookup resolved to nothing: no pages to submit
    counts[0] = ids.shape[0] * ids.shape[1]
    counts[8] = -1   # C_BAD: no bad id
    return 0


def measure(rounds: int, warm_steps: int = 64, span: int = 30, fresh: bool = False,
            against: str | None = None) -> dict:
    """Warm: the last `span` warm-up positions looked up again, `rounds` times. Fresh: rounds x span steps of
    new tokens, each once per engine."""
    layout = EngramLayout.v41()
    ids = W._ids(layout, 128, warm_steps + (rounds * span if fresh else 0))
    original = RC.resolve_layer
    out: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        passes = {name: compile_pass(name, text, tmp) for name, text in variants(fresh, against).items()}
        if not fresh:
            passes[STUB] = _stub
        engines = {name: W.rank_engine(layout, tmp, tag=f"-{k}") for k, name in enumerate(passes)}
        for e in engines.values():   # the variants replace the pass RowCache.resolve calls, one layer at a time
            e._one_entry = False
        engines[ENTRY] = W.rank_engine(layout, tmp, tag="-entry")   # the pass as is, inside engine.steppass
        passes[ENTRY] = _REAL
        out = {name: [] for name in passes} | {"floor": []}
        ends: dict[str, list[float]] = {name: [] for name in passes}

        def step(name: str, t: int) -> float:
            RC.resolve_layer = passes[name]
            cpu, end, _ = W.timed_step(engines[name], ids[t], gather=name != STUB)   # the stub resolved nothing
            ends[name].append(end)
            return cpu

        try:
            # every engine sees the same steps: the last `span` positions are looked up again, all hits
            for t in range(warm_steps):
                for e in engines.values():
                    _warm(e, ids[t])
            for name in passes:   # compile each cut (and the stub) outside the timed rounds
                step(name, warm_steps - 1)
            for v in ends.values():
                v.clear()
            rng = np.random.default_rng(7)
            order = list(passes) + ["floor"]
            if fresh:
                steps = list(range(warm_steps, warm_steps + rounds * span))
            else:
                steps = [t for _ in range(rounds) for t in range(warm_steps - span, warm_steps)]
            for t in steps:
                random.shuffle(order)
                for name in order:
                    if name == "floor":
                        out[name].append(W._directory_floor(engines["as is"], ids[t], rng))
                    else:
                        out[name].append(step(name, t))
        finally:
            RC.resolve_layer = original
            for e in engines.values():
                e.close()
    return out | {f"end_step:{name}": v for name, v in ends.items()}


def _warm(engine: StepEngine, ids_t: np.ndarray) -> None:
    """A warm-up step with the real pass (the ablations are only right on hits)."""
    RC.resolve_layer = _REAL
    engine.begin_step(ids_t)
    for layer in engine.layers:
        engine.gather(layer)
    engine.end_step()


_REAL = RC.resolve_layer


def report(out: dict, args: argparse.Namespace) -> str:
    base = statistics.median(out["as is"])
    floor = statistics.median(out["floor"])
    rows = []
    for name, v in out.items():
        if name.startswith("end_step:"):
            continue
        med = statistics.median(v)
        end = out.get(f"end_step:{name}")
        end_cell = f"{statistics.median(end):.1f}" if end else ""
        if name == "floor":
            label = "directory floor (numpy gather of the owned lookups' entries)"
        elif name == STUB:
            label = "begin_step per layer, pass replaced by a stub (Python + numba dispatch only)"
        elif name == ENTRY:
            label = "begin_step, all layers in one compiled entry (engine.steppass), pass as is"
        else:
            label = f"begin_step per layer, pass {name}"
        right = name in (LOADS, NO_HTAB, NO_REF, NO_STATE, ENTRY) or name.startswith("of commit ")
        saved = "" if right or name in ("floor", STUB, "as is") else f"{base - med:+.1f}"
        rows.append(f"| {label} | {min(v):.1f} / {med:.1f} / {max(v):.1f} | {med / base:.2f} | {med / floor:.2f} | "
                    f"{saved} | {end_cell} |")
    if args.fresh:
        what = (f"{args.rounds * 30} steps of new tokens per variant (misses, pages submitted), variants "
                "interleaved in shuffled order in one process; CPU time of the calling thread (us). Every pass "
                "here is right: they differ in prefetches and loops, not in what they resolve.")
    else:
        what = (f"{args.rounds} rounds x 30 warm steps per variant, variants interleaved in shuffled order in one "
                "process; CPU time of the calling thread (us). Ablated passes are wrong on purpose and run only "
                "where every lookup hits: \"saved\" bounds what dropping that part could gain, not a result.")
    return "\n".join([
        f"#### Anatomy of {'fresh' if args.fresh else 'warm'} begin_step, {utc_stamp()}",
        "",
        f"`{command_line(__file__, sys.argv[1:])}`; {machine()}; {what}",
        "",
        "| what ran | us (min / median / max) | vs pass as is | vs floor | saved vs as is (us, median) | "
        "end_step after it (us, median) |",
        "|---|---|---|---|---|---|",
        *rows,
    ])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--fresh", action="store_true", help="decode steps of new tokens instead of warm steps, "
                    "right passes only (no stub)")
    ap.add_argument("--against", default=None, metavar="COMMIT",
                    help="also run that commit's pass (from git) beside the current one")
    ap.add_argument("--append", action="store_true", help=f"append the table to BENCHMARKS.md ({SUBSECTION})")
    args = ap.parse_args()
    out = measure(args.rounds, fresh=args.fresh, against=args.against)
    block = report(out, args)
    return publish(block, args.append, SECTION, SUBSECTION)


if __name__ == "__main__":
    raise SystemExit(main())
