"""The paper's experiment rig: what only the benchmarks use of served runs, beside them rather than in the package.

- `placements`: the real-disk replay's Table 2 placements (`replay_table2_placements`) and the provider that
  holds each layer's rows back by an injected delay (`DelayedRowProvider`, the paper's Table 3 check of Eq. 1).
- `records`: a run record as JSON data and back (the harness's results files).
- `report`: the harness's wide Table 2 layout (`format_placement_table`).

The package keeps what `slacktier demo` runs (slacktier.serve: the replay rig, the step timeline, the planner's
prediction); benchmarks import both, as `benchmarks.rig` with the repo root on sys.path
(`python -m benchmarks.run`, or a script's own sys.path line).
"""
