"""The read-time model of one device queue (paper section 4.1), the one the planner, `inspect` and the timeline use.

Every table on a device shares its queue, which admits reads in window order:
the shortest-window layer's pages first (DESIGN section 2, "device queue"). On a
device with read-time model (a, b, c, c_behind), layer l's read time, in ms from
the end of index resolution until its last page lands, is

    T_l = a + b * P_l + c * A_l + c_behind * B_l        (0 when P_l = 0: a layer that reads nothing waits for nothing)

    P_l  pages layer l reads this step
    A_l  pages queued ahead of l on its device: the pages of every layer on that device submitted before l
         (shorter window, or an earlier `order` in the control file)
    B_l  pages queued behind l on its device: the pages of every layer on that device submitted after l

`b` is what a page of the layer's own costs, `c` what a page queued ahead of it
costs (with one deadline-ordered queue per device, about `b`: the layer waits for
those reads), `c_behind` what a page queued behind it costs (contention only:
later reads fill the depth the earlier layer leaves). The paper fits T_1 = 0.30 ms
+ 3.05 us * P_1 + 0.37 us * P_14 for layer 1 on one NVMe (plan.constants): a = 0.30,
b = 3.05 us, c_behind = 0.37 us. Layers on other devices do not enter.

Worked example (the paper's NVMe, plan.constants.PAPER_NVME_*): P_1 = 100 and
P_14 = 1000 on one disk, layer 1 first: T_1 = 0.30 + 0.00305*100 + 0.00037*1000
= 0.975 ms; T_14 = 0.30 + 0.00305*1000 + 0.00305*100 = 3.655 ms. With layer 1
in DRAM instead, layer 14 is alone on the disk: T_14 = 0.30 + 3.05 = 3.35 ms.

The model is pure: `read_times(loads, models)` returns `ReadTime` values. The
least-squares fit is `plan.fit.fit_device_read_model`; `slacktier probe
--read-fit` measures a tier and writes its (a, b, c, c_behind) to a tiers file
(plan.tiers).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Sequence

from slacktier.errors import ErrorKind, SlackTierError
from slacktier.plan.constants import (PAPER_NVME_AHEAD_PAGE_MS, PAPER_NVME_BEHIND_PAGE_MS, PAPER_NVME_INTERCEPT_MS,
                                      PAPER_NVME_PAGE_MS)

#: the model's coefficients, in the order of the fit's design columns (1, P_l, A_l, B_l)
TERMS = ("intercept_ms", "page_ms", "ahead_page_ms", "behind_page_ms")


#: larger read-time terms are typos (1000 s a read), and overflow the model to inf
MAX_TERM_MS = 1e6


@dataclass(frozen=True)
class DeviceReadModel:
    """T_l = a + b P_l + c A_l + c_behind B_l on one device queue (ms; see the module docstring)."""

    intercept_ms: float     # a: ms per read of a layer
    page_ms: float          # b: ms per page of the layer itself
    ahead_page_ms: float    # c: ms per page queued ahead of it on the device (earlier-window layers)
    behind_page_ms: float   # c_behind: ms per page queued behind it on the device (later-window layers)

    def __post_init__(self) -> None:
        for key in TERMS:
            v = getattr(self, key)
            if (not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v < 0
                    or v > MAX_TERM_MS):
                raise SlackTierError(ErrorKind.BAD_INPUT, f"read-time term {key} = {v!r} is not a finite number "
                                     f"in 0..{MAX_TERM_MS:g} ms",
                                     fix=f"give {key} in ms (per page for the *_page_ms terms), >= 0; refit the "
                                         "device with `slacktier probe --read-fit MANIFEST`")

    def read_ms(self, pages: float, ahead_pages: float = 0.0, behind_pages: float = 0.0) -> float:
        """T_l of a layer reading `pages` with `ahead_pages` queued before and `behind_pages` after it."""
        if min(pages, ahead_pages, behind_pages) < 0:
            raise SlackTierError(ErrorKind.BAD_INPUT, f"page counts {pages}, {ahead_pages}, {behind_pages}",
                                 fix="page counts are >= 0")
        if pages == 0:
            return 0.0
        return (self.intercept_ms + self.page_ms * pages + self.ahead_page_ms * ahead_pages
                + self.behind_page_ms * behind_pages)

    @property
    def ahead_over_page(self) -> float:
        """c / b: 1 for a device that reads the earlier layer's pages first, below 1 where they share it."""
        return self.ahead_page_ms / self.page_ms if self.page_ms > 0 else math.nan


#: the paper's fit for one NVMe shared by four ranks (plan.constants; c is the paper's FIFO statement, not a fit)
PAPER_NVME = DeviceReadModel(PAPER_NVME_INTERCEPT_MS, PAPER_NVME_PAGE_MS, PAPER_NVME_AHEAD_PAGE_MS,
                             PAPER_NVME_BEHIND_PAGE_MS)


@dataclass(frozen=True)
class LayerPages:
    """One layer's reads in a step: its device queue, its pages, and where it is submitted on that device."""

    layer: int
    device: str     # the device queue (the tier name in a tiers file: every table on it shares one queue)
    pages: float    # P_l
    order: float    # submission order; lower first (window order, or the control file's `order`); ties: layer

    def __post_init__(self) -> None:
        if not math.isfinite(self.pages) or self.pages < 0:
            raise SlackTierError(ErrorKind.BAD_INPUT, f"pages {self.pages} of layer {self.layer}",
                                 fix="pages per step are finite and >= 0", layer=self.layer)


@dataclass(frozen=True)
class ReadTime:
    """The model's answer for one layer: its pages, the pages queued ahead of and behind it, and T_l."""

    layer: int
    device: str
    pages: float
    ahead_pages: float
    behind_pages: float
    read_ms: float


def read_times(loads: Sequence[LayerPages], models: Mapping[str, DeviceReadModel]) -> tuple[ReadTime, ...]:
    """T_l of every layer of `loads` (same order as given), the queued-ahead/behind pages taken from the layers
    that share its device. Worked example: see the module docstring."""
    layers = [x.layer for x in loads]
    if len(set(layers)) != len(layers):
        raise SlackTierError(ErrorKind.BAD_INPUT, f"layer listed twice in {layers}", fix="give each layer once")
    missing = sorted({x.device for x in loads} - set(models))
    if missing:
        raise SlackTierError(ErrorKind.MISSING, f"no read-time model for device {missing}",
                             fix="give every tier a read model in the tiers file (`slacktier probe --read-fit`)")
    out = []
    for x in loads:
        key = (x.order, x.layer)
        same = [y for y in loads if y.device == x.device and y.layer != x.layer]
        ahead = sum(y.pages for y in same if (y.order, y.layer) < key)
        behind = sum(y.pages for y in same if (y.order, y.layer) > key)
        out.append(ReadTime(x.layer, x.device, float(x.pages), float(ahead), float(behind),
                            models[x.device].read_ms(x.pages, ahead, behind)))
    return tuple(out)
