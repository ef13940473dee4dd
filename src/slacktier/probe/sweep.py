"""The window sweep: hold layer k until X, find the first X that grows the step, window = X - delta.

Noise threshold (paper appendix B): the larger of an absolute floor, three
standard deviations of the baseline step, and 1% of the step. The standard
deviation is estimated robustly (1.4826 x the median absolute deviation), so a
single step stretched by another process on a shared machine does not set it.
By default (`adaptive_threshold`) the baseline is every unheld step so far (the
initial ones and those interleaved in every block), so a machine whose load
changes during the sweep is judged by its noise at that time, not at the start.

Each (k, X) point is measured in a block of `repeats` pairs, each pair one step
held at (k, X) and one step with no target, in shuffled order; delta is the
difference of the two medians. Interleaving keeps slow drift of the machine out
of delta. The first delta above the threshold is confirmed by a second block
(a delta that does not repeat is noise); the window is then X minus the delta of
the two blocks pooled. Since every millisecond of hold beyond the window shows
up in the step, X - delta estimates the window at any X past it; the sweep
still walks X up from zero so the points show where the step starts to grow.
The first X is chosen because its delta passed the threshold, so on a noisy
machine its delta is biased up and X - delta down (the larger the threshold
against the grid, the more). `extra_points` further X values past the first
detection, measured whatever their delta, give unselected estimates; their
median is `window_fit_ms` (the paper's rule, first X only, stays `window_ms`).

An estimate below the absolute noise floor (`floor_ms`; X - delta can even come
out negative when a held step is slowed by more than the hold, as layer 0's
often is) cannot be told from no window at all: the layer's `window_ms` is then
None and `below_noise_floor` says why, instead of a negative number a planner
would refuse. Ctrl-C (KeyboardInterrupt) between or inside layers ends the
sweep with the layers finished so far and `interrupted` set, so a caller can
write what was measured.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import random
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from slacktier.errors import ErrorKind, SlackTierError
from slacktier.probe.config import NO_TARGET, ProbeTarget, write_probe_config
from slacktier.probe.hooks import WindowProbe

log = logging.getLogger(__name__)

MAD_TO_STD = 1.4826  # std of a normal distribution per unit of median absolute deviation


@dataclass(frozen=True)
class SweepSettings:
    """How hard the sweep looks."""

    warmup_steps: int = 5
    baseline_steps: int = 40
    repeats: int = 7               # pairs (held, baseline) per (layer, X) block
    floor_ms: float = 0.3          # absolute floor of the noise threshold (the paper's 0.3 ms)
    points_per_step: int = 10      # X grid spacing = baseline step / points_per_step
    max_delay_frac: float = 1.5    # give up on a layer past X = this x the baseline step
    confirm: bool = True           # re-measure the first point above threshold
    extra_points: int = 3          # X values measured past the first detection, for window_fit_ms
    adaptive_threshold: bool = True  # threshold from every baseline step so far, not only the initial ones
    seed: int = 0

    def __post_init__(self) -> None:
        if min(self.repeats, self.points_per_step) < 1 or self.baseline_steps < 3 or self.extra_points < 0:
            raise SlackTierError(ErrorKind.BAD_INPUT, "sweep needs >= 3 baseline steps, repeats >= 1, points >= 1",
                                 fix="raise baseline_steps, repeats or points_per_step; extra_points >= 0")
        if self.floor_ms < 0 or self.max_delay_frac <= 0:
            raise SlackTierError(ErrorKind.BAD_INPUT, "negative floor or non-positive delay range",
                                 fix="floor_ms >= 0, max_delay_frac > 0")


@dataclass(frozen=True)
class NoiseModel:
    """The baseline step and the threshold a step-time increase must pass to count."""

    baseline_ms: float   # median step with no target
    std_ms: float        # robust standard deviation of the baseline step
    floor_ms: float
    threshold_ms: float  # max(floor, 3 std, 1% of the step)
    steps: int


def noise_model(step_ms: Sequence[float], floor_ms: float) -> NoiseModel:
    """Noise threshold from baseline step times."""
    x = np.asarray(step_ms, dtype=np.float64)
    med = float(np.median(x))
    std = MAD_TO_STD * float(np.median(np.abs(x - med)))
    return NoiseModel(baseline_ms=med, std_ms=std, floor_ms=floor_ms,
                      threshold_ms=max(floor_ms, 3.0 * std, 0.01 * med), steps=int(x.size))


@dataclass(frozen=True)
class DelayPoint:
    """One (layer, X) block: medians of held and baseline steps, and their difference."""

    delay_ms: float
    held_ms: float
    base_ms: float
    delta_ms: float
    pairs: int


@dataclass(frozen=True)
class LayerWindow:
    """The measured window of one decoder layer."""

    layer: int                     # index in the decoder ModuleList
    window_ms: float | None        # X - delta at the first confirmed X; None if no X up to the limit grew the step
    window_frac: float | None      # window / baseline step
    detected_at_ms: float | None   # that X
    window_fit_ms: float | None    # median of X - delta over the `extra_points` X values past the first detection
    arrival_ms: float              # median time from step start to the layer's pre-hook, no target
    points: tuple[DelayPoint, ...]
    below_noise_floor: bool = False  # X - delta came out under the noise floor: window_ms None, not a number

    def describe(self) -> str:
        """'window 1.234 ms', 'window below the noise floor' or 'no window up to the largest X'."""
        if self.window_ms is not None:
            return f"window {self.window_ms:.3f} ms"
        return "window below the noise floor" if self.below_noise_floor else "no window up to the largest X"


@dataclass(frozen=True)
class WindowSweep:
    """Windows of the probed layers of one model at one batch size."""

    model: str
    batch: int
    num_layers: int
    noise: NoiseModel
    layers: tuple[LayerWindow, ...]
    settings: SweepSettings = field(default_factory=SweepSettings)
    steps_run: int = 0
    initial_noise: NoiseModel | None = None  # from the initial baseline steps alone (sets the X grid)
    clock: str = "wall"   # the clock steps and holds were timed with (probe.hooks.CLOCKS)
    interrupted: bool = False       # stopped by Ctrl-C: `layers` holds the layers finished before it
    layers_requested: tuple[int, ...] = ()  # every layer the sweep was asked for (empty in files from older runs)


class _Stepper:
    """Runs steps under a target, through the config file when the probe has one."""

    def __init__(self, probe: WindowProbe, run_step: Callable[[], float]) -> None:
        self.probe = probe
        self.run_step = run_step
        self.current: ProbeTarget | None = None
        self.steps = 0

    def step(self, target: ProbeTarget) -> float:
        if target != self.current:
            if self.probe.config_path:
                write_probe_config(self.probe.config_path, target)
            else:
                self.probe.set_target(target)
            self.current = target
        ms = float(self.run_step())
        self.steps += 1
        if self.probe.step_target != target:
            raise SlackTierError(ErrorKind.BAD_INPUT,
                                 f"the step ran under {self.probe.step_target}, not the target written ({target})",
                                 fix="make run_step call the probed model's forward once per step, and keep "
                                     "other writers off the probe's config file")
        return ms


def _block(stepper: _Stepper, target: ProbeTarget, repeats: int, rng: random.Random) -> tuple[list[float], list[float]]:
    held, base = [], []
    for _ in range(repeats):
        first_held = rng.random() < 0.5
        for is_held in (first_held, not first_held):
            if is_held:
                held.append(stepper.step(target))
            else:
                base.append(stepper.step(NO_TARGET))
    return held, base


def _point(delay_ms: float, held: list[float], base: list[float]) -> DelayPoint:
    h, b = float(np.median(held)), float(np.median(base))
    return DelayPoint(delay_ms=delay_ms, held_ms=h, base_ms=b, delta_ms=h - b, pairs=len(held))


def format_eta(seconds: float) -> str:
    """A remaining time a person reads: '40 s', '3 min', '2.1 h'."""
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def _measure_layer(stepper: _Stepper, k: int, settings: SweepSettings, dx: float, n_points: int,
                   rng: random.Random, threshold: Callable[[list[float]], float]
                   ) -> tuple[list[DelayPoint], float | None, float | None, float | None]:
    """Walk X up for layer k: (points, window, detected X, fit); window None when no X up to the limit grew it."""
    points: list[DelayPoint] = []
    for i in range(1, n_points + 1):
        x = i * dx
        target = ProbeTarget(layer=k, delay_ms=x)
        held, base = _block(stepper, target, settings.repeats, rng)
        p = _point(x, held, base)
        points.append(p)
        if p.delta_ms <= threshold(base):
            continue
        if settings.confirm:
            held2, base2 = _block(stepper, target, settings.repeats, rng)
            p2 = _point(x, held2, base2)
            points.append(p2)
            if p2.delta_ms <= threshold(base2):
                log.info("layer %d X=%.3f ms: delta %.3f ms did not repeat (%.3f ms)", k, x, p.delta_ms,
                         p2.delta_ms)
                continue
            p = _point(x, held + held2, base + base2)
        estimates = []
        for j in range(1, settings.extra_points + 1):
            xj = x + j * dx
            held_j, base_j = _block(stepper, ProbeTarget(layer=k, delay_ms=xj), settings.repeats, rng)
            pj = _point(xj, held_j, base_j)
            threshold(base_j)
            points.append(pj)
            estimates.append(xj - pj.delta_ms)
        window = x - p.delta_ms
        return points, window, x, float(np.median(estimates)) if estimates else window
    return points, None, None, None


def sweep_windows(run_step: Callable[[], float], probe: WindowProbe, layers: Sequence[int] | None = None,
                  settings: SweepSettings = SweepSettings(), *, batch: int = 1, model_name: str = "",
                  progress: Callable[[str], None] | None = None) -> WindowSweep:
    """Measure the windows of `layers` (default: all) of the probed model.

    run_step() runs one step of the model (one forward of the module the probe's
    step-start hook sits on) and returns its wall time in ms. `progress` gets one
    line per finished layer ("layer 14 (2 of 2): ..., about 3 min left"). Ctrl-C
    during the layers returns the sweep so far with `interrupted` set.
    """
    if not probe.attached:
        raise SlackTierError(ErrorKind.BAD_INPUT, "the probe is not attached", fix="call probe.attach() first")
    layers = list(range(probe.num_layers)) if layers is None else list(layers)
    for k in layers:
        if not 0 <= k < probe.num_layers:
            raise SlackTierError(ErrorKind.BAD_INPUT, f"layer {k} outside 0..{probe.num_layers - 1}",
                                 fix="probe layers of the model's decoder list")
    rng = random.Random(settings.seed)
    stepper = _Stepper(probe, run_step)
    for _ in range(settings.warmup_steps):
        stepper.step(NO_TARGET)
    base_ms, arrivals = [], []
    for _ in range(settings.baseline_steps):
        base_ms.append(stepper.step(NO_TARGET))
        arrivals.append(list(probe.arrival_ns))
    noise = first_noise = noise_model(base_ms, settings.floor_ms)
    arrival_ms = np.median(np.asarray(arrivals, dtype=np.float64), axis=0) / 1e6  # [num_layers]
    if progress:
        progress(f"baseline {noise.baseline_ms:.3f} ms, std {noise.std_ms:.3f} ms, "
                 f"threshold {noise.threshold_ms:.3f} ms")
    dx = first_noise.baseline_ms / settings.points_per_step

    def threshold(base: list[float]) -> float:
        nonlocal noise
        if settings.adaptive_threshold:
            base_ms.extend(base)
            noise = noise_model(base_ms, settings.floor_ms)
        return noise.threshold_ms

    n_points = max(1, math.ceil(settings.max_delay_frac * settings.points_per_step))

    def expected_points(k: int) -> int:
        """Blocks layer k should take: X walks up to about its arrival, then a confirmation and the extra points;
        deeper layers take more, so the ETA counts blocks, not layers."""
        return min(n_points, math.ceil(arrival_ms[k] / dx) + 1) + int(settings.confirm) + settings.extra_points

    out = []
    interrupted = False
    t_start = time.monotonic()
    blocks_done = 0
    try:
        for i, k in enumerate(layers, 1):
            points, window, detected, fit = _measure_layer(stepper, k, settings, dx, n_points, rng, threshold)
            below = window is not None and window < settings.floor_ms
            if below:
                log.info("layer %d: X - delta %.3f ms is under the noise floor %.3f ms", k, window,
                         settings.floor_ms)
                window = detected = fit = None
            elif fit is not None and fit < settings.floor_ms:
                fit = None
            lw = LayerWindow(layer=k, window_ms=window,
                             window_frac=None if window is None else window / noise.baseline_ms,
                             detected_at_ms=detected, window_fit_ms=fit, arrival_ms=float(arrival_ms[k]),
                             points=tuple(points), below_noise_floor=below)
            out.append(lw)
            blocks_done += len(points)
            if progress:
                per_block_s = (time.monotonic() - t_start) / blocks_done
                blocks_left = sum(expected_points(j) for j in layers[i:])
                left = "done" if i == len(layers) else f"about {format_eta(per_block_s * blocks_left)} left"
                w = lw.describe() + ("" if window is None else f" ({window / noise.baseline_ms:.3f} of step)")
                progress(f"layer {k} ({i} of {len(layers)}): {w}, arrival {lw.arrival_ms:.3f} ms, "
                         f"{len(points)} points, threshold now {noise.threshold_ms:.3f} ms; {left}")
    except KeyboardInterrupt:   # keep the layers finished so far (a layer cut short is dropped)
        interrupted = True
    if interrupted:   # no further step: the person asked to stop; only the run-time file is reset
        if probe.config_path:
            write_probe_config(probe.config_path, NO_TARGET)
        else:
            probe.set_target(NO_TARGET)
    else:
        stepper.step(NO_TARGET)  # leave the model unheld
    # window_frac against the step measured over the whole sweep
    out = [dataclasses.replace(lw, window_frac=None if lw.window_ms is None else lw.window_ms / noise.baseline_ms)
           for lw in out]
    return WindowSweep(model=model_name, batch=batch, num_layers=probe.num_layers, noise=noise,
                       layers=tuple(out), settings=settings, steps_run=stepper.steps, clock=probe.clock,
                       initial_noise=first_noise, interrupted=interrupted, layers_requested=tuple(layers))


def measure_overhead(run_step: Callable[[], float], probe: WindowProbe, *, pairs: int = 100,
                     warmup_steps: int = 5, seed: int = 0) -> tuple[list[float], list[float]]:
    """Step times with the probe attached but targeting nothing vs hooks removed, A/B interleaved shuffled.

    Returns (hooked_ms, bare_ms); leaves the probe detached.
    """
    rng = random.Random(seed)
    if probe.config_path:
        write_probe_config(probe.config_path, NO_TARGET)
    else:
        probe.set_target(NO_TARGET)
    for _ in range(warmup_steps):
        probe.attach()
        run_step()
        probe.detach()
        run_step()
    hooked, bare = [], []
    for _ in range(pairs):
        first_hooked = rng.random() < 0.5
        for with_hooks in (first_hooked, not first_hooked):
            if with_hooks:
                probe.attach()
                hooked.append(float(run_step()))
            else:
                probe.detach()
                bare.append(float(run_step()))
    probe.detach()
    return hooked, bare
