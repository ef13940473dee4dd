"""`slacktier probe --read-fit`: measure each tier's reads on a staged table (store.measure), fit its device
read-time model (plan.readfit), and write the tiers file `plan` and `inspect` read, with each fit's runs and plot.
"""

from __future__ import annotations

import datetime
from pathlib import Path
from typing import Mapping, Sequence

from slacktier.errors import ErrorKind, SlackTierError
from slacktier.plan.fit import MIN_FIT_RUNS
from slacktier.plan.readfit import (MIN_READ_FIT_RUNS, TRUSTED_HELD_OUT_R2, TierReadFit, describe_fit, fit_read_runs,
                                    fit_warning, predicted_read_ms)
from slacktier.store.measure import measure_reads


def read_fit(tier: str, manifest, layers: Sequence[int], *, runs: int = 45,
             max_pages: Sequence[int] = (3000, 3000), options=None, seed: int = 0, holds_table: bool | None = None,
             measured: str = "", rank: int = 0) -> TierReadFit:
    """Measure `tier` on `manifest`'s regions of `layers` (store.measure.measure_reads) and fit its device read
    model (plan.readfit.fit_read_runs); too few runs are refused before anything is read."""
    if runs < MIN_READ_FIT_RUNS:
        raise SlackTierError(ErrorKind.BAD_INPUT, f"runs: {runs} read-fit runs",
                             fix=f"use at least {MIN_READ_FIT_RUNS} runs ({MIN_FIT_RUNS} to fit, the rest held out)")
    return fit_read_runs(measure_reads(tier, manifest, layers, runs=runs, max_pages=max_pages, options=options,
                                       seed=seed, rank=rank), holds_table=holds_table, measured=measured)


def plot_read_fit(f: TierReadFit, path: str | Path) -> Path:
    """Measured against predicted read time, one point per layer's read, fit runs and held-out runs apart."""
    from slacktier.errors import optional_import

    matplotlib = optional_import("matplotlib", "probe", "the read fit's PNG plot")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pred, meas = predicted_read_ms(f), f.runs.read_ms
    n = f.fit.fit_runs
    fig, ax = plt.subplots(figsize=(6.0, 4.5))
    ax.scatter(pred[:n].ravel(), meas[:n].ravel(), s=12, label=f"fit runs ({n}): R^2 {f.fit.quality.r2:.2f}")
    if f.fit.held_out is not None:
        ax.scatter(pred[n:].ravel(), meas[n:].ravel(), s=14, marker="x",
                   label=f"held-out runs ({len(pred) - n}): R^2 {f.fit.held_out.r2:.2f}")
    top = float(max(pred.max(), meas.max())) * 1.05
    ax.plot([0, top], [0, top], color="0.5", lw=1, ls=":", label="measured = predicted")
    ax.set_xlim(0, top)
    ax.set_ylim(0, top)
    ax.set_xlabel("predicted read time (ms)")
    ax.set_ylabel("measured read time (ms)")
    first, second = f.runs.layers[:2]
    warn = "" if fit_warning(f) is None else f"\nheld-out R^2 below {TRUSTED_HELD_OUT_R2}: do not plan on it unchecked"
    ax.set_title(f"read fit of {f.spec.name}: layers {first} then {second}{warn}", fontsize=10)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    p = Path(path)
    fig.savefig(p, dpi=120)
    plt.close(fig)
    return p


def fit_tiers_file(manifest_path: str | Path, tiers: Sequence[str], out: str | Path, *,
                   layers: Sequence[int] | None = None, runs: int = 45, max_pages: int = 3000, rank: int = 0,
                   options: Mapping[str, object] | None = None, seed: int = 0, command: str = "",
                   plots: bool = True) -> list[TierReadFit]:
    """`slacktier probe --read-fit`: fit every tier of `tiers` on the manifest's regions of two layers (default: its
    first two), print each fit, and write them to the tiers file `out` (second form), keeping the tiers of an
    existing `out` that were not refitted; each tier's runs go beside it as `<out>.<tier>.runs.csv`, and with
    `plots` its measured-against-predicted scatter as `<out>.<tier>.fit.png`."""
    from slacktier.plan.tiers import load_tiers, write_tiers
    from slacktier.tables.manifest import Manifest

    manifest = Manifest.load(manifest_path)
    chosen = tuple(layers) if layers else tuple(manifest.layout.layer_ids[:2])
    if len(chosen) != 2 or any(l not in manifest.layout.layer_ids for l in chosen):
        raise SlackTierError(ErrorKind.BAD_INPUT, f"--read-layers {list(chosen)} of a manifest with layers "
                             f"{list(manifest.layout.layer_ids)}",
                             fix="name two of the manifest's layers, the shorter-window one first")
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    measured = f"{stamp}, {command}" if command else stamp
    fits = []
    for tier in tiers:
        f = read_fit(tier, manifest, chosen, runs=runs, max_pages=(max_pages, max_pages),
                     options=(options or {}).get(tier), seed=seed, measured=measured, rank=rank)
        print(describe_fit(f), flush=True)
        warning = fit_warning(f)
        if warning:
            print(warning, flush=True)
        fits.append(f)
    out = Path(out)
    kept = [t for t in load_tiers(out) if t.name not in set(tiers)] if out.exists() else []
    write_tiers([*kept, *(f.spec for f in fits)], out,
                comment=f"SlackTier tiers file: one [[tier]] per device queue (plan.tiers).\n"
                        f"Read fits of {', '.join(tiers)} measured {measured} on {manifest_path} (layers "
                        f"{chosen[0]} then {chosen[1]}, rank {rank}, {runs} runs of up to {max_pages} pages each)."
                        + (f"\nKept from the earlier file: {', '.join(t.name for t in kept)}." if kept else ""))
    for f in fits:
        out.with_name(f"{out.name}.{f.spec.name}.runs.csv").write_text(f.runs.csv())
        if plots:
            print(f"wrote {plot_read_fit(f, out.with_name(f'{out.name}.{f.spec.name}.fit.png'))}")
    print(f"wrote {out}" + (f" (kept {', '.join(t.name for t in kept)} from it)" if kept else ""))
    return fits
