"""What the end-to-end benchmark runs."""

from __future__ import annotations

from dataclasses import dataclass

from slacktier.errors import ErrorKind, SlackTierError
from slacktier.serve.runs import RigConfig


@dataclass(frozen=True)
class E2EConfig:
    """The experiments; `rig` is the model, table and replay every run shares."""

    rig: RigConfig = RigConfig()
    workloads: tuple[str, ...] = ("agent", "chat")
    table2_batch: int = 8                  # B of Table 2 and Figure 3 (the paper: 128)
    batches: tuple[int, ...] = (4, 8, 16)  # Figure 5's loads (the paper: 8..256)
    runs: int = 3
    split_fs: tuple[float, ...] = (0.0, 0.25, 0.5, 0.75, 1.0)
    # (first-layer ms, second-layer ms) hand-out delays on top of the DRAM tier, run at table2_batch: the
    # paper's Table 3 check of Eq. 1 on read times this machine's disk does not produce.
    delays_ms: tuple[tuple[float, float], ...] = ((60.0, 100.0), (60.0, 160.0), (90.0, 160.0), (120.0, 220.0))
    figure3_runs: int = 1                  # per f other than 0.5 (which is Table 2's disk-split, `runs` times)
    figure3: bool = True
    figure5: bool = True

    def __post_init__(self) -> None:
        if self.runs < 1 or self.table2_batch < 1 or any(b < 1 for b in self.batches) or not self.workloads:
            raise SlackTierError(ErrorKind.BAD_INPUT, f"bad e2e config {self}",
                                 fix="runs and batches >= 1, at least one workload")
        if self.rig.max_batch < max(self.batches + (self.table2_batch,)):
            raise SlackTierError(ErrorKind.BAD_INPUT, f"rig.max_batch {self.rig.max_batch} below the loads",
                                 fix="set rig.max_batch to the largest batch")
