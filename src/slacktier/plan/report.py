"""What a person reads about a plan: the placement table the CLI prints and the control file's header comment."""

from __future__ import annotations

from pathlib import Path
from typing import Mapping, Sequence

from slacktier.plan.types import Plan


def plan_comment(plan: Plan) -> str:
    """The predictions as comment lines for the control file (`config.write_control(..., comment=...)`)."""
    lines = ["SlackTier control file written by `slacktier plan`.",
             f"predicted slowdown {plan.slowdown_ms:.4f} ms per step (target {plan.target_ms:.4f} ms, "
             f"kappa {plan.kappa_ms:.4f} ms, resolve {plan.resolve_ms:.4f} ms)",
             f"host memory {plan.host_bytes} bytes ({plan.host_bytes / 2**30:.3f} GiB)"]
    lines += [f"layer {t.layer} on {t.source}: window {t.window_ms:.4f} ms, {t.pages_per_step:.2f} pages/step "
              f"behind {t.cache_rows:.0f} cache rows, read {t.read_ms:.4f} ms, stall {t.stall_ms:.4f} ms, "
              f"host {t.host_bytes} bytes" for t in plan.tables]
    return "\n".join(lines)


def format_plan(plan: Plan) -> str:
    """The verdict in words, then the placement as a table, one row per table in window order, then the totals."""
    lines = [*plan_verdict(plan), ""]
    lines += [f"{'layer':>5} {'order':>5} {'tier':>6} {'share':>7} {'window ms':>9} {'pages/step':>10} "
              f"{'read ms':>8} {'stall ms':>8} {'host GiB':>9}"]
    lines += [f"{t.layer:>5} {t.order:>5} {t.source:>6} {t.cache_share:>7.4f} {t.window_ms:>9.3f} "
              f"{t.pages_per_step:>10.1f} {t.read_ms:>8.3f} {t.stall_ms:>8.3f} {t.host_bytes / 2**30:>9.3f}"
              for t in plan.tables]
    lines.append(f"predicted slowdown {plan.slowdown_ms:.3f} ms per step (target {plan.target_ms:.3f}); host memory "
                 f"{plan.host_bytes / 2**30:.3f} GiB; {plan.assignments_feasible} of {plan.assignments_tried} "
                 f"placements meet the target")
    return "\n".join(lines)


def in_host_memory(tier: str) -> bool:
    """Whether a tier serves from a copy in host memory (the DRAM tier); a tier name no control file knows is not."""
    from slacktier.config import tier_facts
    from slacktier.errors import SlackTierError

    try:
        return tier_facts(tier).device_kind == "host"
    except SlackTierError:
        return False


def _table_words(t) -> str:
    where = "in DRAM" if in_host_memory(t.source) else f"on {t.source}"
    cache = (f" behind {t.cache_rows:,.0f} cache rows ({100 * t.cache_share:.0f}% of the cache)" if t.cache_rows >= 1
             else "")
    return f"layer {t.layer} {where}{cache}"


def plan_verdict(plan: Plan) -> list[str]:
    """The plan in words, above its table: where each table goes, the predicted cost per step against the target,
    host memory, and that the figures are predictions (the exposure model's), not measurements.

    Worked example: layer 1 on dram, layer 14 on disk, 0.3 ms predicted against 0.5 ms ->
    "Verdict: keep layer 1 in DRAM, layer 14 on disk: predicted +0.300 ms per step, within the 0.500 ms target; ...".
    """
    import textwrap

    keep = "keep " if any(in_host_memory(t.source) for t in plan.tables) else "put "
    words = keep + ", ".join(_table_words(t) for t in sorted(plan.tables, key=lambda t: t.layer))
    within = "within" if plan.slowdown_ms <= plan.target_ms else "OVER"
    text = (f"Verdict: {words}: predicted {plan.slowdown_ms:+.3f} ms per step, {within} the {plan.target_ms:.3f} ms "
            f"target; {plan.host_bytes / 2**30:.3f} GiB of host memory. {plan.assignments_feasible} of "
            f"{plan.assignments_tried} placements meet the target; this one needs the least host memory. A "
            "prediction from the windows, the tiers' read fits and the miss-page curves, not a measurement "
            "(`slacktier whatif` measures a placement).")
    return textwrap.wrap(text, 120, subsequent_indent="  ", break_on_hyphens=False)


def plot_plan(plan: Plan, points: Sequence[tuple[int, Plan]], path: str | Path,
              others: Mapping[str, Sequence[tuple[int, Plan]]] | None = None) -> Path:
    """Predicted stall per step against the cache budget for the plan's placement (total and per table), and for
    `others` (label -> points, e.g. every table on disk) beside it; the target as a line, the planned budget
    marked."""
    from slacktier.errors import optional_import

    matplotlib = optional_import("matplotlib", "workloads", "the plan's PNG plot (or pass --no-plot)")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [c for c, _ in points]
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    ax.plot(xs, [p.slowdown_ms for _, p in points], marker="o", ms=4, color="k", lw=2,
            label="this plan: predicted slowdown")
    for i, t in enumerate(plan.tables):
        ax.plot(xs, [p.tables[i].stall_ms for _, p in points], ls="--", lw=1,
                label=f"stall at layer {t.layer} ({t.source})")
    for label, pts in (others or {}).items():
        ax.plot([c for c, _ in pts], [p.slowdown_ms for _, p in pts], marker="s", ms=3, lw=1, label=label)
    ax.axhline(plan.target_ms, color="tab:red", lw=1, ls=":", label=f"target {plan.target_ms:g} ms")
    ax.axvline(plan.cache_rows, color="0.6", lw=1, label=f"planned cache {plan.cache_rows:,} rows")
    positive = [c for c in xs if c > 0]
    if positive:   # geometric budgets, with 0 (no cache) kept on the axis's linear stretch near it
        ax.set_xscale("symlog", linthresh=min(positive))
        ax.set_xlim(0, max(xs) * 1.1)
    ax.set_xlabel("cache budget (rows; 0 = no cache)")
    ax.set_ylabel("predicted stall per step (ms)")
    where = ", ".join(f"L{t.layer} {t.source}" for t in plan.tables)
    ax.set_title(f"plan: {where}; stall against cache size", fontsize=10)
    top = max([plan.target_ms, *(p.slowdown_ms for _, p in points)])
    other_ms = [p.slowdown_ms for pts in (others or {}).values() for _, p in pts]
    if other_ms:   # the alternatives shown up to 3x the target, so this plan's line stays readable
        top = max(top, min(3 * top, max(other_ms)))
    ax.set_ylim(0, 1.15 * top if top > 0 else 1.0)
    ax.legend(fontsize=8)
    return save_figure(fig, path)


def save_figure(fig, path: str | Path) -> Path:
    """Lay out, write (creating its folder) and close a matplotlib figure as a PNG; the path written."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(p, dpi=120)
    plt.close(fig)
    return p
