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

`--placement` names which layers are read from disk; a layer in host DRAM is the stock path (not on the host's
begin_step path), as in the timeline's placements:

    l1-dram-l14-disk    (default) layer 14 on disk, SlackTier's cache all on it (`--cache-rows`)
    disk                both layers on disk: SlackTier's split cache (`--split-cache-rows`) shared between them as
                        the planner shares it (`planner_split`: plan.planner.predict_placement on miss-page curves
                        of the traffic's FIT half and the disk's read fit on the staged regions; `--split-l1` gives
                        the share instead); each mapping maps both layers' regions and gathers each at its layer,
                        so layer 1's faults fall inside its 0.27 ms window and push the whole step back
    l1-disk-l14-dram    layer 1 on disk, SlackTier's cache all on it (`--cache-rows`)

Same host memory. SlackTier's memory for a layer's cache is its row cache (rows x 264 B) plus its
directory (the planner's `directory_bytes`), summed over the layers on disk. The page cache is what a mapping uses instead, so each run's
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
through the mapping (dequantized by the reference codec) on every layer on disk and counts the rows whose bits
differ (0 expected).
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
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
# placement -> the layers read from disk (the others: host DRAM, the stock path, not on the host's path)
PLACEMENTS = {"l1-dram-l14-disk": (LAYER,), "disk": (1, LAYER), "l1-disk-l14-dram": (1,)}

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


class MmapReaders:
    """Several layers' regions, each memory-mapped by its own MmapLayerReader, served as one timeline engine: at
    `begin_step` every layer's step starts (with WILLNEED, the advice over every layer's pages, in depth order, at
    step start); `gather(l)` indexes layer l's mapping at layer l, so its faults fall inside that layer.

    ids: [T, L, 24] as the hasher gives them (L = the hasher's layers) or prepared [T, len(regions), 24]."""

    def __init__(self, regions_axes, advice: str = "default", willneed: str = "") -> None:
        self.readers: list[MmapLayerReader] = []
        try:
            for region, axis in regions_axes:
                self.readers.append(MmapLayerReader(region, axis, advice, willneed))
        except BaseException:
            self.close()
            raise
        self.axes = [r.axis for r in self.readers]
        self._by_layer = {r.layer: r for r in self.readers}

    def close(self) -> None:
        for r in self.readers:
            r.close()
        self.readers = []

    def prepare(self, ids: np.ndarray) -> np.ndarray:
        """ids [T, L, 24] -> the mapped layers' [T, len(readers), 24] int64 (before the step's clock starts)."""
        return np.ascontiguousarray(np.asarray(ids)[:, self.axes, :], dtype=np.int64)

    def begin_step(self, ids: np.ndarray) -> None:
        if ids.shape[1] != len(self.readers) or ids.dtype != np.int64:   # the warm-up's unprepared ids
            ids = self.prepare(ids)
        for i, r in enumerate(self.readers):
            r.begin_step(ids[:, i, :])

    def gather(self, layer: int) -> np.ndarray:
        r = self._by_layer.get(layer)
        if r is None:
            raise SlackTierError(ErrorKind.BAD_INPUT, f"gather({layer}) on the mappings of layers "
                                 f"{sorted(self._by_layer)}", fix="gather a mapped layer")
        return r.gather(layer)

    def end_step(self) -> StepCounters:
        out = StepCounters()
        for r in self.readers:
            out.layers.update(r.end_step().layers)
        return out


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
    cache_rows: int = 100_000          # SlackTier's row cache on the one layer on disk (scaled with the table: see
                                       # the regime)
    placement: str = "l1-dram-l14-disk"   # one of PLACEMENTS
    split_cache_rows: int = 200_000    # placement "disk": SlackTier's cache over both layers (twice the one-layer
                                       # cache, as the timeline's split against its cache-on-layer-14-only)
    split_l1: float | None = None      # placement "disk": layer 1's share of it (the planner's; the rest to 14)
    decode_steps: int = 24
    warmup_steps: int = 8
    start_decode_steps: int = 200      # decode steps before the window: SlackTier's cache fills on them
    check_steps: int = 2               # untimed decode steps after the timed ones, SlackTier's checker on
    profile: str = "v41_paper"

    def __post_init__(self) -> None:
        if self.placement not in PLACEMENTS:
            raise SlackTierError(ErrorKind.BAD_INPUT, f"placement {self.placement!r}",
                                 fix=f"pick one of {', '.join(PLACEMENTS)}")
        if self.split_l1 is not None and not 0.0 <= self.split_l1 <= 1.0:
            raise SlackTierError(ErrorKind.BAD_INPUT, f"layer 1's cache share {self.split_l1}",
                                 fix="give a share in 0..1 (layer 14 gets the rest)")

    @property
    def disk_layers(self) -> tuple[int, ...]:
        """The layers read from disk under the placement (depth order)."""
        return PLACEMENTS[self.placement]

    def cache_slots(self) -> dict[int, int]:
        """SlackTier's cache rows per layer on disk, as the engine splits them (cache.rowcache.split_slots)."""
        from slacktier.cache.rowcache import split_slots

        if len(self.disk_layers) == 1:
            return {self.disk_layers[0]: self.cache_rows}
        if self.split_l1 is None:
            raise SlackTierError(ErrorKind.MISSING, "no cache split for the both-on-disk placement",
                                 fix="compute the planner's split (planner_split) or pass --split-l1")
        return split_slots(self.split_cache_rows, {1: self.split_l1, LAYER: 1.0 - self.split_l1})

    @property
    def total_cache_rows(self) -> int:
        return self.cache_rows if len(self.disk_layers) == 1 else self.split_cache_rows

    def full_rank(self, cache_rows: int | None = None):
        from benchmarks.paper.full_rank import FullRankConfig

        return FullRankConfig(workdir=self.workdir, rank=self.rank, workload=self.workload, batches=(self.batch,),
                              runs=1, decode_steps=self.decode_steps, warmup_steps=self.warmup_steps,
                              cache_rows=self.total_cache_rows if cache_rows is None else cache_rows,
                              engram_vocab=self.engram_vocab, check_steps=self.check_steps, profile=self.profile)


def budget_bytes(cache_rows: int | dict[int, int]) -> int:
    """SlackTier's memory for the row cache of `cache_rows` rows (or rows per layer): the rows plus each layer's
    directory (the planner's `plan.tiers.directory_bytes`, one per layer, sized to its slots). The brief's budget
    counts the rows too, though on a GPU server they are device memory: the mapping gets every byte SlackTier's
    cache structures take.

    100,000 rows -> 26,400,000 B of rows + 2**18 entries x 8 B = 28,497,152 B; {1: 120,000, 14: 80,000} ->
    52,800,000 B of rows + (2**18 + 2**18) x 8 B = 56,994,304 B."""
    from slacktier.plan.tiers import directory_bytes

    per_layer = cache_rows if isinstance(cache_rows, dict) else {LAYER: cache_rows}
    return sum(rows * ROW_BYTES + directory_bytes(rows) for rows in per_layer.values())


def _placement(variant: str, cfg: RunConfig):
    from slacktier.serve.tiers import Placement

    tiers = tuple((layer, "disk" if layer in cfg.disk_layers else "dram") for layer in (1, LAYER))
    if variant == "slacktier":
        total = cfg.total_cache_rows
        slots = cfg.cache_slots()
        return Placement(f"{cfg.placement}-cache", tiers, total,
                         tuple((layer, rows / total) for layer, rows in slots.items()))
    return Placement(cfg.placement, tiers)


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
    layers = cfg.disk_layers
    regions = [manifest.region(layer, cfg.rank) for layer in layers]
    hasher = EngramLookupHasher(layout)
    st = load_profile(cfg.profile).times(cfg.batch, cfg.workload, layout.layer_ids)
    times = StepTimes(st.workload, st.batch, st.step_ms, {layer: st.windows_ms[layer] for layer in layers})
    replay = iter(s for s in _replay(fr, cfg.batch, hasher) if s.kind == "decode")
    axes = [list(layout.layer_ids).index(layer) for layer in layers]
    mapped = variant in MMAP_VARIANTS
    engine = reader = None
    if mapped:
        advice, willneed = MMAP_VARIANTS[variant]
        reader = MmapReaders(zip(regions, axes), advice, willneed)
        target = reader
    else:
        from slacktier.engine.step import StepEngine

        control, served = rank_control(manifest, cfg.rank, _placement(variant, cfg), fr, cfg.batch)
        engine = StepEngine.from_config(control, ids_layers=tuple(served), columns=layout.n_columns)
        target = LayerSubset(engine, axes)
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
        resident = {r.layer: resident_pages(r.path, r.offset_bytes, r.nbytes) for r in regions}
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
    def per_layer(d: dict) -> dict[str, float]:   # JSON keys: the layer as a string
        return {str(layer): float(d[layer]) for layer in layers}

    return {"variant": variant, "placement": cfg.placement, "steps": s.steps, "step_ms": st.step_ms,
            "window_ms": per_layer(st.windows_ms),
            "stall_ms": s.stall_ms, "stall_layer_ms": per_layer(s.stall_layer_ms), "p99_stall_ms": s.p99_stall_ms,
            "read_layer_ms": per_layer(s.read_ms), "s_ms": s.s_ms, "pages_layer": per_layer(s.pages),
            "hit_layer": None if mapped else per_layer(s.hit_rate),
            "stalls_ms": [x.stall_total_ms for x in steps],
            "reads_ms": [[x.read_ms[layer] for layer in layers] for x in steps],
            "checked_steps": checked, "mismatches": bad, "wall_s": wall,
            "anon_at_window_bytes": at_window.get("anon", 0), "other_at_window_bytes": at_window.get("other", 0),
            "limit_bytes": at_window.get("limit", 0),
            "peak_bytes": peak, "anon_at_end_bytes": end.get("total_rss", 0),
            "cache_at_end_bytes": end.get("total_cache", 0),
            "table_resident_bytes": sum(resident.values()) * PAGE_BYTES,
            "resident_layer_bytes": per_layer({k: v * PAGE_BYTES for k, v in resident.items()}),
            "majflt": resource.getrusage(resource.RUSAGE_SELF).ru_majflt - f0,
            "faults_per_step": float(np.mean([sum(x.pages.values()) for x in steps])) if mapped else None}


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

def check_rows(cfg: RunConfig, steps: int = 3) -> dict[int, tuple[int, int]]:
    """Held-out decode steps gathered by SlackTier's engine (uncached disk tier) and by the mapping with each
    advice, on every layer on disk: layer -> (rows compared, rows whose bits differ)."""
    from benchmarks.paper.full_rank import _replay, rank_control, stage_rank_shard
    from slacktier.engine.checker import mismatching_rows
    from slacktier.engine.step import StepEngine
    from slacktier.serve.timeline import LayerSubset
    from slacktier.workloads.hashing import EngramLookupHasher

    fr = cfg.full_rank()
    layout = fr.layout()
    manifest = stage_rank_shard(fr)
    layers = cfg.disk_layers
    axes = [list(layout.layer_ids).index(layer) for layer in layers]
    control, served = rank_control(manifest, cfg.rank, _placement("slacktier-nocache", cfg), fr,
                                   max(fr.prefill_chunk_tokens, cfg.batch))
    engine = StepEngine.from_config(control, ids_layers=tuple(served), columns=layout.n_columns)
    readers = [MmapReaders(((manifest.region(layer, cfg.rank), axis) for layer, axis in zip(layers, axes)), a, w)
               for a, w in MMAP_VARIANTS.values()]
    sub = LayerSubset(engine, axes)
    counts = {layer: [0, 0] for layer in layers}
    done = 0
    try:
        for st in _replay(fr, cfg.batch, EngramLookupHasher(layout)):
            if st.kind != "decode" or st.num_tokens != cfg.batch:
                continue
            engine.begin_step(sub.prepare(st.ids))
            ours = {layer: engine.gather(layer).reshape(-1, 256).clone() for layer in layers}
            engine.end_step()
            for r in readers:
                r.begin_step(r.prepare(st.ids))
                raws = {layer: r.gather(layer) for layer in layers}
                r.end_step()
                for one in r.readers:
                    _, mine = one._local(one.prepare(st.ids))
                    ref = dequantized(raws[one.layer], ~mine)
                    counts[one.layer][0] += ref.shape[0]
                    counts[one.layer][1] += int(mismatching_rows(ours[one.layer], ref).sum())
            done += 1
            if done >= steps:
                break
    finally:
        engine.close()
        for r in readers:
            r.close()
    return {layer: (c[0], c[1]) for layer, c in counts.items()}


def _one_run(cfg: RunConfig, variant: str, budget: int, capped: bool, targets: list[str], tag: str) -> dict:
    for target in targets:
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


@dataclass(frozen=True)
class PlannerSplit:
    """The planner's split of the both-on-disk cache and what it was made from."""

    l1_share: float
    pages: dict[int, tuple[tuple[int, float], ...]]   # layer -> (cache rows, pages per step) of its miss curve
    page_ms: float           # the disk's b: what one more page of layer 1 (submitted first) costs its read
    behind_page_ms: float    # c_behind: what one more page of layer 14 (queued behind) costs layer 1's read
    predicted_pages: dict[int, float]
    predicted_stall_ms: float
    fit_sessions: int
    replayed_batch: int
    steps: int               # full-batch decode steps the curves average
    depth: int               # decode steps before the first of them
    read_fit_runs: int

    def text(self) -> str:
        curves = "; ".join(f"L{x}: " + ", ".join(f"{c:,} rows {p:.0f} pg" for c, p in pts)
                           for x, pts in self.pages.items())
        return (f"cache split by the planner (plan.planner.predict_placement, both layers on disk): layer 1 "
                f"{self.l1_share:.4f}, layer 14 {1 - self.l1_share:.4f}, from miss-page curves of the rank's own lookups "
                f"on the FIT half ({self.fit_sessions} sessions, replayed at B={self.replayed_batch} as the timed "
                f"runs replay, decode steps only, {self.steps} full-batch steps from decode step {self.depth}; {curves}) and "
                f"the disk's read fit on the staged regions ({self.read_fit_runs} runs: b {self.page_ms * 1e3:.2f} "
                f"us/page, c_behind {self.behind_page_ms * 1e3:.2f} us/page); predicted pages L1 "
                f"{self.predicted_pages[1]:.0f}, L14 {self.predicted_pages[LAYER]:.0f} per step, stall "
                f"{self.predicted_stall_ms:.2f} ms/step (kappa 0, s 0)")


def planner_split(cfg: RunConfig, manifest, read_fit_runs: int = 15, points: int = 11) -> PlannerSplit:
    """Layer 1's share of `cfg.split_cache_rows` as `slacktier plan` would set it with both layers on the disk
    (plan.planner.predict_placement, whose split is plan.split.best_split with the disk's per-page weights):

    - miss-page curves P_l(rows) of this rank's own lookups (benchmarks.paper.rank_pages, the served CLOCK with
      evict-ahead) on the FIT half of the traffic, never the held-out sessions the timed runs replay, replayed
      the way the timed runs replay theirs (decode steps only, B sessions or all the fit half has, pages scaled
      to B as serve.predict.fit_miss_curves scales them), averaged over the full-batch decode steps at the
      timed window's depth (after `start_decode_steps + warmup_steps` decode steps) or, where the fit half
      cannot fill B that deep, over its last `decode_steps` full-batch steps, at `points` capacities from 0 to
      the whole cache;
    - the disk tier's read model fitted on the staged regions of both layers (serve.readfit.read_fit, what
      `slacktier probe --read-fit` runs), layer 1 submitted first;
    - the profile's windows at B (the planner orders tables by window)."""
    from benchmarks.paper.full_rank import _replay
    from benchmarks.paper.rank_pages import _rank_clock
    from slacktier.plan.curves import MissCurve
    from slacktier.plan.planner import predict_placement
    from slacktier.plan.types import TableDemand
    from slacktier.serve.readfit import read_fit
    from slacktier.serve.runs import clip_sessions
    from slacktier.serve.timeline import load_profile
    from slacktier.workloads.corpus import CorpusConfig, load_workload
    from slacktier.workloads.hashing import EngramLookupHasher
    from slacktier.workloads.replay import collect_trace

    fr = cfg.full_rank()
    layout = fr.layout()
    hasher = EngramLookupHasher(layout)
    split = load_workload(cfg.workload, CorpusConfig(seed=fr.seed, agent_sessions_per_source=1))
    fit = clip_sessions(split.fit, fr.max_session_tokens, fr.max_turns)
    if not fit:
        raise SlackTierError(ErrorKind.MISSING, "no fit-half sessions for the planner's miss-page curves",
                             fix="use traffic with a fit half, or pass --split-l1")
    b = min(cfg.batch, len(fit))
    depth = cfg.start_decode_steps + cfg.warmup_steps
    steps, decode, timed = [], 0, 0
    for st in _replay(fr, b, hasher, pool=fit):
        if st.kind != "decode":
            continue
        steps.append(st)
        decode += 1
        timed += decode > depth and st.num_tokens == b
        if timed >= cfg.decode_steps:
            break
    trace = collect_trace(iter(steps), hasher, cfg.workload, b)
    dec_steps = np.unique(trace.token_step[trace.token_decode])
    tokens = np.bincount(trace.token_step, minlength=int(trace.token_step.max()) + 1)[dec_steps]
    full = np.flatnonzero(tokens == b)   # decode-step positions with a full batch
    if full.shape[0] == 0:
        raise SlackTierError(ErrorKind.MISSING, f"the fit half ran no full B={b} decode step",
                             fix="use a smaller B, or pass --split-l1")
    # the timed window's depth where the fit half reaches it at B; else its last full-batch steps (a half of the
    # traffic runs out of sessions to refill a batch sooner than both halves do)
    deep = full[full >= depth]
    chosen = deep[:cfg.decode_steps] if deep.shape[0] else full[-cfg.decode_steps:]
    window = np.zeros(dec_steps.shape[0], dtype=bool)
    window[chosen] = True
    at_depth = int(chosen[0])
    caps = sorted({int(c) for c in np.linspace(0, cfg.split_cache_rows, points)})
    pages: dict[int, tuple[tuple[int, float], ...]] = {}
    for layer in (1, LAYER):
        pts = []
        for c in caps:
            _, _, per_step = _rank_clock(trace, layer, cfg.rank, fr.ranks, c, fr.partition)
            pts.append((c, float(per_step[window].mean()) * cfg.batch / b))
        pages[layer] = tuple(pts)
    curves = {x: MissCurve(tuple(float(c) for c, _ in pts), tuple(p for _, p in pts)) for x, pts in pages.items()}
    manifest_fit = read_fit("disk", manifest, (1, LAYER), runs=read_fit_runs, seed=fr.seed, rank=cfg.rank)
    st = load_profile(cfg.profile).times(cfg.batch, cfg.workload, layout.layer_ids)
    tables = [TableDemand(x, manifest.region(x, cfg.rank).rows, str(manifest.path), st.windows_ms[x])
              for x in (1, LAYER)]
    plan = predict_placement(tables, {1: "disk", LAYER: "disk"}, [manifest_fit.spec], curves, cfg.split_cache_rows)
    by = {t.layer: t for t in plan.tables}
    model = manifest_fit.spec.read
    return PlannerSplit(by[1].cache_share, pages, model.page_ms, model.behind_page_ms,
                        {x: t.pages_per_step for x, t in by.items()}, plan.slowdown_ms, len(fit), b,
                        int(window.sum()), at_depth, read_fit_runs)


def _stat(xs) -> tuple[float, float, float]:
    a = np.asarray(xs, dtype=float)
    return float(a.min()), float(np.median(a)), float(a.max())


def _fmt(t: tuple[float, float, float], digits: int = 2) -> str:
    return f"{t[1]:.{digits}f} ({t[0]:.{digits}f}..{t[2]:.{digits}f})"


def report(cfg: RunConfig, runs: list[dict], budget: int, rows: dict[int, tuple[int, int]] | None) -> str:
    """The table: per variant, median (min..max over rounds) of each run's mean over its timed steps; per layer on
    disk its stall and read time, and the step's total stall where more than one layer is on disk."""
    mb = 1e6
    layers = cfg.disk_layers
    header = ["variant", "runs"]
    if len(layers) > 1:
        header.append("stall total ms/step")
    for layer in layers:
        header += [f"stall L{layer} ms/step", f"read L{layer} ms/step"]
    header += ["p99 stall ms", "s ms", "pages read or major faults /step", "hit " + "/".join(f"L{x}" for x in layers),
               "anon MB at window", "anon+kernel MB", "limit MB", "table in page cache MB"]
    table = []
    by = {v: [r for r in runs if r["variant"] == v] for v in VARIANTS}
    for v, rs in by.items():
        if not rs:
            continue
        mapped = v in MMAP_VARIANTS
        if mapped:
            pages = f"{_fmt(_stat([r['faults_per_step'] for r in rs]), 0)} flt"
        elif len(layers) == 1:
            pages = f"{_fmt(_stat([r['pages_layer'][str(layers[0])] for r in rs]), 0)} pg"
        else:   # medians, per layer
            pages = "+".join(f"{_stat([r['pages_layer'][str(x)] for r in rs])[1]:.0f}" for x in layers) + " pg"
        hit = "-" if mapped else "/".join(f"{100 * _stat([r['hit_layer'][str(x)] for r in rs])[1]:.1f}%"
                                          for x in layers)
        limit = f"{_stat([r['limit_bytes'] for r in rs])[1] / mb:.0f}" if mapped and rs[0]["limit_bytes"] else "-"
        row = [v, len(rs)]
        if len(layers) > 1:
            row.append(_fmt(_stat([r["stall_ms"] for r in rs])))
        for x in layers:
            row += [_fmt(_stat([r["stall_layer_ms"][str(x)] for r in rs])),
                    _fmt(_stat([r["read_layer_ms"][str(x)] for r in rs]))]
        table.append(row + [_fmt(_stat([r["p99_stall_ms"] for r in rs])), _fmt(_stat([r["s_ms"] for r in rs])), pages,
                            hit, f"{_stat([r['anon_at_window_bytes'] for r in rs])[1] / mb:.0f}",
                            f"{_stat([r.get('other_at_window_bytes', 0) for r in rs])[1] / mb:.0f}", limit,
                            f"{_stat([r['table_resident_bytes'] for r in rs])[1] / mb:.1f}"])
    lines = [format_table(header, table)]
    base = by.get("slacktier")
    if base:
        for what, key in [("step's stall", None)] + ([(f"L{x} stall", str(x)) for x in layers] if len(layers) > 1
                                                     else []):
            def stall(r: dict) -> float:
                return r["stall_ms"] if key is None else r["stall_layer_ms"][key]

            ref = _stat([stall(r) for r in base])[1]
            for v in MMAP_VARIANTS:
                if by.get(v):
                    m = _stat([stall(r) for r in by[v]])[1]
                    lines.append(f"{what} {v} / slacktier (medians): {m / ref:.1f}x" if ref > 0 else
                                 f"{what} {v}: {m:.2f} ms/step against SlackTier's 0.00")
    checked = [r for r in runs if r["checked_steps"]]
    lines.append(f"SlackTier's checker: {sum(r['checked_steps'] for r in checked)} decode steps after the timed ones, "
                 f"{sum(r['mismatches'] for r in checked)} mismatching rows")
    if rows is not None:
        lines.append("mapping vs SlackTier's gather (" + f"{len(MMAP_VARIANTS)} variants): " + "; ".join(
            f"layer {x}: {c:,} rows compared, {d} differ" for x, (c, d) in rows.items()))
    lines.append("stall = rows ready past the layer's scheduled start (the timeline's measure; a layer's stall "
                 "pushes every later layer's start back), total = the step's, summed over layers; read = "
                 "SlackTier's submit-to-completion, a mapping's gather (its faults happen there; after WILLNEED the "
                 "kernel's reads are not seen); s = the step's start (begin_step; the WILLNEED call for that "
                 "variant, over every layer on disk); flt = major faults in the gathers, all layers (one may bring "
                 "readahead pages); pg = pages SlackTier read, per layer; anon = the process's anonymous memory "
                 "when the window started (SlackTier's includes its cache and page buffers), anon+kernel = all the "
                 "cgroup held then but page cache; limit = the mapping's cgroup cap (all but page cache + budget, "
                 "reset before each step; the largest shown); table in page cache = the regions' resident pages at "
                 "the end (mincore), all layers on disk")
    return "\n".join(lines)


def regime(cfg: RunConfig, manifest, budget: int, capped: bool, reason: str, split: str = "") -> str:
    layers = cfg.disk_layers
    regions = [manifest.region(x, cfg.rank) for x in layers]
    total = sum(r.nbytes for r in regions)
    slots = cfg.cache_slots()
    dram = [x for x in (1, LAYER) if x not in layers]
    return (f"Regime: placement {cfg.placement}: layer{'s' if len(layers) > 1 else ''} "
            + " and ".join(map(str, layers)) + f" of rank {cfg.rank} of TP4 on disk, a V4.1-shaped table scaled "
            f"to engram_vocab {cfg.engram_vocab:,} ("
            + ", ".join(f"layer {r.layer}: {r.rows:,} rows, {r.nbytes / 1e9:.2f} GB of pages" for r in regions)
            + f"; {total / budget:.0f}x the host budget), synthetic rows, V4.1 hash; {cfg.workload} traffic, "
            f"held-out sessions first (sweep_sessions: the first batch held-out at B={cfg.batch} agent; the "
            f"sessions refilling it by the window come from the fit half too), B={cfg.batch}, decode steps only "
            f"(prefills not read by any reader), the window after "
            f"{cfg.start_decode_steps} decode steps (read untimed by SlackTier to fill its cache, skipped by the "
            f"mappings, whose page cache fills in the window's {cfg.warmup_steps} untimed steps), then "
            f"{cfg.decode_steps} timed steps per run; device compute from profile {cfg.profile}"
            + (f"; layer {dram[0]} in host DRAM (stock path)" if dram else "")
            + f". Host budget {budget / 1e6:.1f} MB = SlackTier's "
            + " + ".join(f"{n:,}-row cache on layer {x}" for x, n in slots.items())
            + " (rows x 264 B) plus " + ("its directory" if len(slots) == 1 else "each layer's directory")
            + (f"; {split}" if split else "") + "; "
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
    ap.add_argument("--placement", default=RunConfig.placement, choices=tuple(PLACEMENTS),
                    help="which layers are read from disk (the others: host DRAM, the stock path)")
    ap.add_argument("--cache-rows", type=int, default=RunConfig.cache_rows,
                    help="SlackTier's cache rows on the one layer on disk (placements with one layer on disk)")
    ap.add_argument("--split-cache-rows", type=int, default=RunConfig.split_cache_rows,
                    help="placement disk: SlackTier's cache rows over both layers")
    ap.add_argument("--split-l1", type=float, default=None,
                    help="placement disk: layer 1's share of the split cache (default: the planner's, computed "
                         "before the runs from the fit half's miss curves and a read fit of the disk)")
    ap.add_argument("--read-fit-runs", type=int, default=15, help="placement disk: the planner's disk read fit")
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
                    start_decode_steps=args.start_decode_steps, placement=args.placement,
                    split_cache_rows=args.split_cache_rows, split_l1=args.split_l1)
    t0 = time.perf_counter()
    manifest = stage_rank_shard(cfg.full_rank(), progress=True)
    targets = sorted({manifest.region(x, cfg.rank).path for x in cfg.disk_layers})
    target = targets[0]
    split_text = ""
    try:
        if len(cfg.disk_layers) > 1:
            if cfg.split_l1 is None:
                print("the planner's cache split: fit-half miss curves, disk read fit ...", flush=True)
                ps = planner_split(cfg, manifest, read_fit_runs=args.read_fit_runs)
                cfg = dataclasses.replace(cfg, split_l1=ps.l1_share)
                split_text = ps.text()
            else:
                split_text = f"cache split given (--split-l1): layer 1 {cfg.split_l1:.4f}, layer 14 the rest"
            split_text += " -> slots " + ", ".join(f"L{x} {n:,}" for x, n in cfg.cache_slots().items())
            print(split_text, flush=True)
        budget = budget_bytes(cfg.cache_slots())
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
                r = _one_run(cfg, v, budget, capped, targets, f"{rnd}-{v}")
                r["round"] = rnd
                runs.append(r)
                per = ", ".join(f"L{x} stall {r['stall_layer_ms'][str(x)]:.2f} read {r['read_layer_ms'][str(x)]:.2f}"
                                for x in cfg.disk_layers)
                print(f"  round {rnd + 1}/{args.rounds} {v}: stall {r['stall_ms']:.2f} ms/step ({per}), "
                      f"s {r['s_ms']:.2f} ms, major faults {r['majflt']}, anon "
                      f"{r['anon_at_window_bytes'] / 1e6:.0f} MB, limit {r['limit_bytes'] / 1e6:.0f} MB, table "
                      f"in page cache {r['table_resident_bytes'] / 1e6:.1f} MB, "
                      f"{r['wall_s']:.0f} s", flush=True)
        rows = check_rows(cfg)
        print("rows: " + "; ".join(f"layer {x}: {c:,} compared, {d} differ" for x, (c, d) in rows.items()),
              flush=True)
        if runs:
            text = "\n".join([f"{utc_stamp()}, {machine()}", f"`{command_line(__file__)}`",
                              regime(cfg, manifest, budget, capped, reason, split_text), "",
                              report(cfg, runs, budget, rows),
                              f"whole command: {time.perf_counter() - t0:.0f} s"])
            print(text)
            if args.json:
                Path(args.json).write_text(json.dumps(runs, indent=1))
            med = {v: _stat([r["stall_ms"] for r in runs if r["variant"] == v])[1]
                   for v in VARIANTS if any(r["variant"] == v for r in runs)}
            write_result("mmap_baseline" if cfg.placement == RunConfig.placement else f"mmap_baseline_{cfg.placement}",
                         {f"stall_ms_{v}": m for v, m in med.items()})
        if any(d for _, d in rows.values()):
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
