"""The emulated device as a fluid server (pure): when each batch of reads lands, from the device model.

One emulated device is a fluid server shared by every rank queue mapped to
it. A page costs the device tau = b / ranks_in_fit of its time
(`DeviceModel.page_share_ms`), so k ranks reading P pages each at once finish
after k * tau * P, which for k = ranks_in_fit is the fit's b * P. Pending work
is served in window order (lower layer first, the device queue's order);
jobs of the same layer from several ranks share the device equally. A job
arriving while earlier-window work is outstanding steals c_behind /
ranks_in_fit of device time per page (the contention of layer 14 on layer 1).
A batch lands a after its last page was served. The ahead term c is not an
input: a later layer waits for the earlier layers' pages by the queue order
itself, so it comes out as b.

Worked example (nvme-paper, one disk, four ranks each submitting 700 layer-1
then 700 layer-14 pages at 0): layer 1 lands at 0.30 + 4 * 0.7625 us * 700 +
4 * 0.0925 us * 700 = 2.694 ms, the paper's T_1 = 0.30 + 3.05 us * 700 +
0.37 us * 700.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from slacktier.whatif.models import DeviceModel


@dataclass(frozen=True)
class SimJob:
    """One batch on an emulated device: its key, window priority (layer), pages, and submit time (ms)."""

    key: int
    priority: int
    pages: int
    submit_ms: float


def completions_ms(jobs: Sequence[SimJob], model: DeviceModel) -> dict[int, float]:
    """When each job lands (ms, same clock as submit_ms) on one device serving them all (module docstring).

    Worked example (nvme-paper): two ranks, each 100 pages of layer 1 at 0 -> tau = 0.7625 us; both share the
    device and finish their pages at 2 * 100 * tau = 0.1525 ms, landing at 0.4525 ms.
    """
    tau = model.page_share_ms()
    steal = model.behind_share_ms()
    intercept = model.read.intercept_ms
    pending = sorted(jobs, key=lambda j: (j.submit_ms, j.priority, j.key))
    left: dict[int, float] = {}
    prio: dict[int, int] = {}
    out: dict[int, float] = {}
    stolen = 0.0
    t = pending[0].submit_ms if pending else 0.0
    i = 0
    while i < len(pending) or left:
        while i < len(pending) and pending[i].submit_ms <= t + 1e-12:
            j = pending[i]
            i += 1
            if j.pages <= 0:
                out[j.key] = j.submit_ms
                continue
            if any(prio[k] < j.priority for k in left):
                stolen += steal * j.pages
            left[j.key] = tau * j.pages
            prio[j.key] = j.priority
        next_arrival = pending[i].submit_ms if i < len(pending) else math.inf
        if not left:
            t = next_arrival
            continue
        if stolen > 0:
            dt = min(stolen, next_arrival - t)
            stolen -= dt
            t += dt
            continue
        top = min(prio[k] for k in left)
        served = [k for k in left if prio[k] == top]
        share = len(served)
        finish = min(left[k] for k in served) * share
        dt = min(finish, next_arrival - t)
        for k in served:
            left[k] -= dt / share
        t += dt
        for k in served:
            if left[k] <= 1e-12:
                del left[k]
                out[k] = t + intercept
    return out


def alone_ms(model: DeviceModel, pages: int) -> float:
    """When a batch of `pages` submitted alone lands, in ms after its submit: a + tau * pages (0 for none)."""
    return model.read.intercept_ms + model.page_share_ms() * pages if pages else 0.0
