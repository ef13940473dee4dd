"""What a person reads about a plan: the placement table the CLI prints and the control file's header comment."""

from __future__ import annotations

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
    """The placement as a table, one row per table in window order, then the predicted totals."""
    lines = [f"{'layer':>5} {'order':>5} {'tier':>6} {'share':>7} {'window ms':>9} {'pages/step':>10} "
             f"{'read ms':>8} {'stall ms':>8} {'host GiB':>9}"]
    lines += [f"{t.layer:>5} {t.order:>5} {t.source:>6} {t.cache_share:>7.4f} {t.window_ms:>9.3f} "
              f"{t.pages_per_step:>10.1f} {t.read_ms:>8.3f} {t.stall_ms:>8.3f} {t.host_bytes / 2**30:>9.3f}"
              for t in plan.tables]
    lines.append(f"predicted slowdown {plan.slowdown_ms:.3f} ms per step (target {plan.target_ms:.3f}); host memory "
                 f"{plan.host_bytes / 2**30:.3f} GiB; {plan.assignments_feasible} of {plan.assignments_tried} "
                 f"placements meet the target")
    return "\n".join(lines)
