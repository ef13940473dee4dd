"""The step timeline: profile loading and refusals, and the runner on a fake clock (no wall-clock assertions)."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest

from slacktier.engine.counters import LayerCounters, StepCounters
from slacktier.errors import SlackTierError
from slacktier.serve.timeline import (PROFILES_DIR, ComputeProfile, StepTimes, TimelineRunner, load_profile,
                                      profile_from_dict, run_replay, sleep_then_spin, summarize)


class FakeClock:
    """Time passes only when told: sleep() and the fake engine's work advance it."""

    def __init__(self) -> None:
        self.t = 100.0

    def now(self) -> float:
        return self.t

    def wait_until(self, deadline: float) -> None:
        self.t = max(self.t, deadline)


class FakeEngine:
    """A StepEngine stand-in: begin_step takes `s_ms`; layer l's rows are ready `ready_ms[l]` after step start;
    each gather's pass takes `pass_ms`; counters report wait and pass as the engine would."""

    def __init__(self, clock: FakeClock, s_ms: float, ready_ms: dict[int, float], pass_ms: float,
                 call_ms: float = 0.0) -> None:
        self.clock, self.s_ms, self.ready_ms, self.pass_ms = clock, s_ms, ready_ms, pass_ms
        self.call_ms = call_ms   # host time of each gather call outside its wait and its pass (Python around them)
        self.calls: list[tuple[str, object, float]] = []

    def begin_step(self, ids: np.ndarray) -> None:
        self.t0 = self.clock.t
        self.counters = {l: LayerCounters(lookups=ids.shape[0] * 24, hits=3, pages_read=7,
                                          read_us=max(0.0, r - self.s_ms) * 1e3) for l, r in self.ready_ms.items()}
        self.calls.append(("begin", None, self.clock.t))
        self.clock.t += self.s_ms / 1e3

    def gather(self, layer: int) -> None:
        self.calls.append(("gather", layer, self.clock.t))
        ready = self.t0 + self.ready_ms[layer] / 1e3
        wait = max(0.0, ready - self.clock.t)
        self.clock.t += wait + (self.pass_ms + self.call_ms) / 1e3
        self.counters[layer].wait_us = wait * 1e6
        self.counters[layer].gather_us = self.pass_ms * 1e3

    def end_step(self) -> StepCounters:
        self.calls.append(("end", None, self.clock.t))
        return StepCounters(step=1, tokens=4, layers=self.counters)


TIMES = StepTimes("agent", 128, 29.41, {1: 0.27, 14: 9.35})
IDS = np.zeros((4, 2, 24), dtype=np.int64)


def run_one(s_ms: float, ready_ms: dict[int, float], pass_ms: float = 0.1):
    clock = FakeClock()
    engine = FakeEngine(clock, s_ms, ready_ms, pass_ms)
    runner = TimelineRunner(engine, TIMES, clock=clock)
    t0 = clock.t
    st = runner.step(IDS)
    return st, engine, clock, t0


def test_generous_windows_give_no_stall_and_the_profile_step():
    st, engine, clock, t0 = run_one(0.05, {1: 0.1, 14: 2.0}, pass_ms=0.0)
    assert st.stall_ms == pytest.approx({1: 0.0, 14: 0.0}, abs=1e-9)
    assert st.step_ms == pytest.approx(29.41)
    assert clock.t - t0 == pytest.approx(29.41e-3)
    # gathers at the layers' scheduled starts, in depth order
    gathers = [(l, t - t0) for kind, l, t in engine.calls if kind == "gather"]
    assert [l for l, _ in gathers] == [1, 14]
    assert gathers[0][1] == pytest.approx(0.27e-3)
    assert gathers[1][1] == pytest.approx(9.35e-3)
    assert st.predicted_ms == pytest.approx({1: 0.0, 14: 0.0}, abs=1e-9)
    assert st.pages == {1: 7, 14: 7} and st.hits == {1: 3, 14: 3} and st.lookups == {1: 96, 14: 96}


def test_stall_is_the_wait_and_excludes_the_dequant_pass():
    # layer 1's rows arrive at 0.9 ms: stall 0.63 (wait), pass 0.1 not counted; layer 14 gets that time
    st, engine, clock, t0 = run_one(0.05, {1: 0.9, 14: 9.0}, pass_ms=0.1)
    assert st.stall_ms[1] == pytest.approx(0.63)
    assert st.gather_ms[1] == pytest.approx(0.1)
    assert st.wait_ms[1] == pytest.approx(0.63)
    assert st.stall_ms[14] == pytest.approx(0.0, abs=1e-9)
    assert st.step_ms == pytest.approx(29.41 + 0.63)
    assert clock.t - t0 == pytest.approx((29.41 + 0.63) * 1e-3)


def test_later_layers_are_scheduled_with_the_previous_steps_dequant_pass_taken_out():
    clock = FakeClock()
    engine = FakeEngine(clock, 0.05, {1: 0.1, 14: 2.0}, 0.1)
    runner = TimelineRunner(engine, TIMES, clock=clock)
    first = runner.step(IDS)
    t0 = clock.t
    second = runner.step(IDS)
    gathers = [t - t0 for kind, l, t in engine.calls[-4:] if kind == "gather"]
    # first step: no pass known yet, layer 14 scheduled 0.1 ms late (an estimate; the stall recorded is still 0)
    assert first.stall_ms == pytest.approx({1: 0.0, 14: 0.0}, abs=1e-9)
    # second step: the pass measured in the first is taken out, layer 14 starts on its window
    assert gathers == [pytest.approx(0.27e-3), pytest.approx(9.35e-3)]
    assert second.step_ms == pytest.approx(29.41)


def test_gather_call_overhead_after_the_rows_are_ready_is_not_stall():
    # each gather spends 0.05 ms outside its wait and its pass; stalls end when the rows are ready, so layer 1
    # stalls 0.9 - 0.27 = 0.63 ms and layer 14 (rows ready at 2 ms, start at 9.35 + 0.63) none
    clock = FakeClock()
    engine = FakeEngine(clock, 0.05, {1: 0.9, 14: 2.0}, pass_ms=0.1, call_ms=0.05)
    runner = TimelineRunner(engine, TIMES, clock=clock)
    steps = [runner.step(IDS) for _ in range(2)]
    for st in steps:
        assert st.stall_ms[1] == pytest.approx(0.63) and st.stall_ms[14] == pytest.approx(0.0, abs=1e-9)
        assert st.step_ms == pytest.approx(29.41 + 0.63)
    # from the second step on, layer 14 starts on its window plus layer 1's stall (the previous step's
    # non-waiting gather time, 0.15 ms, taken out of the schedule shift)
    t0 = clock.t - steps[1].step_ms / 1e3
    assert [t - t0 for kind, l, t in engine.calls[-4:] if kind == "gather"][1] == pytest.approx(9.98e-3)


def test_begin_step_overrun_counts_as_stall():
    # begin_step takes 0.5 ms, past layer 1's 0.27 ms window; its rows were ready at 0.4 ms
    st, *_ = run_one(0.5, {1: 0.4, 14: 3.0}, pass_ms=0.0)
    assert st.s_ms == pytest.approx(0.5)
    assert st.stall_ms[1] == pytest.approx(0.23)
    assert st.wait_ms[1] == 0.0


def test_coupled_stalls_match_eq1_table3_row():
    # Table 3: rows at 0.9 and 12 ms (s ~ 0) -> measured d1 = 0.63, d14 = 12 - 9.35 - 0.63 = 2.02
    st, *_ = run_one(1e-6, {1: 0.9, 14: 12.0}, pass_ms=0.0)
    assert st.stall_ms[1] == pytest.approx(0.63, abs=1e-5)
    assert st.stall_ms[14] == pytest.approx(2.02, abs=1e-5)
    assert st.predicted_ms[1] == pytest.approx(0.63, abs=1e-5)
    assert st.predicted_ms[14] == pytest.approx(2.02, abs=1e-5)


def test_sleep_then_spin_sleeps_all_but_the_last_100_us():
    t = [0.0]
    slept: list[float] = []

    def now() -> float:
        t[0] += 1e-6   # each look at the clock costs a microsecond
        return t[0]

    def sleep(seconds: float) -> None:
        slept.append(seconds)
        t[0] += seconds

    sleep_then_spin(0.010, now, sleep)
    assert slept == [pytest.approx(0.010 - 1e-6 - 100e-6)]
    assert 0.010 <= t[0] < 0.010 + 2e-6


def test_run_replay_warms_prefill_and_times_full_decode_steps():
    class S:
        def __init__(self, kind, t, index=0):
            self.kind, self.ids, self.index = kind, np.zeros((t, 2, 24), dtype=np.int64), index

        @property
        def num_tokens(self):
            return self.ids.shape[0]

    clock = FakeClock()
    engine = FakeEngine(clock, 0.05, {1: 0.1, 14: 2.0}, 0.0)
    runner = TimelineRunner(engine, TIMES, clock=clock)
    steps = run_replay(runner, [S("prefill", 50), S("decode", 4), S("decode", 3), S("decode", 4)], 4, 5)
    assert [s.tokens for s in steps] == [4, 4]
    assert sum(1 for c in engine.calls if c[0] == "begin") == 4
    summ = summarize(steps)
    assert summ.steps == 2 and summ.stall_ms == pytest.approx(0.0, abs=1e-9)
    assert summ.hit_rate[1] == pytest.approx(3 / 96)


def test_run_replay_starts_its_window_deep_in_the_replay():
    """start_decode_steps: the steps before the window run on the engine off the timeline (warm) or are skipped
    (uncached); the window's steps carry their replay indices."""
    class S:
        def __init__(self, index, kind, t):
            self.index, self.kind, self.ids = index, kind, np.zeros((t, 2, 24), dtype=np.int64)

        @property
        def num_tokens(self):
            return self.ids.shape[0]

    replay = [S(0, "prefill", 50), S(1, "decode", 4), S(2, "decode", 4), S(3, "prefill", 9), S(4, "decode", 3),
              S(5, "decode", 4), S(6, "decode", 4), S(7, "decode", 4)]
    for warm, begins in ((True, 8), (False, 4)):
        clock = FakeClock()
        engine = FakeEngine(clock, 0.05, {1: 0.1, 14: 2.0}, 0.0)
        runner = TimelineRunner(engine, TIMES, clock=clock)
        steps = run_replay(runner, replay, 4, 2, warm=warm, warmup_steps=1, start_decode_steps=3)
        # decode steps 1, 2, 4 come before the window; 5 is the warm-up on the timeline; 6, 7 are timed
        assert [s.replay_index for s in steps] == [6, 7]
        assert [s.index for s in steps] == [1, 2]   # the runner timed 5, 6 and 7 only
        # warm: every step reached the engine; uncached: the first (code warm-up) and the three on the timeline
        assert sum(1 for c in engine.calls if c[0] == "begin") == begins
    with pytest.raises(SlackTierError):
        run_replay(runner, replay, 4, 2, start_decode_steps=-1)


def test_s_is_begin_step_alone_and_pulling_the_step_is_reported_apart():
    """The step's clock starts at the begin_step call: s is begin_step alone (what a server pays); pulling and
    hashing the step from the replay happen before it and are kept in prepare_ms."""
    class Pulled:
        kind, num_tokens, index = "decode", 4, 0
        ids = np.zeros((4, 2, 24), dtype=np.int64)

    clock = FakeClock()
    engine = FakeEngine(clock, 0.05, {1: 0.1, 14: 2.0}, 0.0)
    runner = TimelineRunner(engine, TIMES, clock=clock)

    def replay():
        for _ in range(3):
            clock.t += 0.4e-3    # 0.4 ms to pull and hash each step
            yield Pulled()

    steps = run_replay(runner, replay(), 4, 3)
    for st in steps:
        assert st.s_ms == pytest.approx(0.05) and st.begin_ms == pytest.approx(0.05)
        assert st.prepare_ms == pytest.approx(0.4)
    summ = summarize(steps)
    assert summ.s_ms == pytest.approx(0.05) and summ.prepare_ms == pytest.approx(0.4)


def test_runner_on_a_real_engine_records_counters():
    from slacktier.engine import StepEngine
    from slacktier.testing.engine import array_tables
    from slacktier.cache import RowCache

    tables, source, _ = array_tables({1: 3000, 14: 3000})
    clock = FakeClock()
    with StepEngine(tables, RowCache(512), ids_layers=(1, 14), owned_sources=[source]) as engine:
        runner = TimelineRunner(engine, TIMES, clock=clock)
        rng = np.random.default_rng(0)
        ids = rng.integers(0, 3000, size=(8, 2, 24), dtype=np.int64)
        a = runner.step(ids)
        b = runner.step(ids)
    # the fake clock does not move during the engine's real work, so each gather starts at its layer's
    # scheduled start and the stall is exactly the engine's own wait on the reads (its wait_us counter)
    assert a.stall_ms == pytest.approx(a.wait_ms, abs=1e-9)
    assert a.step_ms == pytest.approx(29.41 + sum(a.wait_ms.values()))
    assert a.pages[1] > 0 and a.hits[1] == 0
    assert b.pages[1] == 0 and b.hits[1] > 0   # the second step finds its rows cached
    assert a.gather_ms[1] > 0


# ---- profiles --------------------------------------------------------------------------------------------

def test_shipped_profiles_load_and_interpolate():
    p = load_profile("v41_paper")
    assert p.layers == 40 and "Table 2" in p.origin and p.name in p.header
    assert p.header.startswith("device compute from profile v41_paper; host, cache and I/O real")
    t = p.times(128, "agent", (1, 14))
    assert (t.step_ms, t.windows_ms) == (29.41, {1: 0.27, 14: 9.35})
    assert p.times(128, "chat", (1, 14)).step_ms == 33.71
    assert p.times(32, "agent", (1, 14)).step_ms == pytest.approx(11.0 + 18.41 * 24 / 120)
    q = load_profile("qwen38_paper")
    assert q.layers == 48 and q.times(128, "agent", (1,)).windows_ms == {1: 0.27}


GOOD = json.loads((PROFILES_DIR / "v41_paper.json").read_text())


def bad(change) -> dict:
    doc = copy.deepcopy(GOOD)
    change(doc)
    return doc


@pytest.mark.parametrize("change, words", [
    (lambda d: d.pop("layers"), "missing 'layers'"),
    (lambda d: d.update(layers=-40), "positive integer"),
    (lambda d: d["decode"][0]["windows_ms"].update({"1": -0.1}), "negative"),
    (lambda d: d["decode"][0]["windows_ms"].update({"41": 20.0}), "outside the model's 40 layers"),
    (lambda d: d["decode"][1]["windows_ms"].update({"14": 0.2}), "increase with depth"),
    (lambda d: d["decode"][1]["windows_ms"].update({"14": 0.27}), "increase with depth"),
    (lambda d: d["decode"][1].update(step_ms=5.0), "past the step"),
    (lambda d: d.update(origin=" "), "origin is empty"),
    (lambda d: d.update(decode=[]), "no decode points"),
    (lambda d: d["decode"][0].pop("step_ms"), "point needs"),
    (lambda d: d.update(format="other"), "format"),
    (lambda d: d["decode"][0]["windows_ms"].update({"-1": 0.05}), "outside the model's 40 layers"),
    (lambda d: d.update(layers=0), "positive integer"),
    (lambda d: d.update(layers="40"), "positive integer"),
    (lambda d: d.update(layers=True), "positive integer"),
    (lambda d: d["decode"][0].update(windows_ms={}), "windows_ms must map layer"),
    (lambda d: d["decode"][0].update(windows_ms=[0.1, 3.0]), "windows_ms must map layer"),
    (lambda d: d["decode"][0]["windows_ms"].update({"x": 1.0}), "is not layer -> ms"),
    (lambda d: d["decode"][0].update(batch=-8), "must be > 0"),
    (lambda d: d["decode"].append(copy.deepcopy(d["decode"][0])), "given twice"),
])
def test_bad_profiles_are_refused(change, words):
    with pytest.raises(SlackTierError, match=words):
        profile_from_dict(bad(change))


def test_lookup_layer_the_profile_lacks_is_refused():
    p = load_profile("v41_paper")
    with pytest.raises(SlackTierError, match="no window for lookup layers"):
        p.times(64, "agent", (1, 14, 20))
    with pytest.raises(SlackTierError, match="outside"):
        p.times(256, "agent", (1, 14))
    with pytest.raises(SlackTierError, match="no decode points"):
        p.times(64, "code", (1,))


def test_a_lookup_layer_missing_at_one_batch_point_is_refused():
    doc = bad(lambda d: d["decode"][0]["windows_ms"].pop("14"))
    p = profile_from_dict(doc)   # a point may cover fewer layers ...
    with pytest.raises(SlackTierError, match=r"no window for lookup layers \[14\]"):
        p.times(64, "agent", (1, 14))   # ... but not one the run looks up
    assert p.times(64, "chat", (1, 14)).windows_ms[14] > 0


def test_unknown_profile_name_is_refused():
    with pytest.raises(SlackTierError, match="v41_paper"):
        load_profile("no_such_profile")


def test_profile_type_is_plain_data():
    p = profile_from_dict(GOOD)
    assert isinstance(p, ComputeProfile) and len(p.decode) == 4 and p.prefill == ()


# ---- the sweep's report and refusals ---------------------------------------------------------------------

def _run(name: str, rep: int, stall: float):
    from slacktier.serve.timeline import SweepRun, TimelineSummary

    layers = {1: 0.0, 14: 0.0}
    s = TimelineSummary(steps=4, stall_ms=stall, predicted_ms=stall + 0.1, p99_stall_ms=stall, s_ms=0.5,
                        read_ms=dict(layers), stall_layer_ms=dict(layers), gather_ms=dict(layers), pages=dict(layers),
                        hit_rate=dict(layers))
    return SweepRun(name, 32, rep, 0, 15.54, s)


def test_timeline_table_names_the_profile_first_and_says_whether_placements_separate():
    from slacktier.serve.report import timeline_table

    p = load_profile("v41_paper")
    apart = timeline_table(p, [_run("a", r, 1.0 + 0.1 * r) for r in range(3)]
                           + [_run("b", r, 5.0 + 0.1 * r) for r in range(3)])
    assert apart.startswith("device compute from profile v41_paper; host, cache and I/O real")
    lines = apart.split("\n")
    lines = lines[next(i for i, l in enumerate(lines) if l.startswith("Verdict")) - 1:]   # after the profile
    rows = [l for l in lines if l.startswith("  32 ")]
    assert rows[0].split()[1] == "a" and "1.10" in rows[0]   # sorted by measured stall, mean of 1.0, 1.1, 1.2
    # the verdict comes first, computed from the same runs: a is cheapest, b clearly costlier
    assert lines[1] == f"Verdict: a: {100 * 1.1 / 15.54:+.1f}% of the step in stalls (3 runs, " \
                       f"{100 * 1.0 / 15.54:+.1f}..{100 * 1.2 / 15.54:+.1f}%)."
    assert lines[2] == "Clearly costlier (beyond the run-to-run spread):" and lines[3].startswith("  b: ")
    assert "Cannot tell apart" not in apart
    close = timeline_table(p, [_run("a", r, 1.0 + r) for r in range(3)] + [_run("b", r, 2.5) for r in range(3)])
    verdict = [l for l in close.split("\n") if l.startswith("Verdict")][0]
    assert verdict.startswith("Verdict: a: ")   # a's mean 2.0 ms, b's 2.5 ms
    after = close.split("\n")[close.split("\n").index(verdict) + 1]
    assert after == "Cannot tell apart from it (their min..max ranges overlap):"
    assert "Clearly costlier" not in close
    assert max(map(len, apart.split("\n") + close.split("\n"))) <= 120
    one = timeline_table(p, [_run("a", 0, 1.0), _run("b", 0, 3.0)])   # one run each: no spread, said so
    assert "One run per placement" in one and "Clearly costlier" not in one


def test_a_batch_the_traffic_cannot_fill_is_refused():
    from slacktier.serve.timeline import SweepConfig, sweep_sessions

    with pytest.raises(SlackTierError, match="B=100000 needs 100000 sessions"):
        sweep_sessions(SweepConfig(), 100_000)


def test_a_small_sweep_runs_every_placement_with_the_checker_and_the_remote_rows(tmp_path):
    """End to end on a tiny scaled table: disk and remote (a 1-master local Redis Cluster) placements, each
    run's untimed checked steps compare every row with the table's source: 0 mismatches."""
    import shutil

    from slacktier.serve.report import timeline_table
    from benchmarks.paper.timeline_sweep import run_sweep
    from slacktier.serve.timeline import SweepConfig
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server binary not found (scripts/test.sh installs it)")
    cfg = SweepConfig(workdir=str(tmp_path), batches=(8,), runs=1, decode_steps=2, check_steps=2,
                      engram_vocab=300, cache_rows=2048, remote_nodes=1, max_session_tokens=512)
    profile, runs = run_sweep(cfg)
    names = {r.placement for r in runs}
    assert {"disk", "remote", "l1-dram-l14-remote", "remote-split"} <= names and len(runs) == 8
    assert all(r.checked_steps == 2 and r.mismatches == 0 for r in runs)
    assert "0 mismatching rows" in timeline_table(profile, runs)
