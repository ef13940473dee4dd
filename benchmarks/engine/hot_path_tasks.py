"""One measurement of the hot path, run against whichever SlackTier tree is first on PYTHONPATH.

bench_hot_path.py (issue 14) runs this file under the current tree (and, with
--before, under an earlier one, alternately, so both are measured side by side
in one run; issue 10's refactor A/B ran it the same way). Each task also measures its floor in the same process:
begin_step the random directory reads it cannot avoid, the cold gather torch's
`index_select` plus the codec's table on the same rows. The few constructors whose signatures the refactor changed
are bridged below (`_region`, `_table`, `_disk`, `_dram`); everything timed is
each tree's own code.

    PYTHONPATH=<tree>/src python benchmarks/engine/hot_path_tasks.py begin_step|gather|disk [--quick]

Prints one JSON object: the medians over the steps or batches of this run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

import slacktier
from slacktier.cache import RowCache
from slacktier.engine.step import StepEngine
from slacktier.testing.engine import pack_pages, real_text
from slacktier.store.base import PageBufferPool, PageReads
from slacktier.tables.codec import dequantize, synthetic_rows
from slacktier.tables.engram_hash import EngramHasher, EngramLayout
from slacktier.tables.layout import PAGE_BYTES, pages_for_rows, shard_bounds
from slacktier.tables.tokenizer import encode

NEW = hasattr(__import__("slacktier.engine", fromlist=["reads"]), "LayerReads")
RANKS = 4


def _region(layer: int, rank: int, path: str, offset: int, pages: int, row_start: int, rows: int):
    if NEW:
        from slacktier.tables.regions import Region
        return Region(layer=layer, rank=rank, path=path, offset_bytes=offset, pages=pages, row_start=row_start,
                      rows=rows)
    from slacktier.store.base import RegionSpec
    return RegionSpec(layer=layer, rank=rank, path=path, offset_bytes=offset, pages=pages)


def _table(layer: int, row_start: int, rows: int, region, source, share: float):
    from slacktier.engine.tables import TableSpec
    if NEW:
        return TableSpec(layer=layer, row_start=row_start, rows=rows, regions=(region,), source=source,
                         cache_share=share)
    from slacktier.engine.tables import RankRegion
    return TableSpec(layer=layer, row_start=row_start, rows=rows, source=source, cache_share=share,
                     ranks=(RankRegion(rank=region.rank, row_start=row_start, rows=rows, region=0),))


def _disk(regions, engine: str = "auto", queue_depth: int = 128):
    from slacktier.store.disk import DiskSource
    if NEW:
        from slacktier.config import DiskOptions
        return DiskSource(regions, DiskOptions(engine=engine, queue_depth=queue_depth))
    return DiskSource(regions, engine=engine, queue_depth=queue_depth)


def _dram(regions, pages):
    from slacktier.store.dram import DramSource
    return DramSource(regions, pages=pages) if NEW else DramSource(regions, pages)


def _ids(layout: EngramLayout, sessions: int, tokens_each: int) -> np.ndarray:
    """Row ids [tokens_each, sessions, L, 24]: step t holds token t of every session (real text)."""
    need = sessions * tokens_each
    text_bytes = need * 4
    tokens: list[int] = []
    while len(tokens) < need:
        tokens = encode(real_text(text_bytes))
        text_bytes *= 2
    hasher = EngramHasher(layout)
    toks = np.asarray(tokens[:need], dtype=np.int64).reshape(sessions, tokens_each)
    return np.stack([hasher.prefill(t) for t in toks], axis=1)


def _directory_floor(engine: StepEngine, ids: np.ndarray, rng: np.random.Generator) -> float:
    """us for one numpy gather per layer of as many random directory entries as the step has owned lookups:
    the random DRAM reads any directory pass must make (random rows, so the step's own entries stay cold)."""
    total = 0.0
    for axis, layer in enumerate(sorted(engine.layers)):
        spec = engine.table(layer)
        directory = engine.cache.layer(layer).directory
        local = ids[:, axis, :].reshape(-1) - spec.row_start
        owned = int(np.count_nonzero((local >= 0) & (local < spec.rows)))
        rows = rng.integers(0, spec.rows, owned)
        t0 = time.perf_counter_ns()
        directory.take(rows).sum()
        total += (time.perf_counter_ns() - t0) / 1e3
    return total


def rank_engine(layout: EngramLayout, tmp: Path, batch: int = 128, tag: str = "",
                engine_cls: type = StepEngine) -> StepEngine:
    """Rank 0 of TP4 serving `layout`'s tables (owned_only) from sparse files in `tmp`, 2M cache rows (half per
    layer), steps of up to `batch` tokens: the begin_step setting of this worker, bench_pass_anatomy.py,
    bench_step_ab.py (which passes another commit's `engine_cls`) and profile_begin_step.py. `tag` keeps several
    engines' files apart in one folder."""
    tables, sources = [], []
    for i, layer in enumerate(layout.layer_ids):
        lo, hi = shard_bounds(layout.rows(i), layout.column_bounds(i), 0, RANKS)
        path = tmp / f"l{layer}{tag}.sparse"
        pages = pages_for_rows(hi - lo)
        with open(path, "wb") as f:
            f.truncate(pages * PAGE_BYTES)
        region = _region(layer, 0, str(path), 0, pages, lo, hi - lo)
        source = _disk([region])
        sources.append(source)
        tables.append(_table(layer, lo, hi - lo, region, source, 0.5))
    return engine_cls(tables, RowCache(2_000_000), max_tokens=batch, owned_sources=sources, owned_only=True)


def timed_step(engine: StepEngine, ids_t: np.ndarray, gather: bool = True) -> tuple[float, float, object]:
    """One step through `engine`: (begin_step us, end_step us, its StepCounters), thread CPU time; `gather`
    False skips the layers' gathers (a pass that resolved nothing to gather)."""
    c0 = time.thread_time_ns()
    engine.begin_step(ids_t)
    begin = (time.thread_time_ns() - c0) / 1e3
    if gather:
        for layer in engine.layers:
            engine.gather(layer)
    c0 = time.thread_time_ns()
    counters = engine.end_step()
    return begin, (time.thread_time_ns() - c0) / 1e3, counters


def begin_step(quick: bool) -> dict:
    """One TP4 rank of the V4.1 tables (owned_only), B = 128, 1M cache rows per layer, sparse disk regions."""
    batch, warm_steps, steps = 128, (24 if quick else 64), (20 if quick else 60)
    layout = EngramLayout.v41()
    ids = _ids(layout, batch, warm_steps + steps)
    with tempfile.TemporaryDirectory(dir=os.environ.get("AB_DIR") or None) as tmp:
        engine = rank_engine(layout, Path(tmp), batch)

        ends: list[float] = []   # end_step CPU of the step just run (work moved out of begin_step shows here)

        def step(t: int) -> tuple[float, int]:
            cpu, end, c = timed_step(engine, ids[t])
            ends.append(end)
            return cpu, sum(x.pages_read for x in c.layers.values())

        for t in range(warm_steps):
            step(t)
        rng = np.random.default_rng(7)
        floor = []
        # Positions already looked up once: every row is cached (the pass on a warm cache).
        warm = []
        ends.clear()
        for _ in range(2):
            for t in range(warm_steps - steps // 2, warm_steps):
                floor.append(_directory_floor(engine, ids[t], rng))
                warm.append(step(t)[0])
        warm_ends = list(ends)
        ends.clear()
        fresh = [step(t) for t in range(warm_steps, warm_steps + steps)]
        engine.close()
    return {"warm_cpu_us": statistics.median(warm), "fresh_cpu_us": statistics.median(c for c, _ in fresh),
            "fresh_pages": statistics.median(p for _, p in fresh), "floor_us": statistics.median(floor),
            "warm_end_us": statistics.median(warm_ends), "fresh_end_us": statistics.median(ends)}


def gather(quick: bool) -> dict:
    """gather(layer) of B = 128 from a DRAM table: every row a cache hit, and every row from page buffers."""
    batch, steps = 128, (20 if quick else 60)
    layout = EngramLayout.scaled(42_000, layer_ids=(14,))
    rows = layout.rows(0)
    raw = synthetic_rows(3, 0, rows)
    region = _region(14, 0, "mem", 0, pages_for_rows(rows), 0, rows)
    source = _dram([region], [pack_pages(raw)])
    ids = _ids(layout, batch, steps)
    out = {}
    table = torch.from_numpy(raw)
    lut_times, pass_times = [], []
    for t in range(steps):   # floor: torch's index_select + the codec's exact table, the same rows
        flat = torch.from_numpy(ids[t].reshape(-1))
        t0 = time.perf_counter_ns()
        dequantize(table.index_select(0, flat))
        lut_times.append((time.perf_counter_ns() - t0) / 1e3)
    for name, cache_rows in (("hit", batch * 24 * steps), ("page", 0)):
        engine = StepEngine([_table(14, 0, rows, region, source, 1.0)], RowCache(cache_rows), max_tokens=batch)
        times = []
        for rounds in range(2 if name == "hit" else 1):
            for t in range(steps):
                engine.begin_step(ids[t])
                time.sleep(0.0005)   # the reads land before the gather is timed
                t0 = time.perf_counter_ns()
                engine.gather(14)
                dt = (time.perf_counter_ns() - t0) / 1e3
                c = engine.end_step().layers[14]
                if name == "page" or rounds == 1:
                    times.append(dt)
                if name == "page":
                    pass_times.append(c.gather_us)   # the pass alone, reads already waited for
        out[f"gather_{name}_us"] = statistics.median(times)
    out["gather_page_pass_us"] = statistics.median(pass_times)
    out["torch_lut_us"] = statistics.median(lut_times)
    source.close()
    return out


def disk_file() -> Path:
    """The 1 GiB file of random bytes the disk task reads (in AB_DIR, else the temp folder), written if missing."""
    file_pages = (1 << 30) // PAGE_BYTES
    path = Path(os.environ.get("AB_DIR") or tempfile.gettempdir()) / "ab_disk.bin"
    if not path.exists() or path.stat().st_size != file_pages * PAGE_BYTES:
        with open(path, "wb") as f:
            chunk = np.random.default_rng(0).integers(0, 255, 16 << 20, dtype=np.uint8).tobytes()
            for _ in range(file_pages * PAGE_BYTES // len(chunk)):
                f.write(chunk)
    return path


def disk_run(path: Path, batches: int, seed: int | None = None) -> dict:
    """`batches` batches of 700 random 4 KiB O_DIRECT reads through io_uring: median CPU per page and kIOPS.

    `seed` None draws new pages every run, as fio does beside it (randrepeat=0); up to commit 44b8be3 the disk
    task read the same pages (seed 1) in every run, which the host behind this VM's disk might have kept from the
    last run. bench_disk_repeat.py compares the two."""
    file_pages = path.stat().st_size // PAGE_BYTES
    region = _region(1, 0, str(path), 0, file_pages, 0, 0)
    source = _disk([region], engine="io_uring")
    batch = 700
    pool = PageBufferPool(batch)
    rng = np.random.default_rng(seed)
    cpu, iops = [], []
    for i in range(batches + 5):
        reads = PageReads(np.zeros(batch, np.int32), rng.integers(0, file_pages, batch).astype(np.int64),
                          np.arange(batch, dtype=np.int32))
        c0, t0 = time.process_time_ns(), time.perf_counter_ns()
        source.wait(source.submit(reads, pool))
        c1, t1 = time.process_time_ns(), time.perf_counter_ns()
        if i >= 5:
            cpu.append((c1 - c0) / 1e3 / batch)
            iops.append(batch / ((t1 - t0) / 1e9))
    source.close()
    return {"disk_cpu_us_per_page": statistics.median(cpu), "disk_kiops": statistics.median(iops) / 1e3}


def disk(quick: bool) -> dict:
    """io_uring, random 4 KiB O_DIRECT reads in 700-page batches from a 1 GiB file: CPU per page and IOPS."""
    return disk_run(disk_file(), 40 if quick else 150)


def main() -> int:
    torch.set_num_threads(1)   # our passes are single-threaded too; on a shared 2-core VM more threads only wait
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("task", choices=("begin_step", "gather", "disk"))
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    result = {"begin_step": begin_step, "gather": gather, "disk": disk}[args.task](args.quick)
    result["tree"] = str(Path(slacktier.__file__).parents[2])
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
