"""Forward pre-hooks that hold one decoder layer until X ms after the step began (paper section 6.3).

The probe changes no model code. A pre-hook on the top module (the step-start
hook) stamps the step's start and reads the current target; a pre-hook on each
decoder layer stamps that layer's arrival and, on the target layer only,
busy-waits until the stamp plus X. If the layer arrives after X the hook
returns at once and the step does not grow: X was inside the layer's window.

Two clocks. "wall" (time.perf_counter_ns) is the paper's: the window in real
time on a machine the model has to itself. "thread_cpu" (time.thread_time_ns,
the calling thread's CPU time) is for shared machines: with torch running on one
intra-op thread every step's compute happens on the calling thread, so CPU time
counts compute and the busy-wait alike and leaves out the time other processes
hold the core; on an idle machine the two agree. Step times must be taken with
the same clock (probe.clock_ns).

Both are `Clock`s (now() in seconds, wait_until(deadline)): the shape of
serve.timeline.Clock, declared here because probe/ sits below serve/. A caller
may inject its own Clock (a test's virtual clock on which a layer's compute is a
jump in time): the probe then reads and holds on that clock alone.

Host clocks only: on CPU a layer's pre-hook runs when the layer's compute starts.
On an accelerator the host runs ahead of the device, so the host clock says
nothing about when the device reaches a layer; the probe refuses such models
rather than measure the launch queue (see `WindowProbe.__init__`).
"""

from __future__ import annotations

import time
from typing import Iterable, Protocol

import torch
from torch import nn

from slacktier.errors import ErrorKind, SlackTierError
from slacktier.probe.config import NO_TARGET, ConfigWatcher, ProbeTarget

# Last path components under which decoder stacks live in common model code:
# Llama/Qwen/Mistral/Gemma `model.layers`, GPT-2 `transformer.h`, others `blocks`.
LAYER_LIST_NAMES = ("layers", "h", "blocks", "layer", "decoder_layers")


def find_decoder_layers(model: nn.Module, path: str | None = None) -> tuple[str, nn.ModuleList]:
    """The decoder layers' ModuleList: at `path` (e.g. "model.layers") or the longest list named like one."""
    if path:
        obj: object = model
        for part in path.split("."):
            if not hasattr(obj, part):
                raise SlackTierError(ErrorKind.MISSING, f"{type(model).__name__} has no attribute path {path!r}",
                                     fix="pass the dotted path of the decoder ModuleList, e.g. model.layers")
            obj = getattr(obj, part)
        if not isinstance(obj, (nn.ModuleList, nn.Sequential)) or len(obj) == 0:
            raise SlackTierError(ErrorKind.BAD_INPUT, f"{path!r} is a {type(obj).__name__}, not a list of layers",
                                 fix="point the path at the ModuleList that holds the decoder layers")
        return path, obj  # type: ignore[return-value]
    found = [(name, m) for name, m in model.named_modules()
             if isinstance(m, nn.ModuleList) and len(m) > 0 and name.rsplit(".", 1)[-1] in LAYER_LIST_NAMES]
    if not found:
        raise SlackTierError(ErrorKind.MISSING, f"no decoder layer list found in {type(model).__name__}",
                             fix="pass layers_path, the dotted path of the ModuleList of decoder layers")
    longest = max(len(m) for _, m in found)
    best = [(n, m) for n, m in found if len(m) == longest]
    if len(best) > 1:
        raise SlackTierError(ErrorKind.BAD_INPUT,
                             f"several layer lists of length {longest}: {', '.join(n for n, _ in best)}",
                             fix="pass layers_path to choose one")
    return best[0]


CLOCKS = {"wall": time.perf_counter_ns, "thread_cpu": time.thread_time_ns}


def clock_ns(name: str):
    """The clock function (returns int ns) called `name`: "wall" or "thread_cpu"."""
    if name not in CLOCKS:
        raise SlackTierError(ErrorKind.BAD_INPUT, f"unknown clock {name!r}", fix=f"use one of {sorted(CLOCKS)}")
    if name == "thread_cpu" and torch.get_num_threads() != 1:
        raise SlackTierError(ErrorKind.BAD_INPUT,
                             f"thread CPU time misses the work of torch's other {torch.get_num_threads() - 1} "
                             "intra-op threads", fix="call torch.set_num_threads(1) (or --threads 1) first")
    return CLOCKS[name]


class Clock(Protocol):
    """Seconds on one monotonic clock, and waiting until a time on it (serve.timeline.Clock's shape)."""

    def now(self) -> float: ...

    def wait_until(self, deadline: float) -> None: ...


class SpinClock:
    """A named host clock ("wall" or "thread_cpu"); waits by busy-waiting, as a sleep would overshoot by the
    scheduler's tick."""

    def __init__(self, name: str) -> None:
        fn = clock_ns(name)
        self.name = name
        self._ns = fn

    def now(self) -> float:
        return self._ns() / 1e9

    def wait_until(self, deadline: float) -> None:
        deadline_ns = round(deadline * 1e9)
        ns = self._ns
        while ns() < deadline_ns:
            pass


def as_clock(clock: "str | Clock") -> tuple[str, Clock]:
    """(name, Clock) for a clock name in CLOCKS or an injected Clock (named by its `name`, else its type)."""
    if isinstance(clock, str):
        return clock, SpinClock(clock)
    return str(getattr(clock, "name", type(clock).__name__)), clock


def _devices(model: nn.Module) -> Iterable[torch.device]:
    for p in model.parameters():
        yield p.device
    for b in model.buffers():
        yield b.device


class WindowProbe:
    """Pre-hooks on a decoder that hold one layer until `delay_ms` after step start.

    The target comes from `config_path` (re-read whenever the file changes, see
    probe.config) or, without a file, from `set_target`. After each step:
    `step_target` is the target that was in force, `arrival_ns[k]` the time from
    step start to layer k's pre-hook, `held_ns` how long the hold spun.
    """

    def __init__(self, model: nn.Module, *, layers_path: str | None = None, config_path: str | None = None,
                 step_module: nn.Module | None = None, clock: "str | Clock" = "wall") -> None:
        bad = {str(d) for d in _devices(model) if d.type != "cpu"}
        if bad:
            raise SlackTierError(ErrorKind.UNAVAILABLE, f"model has tensors on {sorted(bad)}; the probe times "
                                 "layers with the host clock, which on an accelerator measures kernel launches",
                                 fix="probe the model on the CPU (model.to('cpu'))")
        self.clock, self._clock = as_clock(clock)   # its name (recorded in a sweep), the Clock itself
        self.model = model
        self.layers_path, self.layers = find_decoder_layers(model, layers_path)
        self.num_layers = len(self.layers)
        self.config_path = config_path
        self._watcher = ConfigWatcher(config_path) if config_path else None
        self._step_module = step_module if step_module is not None else model
        self._target = NO_TARGET
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        self._t0_ns = 0
        self._hold_layer = -1
        self._deadline_ns = 0
        self.step_target = NO_TARGET
        self.arrival_ns = [0] * self.num_layers
        self.held_ns = 0
        self.steps = 0

    # -- wiring -------------------------------------------------------------------------------------
    @property
    def attached(self) -> bool:
        """Whether the hooks are registered."""
        return bool(self._handles)

    def attach(self) -> "WindowProbe":
        """Register the step-start hook and one pre-hook per decoder layer."""
        if self._handles:
            return self
        self._handles.append(self._step_module.register_forward_pre_hook(self._on_step_start))
        for k, layer in enumerate(self.layers):
            self._handles.append(layer.register_forward_pre_hook(self._layer_hook(k)))
        return self

    def detach(self) -> None:
        """Remove every hook; the model runs exactly as before."""
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def __enter__(self) -> "WindowProbe":
        return self.attach()

    def __exit__(self, *exc: object) -> None:
        self.detach()

    def set_target(self, target: ProbeTarget) -> None:
        """Set the target directly (only for a probe without a config file)."""
        if self._watcher is not None:
            raise SlackTierError(ErrorKind.BAD_INPUT, "this probe reads its target from a config file",
                                 fix="write the file with probe.config.write_probe_config instead")
        self._check(target)
        self._target = target

    def _check(self, target: ProbeTarget) -> None:
        if target.layer is not None and target.layer >= self.num_layers:
            raise SlackTierError(ErrorKind.BAD_INPUT,
                                 f"probe target layer {target.layer} but the model has {self.num_layers} layers",
                                 fix=f"target a layer in 0..{self.num_layers - 1}")

    # -- hooks (run inside the forward pass) --------------------------------------------------------
    def _on_step_start(self, module: nn.Module, args: tuple) -> None:
        t0 = round(self._clock.now() * 1e9)
        target = self._watcher.poll() if self._watcher is not None else self._target
        if target is not self.step_target:
            self._check(target)
        self.step_target = target
        self._hold_layer = -1 if target.layer is None else target.layer
        self._deadline_ns = t0 + int(round(target.delay_ms * 1e6))
        self._t0_ns = t0
        self.held_ns = 0
        self.steps += 1

    def _layer_hook(self, k: int):
        arrival = self.arrival_ns
        clock = self._clock

        def hook(module: nn.Module, args: tuple) -> None:
            now = round(clock.now() * 1e9)
            arrival[k] = now - self._t0_ns
            if k == self._hold_layer:
                deadline = self._deadline_ns
                if now < deadline:
                    clock.wait_until(deadline / 1e9)
                    now = round(clock.now() * 1e9)
                self.held_ns = max(0, now - self._t0_ns - arrival[k])

        return hook
