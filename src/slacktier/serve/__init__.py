"""serve room: the serving loop, its runners, staged tables under placements, and runs measured as typed records.

- `loop.replay`: replayed sessions through a runner, per-session caches, measured per step.
- `runners`: V41Runner / Q38Runner (issue lookups at step start, run the model).
- `tiers`: TierSet (a staged table -> row providers under any placement of plan.placement, one engine
  switched in place).
- `runs`: ReplayRig (model + tables + engine across runs) and RunRecord (what one run measured).
- `timeline`: the step timeline (device compute from a profile); `predict`: the planner's prediction of it.
- `report`: the demo's and the timeline's tables; `demo`: `slacktier demo`.

The paper's Table 2 / Figure 3 / Figure 5 harness is beside the package: benchmarks/e2e/, with the pieces only
experiments use in benchmarks/rig/.
"""
