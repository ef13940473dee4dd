"""The step timeline: device compute from a profile; host, cache and I/O real (DESIGN 8b).

On a GPU server the model computes on the device while the host hashes, runs
`begin_step` and reads pages. Here only the device is replaced, by a compute
profile: per lookup layer its window W_l (ms from step start until the layer
needs its rows) and the step's total compute, at a few batch sizes.

One decode step (`TimelineRunner.step`), all times from t0 = step start:

    before t0: pull the step's ids (hash them)                     -> prepare (reported apart)
    host: engine.begin_step(ids)                                  -> s (its call to its return)
    for each lookup layer l in depth order:
        sleep until sched_l = W_l + (stalls so far)  (time.sleep, spin the last ~100 us)
        engine.gather(l), called at c_l              -> returns at g_l
        stall_l = [c_l + wait_l - sched_l]+          (rows ready - scheduled start: wait on reads + begin_step overrun)
    step ends at total_ms + sum(stall_l)

The stall ends when the layer's rows are ready: when the engine's wait on its
reads returned (`wait_us` in its counters, after the call at c_l). The rest of
the gather is host time after the rows are ready: the dequant pass
(`gather_us`, a kernel inside layer l on a GPU; reported apart) and the call's
own Python around it (a small cost per layer), neither a stall.
Counting g_l - sched_l - pass instead would put that call overhead into every
layer's stall, even a layer whose rows were ready before its start. The
engine publishes counters only at `end_step`, so while the step runs the next
layer's schedule is shifted by g_l - sched_l minus layer l's non-waiting gather
time of the previous step (g - c - wait; an estimate); the recorded stalls and
the step's end use this step's counters.

Why the ids are prepared before the step's clock starts: pulling a step from
the replay (history windows, positions, slot bookkeeping in Python) and hashing
it is the benchmark's work, not the server's: a serving engine's scheduler has
the step's tokens before the step, and SGLang hashes on the device. So `s` is
`begin_step` alone, as a server pays it; the preparation is kept
in `prepare_ms`. Worked example: W1 = 0.27, W14 = 9.35, total 29.41;
begin_step takes 0.5 ms, layer 1's gather is called at 0.5 ms, waits 0.4 ms
for its reads and returns at 1.0 ms after a 0.1 ms pass: stall_1 = 0.5 + 0.4 -
0.27 = 0.63; layer 14 is scheduled at 9.98 ms; its rows are ready, so
stall_14 = 0 and the step ends at 30.04 ms.

The predicted stalls come from the exposure model (plan.exposure, Eq. 1
generalized) with this step's measured s and read times: a check of Eq. 1
alone. The prediction made before the runs, with read times from the planner's
device read-time model (plan.readmodel) and pages from miss curves, is
serve.predict's planner column.
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Iterator, Protocol, Sequence

import numpy as np

from slacktier.errors import ErrorKind, SlackTierError
from slacktier.plan.exposure import LayerRead, exposure
from slacktier.errors import read_text

PROFILE_FORMAT = "slacktier-compute-profile/1"
PROFILES_DIR = Path(__file__).parent / "profiles"
SPIN_S = 100e-6   # sleep until this close to a deadline, then spin (the host stays free, as on a GPU server)


# ---- profiles -------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class StepTimes:
    """One step's device compute: each lookup layer's window and the step total (ms), at one batch size."""

    workload: str
    batch: float
    step_ms: float
    windows_ms: dict[int, float]


@dataclass(frozen=True)
class ComputeProfile:
    """Per-layer windows and step totals at several batch sizes, per workload, with where they came from."""

    name: str
    model: str
    layers: int
    origin: str
    decode: tuple[StepTimes, ...]
    prefill: tuple[StepTimes, ...] = ()

    @property
    def header(self) -> str:
        """The line every timeline report starts with."""
        return f"device compute from profile {self.name}; host, cache and I/O real (profile origin: {self.origin})"

    def workloads(self) -> tuple[str, ...]:
        """Workloads with decode points."""
        return tuple(sorted({p.workload for p in self.decode}))

    def times(self, batch: float, workload: str, lookup_layers: Sequence[int]) -> StepTimes:
        """Decode times at `batch`, linear between the profile's batch sizes; refuses a layer or batch it lacks.

        Example (v41_paper, agent): B=8 step 11.0, B=128 29.41 -> B=32 step 11.0 + 18.41 * 24/120 = 14.682 ms.
        """
        pts = sorted((p for p in self.decode if p.workload == workload), key=lambda p: p.batch)
        if not pts:
            raise SlackTierError(ErrorKind.MISSING, f"profile {self.name} has no decode points for {workload!r}",
                                 fix=f"use one of {', '.join(self.workloads())}")
        missing = [l for l in lookup_layers if any(l not in p.windows_ms for p in pts)]
        if missing:
            raise SlackTierError(ErrorKind.MISSING, f"profile {self.name} has no window for lookup layers "
                                 f"{missing}", layer=missing[0],
                                 fix="use a profile measured for this model's lookup layers (slacktier probe)")
        lo, hi = pts[0].batch, pts[-1].batch
        if not lo <= batch <= hi:
            raise SlackTierError(ErrorKind.BAD_INPUT, f"batch {batch} outside profile {self.name}'s "
                                 f"{workload} range [{lo:g}, {hi:g}]",
                                 fix="pick a batch inside the range; the profile does not extrapolate")
        xs = np.array([p.batch for p in pts], dtype=np.float64)

        def at(values: list[float]) -> float:
            return float(np.interp(batch, xs, np.array(values)))

        return StepTimes(workload, float(batch), at([p.step_ms for p in pts]),
                         {l: at([p.windows_ms[l] for p in pts]) for l in lookup_layers})


def _bad(msg: str, where: str) -> SlackTierError:
    return SlackTierError(ErrorKind.BAD_INPUT, f"compute profile {where}: {msg}",
                          fix=f"see src/slacktier/serve/profiles/v41_paper.json for the format ({PROFILE_FORMAT})")


def _points(doc: dict, key: str, layers: int, where: str) -> tuple[StepTimes, ...]:
    out = []
    for i, p in enumerate(doc.get(key, [])):
        at = f"{where} {key}[{i}]"
        try:
            wl, batch, step_ms, windows = str(p["workload"]), float(p["batch"]), float(p["step_ms"]), p["windows_ms"]
        except (KeyError, TypeError, ValueError) as exc:
            raise _bad(f"point needs workload, batch, step_ms, windows_ms ({exc})", at) from None
        if batch <= 0 or step_ms <= 0:
            raise _bad(f"batch {batch:g} and step_ms {step_ms:g} must be > 0", at)
        if not isinstance(windows, dict) or not windows:
            raise _bad("windows_ms must map layer -> ms", at)
        w: dict[int, float] = {}
        for k, v in windows.items():
            try:
                layer, ms = int(k), float(v)
            except (TypeError, ValueError):
                raise _bad(f"window {k!r}: {v!r} is not layer -> ms", at) from None
            if not 0 <= layer < layers:
                raise _bad(f"layer {layer} outside the model's {layers} layers", at)
            if ms < 0:
                raise _bad(f"layer {layer}'s window {ms} ms is negative", at)
            if ms > step_ms:
                raise _bad(f"layer {layer}'s window {ms} ms is past the step's {step_ms} ms", at)
            w[layer] = ms
        depth = sorted(w)
        for a, b in zip(depth, depth[1:]):
            if w[b] <= w[a]:
                raise _bad(f"windows must increase with depth: layer {a} {w[a]} ms, layer {b} {w[b]} ms", at)
        out.append(StepTimes(wl, batch, step_ms, w))
    keys = [(p.workload, p.batch) for p in out]
    if len(set(keys)) != len(keys):
        raise _bad(f"{key}: a (workload, batch) point is given twice", where)
    return tuple(out)


def profile_from_dict(doc: dict, where: str = "<dict>") -> ComputeProfile:
    """A profile from its JSON document; refuses bad input with SlackTierError."""
    if not isinstance(doc, dict):
        raise _bad("not a JSON object", where)
    if doc.get("format") != PROFILE_FORMAT:
        raise _bad(f"format {doc.get('format')!r}, want {PROFILE_FORMAT!r}", where)
    for k in ("name", "origin", "layers", "decode"):
        if k not in doc:
            raise _bad(f"missing {k!r}", where)
    layers = doc["layers"]
    if not isinstance(layers, int) or isinstance(layers, bool) or layers < 1:
        raise _bad(f"layers {layers!r} must be a positive integer", where)
    if not str(doc["origin"]).strip():
        raise _bad("origin is empty: say where the numbers come from", where)
    decode = _points(doc, "decode", layers, where)
    if not decode:
        raise _bad("no decode points", where)
    return ComputeProfile(str(doc["name"]), str(doc.get("model", "")), layers, str(doc["origin"]), decode,
                          _points(doc, "prefill", layers, where))


def load_profile(name_or_path: str | Path) -> ComputeProfile:
    """A shipped profile by name (`v41_paper`, `qwen38_paper`) or a JSON file."""
    path = Path(name_or_path)
    if not path.suffix:
        path = PROFILES_DIR / f"{name_or_path}.json"
    if not path.is_file():
        shipped = ", ".join(sorted(p.stem for p in PROFILES_DIR.glob("*.json")))
        raise SlackTierError(ErrorKind.MISSING, f"no compute profile {name_or_path}",
                             fix=f"pass a JSON file or one of {shipped}")
    text = read_text(path, "compute profile", "JSON",
                     f"see src/slacktier/serve/profiles/v41_paper.json for the format ({PROFILE_FORMAT})")
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise _bad(f"not JSON ({exc})", str(path)) from None
    return profile_from_dict(doc, str(path))


# ---- the runner -----------------------------------------------------------------------------------------

class Clock(Protocol):
    """Seconds on one monotonic clock, and waiting until a time on it."""

    def now(self) -> float: ...

    def wait_until(self, deadline: float) -> None: ...


def sleep_then_spin(deadline: float, now=time.perf_counter, sleep=time.sleep, spin_s: float = SPIN_S) -> None:
    """Sleep until `spin_s` before `deadline`, then spin: the host stays free, as it is beside a GPU."""
    rest = deadline - now()
    if rest > spin_s:
        sleep(rest - spin_s)
    while now() < deadline:
        pass


class RealClock:
    """time.perf_counter; waits by sleep_then_spin."""

    def now(self) -> float:
        return time.perf_counter()

    def wait_until(self, deadline: float) -> None:
        sleep_then_spin(deadline)


class TimelineEngine(Protocol):
    """What the runner needs of a StepEngine."""

    def begin_step(self, ids: np.ndarray) -> None: ...   # and (ids, decode) where `warm` is given decode flags

    def gather(self, layer: int) -> object: ...

    def end_step(self) -> object: ...   # StepCounters: .layers[l] with wait_us, read_us, gather_us, pages_read, hits


class LayerSubset:
    """The timeline's view of a rank's engine serving some of the hasher's layers: ids [T, L, C] -> [T, L', C].

    Its step counters count only the rank's own lookups (`lookups - zero_rows`: another rank's rows are zero
    rows here, nothing read), so hit rates are over the lookups this rank serves.
    """

    def __init__(self, engine, axes: Sequence[int]) -> None:
        self.engine = engine
        self.axes = list(axes)

    def prepare(self, ids: np.ndarray) -> np.ndarray:
        """The step's ids of the served layers, as the engine takes them (C-contiguous), before the step."""
        return np.ascontiguousarray(np.asarray(ids)[:, self.axes, :])

    def begin_step(self, ids: np.ndarray, decode: np.ndarray | None = None) -> None:
        """ids: prepared (`prepare`); the warm-up's unprepared [T, L, C] ids are cut here. decode: as
        StepEngine.begin_step's."""
        if ids.shape[1] != len(self.axes):
            ids = self.prepare(ids)
        self.engine.begin_step(ids, decode)

    def gather(self, layer: int) -> object:
        return self.engine.gather(layer)

    def end_step(self) -> object:
        c = self.engine.end_step()
        return dataclasses.replace(c, layers={l: dataclasses.replace(v, lookups=v.lookups - v.zero_rows)
                                              for l, v in c.layers.items()})


@dataclass
class TimelineStep:
    """One decode step on the timeline (ms; per-layer dicts keyed by layer id)."""

    index: int
    tokens: int
    s_ms: float                     # begin_step, from its call to its return (resolve, submit): the step's start
    step_ms: float                  # profile total + measured stalls
    stall_ms: dict[int, float]      # measured: scheduled start -> rows ready (wait for reads + begin_step overrun)
    predicted_ms: dict[int, float]  # Eq. 1 from s_ms and read_ms
    read_ms: dict[int, float]       # the engine's submit-to-completion read time
    wait_ms: dict[int, float]       # the engine's wait inside gather
    gather_ms: dict[int, float]     # the engine's fill + dequant pass (a kernel inside the layer on a GPU)
    pages: dict[int, int]
    hits: dict[int, int]
    lookups: dict[int, int]
    begin_ms: float = 0.0           # = s_ms (kept for runs stored when s also held the pulling and hashing)
    prepare_ms: float = 0.0         # pulling and hashing the step's ids, before its clock started (not in s)
    replay_index: int = -1          # the replay Step's index (workloads.replay), set by run_replay; -1: not known

    @property
    def stall_total_ms(self) -> float:
        """Measured overhead of the step."""
        return sum(self.stall_ms.values())

    @property
    def predicted_total_ms(self) -> float:
        """Predicted overhead of the step (Eq. 1, kappa = 0)."""
        return sum(self.predicted_ms.values())


@dataclass
class TimelineRunner:
    """Runs decode steps of one engine against a profile's step times (see the module docstring)."""

    engine: TimelineEngine
    times: StepTimes
    clock: Clock = field(default_factory=RealClock)
    _last_rest_s: dict[int, float] = field(default_factory=dict, init=False)   # per layer: gather time not waiting
    _index: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        self.layers = tuple(sorted(self.times.windows_ms))   # depth order

    def warm(self, ids: np.ndarray, decode: np.ndarray | None = None) -> None:
        """A step off the timeline (a prefill chunk): lookups issued and gathered, nothing timed. decode: [T]
        bool per token (None: all decode, and begin_step is called with the ids alone), for the cache's admission
        rule (StepEngine.begin_step)."""
        if decode is None:
            self.engine.begin_step(ids)
        else:
            self.engine.begin_step(ids, decode)
        for layer in self.layers:
            self.engine.gather(layer)
        self.engine.end_step()

    def prepare(self, ids: np.ndarray) -> np.ndarray:
        """The step's ids as the engine takes them (an engine's own `prepare`, e.g. a rank's layer subset)."""
        prep = getattr(self.engine, "prepare", None)
        return prep(ids) if prep is not None else ids

    def step(self, ids: np.ndarray, prepare_ms: float = 0.0) -> TimelineStep:
        """One decode step of prepared ids [T, L, 24] int64 (`prepare`); the step starts at the begin_step call.
        `prepare_ms`: what pulling and preparing them took, recorded apart."""
        clock = self.clock
        t0 = clock.now()
        self.engine.begin_step(ids)
        s = clock.now() - t0
        sched: dict[int, float] = {}
        called: dict[int, float] = {}
        done: dict[int, float] = {}
        shift = 0.0
        for layer in self.layers:
            sched[layer] = t0 + self.times.windows_ms[layer] / 1e3 + shift
            clock.wait_until(sched[layer])
            called[layer] = clock.now()
            self.engine.gather(layer)
            done[layer] = clock.now()
            shift += max(0.0, done[layer] - sched[layer] - self._last_rest_s.get(layer, 0.0))
        counters = self.engine.end_step()
        c = {l: counters.layers[l] for l in self.layers}
        ready = {l: called[l] + c[l].wait_us / 1e6 for l in self.layers}
        stall = {l: max(0.0, ready[l] - sched[l]) * 1e3 for l in self.layers}
        for l in self.layers:
            self._last_rest_s[l] = max(0.0, done[l] - ready[l])
        step_ms = self.times.step_ms + sum(stall.values())
        clock.wait_until(t0 + step_ms / 1e3)
        read_ms = {l: c[l].read_us / 1e3 for l in self.layers}
        pred = exposure([LayerRead(l, self.times.windows_ms[l], read_ms[l]) for l in self.layers],
                        resolve_ms=s * 1e3)
        self._index += 1
        return TimelineStep(
            index=self._index - 1, tokens=int(np.asarray(ids).shape[0]), s_ms=s * 1e3, step_ms=step_ms,
            stall_ms=stall, predicted_ms={l: pred.stall_of(l) for l in self.layers}, read_ms=read_ms,
            wait_ms={l: c[l].wait_us / 1e3 for l in self.layers},
            gather_ms={l: c[l].gather_us / 1e3 for l in self.layers},
            pages={l: int(c[l].pages_read) for l in self.layers}, hits={l: int(c[l].hits) for l in self.layers},
            lookups={l: int(c[l].lookups) for l in self.layers}, begin_ms=s * 1e3, prepare_ms=prepare_ms)


def run_replay(runner: TimelineRunner, steps: Iterable, batch: int, decode_steps: int, warm: bool = True,
               warmup_steps: int = 0, warm_first: bool = True,
               before_step: Callable[[], object] | None = None, start_decode_steps: int = 0) -> list[TimelineStep]:
    """Replay Steps (workloads.replay): prefill warms the cache off the timeline; decode steps with `batch`
    tokens run on it until `decode_steps` of them ran (fewer decode tokens: warmed, not timed).

    `start_decode_steps`: the timeline starts deep in the replay, after this many decode steps (of any size);
    every step before that runs off the timeline like a prefill (warmed, untimed), so a cached placement's cache
    holds what the sessions' earlier turns left in it, as on a serving node. The first `warmup_steps` full-batch
    decode steps after it run on the timeline but are not recorded (first-call costs, the schedule's shift
    estimates); `warm=False` skips the non-timed steps on the engine, all but the first with `warm_first` (an
    uncached placement: nothing a step reads survives it; the first warms the code).
    Each step's ids are pulled and prepared before its clock starts (`TimelineStep.prepare_ms`, module doc).
    `before_step` runs after that, just before the step: TP ranks in several processes meet there (a barrier),
    so every rank's step starts together, as in a tensor-parallel forward."""
    if start_decode_steps < 0 or warmup_steps < 0:
        raise SlackTierError(ErrorKind.BAD_INPUT, f"start_decode_steps {start_decode_steps}, warmup_steps "
                             f"{warmup_steps}", fix="both are >= 0")
    it: Iterator = iter(steps)
    out: list[TimelineStep] = []
    clock = runner.clock
    warmed_once = not warm_first
    skip = warmup_steps
    before = start_decode_steps   # decode steps still to pass off the timeline
    while len(out) < decode_steps:
        tp = clock.now()
        st = next(it, None)   # pulling a step hashes its tokens: the benchmark's work, before the step's clock
        if st is None:
            break
        on_timeline = st.kind == "decode" and st.num_tokens == batch and before == 0
        if st.kind == "decode" and before > 0:
            before -= 1
        if on_timeline:
            ids = runner.prepare(st.ids)
            prepare_ms = (clock.now() - tp) * 1e3
            if before_step is not None:
                before_step()
            step = runner.step(ids, prepare_ms)
            if skip > 0:
                skip -= 1
            else:
                out.append(dataclasses.replace(step, replay_index=int(st.index)))
        elif warm or not warmed_once:
            runner.warm(st.ids)
            warmed_once = True
    return out


@dataclass(frozen=True)
class TimelineSummary:
    """A run's full-batch decode steps: mean measured and predicted overhead per step (ms), per-layer means."""

    steps: int
    stall_ms: float
    predicted_ms: float
    p99_stall_ms: float
    s_ms: float
    read_ms: dict[int, float]
    stall_layer_ms: dict[int, float]
    gather_ms: dict[int, float]
    pages: dict[int, float]
    hit_rate: dict[int, float]
    begin_ms: float = float("nan")   # begin_step itself (= s_ms; NaN: a run stored before it was kept)
    prepare_ms: float = float("nan")  # pulling and hashing a step, before its clock (NaN: a run stored before)


def summarize(steps: Sequence[TimelineStep]) -> TimelineSummary:
    """Means over `steps` (NaN-free: refuses an empty list)."""
    if not steps:
        raise SlackTierError(ErrorKind.MISSING, "no full-batch decode step ran",
                             fix="use traffic with at least B sessions and enough decode tokens")
    layers = tuple(steps[0].stall_ms)

    def mean(f) -> float:
        return float(np.mean([f(s) for s in steps]))

    return TimelineSummary(
        steps=len(steps), stall_ms=mean(lambda s: s.stall_total_ms), predicted_ms=mean(lambda s: s.predicted_total_ms),
        p99_stall_ms=float(np.percentile([s.stall_total_ms for s in steps], 99)), s_ms=mean(lambda s: s.s_ms),
        read_ms={l: mean(lambda s: s.read_ms[l]) for l in layers},
        stall_layer_ms={l: mean(lambda s: s.stall_ms[l]) for l in layers},
        gather_ms={l: mean(lambda s: s.gather_ms[l]) for l in layers},
        pages={l: mean(lambda s: s.pages[l]) for l in layers},
        hit_rate={l: sum(s.hits[l] for s in steps) / max(1, sum(s.lookups[l] for s in steps)) for l in layers},
        begin_ms=mean(lambda s: s.begin_ms), prepare_ms=mean(lambda s: s.prepare_ms))


# ---- placements on a scaled table, shuffled runs (the demo's section and benchmarks/paper/bench_timeline.py)

@dataclass(frozen=True)
class SweepConfig:
    """A scaled V4.1-hashed table, traffic, a profile, placements at some batch sizes, shuffled runs."""

    workdir: str = "runs/timeline"
    profile: str = "v41_paper"
    workload: str = "chat"            # built-in traffic (ShareGPT chat; the agent set needs minutes to build)
    batches: tuple[int, ...] = (32,)
    runs: int = 3
    decode_steps: int = 32            # full-batch decode steps timed per run
    decode_tokens: int = 64           # N tokens per assistant turn
    engram_vocab: int = 12_500        # ~300,000 rows per layer, the demo's table size
    cache_rows: int = 32_768          # rows of the cached placements (both layers)
    max_session_tokens: int | None = 1024   # None: no token cap (whole sessions; chunked prefills)
    max_turns: int | None = 2               # None: every assistant turn
    prefill_chunk_tokens: int = 1024
    seed: int = 0
    metrics: bool = False             # the engines publish Prometheus metrics
    remote_nodes: int = 0             # > 0: also the remote placements, from a local Redis Cluster of this many masters
    check_steps: int = 4              # decode steps after the timed ones, run with the engine's checker on (untimed)


def timeline_placements(first: int, second: int, cache_rows: int, remote: bool = False) -> list:
    """Short-window layer in DRAM + long on disk; both on disk uncached; cache on the long layer only; split;
    with `remote`, the same shapes with the Redis Cluster tier in place of the disk."""
    from slacktier.plan.placement import Placement

    out = []
    for tier, name in (("disk", "disk"), *((("redis", "remote"),) if remote else ())):
        both = ((first, tier), (second, tier))
        out += [Placement(f"l{first}-dram-l{second}-{name}", ((first, "dram"), (second, tier))),
                Placement(name, both),
                Placement(f"{name}-cache-l{second}", both, cache_rows // 2, ((second, 1.0),)),
                Placement(f"{name}-split", both, cache_rows, ((first, 0.5), (second, 0.5)))]
    return out


@dataclass(frozen=True)
class SweepRun:
    """One run: a placement at one batch size, its place in the shuffled order, what it measured."""

    placement: str
    batch: int
    rep: int
    order: int
    step_ms: float       # the profile's step at this batch
    summary: TimelineSummary
    checked_steps: int = 0   # untimed steps after the timed ones, every row compared with the table's source
    mismatches: int = 0      # rows of those steps that differed (0 expected)


def sweep_sessions(cfg: SweepConfig, batch: int) -> list:
    """`batch` distinct sessions of the traffic (held-out first); refuses a batch the traffic cannot fill."""
    from slacktier.serve.runs import clip_sessions
    from slacktier.workloads.corpus import CorpusConfig, load_workload

    split = load_workload(cfg.workload, CorpusConfig(seed=cfg.seed, agent_sessions_per_source=1))
    pool = clip_sessions(split.holdout, cfg.max_session_tokens, cfg.max_turns) + \
        clip_sessions(split.fit, cfg.max_session_tokens, cfg.max_turns)
    if len(pool) < batch:
        raise SlackTierError(ErrorKind.BAD_INPUT, f"B={batch} needs {batch} sessions; the {cfg.workload} traffic "
                             f"has {len(pool)}" + (f" within {cfg.max_session_tokens} tokens"
                                                   if cfg.max_session_tokens is not None else ""),
                             fix="pick a smaller B or more traffic (no session is repeated to fill a batch)")
    return pool


def checked_steps(engine, runner: TimelineRunner, replay: Iterator, batch: int, n: int) -> tuple[int, int]:
    """Run `n` more decode steps of `replay` with the engine's checker on (every gathered row compared with the
    row regenerated from the manifest's source), off the timeline; (steps checked, mismatching rows)."""
    if n <= 0:
        return 0, 0
    cfg = engine.config
    engine.apply(cfg.replace(check=True))
    try:
        before = sum(c.mismatches for c in engine.totals.values())
        steps = run_replay(runner, replay, batch, n)
        return len(steps), sum(c.mismatches for c in engine.totals.values()) - before
    finally:
        engine.apply(cfg)
