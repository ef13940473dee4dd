"""The exposure model (paper section 4.1, Eq. 1), generalized to any ordered list of lookup layers.

All times are in ms from the start of a step, on one clock. Every lookup of the
step is issued at step start; the CPU spends `resolve_ms` (s) resolving indices,
then layer l's missing rows arrive `read_ms` (T_l) later. Layer l needs them
`window_ms` (W_l) after step start. Layers are taken in window order (shortest
first), which is depth order, and a stall at one layer delays all compute after
it, so it gives every later layer that much more time:

    d_1 = [s + T_1 - W_1]+
    d_k = [s + T_k - W_k - sum_{j<k} d_j]+
    slowdown = sum_k d_k + kappa

With the coupling switched off each layer's excess is counted on its own
(d_k = [s + T_k - W_k]+), the "sum of excesses" column of the paper's Table 3.

T_l comes from measurement (`exposure(reads)`), or from the device read-time
model (`device_exposure(loads, windows, models)`, plan.readmodel): T_l = a + b P_l
+ c A_l + c_behind B_l, with the pages queued ahead of and behind l counted over
the layers that share l's device.

Worked example (Table 3, W_1 = 0.27, W_14 = 9.35, s = 0, kappa = 0): delays
s+T = 0.9 and 12 give d_1 = 0.63, d_14 = 12 - 9.35 - 0.63 = 2.02, slowdown 2.65;
uncoupled, 0.63 + 2.65 = 3.28.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

from slacktier.errors import ErrorKind, SlackTierError
from slacktier.plan.readmodel import DeviceReadModel, LayerPages, read_times


@dataclass(frozen=True)
class LayerRead:
    """One lookup layer in one step: its window and the read time of its missing rows."""

    layer: int
    window_ms: float  # W_l: compute time from step start until layer l needs its rows
    read_ms: float    # T_l: time from the end of index resolution until the rows arrive (slowest rank)

    def __post_init__(self) -> None:
        if self.window_ms < 0 or self.read_ms < 0:
            raise SlackTierError(ErrorKind.BAD_INPUT,
                                 f"negative time (window {self.window_ms} ms, read {self.read_ms} ms)",
                                 fix="windows and read times are durations from step start; pass values >= 0",
                                 layer=self.layer)


@dataclass(frozen=True)
class Exposure:
    """Predicted stalls of one step, per layer in window order, and the step's slowdown."""

    layers: tuple[int, ...]       # window order, shortest window first
    stall_ms: tuple[float, ...]   # d_l, same order as `layers`
    kappa_ms: float               # fixed per-step cost
    coupled: bool
    reads: tuple[LayerRead, ...] = ()   # the windows and read times it was computed from, same order

    @property
    def slowdown_ms(self) -> float:
        """Predicted step-time increase: sum of stalls plus kappa."""
        return sum(self.stall_ms) + self.kappa_ms

    def stall_of(self, layer: int) -> float:
        """The stall predicted at `layer`."""
        return self.stall_ms[self.layers.index(layer)]


def window_order(reads: Sequence[LayerRead]) -> tuple[LayerRead, ...]:
    """Reads sorted by window, shortest first (ties keep depth order)."""
    return tuple(sorted(reads, key=lambda r: (r.window_ms, r.layer)))


def exposure(reads: Sequence[LayerRead], *, resolve_ms: float = 0.0, kappa_ms: float = 0.0,
             coupled: bool = True) -> Exposure:
    """Stalls and slowdown of one step from Eq. 1 (coupled) or the sum of excesses (coupled=False)."""
    if resolve_ms < 0:
        raise SlackTierError(ErrorKind.BAD_INPUT, f"resolve time {resolve_ms} ms is negative",
                             fix="pass the CPU time to resolve indices, >= 0")
    layers = [r.layer for r in reads]
    if len(set(layers)) != len(layers):
        raise SlackTierError(ErrorKind.BAD_INPUT, f"layer listed twice in {layers}",
                             fix="give each lookup layer once")
    ordered = window_order(reads)
    stalls: list[float] = []
    earlier_ms = 0.0  # sum of stalls at earlier layers: extra time every later layer gets
    for r in ordered:
        excess = resolve_ms + r.read_ms - r.window_ms
        if coupled:
            excess -= earlier_ms
        d = max(0.0, excess)
        stalls.append(d)
        earlier_ms += d
    return Exposure(layers=tuple(r.layer for r in ordered), stall_ms=tuple(stalls),
                    kappa_ms=kappa_ms, coupled=coupled, reads=ordered)


def device_reads(loads: Sequence[LayerPages], windows_ms: Mapping[int, float],
                 models: Mapping[str, DeviceReadModel]) -> tuple[LayerRead, ...]:
    """Each layer's window and its T_l from its device's read-time model (plan.readmodel), the pages queued ahead
    of and behind it counted over the layers sharing its device; same order as `loads`."""
    missing = [x.layer for x in loads if x.layer not in windows_ms]
    if missing:
        raise SlackTierError(ErrorKind.MISSING, f"no window for layer(s) {missing}", layer=missing[0],
                             fix="give every lookup layer its window (slacktier probe, or --window LAYER=MS)")
    return tuple(LayerRead(t.layer, float(windows_ms[t.layer]), t.read_ms) for t in read_times(loads, models))


def device_exposure(loads: Sequence[LayerPages], windows_ms: Mapping[int, float],
                    models: Mapping[str, DeviceReadModel], *, resolve_ms: float = 0.0, kappa_ms: float = 0.0,
                    coupled: bool = True) -> Exposure:
    """Eq. 1 generalized with T_l from the device read-time model.

    Worked example (the paper's NVMe model, plan.readmodel.PAPER_NVME, Table 3's windows W_1 = 0.27, W_14 = 9.35):
    P_1 = 100 and P_14 = 1000 on one disk, layer 1 first: T_1 = 0.975, T_14 = 3.655 ms; d_1 = 0.975 - 0.27 =
    0.705, d_14 = [3.655 - 9.35 - 0.705]+ = 0, slowdown 0.705 ms (plus kappa).
    """
    return exposure(device_reads(loads, windows_ms, models), resolve_ms=resolve_ms, kappa_ms=kappa_ms,
                    coupled=coupled)
