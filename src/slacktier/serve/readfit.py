"""The read fit: a tier's device read-time model measured on a staged table's own regions.

`slacktier probe --read-fit MANIFEST` and the timeline's planner (serve.predict)
call `read_fit`. Per run it draws a page count for each of two layers (P_first,
P_second, uniform and independent), submits the first layer's pages and then
the second's to the tier's page sources as the engine opens them, and times
each layer from the first submit to its last completion (the source's own
clock, as the engine reports it, plus the second submit's lag). The model
(plan.readmodel) is then fitted by least squares on the first two thirds of the
runs and scored on the rest (plan.fit.fit_device_read_model):

    T_first  = a + b P_first  + c_behind P_second
    T_second = a + b P_second + c P_first

Today each table opens its own page source (engine/build.py: open_table_source),
so the two layers' reads share the device as equals and c comes out well above
zero (BENCHMARKS.md, "Read-time model on this machine's disk"); with one
deadline-ordered queue per device the second layer waits behind the first and c
approaches b, while c_behind, the first layer's cost of the other's pages, is
what falls. When the engine opens one queue per device, this measurement must
submit through it too.
"""

from __future__ import annotations

import datetime
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np

from slacktier.errors import ErrorKind, SlackTierError
from slacktier.plan.fit import MIN_FIT_RUNS, DeviceReadFit, fit_device_read_model
from slacktier.plan.tiers import ReadFitRecord, TierSpec, in_host_memory

#: fewest runs `read_fit` measures: MIN_FIT_RUNS to fit, half as many held out
MIN_READ_FIT_RUNS = (3 * MIN_FIT_RUNS + 1) // 2
#: a fit whose held-out R^2 is below this explains too little of the reads it did not see to plan with unwarned:
#: the share of read-time variance the model predicts on runs it was not fitted on
TRUSTED_HELD_OUT_R2 = 0.8


@dataclass(frozen=True)
class ReadRuns:
    """Measured runs of one tier: per run each layer's pages and read time, layers in submission order."""

    tier: str
    layers: tuple[int, ...]   # submission order
    pages: np.ndarray         # [runs, layers] pages read
    read_ms: np.ndarray       # [runs, layers] ms from the first submit to the layer's last completion

    def csv(self) -> str:
        """The runs as CSV: run, then pages and read_ms per layer."""
        head = ["run"] + [f"pages_l{l}" for l in self.layers] + [f"read_ms_l{l}" for l in self.layers]
        rows = [",".join(head)]
        for i, (p, t) in enumerate(zip(self.pages, self.read_ms)):
            rows.append(",".join([str(i), *(f"{x:.0f}" for x in p), *(f"{x:.6f}" for x in t)]))
        return "\n".join(rows) + "\n"


@dataclass(frozen=True)
class TierReadFit:
    """A tier's read fit: the planner's TierSpec (its device read model), the fit's quality, and the runs."""

    spec: TierSpec
    fit: DeviceReadFit
    runs: ReadRuns


def measure_reads(tier: str, manifest, layers: Sequence[int], *, runs: int,
                  max_pages: Sequence[int] = (3000, 3000), options=None, seed: int = 0, rank: int = 0) -> ReadRuns:
    """`runs` runs over `manifest`'s rank-`rank` regions of `layers` (submitted in that order), random pages.

    Each source is opened as the engine opens it: checked against the manifest's identity (a Redis prefix
    defaults to the one `slacktier load` writes), and a tier that compares stored CRC32Cs on every read (Redis)
    is given the manifest's, with its page check as under `verify_reads = "auto"`."""
    from slacktier.store.base import PageBufferPool
    from slacktier.store.registry import get_tier, open_source

    if len(layers) != len(max_pages) or len(layers) < 2:
        raise SlackTierError(ErrorKind.BAD_INPUT, f"layers {list(layers)} with max pages {list(max_pages)}",
                             fix="give two or more layers and one page maximum per layer")
    regions = [manifest.runtime_regions(layer=l, rank=rank) for l in layers]
    sources = []
    try:
        cls = get_tier(tier).source_cls
        sums = dict(zip(((r.layer, r.rank) for r in manifest.regions), manifest.region_checksums(), strict=True))
        for r in regions:
            crcs = [sums[(x.layer, x.rank)] for x in r] if cls.stored_crc32c else None
            sources.append(open_source(tier, r, options, page_crc32c=crcs, identity=manifest.identity,
                                       verify_pages=cls.verify_by_default))
        pools = [PageBufferPool(m) for m in max_pages]
        rng = np.random.default_rng(seed)
        pages_drawn, t_ms = [], []
        for _ in range(3):   # warm-up: threads, rings, first touches
            for src, reg, pool in zip(sources, regions, pools):
                src.wait(src.submit(_random_reads(min(64, reg[0].pages, pool.capacity), reg[0].pages, rng), pool))
        for _ in range(runs):
            counts = [int(rng.integers(1, min(m, r[0].pages) + 1)) for m, r in zip(max_pages, regions)]
            reads = [_random_reads(n, r[0].pages, rng) for n, r in zip(counts, regions)]
            t0 = time.perf_counter()
            tickets = []
            for src, q, pool in zip(sources, reads, pools):
                lag = time.perf_counter() - t0   # a later layer is submitted after the earlier ones: same clock
                tickets.append((src.submit(q, pool), lag))
            t_ms.append([src.wait(t).read_us / 1e3 + lag * 1e3 for src, (t, lag) in zip(sources, tickets)])
            pages_drawn.append(counts)
    finally:
        for src in sources:
            src.close()
    return ReadRuns(tier, tuple(int(l) for l in layers), np.asarray(pages_drawn, dtype=np.float64),
                    np.asarray(t_ms, dtype=np.float64))


def read_fit(tier: str, manifest, layers: Sequence[int], *, runs: int = 45,
             max_pages: Sequence[int] = (3000, 3000), options=None, seed: int = 0, holds_table: bool | None = None,
             measured: str = "", rank: int = 0) -> TierReadFit:
    """Measure `tier` on `manifest`'s regions of `layers` and fit its device read model (module docstring).

    Worked example: runs whose reads took T_first = 0.3 + 0.02 P_first + 0.01 P_second and T_second = 0.3 +
    0.02 P_second + 0.015 P_first ms give DeviceReadModel(0.3, 0.02, 0.015, 0.01).
    """
    if runs < MIN_READ_FIT_RUNS:
        raise SlackTierError(ErrorKind.BAD_INPUT, f"runs: {runs} read-fit runs",
                             fix=f"use at least {MIN_READ_FIT_RUNS} runs ({MIN_FIT_RUNS} to fit, the rest held out)")
    measured_runs = measure_reads(tier, manifest, layers, runs=runs, max_pages=max_pages, options=options, seed=seed,
                                  rank=rank)
    fit = fit_device_read_model(measured_runs.pages, measured_runs.read_ms)
    held = fit.held_out
    record = ReadFitRecord(fit.fit_runs, fit.quality.r2, fit.quality.rmse_ms, runs - fit.fit_runs,
                           held.r2 if held else float("nan"), held.rmse_ms if held else float("nan"),
                           fit.at_zero, measured)
    spec = TierSpec(tier, fit.model, holds_table=in_host_memory(tier) if holds_table is None else holds_table,
                    fit=record)
    return TierReadFit(spec, fit, measured_runs)


def describe_fit(f: TierReadFit) -> str:
    """One paragraph a person reads (lines of at most 120 characters): the fitted terms, b/c, and the fit's quality
    in-sample and held out."""
    m, q, h = f.spec.read, f.fit.quality, f.fit.held_out
    first, second = f.runs.layers[:2]
    held = "none held out" if h is None else f"held-out {h.runs} reads: R^2 {h.r2:.3f}, RMSE {h.rmse_ms:.3f} ms"
    zero = f"; held at 0: {', '.join(f.fit.at_zero)}" if f.fit.at_zero else ""
    import textwrap

    return textwrap.fill(f"{f.spec.name}: T_l = {m.intercept_ms:.3f} ms + {m.page_ms * 1e3:.2f} us * P_l + "
            f"{m.ahead_page_ms * 1e3:.2f} us * P_ahead + {m.behind_page_ms * 1e3:.2f} us * P_behind "
            f"(b = {m.page_ms * 1e3:.2f}, c = {m.ahead_page_ms * 1e3:.2f} us/page, c/b = {m.ahead_over_page:.2f}); "
            f"layers {first} then {second}, {f.fit.fit_runs} fit runs ({q.runs} reads): R^2 {q.r2:.3f}, "
            f"RMSE {q.rmse_ms:.3f} ms; {held}{zero}", 120, subsequent_indent="  ", break_on_hyphens=False)


def fit_warning(f: TierReadFit) -> str | None:
    """A warning line when the fit's held-out R^2 is below TRUSTED_HELD_OUT_R2 (or nothing was held out)."""
    h = f.fit.held_out
    if h is not None and h.r2 >= TRUSTED_HELD_OUT_R2:
        return None
    said = "no runs were held out" if h is None else f"held-out R^2 {h.r2:.2f} is below {TRUSTED_HELD_OUT_R2}"
    import textwrap

    return textwrap.fill(f"WARNING {f.spec.name}: {said}: the model predicts reads it was not fitted on poorly, so "
                         "plans built on it may miss; rerun with more --read-runs on a quiet machine, and look at "
                         "the fit's plot", 120, subsequent_indent="  ")


def predicted_read_ms(f: TierReadFit) -> np.ndarray:
    """The fitted model's read time of every measured read: [runs, layers], as `runs.read_ms`."""
    from slacktier.plan.fit import device_design

    m = f.spec.read
    coef = np.array([m.intercept_ms, m.page_ms, m.ahead_page_ms, m.behind_page_ms])
    return (device_design(f.runs.pages) @ coef).reshape(f.runs.read_ms.shape)


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


def _random_reads(n: int, region_pages: int, rng: np.random.Generator):
    from slacktier.store.base import PageReads

    pages = np.sort(rng.choice(region_pages, size=n, replace=False)).astype(np.int64)
    return PageReads(region=np.zeros(n, dtype=np.int32), page=pages, buffer=np.arange(n, dtype=np.int32))
