"""serve room: the serving loop and the replay benchmark.

- `loop.replay`: replayed sessions through a runner, per-session caches, measured per step.
- `runners`: V41Runner / Q38Runner (issue lookups at step start, run the model).
- `tiers`: placements (Table 2's rows) and TierSet (staged tables -> row providers, one engine).
- `bench`: `slacktier bench` (Table 2, Figures 3 and 5, the exposure model's fit) and run_short_demo.
"""
