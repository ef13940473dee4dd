"""Layer 14 from a memory-mapped file (what the engines' community patches do) against SlackTier's disk tier.

The peer a user would pick instead of SlackTier is the file-backed table: the rank's region of the staged
file memory-mapped, and at the layer a gather that indexes the mapping (a numpy fancy index), so every row
whose page is not in the OS page cache costs a synchronous fault inside the layer. This script serves the
SAME staged shard (one TP4 rank of the V4.1-shaped table, `benchmarks/paper/full_rank.py`) both ways on the
step timeline (device compute from a profile; hashing, faults and reads real, on this machine's disk):

    slacktier           SlackTier's disk tier (O_DIRECT, io_uring) with a row cache on the layer
    slacktier-nocache   the same without a cache (the floor of its host memory)
    mmap                the mapping with the kernel's default advice (readahead around each fault): the patches
    mmap-random         MADV_RANDOM: a fault reads its one page
    mmap-willneed       MADV_RANDOM, and at step start one process_madvise(MADV_WILLNEED) over the pages of the
                        step's rows, so the kernel reads them during the layer's window: the better variant
    mmap-willneed-async the same call made by a helper thread, so the step's start does not wait for the kernel
                        to queue the reads (the call blocks while the disk's queue is full)

Only the layer with the long window (layer 14) is served; layer 1 is in host DRAM, the stock path (not on the
host's begin_step path), as in the timeline's `l1-dram-l14-disk` placement.

Same host memory. SlackTier's memory for the layer's cache is its row cache (rows x 264 B) plus its
directory (the planner's `directory_bytes`). The page cache is what a mapping uses instead, so each run's
process runs in a child of this process's cgroup-v1 memory cgroup; for a mapping, when the timed window starts,
its limit is set before every step to what the cgroup holds other than page cache at that moment (its
headroom: interpreter, traffic, hasher, replay, and the kernel memory the cgroup charges: the mapping's page
tables) plus that budget. Page-cache pages count against the limit, so the kernel evicts the mapping's
pages to stay under it. SlackTier's runs get a cgroup without a limit, only to read their memory. Every run
starts with the file's pages dropped from the page cache (posix_fadvise DONTNEED after a sync). Where no cgroup v1 memory
controller is writable the cap cannot be set: the script says so and refuses to time (the mmap figures would
be those of an uncapped page cache), unless `--no-cap` asks for that explicitly.

    nice -n 5 .venv/bin/python benchmarks/tier/mmap_baseline.py --rounds 3        # stage, time, check, delete
    .venv/bin/python benchmarks/tier/mmap_baseline.py --check-only --keep          # rows only, no timing

Rows: after the timed runs, `check_rows` gathers some held-out decode steps through SlackTier's engine and
through the mapping (dequantized by the reference codec) and counts the rows whose bits differ (0 expected).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import resource
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # the repo root: benchmarks.* imports
from benchmarks._harness import command_line, drop_file_cache, format_table, interleaved, machine, utc_stamp, write_result  # noqa: E402

from slacktier.errors import ErrorKind, SlackTierError  # noqa: E402
from slacktier.tables.layout import PAGE_BYTES, ROW_BYTES, ROWS_PER_PAGE  # noqa: E402

VARIANTS = ("slacktier", "slacktier-nocache", "mmap", "mmap-random", "mmap-willneed", "mmap-willneed-async")
# variant -> (advice, WILLNEED at step start: "" none, "call" on the step's thread, "thread" by a helper thread)
MMAP_VARIANTS = {"mmap": ("default", ""), "mmap-random": ("random", ""), "mmap-willneed": ("random", "call"),
                 "mmap-willneed-async": ("random", "thread")}
LAYER = 14

_SYS_PROCESS_MADVISE = 440   # x86_64 and aarch64 (the generic syscall table)
_IOV_MAX = 1024              # UIO_MAXIOV: process_madvise takes at most this many ranges per call


# ---- the file-backed reader ------------------------------------------------------------------------------

@dataclass
class LayerCounters:
    """What the timeline runner reads of a layer's step (engine.counters' field names)."""

    wait_us: float = 0.0      # the gather at the layer: the fancy index, faults included
    read_us: float = 0.0      # the same: a mapping's reads happen inside the gather (or unseen, after WILLNEED)
    gather_us: float = 0.0    # nothing after the rows arrive (dequant is the device's, as for SlackTier)
    pages_read: int = 0       # major faults taken during the gather (a fault may bring in readahead pages)
    hits: int = 0             # not known for a mapping (no per-page residency check on the timed path)
    lookups: int = 0          # the rank's own lookups
    zero_rows: int = 0
    pages_wanted: int = 0     # distinct pages of the rank's rows this step


@dataclass
class StepCounters:
    layers: dict[int, LayerCounters] = field(default_factory=dict)


class MmapLayerReader:
    """One (layer, rank) region of a staged file, memory-mapped read-only, served as the timeline's engine.

    A global row id in [row_start, row_start + rows) is the rank's; shard row r sits at page r // 15, byte
    (r % 15) * 264 of the region: row 36,007,693 of rank 3 (row_start 36,007,662) -> shard row 31 -> page 2,
    byte 264. Other ids are another rank's rows and come out as zero bytes (SlackTier's engine gives -0.0
    after dequant for them; `dequantized` applies that convention).

    `advice`: "default" (the kernel's readahead around each fault) or "random" (MADV_RANDOM, one page per
    fault). `willneed`: at `begin_step`, process_madvise(MADV_WILLNEED) over the step's pages, so their reads
    start at step start instead of at the layer: "call" makes it on the step's thread (it returns once the
    kernel queued the reads), "thread" hands it to a helper thread (the gather then faults on pages whose
    advice is not yet through, as a patch with a prefetch thread would), "" not at all.
    """

    def __init__(self, region, axis: int, advice: str = "default", willneed: str = "") -> None:
        if advice not in ("default", "random") or willneed not in ("", "call", "thread"):
            raise SlackTierError(ErrorKind.BAD_INPUT, f"advice {advice!r}, willneed {willneed!r}",
                                 fix="advice 'default' or 'random'; willneed '', 'call' or 'thread'")
        self.layer = region.layer
        self.axis = axis
        self.row_start = region.row_start
        self.rows = region.rows
        self.willneed = willneed
        self._fd = os.open(region.path, os.O_RDONLY)
        try:
            self._map = mmap.mmap(self._fd, region.nbytes, offset=region.offset_bytes, access=mmap.ACCESS_READ)
        except BaseException:
            os.close(self._fd)
            raise
        if advice == "random":
            self._map.madvise(mmap.MADV_RANDOM)
        flat = np.frombuffer(self._map, dtype=np.uint8)
        self._base = flat.ctypes.data
        # [pages, 15, 264]: a view, so rows[page, slot] is the fancy index a patch's gather does
        self._rows = np.lib.stride_tricks.as_strided(flat, shape=(region.pages, ROWS_PER_PAGE, ROW_BYTES),
                                                     strides=(PAGE_BYTES, ROW_BYTES, 1), writeable=False)
        self._pidfd = os.pidfd_open(os.getpid()) if willneed else -1
        self._libc = ctypes.CDLL(None, use_errno=True)
        self._libc.syscall.restype = ctypes.c_long
        self._ids: np.ndarray | None = None
        self._counters = LayerCounters()
        self._pool = None
        self._advised = None
        if willneed == "thread":
            from concurrent.futures import ThreadPoolExecutor

            self._pool = ThreadPoolExecutor(1, thread_name_prefix="willneed")   # ctypes drops the GIL in the call

    def close(self) -> None:
        """Unmap and close (the views into the mapping must be gone)."""
        self._rows = None
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        self._map.close()
        os.close(self._fd)
        if self._pidfd >= 0:
            os.close(self._pidfd)

    def prepare(self, ids: np.ndarray) -> np.ndarray:
        """ids [T, L, 24] -> the layer's [T, 24] int64 (before the step's clock starts, as LayerSubset)."""
        return np.ascontiguousarray(np.asarray(ids)[:, self.axis, :], dtype=np.int64)

    def _local(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Shard rows of the rank's ids, and the mask of those ids among `ids` (flat)."""
        flat = ids.reshape(-1) - self.row_start
        mine = (flat >= 0) & (flat < self.rows)
        return flat[mine], mine

    def advise(self, local: np.ndarray) -> int:
        """MADV_WILLNEED over the pages of shard rows `local`, in as few process_madvise calls as the kernel
        allows; returns the pages advised."""
        pages = np.unique(local // ROWS_PER_PAGE)
        iov = np.empty((pages.shape[0], 2), dtype=np.uint64)
        iov[:, 0] = self._base + pages.astype(np.uint64) * PAGE_BYTES
        iov[:, 1] = PAGE_BYTES
        for at in range(0, pages.shape[0], _IOV_MAX):
            n = min(_IOV_MAX, pages.shape[0] - at)
            got = self._libc.syscall(ctypes.c_long(_SYS_PROCESS_MADVISE), ctypes.c_int(self._pidfd),
                                     ctypes.c_void_p(iov[at:].ctypes.data), ctypes.c_ulong(n),
                                     ctypes.c_int(mmap.MADV_WILLNEED), ctypes.c_uint(0))
            if got < 0:
                err = ctypes.get_errno()
                raise SlackTierError(ErrorKind.IO, f"process_madvise(MADV_WILLNEED): {os.strerror(err)}",
                                     fix="run on Linux 5.10 or later, or drop the willneed variant")
        return int(pages.shape[0])

    def raw_rows(self, ids: np.ndarray) -> np.ndarray:
        """ids [T, 24] global -> raw rows [T * 24, 264] uint8 (another rank's rows: zero bytes)."""
        local, mine = self._local(ids)
        out = np.zeros((mine.shape[0], ROW_BYTES), dtype=np.uint8)
        out[mine] = self._rows[local // ROWS_PER_PAGE, local % ROWS_PER_PAGE]
        return out

    # the timeline's engine: begin_step / gather / end_step

    def begin_step(self, ids: np.ndarray) -> None:
        if ids.ndim == 3:
            ids = self.prepare(ids)
        self._ids = ids
        local, _ = self._local(ids)
        c = LayerCounters(lookups=int(local.shape[0]), zero_rows=int(ids.size - local.shape[0]))
        if self.willneed == "call":
            c.pages_wanted = self.advise(local)
        elif self.willneed == "thread":
            self._advised = self._pool.submit(self.advise, local)
        self._counters = c

    def gather(self, layer: int) -> np.ndarray:
        if layer != self.layer or self._ids is None:
            raise SlackTierError(ErrorKind.BAD_INPUT, f"gather({layer}) on the reader of layer {self.layer}",
                                 fix="call begin_step first, and gather the reader's own layer")
        f0 = resource.getrusage(resource.RUSAGE_SELF).ru_majflt
        t0 = time.perf_counter_ns()
        out = self.raw_rows(self._ids)
        dt_us = (time.perf_counter_ns() - t0) / 1e3
        self._counters.pages_read = resource.getrusage(resource.RUSAGE_SELF).ru_majflt - f0
        self._counters.wait_us = self._counters.read_us = dt_us
        return out

    def end_step(self) -> StepCounters:
        c = self._counters
        if self._advised is not None:   # its errors surface here; the step's rows are already gathered
            c.pages_wanted = self._advised.result()
            self._advised = None
        if not c.pages_wanted and self._ids is not None:
            local, _ = self._local(self._ids)
            c.pages_wanted = int(np.unique(local // ROWS_PER_PAGE).shape[0])
        self._ids = None
        return StepCounters({self.layer: c})


def dequantized(raw: np.ndarray, foreign: np.ndarray):
    """The reference gather of raw rows [n, 264] (codec.reference_dequant), another rank's rows as -0.0 (bf16
    0x8000), SlackTier's torch convention for them: bf16 [n, 256]."""
    import torch

    from slacktier.engine.checker import reference_gather

    out = reference_gather(raw).clone()
    out.view(torch.int16)[torch.from_numpy(foreign)] = -32768
    return out


# ---- memory cgroup (v1) ----------------------------------------------------------------------------------

def own_memory_cgroup() -> Path | None:
    """This process's cgroup-v1 memory cgroup directory, if the controller is mounted and writable."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, ctrls, path = line.split(":", 2)
        if "memory" in ctrls.split(","):
            d = Path("/sys/fs/cgroup/memory") / path.lstrip("/")
            if (d / "memory.limit_in_bytes").is_file() and os.access(d, os.W_OK):
                return d
    return None


def make_cgroup(name: str) -> Path | None:
    """A child memory cgroup `name` under this process's own (None where none can be made)."""
    parent = own_memory_cgroup()
    if parent is None:
        return None
    d = parent / name
    try:
        d.mkdir(exist_ok=True)
    except OSError:
        return None
    return d


def remove_cgroup(d: Path) -> None:
    """Remove an emptied cgroup (its page-cache charges move to the parent)."""
    for _ in range(50):
        try:
            d.rmdir()
            return
        except OSError:
            time.sleep(0.1)
    print(f"warning: could not remove cgroup {d}", file=sys.stderr)


def read_int(p: Path) -> int:
    return int(p.read_text().strip())


# ---- one timed run (a child process, inside its cgroup) ---------------------------------------------------

@dataclass(frozen=True)
class RunConfig:
    """What every run shares: the staged shard, the traffic, the timeline's steps, the budget."""

    workdir: str = "runs/mmap_baseline"
    engram_vocab: int = 2_000_000
    rank: int = 3
    workload: str = "agent"
    batch: int = 128
    cache_rows: int = 100_000          # SlackTier's row cache on layer 14 (scaled with the table: see the regime)
    decode_steps: int = 24
    warmup_steps: int = 8
    start_decode_steps: int = 200      # decode steps before the window: SlackTier's cache fills on them
    check_steps: int = 2               # untimed decode steps after the timed ones, SlackTier's checker on
    profile: str = "v41_paper"

    def full_rank(self, cache_rows: int | None = None):
        from benchmarks.paper.full_rank import FullRankConfig

        return FullRankConfig(workdir=self.workdir, rank=self.rank, workload=self.workload, batches=(self.batch,),
                              runs=1, decode_steps=self.decode_steps, warmup_steps=self.warmup_steps,
                              cache_rows=self.cache_rows if cache_rows is None else cache_rows,
                              engram_vocab=self.engram_vocab, check_steps=self.check_steps, profile=self.profile)


def budget_bytes(cache_rows: int) -> int:
    """SlackTier's memory for one layer's row cache of `cache_rows` rows: the rows plus the directory (the
    planner's `plan.tiers.directory_bytes`). The brief's budget counts the rows too, though on a GPU server
    they are device memory: the mapping gets every byte SlackTier's cache structures take.

    100,000 rows -> 26,400,000 B of rows + 2**18 entries x 8 B = 28,497,152 B."""
    from slacktier.plan.tiers import directory_bytes

    return cache_rows * ROW_BYTES + directory_bytes(cache_rows)


def _placement(variant: str, cfg: RunConfig):
    from slacktier.serve.tiers import Placement

    tiers = ((1, "dram"), (LAYER, "disk"))
    if variant == "slacktier":
        return Placement("l1-dram-l14-disk-cache", tiers, cfg.cache_rows, ((LAYER, 1.0),))
    return Placement("l1-dram-l14-disk", tiers)


def resident_pages(path: str, offset_bytes: int, nbytes: int) -> int:
    """Pages of the file's byte range [offset_bytes, offset_bytes + nbytes) in the page cache now (mincore on a
    fresh mapping; mapping a range faults nothing in)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        m = mmap.mmap(fd, nbytes, offset=offset_bytes, access=mmap.ACCESS_READ)
    finally:
        os.close(fd)
    try:
        base = np.frombuffer(m, dtype=np.uint8).ctypes.data
        pages = -(-nbytes // PAGE_BYTES)
        vec = np.zeros(pages, dtype=np.uint8)
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.mincore(ctypes.c_void_p(base), ctypes.c_size_t(nbytes), ctypes.c_void_p(vec.ctypes.data)) != 0:
            raise SlackTierError(ErrorKind.IO, f"mincore: {os.strerror(ctypes.get_errno())}",
                                 fix="run on Linux")
        return int(np.count_nonzero(vec & 1))
    finally:
        m.close()


def _memory_stat(cgroup: Path) -> dict[str, int]:
    return {k: int(v) for k, v in (line.split() for line in (cgroup / "memory.stat").read_text().splitlines())}


def serve_run(cfg: RunConfig, variant: str, cgroup: Path | None, budget: int) -> dict:
    """One timed run of `variant` in this process (already in `cgroup`): its summary as a dict.

    Prefill steps are dropped for every variant (no reader is warmed by them: reading a session's prefill
    through a capped page cache takes minutes). SlackTier's engine reads the `start_decode_steps` decode steps
    before the timed window untimed, so its cache is full when the window starts; the mappings skip them: the
    window's `warmup_steps` fill a page cache of the budget's size many times over, so a mapping enters the
    timed steps with its page cache full too (the report gives the table's resident pages at the end).

    The cap: before each step on the timeline (off its clock) the cgroup's limit is set to what the cgroup
    holds other than page cache (anonymous memory, and the kernel memory v1 charges with it: the mapping's page
    tables, the page cache's index) plus the budget, so the page cache itself may hold the budget however the
    rest moves."""
    from benchmarks.paper.full_rank import _checked, _replay, rank_control, stage_rank_shard
    from slacktier.serve.timeline import (LayerSubset, StepTimes, TimelineRunner, load_profile, run_replay,
                                          summarize)
    from slacktier.workloads.hashing import EngramLookupHasher

    fr = cfg.full_rank()
    layout = fr.layout()
    manifest = stage_rank_shard(fr)   # reuses the staged shard (its targets checked)
    region = manifest.region(LAYER, cfg.rank)
    hasher = EngramLookupHasher(layout)
    st = load_profile(cfg.profile).times(cfg.batch, cfg.workload, layout.layer_ids)
    times = StepTimes(st.workload, st.batch, st.step_ms, {LAYER: st.windows_ms[LAYER]})
    replay = iter(s for s in _replay(fr, cfg.batch, hasher) if s.kind == "decode")
    axis = list(layout.layer_ids).index(LAYER)
    mapped = variant in MMAP_VARIANTS
    engine = reader = None
    if mapped:
        advice, willneed = MMAP_VARIANTS[variant]
        reader = MmapLayerReader(region, axis, advice, willneed)
        target = reader
    else:
        from slacktier.engine.step import StepEngine

        control, served = rank_control(manifest, cfg.rank, _placement(variant, cfg), fr, cfg.batch)
        engine = StepEngine.from_config(control, ids_layers=tuple(served), columns=layout.n_columns)
        target = LayerSubset(engine, [axis])
    runner = TimelineRunner(target, times)
    at_window: dict[str, int] = {}

    def before_step() -> None:   # before every step on the timeline, off its clock
        if cgroup is None:
            return
        stat = _memory_stat(cgroup)
        other = read_int(cgroup / "memory.usage_in_bytes") - stat["total_cache"]   # anon + kernel memory
        if not at_window:
            at_window.update(anon=stat["total_rss"], cache=stat["total_cache"], other=other)
            (cgroup / "memory.max_usage_in_bytes").write_text("0")
        if mapped:   # the cap follows the process's own memory: the page cache may hold the budget
            limit = other + budget
            at_window["limit"] = max(at_window.get("limit", 0), limit)
            (cgroup / "memory.limit_in_bytes").write_text(str(limit))

    t0 = time.perf_counter()
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_majflt
    try:
        steps = run_replay(runner, replay, cfg.batch, cfg.decode_steps, warm=not mapped,
                           warmup_steps=cfg.warmup_steps, before_step=before_step,
                           start_decode_steps=cfg.start_decode_steps)
        peak = read_int(cgroup / "memory.max_usage_in_bytes") if cgroup else 0
        end = _memory_stat(cgroup) if cgroup else {}
        resident = resident_pages(region.path, region.offset_bytes, region.nbytes)
        checked = bad = 0
        if engine is not None:
            checked, bad = _checked(engine, runner, replay, cfg.batch, cfg.check_steps, True)
    finally:
        if engine is not None:
            engine.close()
        if reader is not None:
            reader.close()
    wall = time.perf_counter() - t0
    s = summarize(steps)
    return {"variant": variant, "steps": s.steps, "step_ms": st.step_ms, "window_ms": st.windows_ms[LAYER],
            "stall_ms": s.stall_layer_ms[LAYER], "p99_stall_ms": s.p99_stall_ms, "read_ms": s.read_ms[LAYER],
            "s_ms": s.s_ms, "pages": s.pages[LAYER], "hit_rate": None if mapped else s.hit_rate[LAYER],
            "stalls_ms": [x.stall_ms[LAYER] for x in steps], "reads_ms": [x.read_ms[LAYER] for x in steps],
            "checked_steps": checked, "mismatches": bad, "wall_s": wall,
            "anon_at_window_bytes": at_window.get("anon", 0), "other_at_window_bytes": at_window.get("other", 0), "limit_bytes": at_window.get("limit", 0),
            "peak_bytes": peak, "anon_at_end_bytes": end.get("total_rss", 0),
            "cache_at_end_bytes": end.get("total_cache", 0), "table_resident_bytes": resident * PAGE_BYTES,
            "majflt": resource.getrusage(resource.RUSAGE_SELF).ru_majflt - f0,
            "faults_per_step": float(np.mean([x.pages[LAYER] for x in steps])) if mapped else None}


def _serve_main(args: argparse.Namespace) -> int:
    """The child: join the cgroup first (so everything it allocates is charged there), run, write JSON."""
    cgroup = Path(args.cgroup) if args.cgroup else None
    if cgroup is not None:
        (cgroup / "cgroup.procs").write_text(str(os.getpid()))
    cfg = RunConfig(**json.loads(args.config))
    out = serve_run(cfg, args.variant, cgroup, args.budget)
    Path(args.out).write_text(json.dumps(out))
    return 0


# ---- the parent: stage, runs in shuffled order, rows checked, table ------------------------------------

def check_rows(cfg: RunConfig, steps: int = 3) -> tuple[int, int]:
    """Held-out decode steps gathered by SlackTier's engine (uncached disk tier) and by the mapping with each
    advice: (rows compared, rows whose bits differ)."""
    from benchmarks.paper.full_rank import _replay, rank_control, stage_rank_shard
    from slacktier.engine.checker import mismatching_rows
    from slacktier.engine.step import StepEngine
    from slacktier.serve.timeline import LayerSubset
    from slacktier.workloads.hashing import EngramLookupHasher

    fr = cfg.full_rank()
    layout = fr.layout()
    manifest = stage_rank_shard(fr)
    axis = list(layout.layer_ids).index(LAYER)
    control, served = rank_control(manifest, cfg.rank, _placement("slacktier-nocache", cfg), fr,
                                   max(fr.prefill_chunk_tokens, cfg.batch))
    engine = StepEngine.from_config(control, ids_layers=tuple(served), columns=layout.n_columns)
    readers = [MmapLayerReader(manifest.region(LAYER, cfg.rank), axis, a, w) for a, w in MMAP_VARIANTS.values()]
    sub = LayerSubset(engine, [axis])
    compared = differ = done = 0
    try:
        for st in _replay(fr, cfg.batch, EngramLookupHasher(layout)):
            if st.kind != "decode" or st.num_tokens != cfg.batch:
                continue
            ids = sub.prepare(st.ids)
            engine.begin_step(ids)
            ours = engine.gather(LAYER).reshape(-1, 256)
            engine.end_step()
            for r in readers:
                layer_ids = r.prepare(st.ids)
                r.begin_step(layer_ids)
                raw = r.gather(LAYER)
                r.end_step()
                _, mine = r._local(layer_ids)
                ref = dequantized(raw, ~mine)
                compared += ref.shape[0]
                differ += int(mismatching_rows(ours, ref).sum())
            done += 1
            if done >= steps:
                break
    finally:
        engine.close()
        for r in readers:
            r.close()
    return compared, differ


def _one_run(cfg: RunConfig, variant: str, budget: int, capped: bool, target: str, tag: str) -> dict:
    drop_file_cache(target)
    cgroup = make_cgroup(f"mmap-baseline-{os.getpid()}-{tag}") if capped else None
    out = Path(cfg.workdir) / f"run-{tag}.json"
    cmd = [sys.executable, str(Path(__file__).resolve()), "_serve", "--variant", variant, "--out", str(out),
           "--budget", str(budget), "--config", json.dumps(cfg.__dict__)]
    if cgroup is not None:
        cmd += ["--cgroup", str(cgroup)]
    try:
        proc = subprocess.run(cmd, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
        if proc.returncode != 0:
            oom = read_int(cgroup / "memory.failcnt") if cgroup else 0
            raise SlackTierError(ErrorKind.IO, f"run {variant} exited {proc.returncode} (cgroup failcnt {oom})",
                                 fix="see its stderr above; a killed run under a cap may need more headroom")
        return json.loads(out.read_text())
    finally:
        out.unlink(missing_ok=True)
        if cgroup is not None:
            remove_cgroup(cgroup)


def _stat(xs) -> tuple[float, float, float]:
    a = np.asarray(xs, dtype=float)
    return float(a.min()), float(np.median(a)), float(a.max())


def _fmt(t: tuple[float, float, float], digits: int = 2) -> str:
    return f"{t[1]:.{digits}f} ({t[0]:.{digits}f}..{t[2]:.{digits}f})"


def report(cfg: RunConfig, runs: list[dict], budget: int, rows: tuple[int, int] | None) -> str:
    """The table: per variant, median (min..max over rounds) of each run's mean over its timed steps."""
    mb = 1e6
    header = ["variant", "runs", "stall L14 ms/step", "read L14 ms/step", "p99 stall ms", "s ms",
              "pages read or major faults /step", "hit", "anon MB at window", "anon+kernel MB", "limit MB", "table in page cache MB"]
    table = []
    by = {v: [r for r in runs if r["variant"] == v] for v in VARIANTS}
    for v, rs in by.items():
        if not rs:
            continue
        mapped = v in MMAP_VARIANTS
        pages = (f"{_fmt(_stat([r['faults_per_step'] for r in rs]), 0)} flt" if mapped else
                 f"{_fmt(_stat([r['pages'] for r in rs]), 0)} pg")
        hit = "-" if mapped else f"{100 * _stat([r['hit_rate'] for r in rs])[1]:.1f}%"
        limit = f"{_stat([r['limit_bytes'] for r in rs])[1] / mb:.0f}" if mapped and rs[0]["limit_bytes"] else "-"
        table.append([v, len(rs), _fmt(_stat([r["stall_ms"] for r in rs])), _fmt(_stat([r["read_ms"] for r in rs])),
                      _fmt(_stat([r["p99_stall_ms"] for r in rs])), _fmt(_stat([r["s_ms"] for r in rs])), pages, hit,
                      f"{_stat([r['anon_at_window_bytes'] for r in rs])[1] / mb:.0f}",
                      f"{_stat([r.get('other_at_window_bytes', 0) for r in rs])[1] / mb:.0f}", limit,
                      f"{_stat([r['table_resident_bytes'] for r in rs])[1] / mb:.1f}"])
    lines = [format_table(header, table)]
    base = by.get("slacktier")
    if base:
        ref = _stat([r["stall_ms"] for r in base])[1]
        for v in MMAP_VARIANTS:
            if by.get(v):
                m = _stat([r["stall_ms"] for r in by[v]])[1]
                lines.append(f"stall {v} / slacktier (medians): {m / ref:.1f}x" if ref > 0 else
                             f"stall {v}: {m:.2f} ms/step against SlackTier's 0.00")
    checked = [r for r in runs if r["checked_steps"]]
    lines.append(f"SlackTier's checker: {sum(r['checked_steps'] for r in checked)} decode steps after the timed ones, "
                 f"{sum(r['mismatches'] for r in checked)} mismatching rows")
    if rows is not None:
        lines.append(f"mapping vs SlackTier's gather: {rows[0]:,} rows compared ({len(MMAP_VARIANTS)} variants), "
                     f"{rows[1]} differ")
    lines.append("stall = rows ready past layer 14's scheduled start (the timeline's measure); read = SlackTier's "
                 "submit-to-completion, a mapping's gather (its faults happen there; after WILLNEED the kernel's "
                 "reads are not seen); s = the step's start (begin_step; the WILLNEED call for that variant); "
                 "flt = major faults in the gather (one may bring readahead pages); anon = the process's "
                 "anonymous memory when the window started (SlackTier's includes its cache and page buffers), anon+kernel = all the cgroup held then but page cache; "
                 "limit = the mapping's cgroup cap (all but page cache + budget, reset before each step; the largest shown); table in page cache = the region's resident "
                 "pages at the end (mincore)")
    return "\n".join(lines)


def regime(cfg: RunConfig, manifest, budget: int, capped: bool, reason: str) -> str:
    region = manifest.region(LAYER, cfg.rank)
    return (f"Regime: layer {LAYER} of rank {cfg.rank} of TP4, a V4.1-shaped table scaled to engram_vocab "
            f"{cfg.engram_vocab:,} ({region.rows:,} rows, {region.nbytes / 1e9:.2f} GB of pages for the layer; "
            f"{region.nbytes / budget:.0f}x the host budget), synthetic rows, V4.1 hash; {cfg.workload} traffic, "
            f"held-out sessions first (sweep_sessions; all {cfg.batch} from the held-out half at B={cfg.batch} "
            f"agent), B={cfg.batch}, decode steps only (prefills not read by any reader), the window after "
            f"{cfg.start_decode_steps} decode steps (read untimed by SlackTier to fill its cache, skipped by the "
            f"mappings, whose page cache fills in the window's {cfg.warmup_steps} untimed steps), then "
            f"{cfg.decode_steps} timed steps per run; device compute from profile {cfg.profile}; layer 1 in "
            f"host DRAM (stock path). Host budget {budget / 1e6:.1f} MB = SlackTier's {cfg.cache_rows:,}-row "
            f"cache on layer {LAYER} (rows x 264 B) plus its directory; "
            + ("each mapping's process capped by a cgroup-v1 memory limit (page cache counted) to what it holds "
               "other than page cache plus that budget, reset before every step; every run starts with the "
               "file's pages dropped"
               if capped else f"NOT capped: {reason}")
            + ". Shared 2-core VM and shared virtio disk: the figures are noisy; compare within this run.")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd")
    s = sub.add_parser("_serve", help=argparse.SUPPRESS)
    s.add_argument("--variant", required=True, choices=VARIANTS)
    s.add_argument("--out", required=True)
    s.add_argument("--config", required=True)
    s.add_argument("--budget", type=int, required=True)
    s.add_argument("--cgroup", default="")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--workdir", default=RunConfig.workdir)
    ap.add_argument("--engram-vocab", type=int, default=RunConfig.engram_vocab,
                    help="the V4.1 hash over tables scaled to this vocabulary (layer 14's rank shard: 6 rows "
                         "per 1,000 of vocabulary)")
    ap.add_argument("--workload", default="agent")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--cache-rows", type=int, default=RunConfig.cache_rows)
    ap.add_argument("--decode-steps", type=int, default=RunConfig.decode_steps)
    ap.add_argument("--warmup-steps", type=int, default=RunConfig.warmup_steps)
    ap.add_argument("--start-decode-steps", type=int, default=RunConfig.start_decode_steps,
                    help="decode steps before the timed window (SlackTier reads them untimed, the mappings skip)")
    ap.add_argument("--check-only", action="store_true", help="compare rows only, no timed runs")
    ap.add_argument("--no-cap", action="store_true",
                    help="time without a memory cgroup where none can be made (the mmap runs then use all the "
                         "page cache they like; the report says so)")
    ap.add_argument("--keep", dest="delete", action="store_false",
                    help="keep the staged shard (default: delete it at the end)")
    ap.add_argument("--json", default="", help="also write every run's figures here")
    args = ap.parse_args(argv)
    if args.cmd == "_serve":
        return _serve_main(args)

    from benchmarks.paper.full_rank import stage_rank_shard

    cfg = RunConfig(workdir=args.workdir, engram_vocab=args.engram_vocab, workload=args.workload, batch=args.batch,
                    cache_rows=args.cache_rows, decode_steps=args.decode_steps, warmup_steps=args.warmup_steps,
                    start_decode_steps=args.start_decode_steps)
    t0 = time.perf_counter()
    manifest = stage_rank_shard(cfg.full_rank(), progress=True)
    target = manifest.region(LAYER, cfg.rank).path
    budget = budget_bytes(cfg.cache_rows)
    try:
        runs: list[dict] = []
        capped, reason = False, ""
        if not args.check_only:
            probe = make_cgroup(f"mmap-baseline-{os.getpid()}-probe")
            capped = probe is not None
            if probe is not None:
                remove_cgroup(probe)
            else:
                reason = "no writable cgroup-v1 memory controller for this process"
                print(f"memory cap unavailable: {reason}", flush=True)
                if not args.no_cap:
                    raise SlackTierError(ErrorKind.MISSING, reason, fix="run where /sys/fs/cgroup/memory is "
                                         "writable, or pass --no-cap to time an uncapped page cache")
            variants = [v for v in args.variants.split(",") if v]
            bad = sorted(set(variants) - set(VARIANTS))
            if bad:
                raise SlackTierError(ErrorKind.BAD_INPUT, f"unknown variants {bad}", fix=f"pick among {VARIANTS}")
            for k, (rnd, v) in enumerate(interleaved(variants, args.rounds, seed=0)):
                r = _one_run(cfg, v, budget, capped, target, f"{rnd}-{v}")
                r["round"] = rnd
                runs.append(r)
                print(f"  round {rnd + 1}/{args.rounds} {v}: stall {r['stall_ms']:.2f} ms/step, read "
                      f"{r['read_ms']:.2f} ms, s {r['s_ms']:.2f} ms, major faults {r['majflt']}, anon "
                      f"{r['anon_at_window_bytes'] / 1e6:.0f} MB, limit {r['limit_bytes'] / 1e6:.0f} MB, table "
                      f"in page cache {r['table_resident_bytes'] / 1e6:.1f} MB, "
                      f"{r['wall_s']:.0f} s", flush=True)
        rows = check_rows(cfg)
        print(f"rows: {rows[0]:,} compared, {rows[1]} differ", flush=True)
        if runs:
            text = "\n".join([f"{utc_stamp()}, {machine()}", f"`{command_line(__file__)}`",
                              regime(cfg, manifest, budget, capped, reason), "", report(cfg, runs, budget, rows),
                              f"whole command: {time.perf_counter() - t0:.0f} s"])
            print(text)
            if args.json:
                Path(args.json).write_text(json.dumps(runs, indent=1))
            med = {v: _stat([r["stall_ms"] for r in runs if r["variant"] == v])[1]
                   for v in VARIANTS if any(r["variant"] == v for r in runs)}
            write_result("mmap_baseline", {f"stall_ms_{v}": m for v, m in med.items()})
        if rows[1]:
            return 1
    finally:
        if args.delete:
            for t in {str(manifest.path), *(r.path for r in manifest.regions)}:
                Path(t).unlink(missing_ok=True)
            for p in Path(cfg.workdir).glob(f"{Path(target).stem}*"):
                p.unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
