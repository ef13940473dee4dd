"""Window sweeps as a table, as JSON, and as a plot like the paper's Figure 4 (window / step vs depth).

`run_probe(config)` is what `slacktier probe` calls: it loads the model, sweeps
each batch size (or follows the config file step by step) and writes the table,
the JSON and the plot from here, so the verb makes one call. The sweep itself is
`probe.sweep`; this module only drives it and reports.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from slacktier.errors import ErrorKind, SlackTierError, optional_import
from slacktier.probe.config import NO_TARGET, ProbeTarget, write_probe_config
from slacktier.probe.hooks import CLOCKS, WindowProbe
from slacktier.probe.sweep import (DelayPoint, LayerWindow, NoiseModel, SweepSettings, WindowSweep, measure_overhead,
                                   sweep_windows)

# Paper section 6.3: on Gemma 4 E4B, normalized by step time, layer k's window is
# about 0.85-0.92 k/L of a step on H200, MI300X and GB10.
PAPER_FRAC_LOW, PAPER_FRAC_HIGH = 0.85, 0.92


def depth(layer: int, num_layers: int) -> float:
    """k/L of decoder layer index k: the share of the decoder that runs before layer k."""
    return layer / num_layers


def sweep_to_dict(sweep: WindowSweep) -> dict:
    """The sweep as plain data."""
    return dataclasses.asdict(sweep)


def write_json(sweeps: Sequence[WindowSweep], path: str | Path) -> Path:
    """Write sweeps to a JSON file ({"sweeps": [...]})."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps({"sweeps": [sweep_to_dict(s) for s in sweeps]}, indent=1))
    return p


def read_json(path: str | Path) -> list[WindowSweep]:
    """Sweeps back from a file written by write_json."""
    doc = json.loads(Path(path).read_text())
    out = []
    for d in doc["sweeps"]:
        layers = tuple(LayerWindow(**{**lw, "points": tuple(DelayPoint(**p) for p in lw["points"])})
                       for lw in d["layers"])
        initial = d.get("initial_noise")
        out.append(WindowSweep(**{**d, "noise": NoiseModel(**d["noise"]), "settings": SweepSettings(**d["settings"]),
                                  "layers": layers, "layers_requested": tuple(d.get("layers_requested", ())),
                                  "initial_noise": None if initial is None else NoiseModel(**initial)}))
    return out


def format_table(sweeps: Sequence[WindowSweep]) -> str:
    """One row per probed layer and batch: window in ms and as a share of the step, next to k/L."""
    lines = []
    for s in sweeps:
        n = s.noise
        lines.append(f"{s.model}  B={s.batch}  clock={s.clock}")
        lines.append(f"step {n.baseline_ms:.3f} ms (median of {n.steps}), robust std {n.std_ms:.3f} ms, threshold "
                     f"{n.threshold_ms:.3f} ms, {s.steps_run} steps")
        if s.interrupted:
            lines.append(f"interrupted: {len(s.layers)} of {len(s.layers_requested) or '?'} layers measured")
        lines.append(f"{'layer':>5} {'k/L':>6} {'window ms':>10} {'window/step':>11} {'(w/step)/(k/L)':>14} "
                     f"{'fit ms':>8} {'arrival ms':>10} {'found at X':>10} {'points':>6}")
        for lw in s.layers:
            d = depth(lw.layer, s.num_layers)
            if lw.window_ms is None:
                w = frac = ratio = found = fit = "-"
                if lw.below_noise_floor:
                    w = "< floor"
            else:
                w, frac = f"{lw.window_ms:.3f}", f"{lw.window_frac:.3f}"
                ratio = f"{lw.window_frac / d:.3f}" if d > 0 else "-"
                found = f"{lw.detected_at_ms:.2f}"
                fit = "< floor" if lw.window_fit_ms is None else f"{lw.window_fit_ms:.3f}"
            lines.append(f"{lw.layer:>5} {d:>6.3f} {w:>10} {frac:>11} {ratio:>14} {fit:>8} {lw.arrival_ms:>10.3f} "
                         f"{found:>10} {len(lw.points):>6}")
        if any(lw.below_noise_floor for lw in s.layers):
            lines.append(f"< floor: X - delta came out under the noise floor ({s.settings.floor_ms:.3f} ms): the "
                         "window cannot be told from none")
        lines.append("")
    return "\n".join(lines)


def plot_windows(sweeps: Sequence[WindowSweep], path: str | Path, title: str = "", *, arrivals: bool = True) -> Path:
    """Figure-4-style plot: window as a fraction of the step against layer depth k/L, one line per sweep."""
    matplotlib = optional_import("matplotlib", "probe", "the window probe's PNG plot (or pass --no-plot)")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.0, 4.0))
    ax.fill_between([0, 1], [0, PAPER_FRAC_LOW], [0, PAPER_FRAC_HIGH], color="0.85",
                    label=f"paper: {PAPER_FRAC_LOW}-{PAPER_FRAC_HIGH} k/L")
    ax.plot([0, 1], [0, 1], ls=":", color="0.5", lw=1, label="k/L")
    for s in sweeps:
        pts = [(depth(lw.layer, s.num_layers), lw.window_frac) for lw in s.layers if lw.window_frac is not None]
        if pts:
            xs, ys = zip(*pts)
            line, = ax.plot(xs, ys, marker="o", ms=3,
                            label=f"B={s.batch} ({s.noise.baseline_ms:.1f} ms step, {s.clock} clock): measured "
                                  "window")
            if arrivals:
                ax.plot([depth(lw.layer, s.num_layers) for lw in s.layers],
                        [lw.arrival_ms / s.noise.baseline_ms for lw in s.layers], ls="--", lw=1,
                        color=line.get_color(), label=f"B={s.batch}: arrival at the layer, nothing held")
    ax.set_xlabel("depth of the layer that reads the table (k/L)")
    ax.set_ylabel("window / step")
    ax.set_xlim(0, 1)
    # min over a list: a sweep that found no window (a loaded machine) leaves only the 0.0
    ax.set_ylim(bottom=min([0.0, *(lw.window_frac for s in sweeps for lw in s.layers if lw.window_frac is not None)]))
    ax.set_title(title or (sweeps[0].model if sweeps else ""), fontsize=9)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(p, dpi=120)
    plt.close(fig)
    return p


#: DeepSeek-V4.1's Engram layers, the ones `plan` places tables on (the probe room imports no other room; a test
#: holds this equal to tables.engram_hash.V41_LAYER_IDS)
V41_LAYER_IDS = (1, 14)


def parse_layers(spec: str, num_layers: int) -> list[int]:
    """'tables' | 'all' | '0,5,10' | 'every:N' -> decoder layer indices (every:3 of 8 layers -> [0, 3, 6]).

    'tables' is DeepSeek-V4.1's Engram layers (1, 14), the layers `plan` places tables on; a model with too few
    decoder layers for them is refused (num_layers 0: not known yet, only the spec is checked).
    """
    if spec == "tables":
        if num_layers and max(V41_LAYER_IDS) >= num_layers:
            raise SlackTierError(ErrorKind.BAD_INPUT, f"--layers tables is layers {list(V41_LAYER_IDS)}, and this "
                                 f"model has {num_layers} decoder layers",
                                 fix="pass --layers all or a comma list of the layers that read your tables")
        return list(V41_LAYER_IDS)
    if spec == "all":
        return list(range(num_layers))
    if spec.startswith("every:"):
        try:
            step = int(spec.split(":", 1)[1])
        except ValueError:
            step = 0
        if step < 1:
            raise SlackTierError(ErrorKind.BAD_INPUT, f"--layers {spec}", fix="use every:N with N >= 1")
        return list(range(0, num_layers, step))
    try:
        return [int(x) for x in spec.split(",") if x.strip()]
    except ValueError as exc:
        raise SlackTierError(ErrorKind.BAD_INPUT, f"--layers {spec!r}", fix="use all, every:N or 0,5,10") from exc


@dataclass(frozen=True)
class ProbeRunConfig:
    """One `slacktier probe` run: which model, which batches and layers, how hard to look, where to write."""

    model: str = "smollm2"               # 'smollm2', a .gguf file or a local Hugging Face model directory
    layers_path: str | None = None       # dotted path of the decoder ModuleList (None: found by name)
    batches: tuple[int, ...] = (1,)
    layers: str = "tables"               # 'tables', 'all', '0,5,10' or 'every:N' (parse_layers)
    clock: str = "wall"                  # probe.hooks.CLOCKS
    threads: int = 0                     # torch intra-op threads (0: leave torch's default)
    config_path: Path = Path("runs/probe/probe.json")  # the probe's run-time target file, rewritten by the sweep
    settings: SweepSettings = field(default_factory=SweepSettings)
    prompt_tokens: int = 64
    max_new_tokens: int = 64
    overhead_pairs: int = 0              # also time N (hooked, bare) step pairs per batch
    follow: int = 0                      # >0: follow the config file for N steps instead of sweeping
    seed: int = 0
    json_path: Path = Path("runs/probe/windows.json")
    plot_path: Path | None = Path("runs/probe/windows.png")  # None: no plot

    def __post_init__(self) -> None:
        if not self.batches or min(self.batches) < 1 or min(self.threads, self.overhead_pairs, self.follow) < 0:
            raise SlackTierError(ErrorKind.BAD_INPUT, f"batches {self.batches}, threads {self.threads}, overhead "
                                 f"pairs {self.overhead_pairs}, follow {self.follow}",
                                 fix="give batch sizes >= 1 and threads, overhead pairs and follow steps >= 0")
        if self.clock not in CLOCKS:
            raise SlackTierError(ErrorKind.BAD_INPUT, f"unknown clock {self.clock!r}",
                                 fix=f"use one of {sorted(CLOCKS)}")
        parse_layers(self.layers, 0)  # a malformed spec fails here, before the model loads


def format_overhead(batch: int, hooked_ms: Sequence[float], bare_ms: Sequence[float], clock: str) -> str:
    """One line: step time with hooks attached (no target) against hooks removed, medians and ranges."""
    h, b = statistics.median(hooked_ms), statistics.median(bare_ms)
    return (f"probe overhead B={batch} ({len(hooked_ms)} interleaved pairs, clock {clock}): hooked, no target "
            f"median {h:.3f} ms [min {min(hooked_ms):.3f}, max {max(hooked_ms):.3f}]; hooks removed median {b:.3f} "
            f"ms [min {min(bare_ms):.3f}, max {max(bare_ms):.3f}]; ratio {h / b:.4f}")


def format_follow_step(step: int, target: ProbeTarget, step_ms: float) -> str:
    """One line of follow mode: the target the step ran under and its time."""
    return (f"step {step} layer {'-' if target.layer is None else target.layer} delay_ms {target.delay_ms:.3f} "
            f"step_ms {step_ms:.3f}")


def run_probe(config: ProbeRunConfig) -> list[WindowSweep]:
    """Sweep every batch (print the table, write JSON and plot), or follow the config file; the sweeps."""
    import torch

    from slacktier.probe.hf import DecodeLoop, load_causal_lm

    if config.threads:
        torch.set_num_threads(config.threads)
    model, name = load_causal_lm(config.model)
    config.config_path.parent.mkdir(parents=True, exist_ok=True)
    if config.follow:
        if not config.config_path.exists():
            write_probe_config(config.config_path, NO_TARGET)
        loop = DecodeLoop(model, config.batches[0], config.prompt_tokens, config.max_new_tokens, config.seed,
                          config.clock)
        with WindowProbe(model, layers_path=config.layers_path, config_path=str(config.config_path),
                         clock=config.clock) as pr:
            for i in range(config.follow):
                ms = loop.step()
                print(format_follow_step(i, pr.step_target, ms), flush=True)
        return []
    sweeps, overheads = [], []
    try:
        for i, batch in enumerate(config.batches, 1):
            loop = DecodeLoop(model, batch, config.prompt_tokens, config.max_new_tokens, config.seed, config.clock)
            write_probe_config(config.config_path, NO_TARGET)
            probe = WindowProbe(model, layers_path=config.layers_path, config_path=str(config.config_path),
                                clock=config.clock)
            layers = parse_layers(config.layers, probe.num_layers)
            n = len(config.batches)
            tag = f"[B={batch}]" if n == 1 else f"[B={batch}, batch size {i} of {n}]"
            with probe:
                sweep = sweep_windows(loop.step, probe, layers, config.settings, batch=batch, model_name=name,
                                      progress=lambda m, t=tag: print(f"{t} {m}", file=sys.stderr, flush=True))
            sweeps.append(sweep)
            if sweep.interrupted:
                break
            if config.overhead_pairs:
                hooked, bare = measure_overhead(loop.step, probe, pairs=config.overhead_pairs, seed=config.seed)
                overheads.append((batch, hooked, bare))
    except KeyboardInterrupt:   # outside a sweep's layers (loading, baseline, overhead): keep the finished sweeps
        if not sweeps:
            print("interrupted before any layer was measured: nothing written", file=sys.stderr, flush=True)
            raise
        sweeps[-1] = dataclasses.replace(sweeps[-1], interrupted=True)
    sweeps = [s for s in sweeps if s.layers or not s.interrupted]
    if not sweeps:
        print("interrupted before any layer was measured: nothing written", file=sys.stderr, flush=True)
        raise KeyboardInterrupt
    print(format_table(sweeps))
    for batch, hooked, bare in overheads:
        print(format_overhead(batch, hooked, bare, config.clock))
    print(f"wrote {write_json(sweeps, config.json_path)}")
    if config.plot_path is not None:
        print(f"wrote {plot_windows(sweeps, config.plot_path)}")
    if any(s.interrupted for s in sweeps):
        done = {lw.layer for s in sweeps for lw in s.layers}
        print(f"interrupted: the file holds the {len(done)} layers measured before Ctrl-C", file=sys.stderr)
    return sweeps
