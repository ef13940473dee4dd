"""engine room: the step engine (begin_step / gather / end_step), its control file and the bit-exact checker.

    from slacktier.engine import StepEngine
    engine = StepEngine.from_control("tier.toml")   # or StepEngine(tables, cache, device)
    engine.begin_step(ids)                          # ids [T, L, 24] int64, L in ascending layer-id order
    rows = engine.gather(layer_id)                  # bf16 [T, 24, 256] on the engine's device
    counters = engine.end_step()                    # StepCounters: per-layer LayerCounters
    engine.reload("other.toml")                     # between steps
    engine.close()
"""

from slacktier.engine.control import ControlFile, EngineConfig, TableConfig, load_control, parse_control
from slacktier.engine.counters import LayerCounters, StepCounters
from slacktier.engine.step import StepEngine
from slacktier.engine.tables import RankRegion, TableSpec, rank_regions_for, seen_bitmap

__all__ = ["ControlFile", "EngineConfig", "LayerCounters", "RankRegion", "StepCounters", "StepEngine", "TableConfig",
           "TableSpec", "load_control", "parse_control", "rank_regions_for", "seen_bitmap"]
