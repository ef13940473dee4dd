"""Injected delays, the paper's Table 3 analog (issue 13, item 5): an experiment beside bench_timeline_planner.py.

`DelayedEngine` hands layer l's rows out no earlier than D_l after the step started (the runner's t0, before
the step's ids are pulled and hashed), so Eq. 1 with s + T_l = D_l and the profile's windows predicts the
stall; with the table in DRAM the real reads finish well before D_l. `run_delayed` is the runner
serve.predict's `run_jobs` and `planner_sweep` take (`delayed=`) for jobs with delays.

Worked example (B=8 chat on v41_paper: W1 = 0.101, W14 = 3.4971 ms): D = (2.5, 6) ms ->
d1 = 2.399, d14 = [6 - 3.4971 - 2.399]+ = 0.104, predicted 2.503 ms; the sum of excesses says 4.902.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator, Mapping

import numpy as np

from slacktier.plan.exposure import LayerRead, exposure
from slacktier.serve.timeline import Clock, RealClock, StepTimes, TimelineRunner, TimelineStep


@dataclass
class DelayedEngine:
    """A timeline engine whose layer l rows are handed out no earlier than `delays_ms[l]` after the step
    started (`t0`, set by `run_delayed_replay`); the wrapped engine still resolves, reads and gathers every row.

    The hold is a read the layer waits on, so end_step adds it to the layer's `wait_us`: the time from the
    gather call until t0 + D_l, the moment the injected read lands. The host's wake-up after that moment (the
    sleep's overshoot, 0.002-0.06 ms on this VM) is the emulation's, not the read's, and is not added. Worked
    example: t0 = 0, D_1 = 4 ms, gather called at 1.2 ms, the wrapped wait 0.05 ms -> wait_us 2800 + 50.
    """

    inner: object
    delays_ms: Mapping[int, float]
    clock: Clock = field(default_factory=RealClock)
    t0: float = 0.0
    _held_us: dict[int, float] = field(default_factory=dict, init=False)

    def begin_step(self, ids: np.ndarray) -> None:
        """The wrapped engine's begin_step."""
        self._held_us = {}
        self.inner.begin_step(ids)

    def gather(self, layer: int) -> object:
        """Wait until the layer's delay has passed since the step started, then the wrapped gather."""
        ready = self.t0 + self.delays_ms.get(layer, 0.0) / 1e3
        self._held_us[layer] = max(0.0, ready - self.clock.now()) * 1e6
        self.clock.wait_until(ready)
        return self.inner.gather(layer)

    def end_step(self) -> object:
        """The wrapped engine's end_step, each layer's hold added to its wait_us."""
        counters = self.inner.end_step()
        for layer, held_us in self._held_us.items():
            counters.layers[layer].wait_us += held_us
        return counters


def run_delayed_replay(runner: TimelineRunner, engine: DelayedEngine, steps: Iterator, batch: int,
                       decode_steps: int) -> list[TimelineStep]:
    """serve.timeline.run_replay with the delay clock of `engine` started at each step's t0."""
    out: list[TimelineStep] = []
    clock = runner.clock
    while len(out) < decode_steps:
        tp = clock.now()
        st = next(steps, None)
        if st is None:
            break
        if st.kind == "decode" and st.num_tokens == batch:
            ids = runner.prepare(st.ids)
            prepare_ms = (clock.now() - tp) * 1e3
            engine.t0 = clock.now()
            out.append(runner.step(ids, prepare_ms))
        else:
            engine.t0 = clock.now()
            runner.warm(st.ids)
    return out


def delay_prediction(times: StepTimes, delays_ms: Mapping[int, float], coupled: bool = True) -> float:
    """Eq. 1 (or the sum of excesses, coupled=False) with s + T_l = D_l and the profile's windows."""
    return exposure([LayerRead(l, times.windows_ms[l], float(delays_ms.get(l, 0.0))) for l in sorted(times.windows_ms)],
                    coupled=coupled).slowdown_ms


def run_delayed(engine, times: StepTimes, delays_ms: Mapping[int, float], replay: Iterator, batch: int,
                decode_steps: int) -> list[TimelineStep]:
    """One job with injected delays on the timeline (serve.predict.DelayedRun): `engine` wrapped so layer l's
    rows land D_l after each step's start; its timed full-batch decode steps."""
    delayed = DelayedEngine(engine, dict(delays_ms))
    return run_delayed_replay(TimelineRunner(delayed, times), delayed, replay, batch, decode_steps)
