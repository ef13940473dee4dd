"""probe room: the prefetch-window probe for any torch decoder (paper section 6.3, appendix B).

hf.py (transformers) is not imported here; import slacktier.probe.hf to load real models. The read fit that
`slacktier probe --read-fit` also runs lives above the tiers it measures: store.measure times a tier's reads,
plan.readfit fits its model to them, and serve.readfit runs both and writes the tiers file.
"""

from slacktier.probe.config import (NO_TARGET, ConfigWatcher, ProbeTarget, read_probe_config,
                                    write_probe_config)
from slacktier.probe.hooks import CLOCKS, Clock, SpinClock, WindowProbe, as_clock, clock_ns, find_decoder_layers
from slacktier.probe.report import format_table, plot_windows, read_json, sweep_to_dict, write_json
from slacktier.probe.sweep import (DelayPoint, LayerWindow, NoiseModel, SweepSettings, WindowSweep,
                                   measure_overhead, noise_model, sweep_windows)

__all__ = [
    "CLOCKS", "Clock", "ConfigWatcher", "DelayPoint", "LayerWindow", "NO_TARGET", "NoiseModel", "ProbeTarget",
    "SpinClock", "SweepSettings", "WindowProbe", "WindowSweep", "as_clock", "clock_ns", "find_decoder_layers", "format_table",
    "measure_overhead", "noise_model", "plot_windows", "read_json", "read_probe_config", "sweep_to_dict",
    "sweep_windows",
    "write_json", "write_probe_config",
]
