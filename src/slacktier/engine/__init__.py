"""engine room: the step engine (begin_step / gather / end_step), per-layer reads and the bit-exact checker.

    from slacktier.engine import StepEngine
    engine = StepEngine.from_control("tier.toml")   # or from_config(ControlFile), or StepEngine(tables, cache)
    engine.begin_step(ids)                          # ids [T, L, 24] int64, L in ascending layer-id order
    rows = engine.gather(layer_id)                  # bf16 [T, 24, 256] on the engine's device
    counters = engine.end_step()                    # StepCounters: per-layer LayerCounters
    engine.apply(other_cfg)                         # between steps: a ControlFile, a path, or a Change
    engine.close()
"""

from slacktier.engine.configure import Change
from slacktier.engine.counters import LayerCounters, StepCounters
from slacktier.engine.reads import LayerReads, LayerWait
from slacktier.engine.step import StepEngine
from slacktier.engine.tables import TableSpec, rank_regions_for, seen_bitmap

__all__ = ["Change", "LayerCounters", "LayerReads", "LayerWait", "StepCounters", "StepEngine", "TableSpec",
           "rank_regions_for", "seen_bitmap"]
