"""begin_step against its floor, one TP4 rank of V4.1, uncached and at agent traffic's hit rates (issue 28).

One process serves what one TP rank's process serves: both V4.1 Engram layers'
shards of `--rank` (default 3, the rank of 4-gram heads, which misses most),
`owned_only`, each shard a sparse file read through the io_uring device queue
(so begin_step submits real reads: layer 1's are in flight while layer 14 is
resolved), a row cache of `--cache-rows` (default 1M) split half and half.
Two engines of that shape, side by side, step by step:

- `uncached`: every step looks up rows drawn at random from the rank's shard
  (6 of 24 columns; the other 18 are other ranks' rows), into a cache already
  filled by random rows: every lookup misses and evicts. At B = 128 that is 768
  lookups per layer, the figure of the issue.
- `agent`: the built-in agent traffic (real trajectories, DeepSeek-V4
  tokenizer, the V4.1 hash), replayed B sessions at a time; prefill chunks warm
  the cache off the clock; full-batch decode steps are timed.

The floors, measured in the same process on the same traffic, in turn with
begin_step step by step (every step is gathered and ended, so each timed part
follows a whole step):
- the floor: one compiled loop that does what any resolve must, and nothing
  else: one prefetched probe of each in-table lookup into that engine's own
  directory (cache.rowdir; before issue 28, the int32 array of a row per table
  row), then a stamped hash-table dedup of the pages of the rows it did not find;
- the floor with the evictions' reads: the same, plus, for each distinct row not
  found, one prefetched probe of the directory entry of the row that CLOCK's next
  victim slot holds (read only): the random directory reads a full cache's pass
  makes, evictions included. The compiled pass against it shows how far the pass
  is from its own memory traffic.
Before each timed part the CPU caches are flushed (a 96 MiB sweep; this VM's L3
is 32 MiB), as after the model's forward; `--no-flush` times them as they come.

`--admission RULE` adds a twin of the agent engine that serves that admission rule
(`[engine] admission`), configured as `agent` otherwise (as `agent+ahead` with
`--evict-ahead`) and replayed on the same steps with the prefill chunks flagged
as prefill: what the rule costs begin_step at the rank's full cache, hits and
pages beside it.

`--flags` passes each timed step's decode flags to every engine's begin_step, as the
SGLang and vLLM plug-ins do on every step (without it, timed steps pass none: every
token decodes, and an engine without a rule checks nothing).

`--evict-ahead` adds a twin of each engine with `evict_ahead` on (end_step
empties as many slots per layer as the step claimed: the next step's misses
claim them without reading a victim's entry), on the same steps; end_step's
time is reported beside begin_step's, since that is where the work went.

Reported per engine and B: begin_step wall and thread-CPU time (min / median /
max of the rounds' medians), the compiled pass alone (the engine's resolve +
submit counters), the floor, their ratio, the hit rate and pages per step, and
the host memory of the rank's directories beside what 4 B per shard row took.
`--json PATH` writes every figure.

    .venv/bin/python benchmarks/engine/bench_host_pass.py [--batches 32,64,128] [--rounds 3] [--steps 40]
        [--admission counters] [--evict-ahead] [--flags] [--no-flush]
"""

from __future__ import annotations

import argparse
import datetime
import inspect
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from numba import njit

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # the repo root: benchmarks.* imports
from benchmarks._harness import timed_step  # noqa: E402

from slacktier.cache import ADMISSIONS, RowCache
from slacktier.cache.kernels import HAND, prefetch
from slacktier.engine.step import StepEngine
from slacktier.engine.tables import TableSpec
from slacktier.store.disk import DiskSource
from slacktier.tables.engram_hash import EngramLayout
from slacktier.tables.layout import PAGE_BYTES, ROWS_PER_PAGE, pages_for_rows, shard_bounds
from slacktier.tables.regions import Region

try:   # the directory of issue 28; before it, an int32 array of one entry per shard row
    from slacktier.cache import rowdir as D
except ImportError:  # pragma: no cover - a run against an earlier commit (--src)
    D = None

RANKS = 4
COLUMNS = 24
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_FLUSH = np.ones(96 * 2**20 // 8, dtype=np.int64)


def flush_caches() -> int:
    """Read 96 MiB (3x this VM's L3) so the next measurement starts with cold CPU caches."""
    return int(_FLUSH.sum())


if D is not None:
    @njit(nogil=True, cache=True)
    def _probe_all(dtab, rows, out):
        mask = dtab.shape[0] - 1
        for j in range(rows.shape[0]):   # all probes' lines in flight together, as the pass does
            prefetch(dtab, D.home(rows[j], mask))
        for j in range(rows.shape[0]):
            out[j] = D.find(dtab, rows[j])
else:  # pragma: no cover
    @njit(nogil=True, cache=True)
    def _probe_all(dtab, rows, out):
        for j in range(rows.shape[0]):
            prefetch(dtab, rows[j])
        for j in range(rows.shape[0]):
            out[j] = dtab[rows[j]]


@njit(nogil=True, cache=True)
def _dedup_pages(rows, slot, htab, stamp, bits):
    """Pages of the rows without a slot, each counted once (a stamped open-addressing table)."""
    mask = (np.int64(1) << bits) - 1
    pages = 0
    for j in range(rows.shape[0]):
        if slot[j] >= 0:
            continue
        key = rows[j] // ROWS_PER_PAGE
        h = np.int64((np.uint64(key) * _GOLDEN) >> np.uint64(64 - bits))
        while htab[h, 0] == stamp and htab[h, 1] != key:
            h = (h + 1) & mask
        if htab[h, 0] != stamp:
            htab[h, 0] = stamp
            htab[h, 1] = key
            pages += 1
    return pages


if D is not None:
    @njit(nogil=True, cache=True)
    def _probe_victims(dtab, owned, slot_row, slot_layer, hand, n):
        """Find the directory entries of the rows in the `n` owned slots from the CLOCK hand on (read only):
        the random reads a full cache's evictions make, one per evicted row."""
        mask = dtab.shape[0] - 1
        m = owned.shape[0]
        for k in range(min(n, m)):
            s = owned[(hand + k) % m]
            if slot_layer[s] >= 0:
                prefetch(dtab, D.home(slot_row[s], mask))
        found = 0
        for k in range(min(n, m)):
            s = owned[(hand + k) % m]
            if slot_layer[s] >= 0:
                found += D.find(dtab, slot_row[s]) >= 0
        return found


class Floor:
    """The minimal resolve of a step on one engine's directories (module doc). `run` times two floors on the
    same ids: the probes and page dedup alone, and the same plus one directory read per row a full cache
    must evict for (the victims' entries: the pass's own random reads of the directory, evictions included).
    """

    def __init__(self, engine: StepEngine, shards: dict[int, tuple[int, int]]) -> None:
        self.engine = engine
        self.shards = shards
        self.htab = np.zeros((1 << 16, 2), dtype=np.int64)
        self.stamp = 0
        self.slot = np.empty(COLUMNS * 4096, dtype=np.int64)

    def run(self, ids: np.ndarray, evictions: bool = False) -> tuple[float, int]:
        """(us, pages) of the floor on ids [T, 2, 24]: the compiled loops alone (each layer's in-shard rows are
        picked out before the clock starts); with `evictions`, also the victims' directory reads."""
        work = []
        cache = self.engine.cache
        for axis, layer in enumerate(self.engine.layers):
            lo, hi = self.shards[layer]
            flat = ids[:, axis, :].reshape(-1)
            st = cache.layer(layer)
            rows = flat[(flat >= lo) & (flat < hi)] - lo
            evict = 0
            if evictions:   # the distinct rows not cached: what a full cache evicts for (found before the clock)
                evict = int(np.unique(rows[cache.slot_of(layer, rows) < 0]).shape[0])
            work.append((st, rows, evict))
        if FLUSH:
            flush_caches()
        t0 = time.perf_counter_ns()
        pages = 0
        for st, rows, evict in work:
            slot = self.slot[:rows.shape[0]]
            _probe_all(st.directory, rows, slot)
            self.stamp += 1
            pages += _dedup_pages(rows, slot, self.htab, self.stamp, 16)
            if evict:
                _probe_victims(st.directory, st.owned, cache.slot_row, cache.slot_layer, st.lstate[HAND], evict)
        return (time.perf_counter_ns() - t0) / 1e3, pages


def build_rank_engine(layout: EngramLayout, folder: Path, cache_rows: int, rank: int, max_tokens: int,
                      evict_ahead: bool = False,
                      admission: str = "off") -> tuple[StepEngine, dict[int, tuple[int, int]]]:
    """One rank of TP4: both layers' shards of `rank` (a sparse file each, io_uring), owned_only."""
    tables, sources, shards = [], [], {}
    for i, layer in enumerate(layout.layer_ids):
        lo, hi = shard_bounds(layout.rows(i), layout.column_bounds(i), rank, RANKS)
        path = folder / f"layer{layer}.rank{rank}.sparse"
        region = Region(layer=layer, rank=rank, path=str(path), offset_bytes=0, pages=pages_for_rows(hi - lo),
                        row_start=lo, rows=hi - lo)
        with open(path, "wb") as f:
            f.truncate(region.pages * PAGE_BYTES)   # sparse: reads return zeros, no disk space used
        source = DiskSource([region])
        sources.append(source)
        tables.append(TableSpec(layer=layer, row_start=lo, rows=hi - lo, source=source, cache_share=0.5,
                                regions=(region,)))
        shards[layer] = (lo, hi)
    # CLOCK alone unless asked (the engine's default is on since issue 28); an older tree's engine has no such option
    kw = {"evict_ahead": evict_ahead} if "evict_ahead" in inspect.signature(StepEngine).parameters else {}
    if admission != "off":
        kw["admission"] = admission
    engine = StepEngine(tables, RowCache(cache_rows), max_tokens=max_tokens, owned_sources=sources,
                        owned_only=True, **kw)
    return engine, shards


def random_ids(layout: EngramLayout, shards: dict, rank: int, tokens: int, rng: np.random.Generator) -> np.ndarray:
    """ids [T, 2, 24]: the rank's 6 columns random rows of its shard, the other 18 other ranks' rows."""
    ids = np.empty((tokens, len(layout.layer_ids), COLUMNS), dtype=np.int64)
    per = COLUMNS // RANKS
    for axis, layer in enumerate(layout.layer_ids):
        lo, hi = shards[layer]
        ids[:, axis, :] = rng.integers(0, lo if lo > 0 else hi, (tokens, COLUMNS)) + (0 if lo > 0 else hi)
        ids[:, axis, rank * per:(rank + 1) * per] = rng.integers(lo, hi, (tokens, per))
    return ids


def agent_steps(layout: EngramLayout, batch: int, seed: int):
    """The built-in agent traffic replayed `batch` sessions at a time (serve.timeline's sessions)."""
    from slacktier.serve.timeline import SweepConfig, sweep_sessions
    from slacktier.workloads.hashing import EngramLookupHasher
    from slacktier.workloads.replay import ReplayConfig, replay_steps

    cfg = SweepConfig(workload="agent", max_session_tokens=4096, max_turns=2, seed=seed)
    pool = sweep_sessions(cfg, batch)
    rc = ReplayConfig(batch=batch, decode_tokens=128, prefill_chunk_tokens=4096, start_spread_steps=32, seed=seed)
    return replay_steps(pool, EngramLookupHasher(layout), rc)


FLUSH = True
FLAGS = False
AHEAD = "+ahead"


def run_one(engine: StepEngine, floor: Floor, ids: np.ndarray, part: str) -> dict:
    """One step: `part` "floor" or "floor_ev" times that floor on its ids and not begin_step; "step" times
    begin_step. Each timed part after a cache flush (unless --no-flush); the step is
    gathered and ended either way, so the engine sees every step and each timed part follows a whole step."""
    out: dict = {}
    if part != "step":
        out[f"{part}_us"], out["floor_pages"] = floor.run(ids, evictions=part == "floor_ev")
        warm(engine, ids)
        return out
    if FLUSH:
        flush_caches()
    decode = np.ones(ids.shape[0], dtype=bool) if FLAGS else None   # all decode, as the timed steps are
    wall, cpu, counters = timed_step(engine, ids, end_us := [], decode)
    lay = counters.layers.values()
    return {"wall_us": wall, "cpu_us": cpu, "end_us": end_us[0],
            "pass_us": sum(c.resolve_us + c.submit_us for c in lay), "resolve_us": sum(c.resolve_us for c in lay),
            "submit_us": sum(c.submit_us for c in lay), "hits": sum(c.hits for c in lay),
            "served": sum(c.lookups - c.zero_rows for c in lay), "pages": sum(c.pages_read for c in lay)}


def warm(engine: StepEngine, ids: np.ndarray, decode: np.ndarray | None = None) -> None:
    """One whole step; `decode` (the tokens' phase) only for the engine whose admission rule reads it: an
    older tree's begin_step (--src) takes no flags."""
    if decode is None:
        engine.begin_step(ids)
    else:
        engine.begin_step(ids, decode)
    for layer in engine.layers:
        engine.gather(layer)
    engine.end_step()


def mmm(values: list[float]) -> tuple[float, float, float]:
    v = sorted(values)
    return v[0], statistics.median(v), v[-1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="32,64,128")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=40, help="timed decode steps per (round, engine, B)")
    ap.add_argument("--cache-rows", type=int, default=1_000_000, help="the rank's cache rows, both layers")
    ap.add_argument("--rank", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dir", default="", help="where the sparse shard files go (default: a temp dir)")
    ap.add_argument("--json", default="")
    ap.add_argument("--no-flush", action="store_true", help="no cache flush before the floor and begin_step")
    ap.add_argument("--admission", default="off", choices=ADMISSIONS,
                    help="also run a twin of the agent engine that serves this admission rule (the replay's prefill "
                         "chunks flagged as prefill), on the same steps, in turn")
    ap.add_argument("--evict-ahead", action="store_true",
                    help="also run each engine's twin with evict_ahead (end_step empties the next step's slots), "
                         "on the same steps, in turn")
    ap.add_argument("--flags", action="store_true",
                    help="pass each timed step's decode flags (all decode) to every engine, as the plug-ins do")
    args = ap.parse_args()
    global FLUSH, FLAGS
    FLUSH = not args.no_flush
    FLAGS = args.flags
    batches = [int(b) for b in args.batches.split(",")]
    names = ["uncached", "agent"] + ([f"uncached{AHEAD}", f"agent{AHEAD}"] if args.evict_ahead else [])
    # the rule's twin is configured as the agent engine it is compared with: evict-ahead too when asked
    twin = f"agent{AHEAD if args.evict_ahead else ''}+{args.admission}"
    names += [twin] if args.admission != "off" else []
    layout = EngramLayout.v41()
    rng = np.random.default_rng(args.seed)
    results: dict[tuple[str, int], list[dict]] = {}
    rounds: dict[tuple[str, int], list[dict]] = {}
    with tempfile.TemporaryDirectory(dir=args.dir or None) as d:
        engines = {}
        for name in names:
            sub = Path(d) / name
            sub.mkdir()
            engines[name] = build_rank_engine(layout, sub, args.cache_rows, args.rank, 4096,
                                              evict_ahead=AHEAD in name,
                                              admission=args.admission if name == twin else "off")
        shard_rows = {l: hi - lo for l, (lo, hi) in engines["agent"][1].items()}
        for name in names:
            if name.startswith("uncached"):   # the twins get the same fill, and the same steps below
                engine, shards = engines[name]
                fill = np.random.default_rng(args.seed + 1)
                t = time.perf_counter()
                for _ in range(int(1.2 * args.cache_rows / (2 * 6 * 4096)) + 1):   # fill with random rows
                    warm(engine, random_ids(layout, shards, args.rank, 4096, fill))
                print(f"{name} engine's cache filled in {time.perf_counter() - t:.0f} s", flush=True)
        floors = {name: Floor(e, s) for name, (e, s) in engines.items()}
        replays = {(name, b): agent_steps(layout, b, args.seed) for b in batches for name in names}
        for r in range(args.rounds):
            order = list(rng.permutation(batches))
            for b in order:
                b = int(b)
                step_rng = {name: np.random.default_rng([args.seed, r, b]) for name in names}
                for name in rng.permutation(names):   # engines in a new order each round and B
                    name = str(name)
                    engine, shards = engines[name]
                    # timed begin_steps, floors and floors with the evictions' reads: in turn, step by step
                    got, fl, fe = [], [], []
                    parts = (("step", got), ("floor", fl), ("floor_ev", fe))
                    turn = 0
                    while min(len(got), len(fl), len(fe)) < args.steps:
                        if name.startswith("uncached"):
                            ids = random_ids(layout, shards, args.rank, b, step_rng[name])
                        else:
                            st = next(replays[name, b])   # prefill chunks and part-batch steps warm the cache, untimed
                            if st.kind != "decode" or st.num_tokens != b:
                                warm(engine, np.ascontiguousarray(st.ids), st.is_decode if name == twin else None)
                                continue
                            ids = np.ascontiguousarray(st.ids)
                        part, into = parts[turn % 3]
                        turn += 1
                        into.append(run_one(engine, floors[name], ids, part))
                    results.setdefault((name, b), []).extend(got)
                    med = {k: statistics.median(g[k] for g in got)
                           for k in ("wall_us", "cpu_us", "pass_us", "resolve_us", "submit_us", "end_us")}
                    med |= {"floor_us": statistics.median(f["floor_us"] for f in fl),
                            "floor_ev_us": statistics.median(f["floor_ev_us"] for f in fe)}
                    rounds.setdefault((name, b), []).append(
                        med | {"ratio": med["wall_us"] / med["floor_us"], "pass_ratio": med["resolve_us"] / med["floor_us"],
                               "ratio_ev": med["wall_us"] / med["floor_ev_us"],
                               "pass_ratio_ev": med["resolve_us"] / med["floor_ev_us"]})
                print(f"round {r + 1}/{args.rounds} B={b} done", flush=True)
        dir_bytes = {name: sum(e.cache.layer(l).directory.nbytes for l in e.layers) for name, (e, _) in engines.items()}
        for e, _ in engines.values():
            e.close()
    old_bytes = 4 * sum(shard_rows.values())
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [f"begin_step against its floor: rank {args.rank} of TP4, V4.1 (both layers' shards, owned_only), "
             f"io_uring reads in flight, cache {args.cache_rows:,} rows split 0.5/0.5; {now}, {platform.node()}, "
             f"{os.cpu_count()} CPUs; {args.rounds} rounds x {args.steps} steps per engine and B, B in shuffled "
             f"order per round, begin_step and the two floors timed in turn, step by step (each after a whole step); "
             + ("no cache flush" if args.no_flush else "each timed part after a 96 MiB cache flush")
             + ("; timed steps pass decode flags (all decode) to every engine" if args.flags else ""),
             "| engine | B | lookups served / step | hit rate | pages / step | begin_step wall us (min / med / max "
             "of round medians) | thread CPU us (med) | compiled pass: resolve + submit us (med) | floor us (med) | "
             "begin_step / floor (min / med / max of rounds) | compiled resolve / floor (med) | floor with the evictions' "
             "reads us (med) | begin_step / it (min / med / max) | compiled resolve / it (med) | end_step us (med) |",
             "|---|---:|---:|---:|---:|---|---:|---:|---:|---|---:|---:|---|---:|---:|"]
    doc = {"when": now, "machine": platform.node(), "args": vars(args), "directory_bytes": dir_bytes,
           "directory_bytes_4B_per_row": old_bytes, "rows": {}}
    for b in batches:
        for name in names:
            got, rs = results[name, b], rounds[name, b]
            wall = mmm([r["wall_us"] for r in rs])
            ratio = mmm([r["ratio"] for r in rs])
            served = statistics.mean(g["served"] for g in got)
            hit = sum(g["hits"] for g in got) / max(1, sum(g["served"] for g in got))
            pages = statistics.median(g["pages"] for g in got)
            cpu = statistics.median(r["cpu_us"] for r in rs)
            res = statistics.median(r["resolve_us"] for r in rs)
            sub = statistics.median(r["submit_us"] for r in rs)
            fl = statistics.median(r["floor_us"] for r in rs)
            rp = statistics.median(r["pass_ratio"] for r in rs)
            fe = statistics.median(r["floor_ev_us"] for r in rs)
            ratio_ev = mmm([r["ratio_ev"] for r in rs])
            rpe = statistics.median(r["pass_ratio_ev"] for r in rs)
            lines.append(f"| {name} | {b} | {served:,.0f} | {hit:.3f} | {pages:,.0f} | {wall[0]:.0f} / {wall[1]:.0f}"
                         f" / {wall[2]:.0f} | {cpu:.0f} | {res:.0f} + {sub:.0f} | {fl:.0f} | {ratio[0]:.2f} / {ratio[1]:.2f} / "
                         f"{ratio[2]:.2f}x | {rp:.2f}x | {fe:.0f} | {ratio_ev[0]:.2f} / {ratio_ev[1]:.2f} / {ratio_ev[2]:.2f}x | "
                         f"{rpe:.2f}x | {statistics.median(r['end_us'] for r in rs):.0f} |")
            doc["rows"][f"{name}/{b}"] = {"rounds": rs, "served": served, "hit_rate": hit, "pages": pages}
    lines.append(f"directories of the rank (both layers): {dir_bytes['agent'] / 2**20:.1f} MiB, sized to the cache; "
                 f"4 B per shard row took {old_bytes / 2**20:.0f} MiB")
    print("\n".join(lines))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
