"""The real-disk replay's placements of the paper's Table 2, and injected hand-out delays.

The what-if's Table 2 (`slacktier whatif`) places the same tables on emulated
devices; the placements here are served from this machine's own disk, so they
carry a device-file count instead of a device model.
"""

from __future__ import annotations

import time
from typing import Mapping

from slacktier.models.rows import RowProvider
from slacktier.plan.placement import Placement


def replay_table2_placements(first: int, second: int, cache_rows: int, devices: int = 4) -> list[Placement]:
    """The paper's Table 2 rows on this machine's disk for lookup layers (first, second) = (1, 14): the short
    window, then the long; `devices` files stand for the several-disk rows."""
    both_disk = ((first, "disk"), (second, "disk"))
    split = ((first, 0.5), (second, 0.5))
    return [
        Placement("dram-table", stock=True),
        Placement(f"l{first}-dram-l{second}-disk", ((first, "dram"), (second, "disk"))),
        Placement("disk", both_disk),
        Placement(f"disk{devices}", both_disk, devices=devices),
        Placement(f"disk-cache-l{second}", both_disk, cache_rows // 2, ((second, 1.0),)),
        Placement("disk-split", both_disk, cache_rows, split),
        Placement(f"disk{devices}-split", both_disk, cache_rows, split, devices=devices),
    ]


class DelayedRowProvider:
    """A provider whose layer l rows are not handed out before `delays_ms[l]` after begin_step (the paper's probe).

    Checks the exposure model on read times this machine's disk does not produce: the wrapped provider still
    reads and gathers every row; only the hand-out waits.
    """

    def __init__(self, inner: RowProvider, delays_ms: Mapping[int, float]) -> None:
        self.inner = inner
        self.layer_ids = tuple(inner.layer_ids)
        self.delays_ms = dict(delays_ms)
        self._t0 = 0.0

    @property
    def last_counters(self):
        """The wrapped provider's counters of the last step."""
        return getattr(self.inner, "last_counters", None)

    def begin_step(self, ids) -> None:
        """Issue through the wrapped provider; the delay clock starts now."""
        self.inner.begin_step(ids)
        self._t0 = time.perf_counter()

    def rows(self, layer_id: int):
        """Wait until the layer's delay has passed since issue, then the wrapped provider's rows."""
        ready = self._t0 + self.delays_ms.get(layer_id, 0.0) / 1e3
        now = time.perf_counter()
        if ready > now:
            time.sleep(ready - now)
        return self.inner.rows(layer_id)

    def end_step(self) -> None:
        """Forward to the wrapped provider."""
        self.inner.end_step()
