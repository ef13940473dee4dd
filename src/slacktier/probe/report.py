"""Window sweeps as a table, as JSON, and as a plot like the paper's Figure 4 (window / step vs depth)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Sequence

from slacktier.probe.sweep import DelayPoint, LayerWindow, NoiseModel, SweepSettings, WindowSweep

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
                                  "layers": layers,
                                  "initial_noise": None if initial is None else NoiseModel(**initial)}))
    return out


def format_table(sweeps: Sequence[WindowSweep]) -> str:
    """One row per probed layer and batch: window in ms and as a share of the step, next to k/L."""
    lines = []
    for s in sweeps:
        n = s.noise
        lines.append(f"{s.model}  B={s.batch}  clock={s.clock}  step {n.baseline_ms:.3f} ms (median of {n.steps}), "
                     f"robust std {n.std_ms:.3f} ms, threshold {n.threshold_ms:.3f} ms, {s.steps_run} steps")
        lines.append(f"{'layer':>5} {'k/L':>6} {'window ms':>10} {'window/step':>11} {'(w/step)/(k/L)':>14} "
                     f"{'fit ms':>8} {'arrival ms':>10} {'found at X':>10} {'points':>6}")
        for lw in s.layers:
            d = depth(lw.layer, s.num_layers)
            if lw.window_ms is None:
                w = frac = ratio = found = fit = "-"
            else:
                w, frac = f"{lw.window_ms:.3f}", f"{lw.window_frac:.3f}"
                ratio = f"{lw.window_frac / d:.3f}" if d > 0 else "-"
                found = f"{lw.detected_at_ms:.2f}"
                fit = f"{lw.window_fit_ms:.3f}"
            lines.append(f"{lw.layer:>5} {d:>6.3f} {w:>10} {frac:>11} {ratio:>14} {fit:>8} {lw.arrival_ms:>10.3f} "
                         f"{found:>10} {len(lw.points):>6}")
        lines.append("")
    return "\n".join(lines)


def plot_windows(sweeps: Sequence[WindowSweep], path: str | Path, title: str = "", *, arrivals: bool = True) -> Path:
    """Figure-4-style plot: window as a fraction of the step against layer depth k/L, one line per sweep."""
    import matplotlib

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
                            label=f"B={s.batch} ({s.noise.baseline_ms:.1f} ms step, {s.clock}): X - delta")
            if arrivals:
                ax.plot([depth(lw.layer, s.num_layers) for lw in s.layers],
                        [lw.arrival_ms / s.noise.baseline_ms for lw in s.layers], ls="--", lw=1,
                        color=line.get_color(), label=f"B={s.batch}: arrival at the layer, nothing held")
    ax.set_xlabel("depth of the layer that reads the table (k/L)")
    ax.set_ylabel("window / step")
    ax.set_xlim(0, 1)
    ax.set_ylim(bottom=min(0.0, *(lw.window_frac for s in sweeps for lw in s.layers if lw.window_frac is not None)))
    ax.set_title(title or (sweeps[0].model if sweeps else ""), fontsize=9)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(p, dpi=120)
    plt.close(fig)
    return p
