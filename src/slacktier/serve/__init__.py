"""serve room: the serving loop, its runners, placements, and runs measured as typed records.

- `loop.replay`: replayed sessions through a runner, per-session caches, measured per step.
- `runners`: V41Runner / Q38Runner (issue lookups at step start, run the model).
- `tiers`: placements (tier per layer, cache, devices) as control files, and TierSet (staged tables -> providers,
  one engine switched in place).
- `runs`: ReplayRig (model + tables + engine across runs) and RunRecord (what one run measured).
- `report`: the placement table and the demo's report; `demo`: `slacktier demo`.

The paper's Table 2 / Figure 3 / Figure 5 harness is beside the package: benchmarks/e2e/.
"""
