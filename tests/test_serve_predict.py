"""The planner's timeline prediction (serve.predict): exact numbers on hand-made inputs, injected delays on a fake
clock, the fit-half curves on real components; no wall-clock assertions. Bad profiles are tested in
test_serve_timeline.py, the read fit in test_probe_readfit.py."""

from __future__ import annotations

import numpy as np
import pytest

from slacktier.engine.counters import LayerCounters, StepCounters
from slacktier.errors import SlackTierError
from slacktier.plan.curves import MissCurve, MissCurves
from slacktier.plan.readmodel import DeviceReadModel
from slacktier.plan.tiers import TierSpec
from benchmarks.paper.injected_delays import DelayedEngine, delay_prediction, run_delayed_replay
from slacktier.serve.predict import Calibration, FitCurves, PlannerInputs, calibrate, fit_miss_curves, predict
from slacktier.plan.placement import Placement
from slacktier.serve.timeline import StepTimes, SweepRun, TimelineRunner, TimelineSummary, load_profile

from test_serve_timeline import FakeClock   # time passes only when told

# a disk whose second table pays c = 5 us per page queued ahead, not b = 20 us (two sources side by side)
DISK = TierSpec("disk", DeviceReadModel(0.3, 0.02, 0.005, 0.01), holds_table=False)
DRAM = TierSpec("dram", DeviceReadModel(0.05, 0.001, 0.001, 0.0), holds_table=True)


def inputs() -> PlannerInputs:
    """B=128 agent on v41_paper (W1 0.27, W14 9.35); P1 100 -> 50 pages over 0..1000 rows, P14 200 -> 100."""
    curves = MissCurves("agent", 128, {1: MissCurve((0.0, 1000.0), (100.0, 50.0)),
                                       14: MissCurve((0.0, 1000.0), (200.0, 100.0))})
    return PlannerInputs(load_profile("v41_paper"), "agent", {"disk": DISK, "dram": DRAM},
                         {128: FitCurves(curves, 128, 128, 200, 16)}, {1: 300_000, 14: 300_000})


BOTH = ((1, "disk"), (14, "disk"))
CAL = Calibration(s0_ms=0.5, s1_ms=0.0, kappa_ms=0.1, runs=1)


def test_both_on_disk_uncached_is_eq1_on_the_device_model():
    # T1 = 0.3 + 0.02*100 + 0.01*200 (behind) = 4.3; T14 = 0.3 + 0.02*200 + 0.005*100 (ahead) = 4.8; s = 0.5
    # d1 = 0.5 + 4.3 - 0.27 = 4.53; d14 = [0.5 + 4.8 - 9.35 - 4.53]+ = 0; + kappa 0.1
    plan = predict(inputs(), Placement("disk", BOTH), 128, CAL)
    assert [r.read_ms for r in plan.reads] == pytest.approx([4.3, 4.8])
    assert plan.pages == pytest.approx({1: 100.0, 14: 200.0}) and plan.slowdown_ms == pytest.approx(4.63)
    late = Calibration(s0_ms=6.0, s1_ms=0.0, kappa_ms=0.0, runs=1)
    # s = 6: d1 = 6 + 4.3 - 0.27 = 10.03; d14 = [6 + 4.8 - 9.35 - 10.03]+ = 0
    assert predict(inputs(), Placement("disk", BOTH), 128, late).slowdown_ms == pytest.approx(10.03)
    # the same device with c = b (layer 14 waits for every page of layer 1): T14 = 0.3 + 0.02*300 = 6.3
    fifo = PlannerInputs(**{**vars(inputs()), "tiers": {"disk": TierSpec("disk", DeviceReadModel(0.3, 0.02, 0.02,
                                                                                                0.01), False),
                                                        "dram": DRAM}})
    assert [r.read_ms for r in predict(fifo, Placement("disk", BOTH), 128).reads] == pytest.approx([4.3, 6.3])


def test_layer1_in_dram_and_the_split_cache():
    plan = predict(inputs(), Placement("l1-dram", ((1, "dram"), (14, "disk"))), 128, CAL)
    # T1 = 0.05 + 0.001*100 = 0.15 -> d1 = 0.38; layer 14 alone on disk: T14 = 0.3 + 0.02*200 = 4.3 -> d14 = 0
    assert [r.read_ms for r in plan.reads] == pytest.approx([0.15, 4.3])
    assert plan.slowdown_ms == pytest.approx(0.48)
    split = predict(inputs(), Placement("split", BOTH, 1000, ((1, 0.5), (14, 0.5))), 128, CAL)
    # P1(500) = 75, P14(500) = 150: T1 = 0.3 + 1.5 + 1.5 = 3.3 -> d1 = 3.53
    assert [split.pages[1], split.pages[14]] == pytest.approx([75.0, 150.0])
    assert split.slowdown_ms == pytest.approx(3.63)
    assert predict(inputs(), Placement("split", BOTH, 1000, ((1, 0.5), (14, 0.5))),
                   128).slowdown_ms == pytest.approx(3.3 - 0.27)   # no calibration: s = 0, kappa = 0


def test_prediction_refuses_a_batch_without_curves_and_a_tier_without_a_model():
    with pytest.raises(SlackTierError, match="no miss-page curves for B=64"):
        predict(inputs(), Placement("disk", BOTH), 64)
    with pytest.raises(SlackTierError, match="without a read-time model"):
        predict(inputs(), Placement("remote", ((1, "redis"), (14, "disk"))), 128)


def _summary(stall: float, s: float) -> TimelineSummary:
    z = {1: 0.0, 14: 0.0}
    return TimelineSummary(steps=4, stall_ms=stall, predicted_ms=stall, p99_stall_ms=stall, s_ms=s, read_ms=dict(z),
                           stall_layer_ms=dict(z), gather_ms=dict(z), pages=dict(z), hit_rate=dict(z))


def test_calibration_fits_s_of_b_and_kappa_on_the_fit_runs():
    inp = inputs()
    inp = PlannerInputs(inp.profile, inp.workload, inp.tiers, {**inp.curves, 8: inp.curves[128]}, inp.table_rows)
    pl = Placement("disk", BOTH)
    # s(B) = 0.2 + 0.01 B; measured = planner's stall at that s + 0.25
    runs = []
    for b in (8, 128):
        s = 0.2 + 0.01 * b
        bare = predict(inp, pl, b, Calibration(s, 0.0, 0.0, 1)).slowdown_ms
        runs.append((pl, SweepRun("disk", b, 0, 0, 29.41, _summary(bare + 0.25, s))))
    cal = calibrate(inp, runs)
    assert (cal.s0_ms, cal.s1_ms, cal.kappa_ms) == pytest.approx((0.2, 0.01, 0.25))
    assert predict(inp, pl, 128, cal).slowdown_ms == pytest.approx(runs[1][1].summary.stall_ms)
    with pytest.raises(SlackTierError, match="no fit runs"):
        calibrate(inp, [])


# ---- injected delays -----------------------------------------------------------------------------------

def test_delay_prediction_worked_example():
    times = load_profile("v41_paper").times(8, "chat", (1, 14))
    assert delay_prediction(times, {1: 2.5, 14: 6.0}) == pytest.approx(2.5 - 0.101 + 0.0 + (6 - 3.4971 - 2.399))
    assert delay_prediction(times, {1: 2.5, 14: 6.0}, coupled=False) == pytest.approx(2.399 + 2.5029)
    t128 = StepTimes("agent", 128, 29.41, {1: 0.27, 14: 9.35})
    assert delay_prediction(t128, {1: 0.9, 14: 12.0}) == pytest.approx(2.65)   # the paper's Table 3 row


class ReadyEngine:
    """Rows ready at once; begin_step takes 0.2 ms of host time; gathers cost nothing."""

    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock

    def begin_step(self, ids) -> None:
        self.clock.t += 0.2e-3

    def gather(self, layer: int) -> None:
        return None

    def end_step(self) -> StepCounters:
        return StepCounters(step=1, tokens=4, layers={l: LayerCounters(lookups=96) for l in (1, 14)})


class S:
    def __init__(self, kind: str, t: int, hash_ms: float, clock: FakeClock):
        self.kind, self.ids, self.hash_ms, self.clock = kind, np.zeros((t, 2, 24), dtype=np.int64), hash_ms, clock

    @property
    def num_tokens(self) -> int:
        return self.ids.shape[0]


def _steps(clock: FakeClock, items):
    for st in items:
        clock.t += st.hash_ms / 1e3   # pulling a step hashes it: host time before the step's clock starts
        yield st


@pytest.mark.parametrize("d1, d14", [(0.4, 9.0), (0.9, 12.0), (1.5, 12.0), (2.5, 15.0)])
def test_injected_delays_on_the_timeline_match_eq1(d1, d14):
    clock = FakeClock()
    times = StepTimes("agent", 128, 29.41, {1: 0.27, 14: 9.35})
    engine = DelayedEngine(ReadyEngine(clock), {1: d1, 14: d14}, clock=clock)
    runner = TimelineRunner(engine, times, clock=clock)
    items = [S("prefill", 20, 0.1, clock), S("decode", 4, 0.1, clock), S("decode", 4, 0.1, clock)]
    steps = run_delayed_replay(runner, engine, _steps(clock, items), 4, 5)
    assert len(steps) == 2
    # delays count from step start (the begin_step call, after hashing), so begin_step (0.2 ms) hides in them
    for st in steps:
        assert st.stall_total_ms == pytest.approx(delay_prediction(times, {1: d1, 14: d14}), abs=1e-9)


class LateWaker:
    """The shared fake clock, but every sleep wakes 0.05 ms past its deadline (the host's wake-up)."""

    def __init__(self, base: FakeClock) -> None:
        self.base = base

    def now(self) -> float:
        return self.base.t

    def wait_until(self, deadline: float) -> None:
        if deadline > self.base.t:
            self.base.t = deadline + 0.05e-3


class SlowCallEngine(ReadyEngine):
    """Rows ready at once, but each gather call spends 0.03 ms of host time (no wait, no pass counted)."""

    def gather(self, layer: int) -> None:
        self.clock.t += 0.03e-3


@pytest.mark.parametrize("d1, d14", [(0.4, 9.0), (0.9, 12.0), (1.5, 12.0), (2.5, 15.0)])
def test_injected_delay_wake_up_and_call_overhead_are_not_stall(d1, d14):
    # the injected read lands at t0 + D; the hold's late wake-up and the gather call's host time come after it
    clock = FakeClock()
    times = StepTimes("agent", 128, 29.41, {1: 0.27, 14: 9.35})
    engine = DelayedEngine(SlowCallEngine(clock), {1: d1, 14: d14}, clock=LateWaker(clock))
    runner = TimelineRunner(engine, times, clock=clock)
    items = [S("prefill", 20, 0.1, clock)] + [S("decode", 4, 0.1, clock) for _ in range(3)]
    steps = run_delayed_replay(runner, engine, _steps(clock, items), 4, 5)
    assert len(steps) == 3
    held = steps[1].wait_ms[1]
    # begin_step returns at 0.2 ms, so layer 1 is called at its scheduled start, W1 = 0.27 ms; the read lands at d1
    assert held == pytest.approx(d1 - 0.27)
    # the first step has no previous one to take the 0.08 ms of non-waiting gather time out of layer 14's
    # schedule; from the second on, measured = Eq. 1 exactly
    for st in steps[1:]:
        assert st.stall_total_ms == pytest.approx(delay_prediction(times, {1: d1, 14: d14}), abs=1e-9)


# ---- the fit-half curves on real components ----------------------------------------------

def test_fit_half_curves_fall_with_capacity_and_count_full_decode_steps():
    from slacktier.serve.timeline import SweepConfig
    from slacktier.tables.engram_hash import EngramLayout
    from slacktier.workloads.hashing import EngramLookupHasher
    from slacktier.workloads.sessions import TokenSession

    layout = EngramLayout.scaled(300, (1, 14))
    hasher = EngramLookupHasher(layout)
    rng = np.random.default_rng(0)
    sessions = [TokenSession(f"s{i}", "test", "chat", rng.integers(0, 5000, 60).astype(np.int32),
                             np.array([30]), np.array([60])) for i in range(6)]
    cfg = SweepConfig(decode_steps=5, decode_tokens=8, workload="chat")
    fc = fit_miss_curves(cfg, sessions, hasher, 4, [0, 200, 2000])
    assert fc.replayed_batch == 4 and fc.steps == 5 and fc.note == ""
    for layer in (1, 14):
        pages = fc.curves.curve(layer).pages_per_step
        assert pages[0] > 0 and all(b <= a for a, b in zip(pages, pages[1:]))
        assert pages[0] <= 4 * 24   # at most one page per lookup of a 4-token step
    big = fit_miss_curves(cfg, sessions, hasher, 12, [0])   # 6 sessions cannot fill 12: replayed at 6, scaled
    assert big.replayed_batch == 6 and "scaled by 12/6" in big.note


def test_timeline_table_shows_the_planner_column():
    from slacktier.serve.report import timeline_table

    runs = [SweepRun(n, 32, r, 0, 15.54, _summary(st, 0.5)) for r in range(2) for n, st in (("a", 1.0), ("b", 4.0))]
    table = timeline_table(load_profile("v41_paper"), runs, planner_ms={(32, "a"): 1.25})
    lines = table.split("\n")
    head = next(l for l in lines if l.split()[:2] == ["B", "placement"])
    row_a, row_b = lines[lines.index(head) + 1:lines.index(head) + 3]
    assert "planner" in head.split() and max(map(len, lines)) <= 120
    assert "1.25" in row_a.split() and row_b.split()[head.split().index("planner")] == "-"
    plain = timeline_table(load_profile("v41_paper"), runs).split("\n")
    assert "planner" not in next(l for l in plain if l.split()[:2] == ["B", "placement"]).split()


def test_planner_sweep_refuses_a_batch_the_traffic_cannot_fill_before_staging(tmp_path):
    from slacktier.serve.predict import Job, planner_sweep
    from slacktier.serve.timeline import SweepConfig

    cfg = SweepConfig(workdir=str(tmp_path / "w"))
    with pytest.raises(SlackTierError, match="B=100000 needs 100000 sessions"):
        planner_sweep(cfg, lambda a, b: [Job(100_000, Placement("disk", ((a, "disk"), (b, "disk"))))],
                      lambda j: True)
    assert not (tmp_path / "w").exists()   # nothing staged


def test_planner_sweep_refuses_injected_delays_without_their_runner_before_staging(tmp_path):
    """Injected delays are the Table 3 experiment's (benchmarks/paper/injected_delays.py); the package runs them
    only through the runner it is given."""
    from slacktier.serve.predict import Job, planner_sweep
    from slacktier.serve.timeline import SweepConfig

    cfg = SweepConfig(workdir=str(tmp_path / "w"))
    dram = lambda a, b: Placement("dram", ((a, "dram"), (b, "dram")))   # noqa: E731
    with pytest.raises(SlackTierError, match=r"job dram\+delay 2/6 injects delays") as err:
        planner_sweep(cfg, lambda a, b: [Job(8, dram(a, b), ((a, 2.0), (b, 6.0)), group="delays")],
                      lambda j: False)
    assert "injected_delays.py" in err.value.fix
    assert not (tmp_path / "w").exists()   # nothing staged
