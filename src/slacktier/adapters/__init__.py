"""adapters room: plug-ins that put the step engine inside the serving engines users run.

Each module is one serving engine's plug-in, loaded by that engine's own
plug-in mechanism and inert unless its one environment variable names a
control file (`{tp_rank}` in the path picks the rank's own file):

| module | engine, version checked | entry-point group | variable |
|---|---|---|---|
| `adapters.sglang` | SGLang 0.5.23 | `sglang.srt.plugins` | `SLACKTIER_SGLANG_CONTROL` |
| `adapters.vllm` | vLLM 0.33.0 | `vllm.general_plugins` | `SLACKTIER_VLLM_CONTROL` |

Each engine's PLE part (Qwen3.8's per-layer n-gram table) sits beside it
(`adapters.sglang_ple`, `adapters.vllm_ple`), loaded by the same entry point;
what both parts share (version and scope checks, the rank's binding, step
ends) is in `adapters.sglang_binding` and `adapters.vllm_binding`.

They use the engine's public API only (`StepEngine.from_config`, `begin_step`,
`gather`, `end_step`) and import the serving engine lazily, so importing this
room never imports SGLang or vLLM. How to turn them on, what each supports and
refuses, and what was verified where: docs/integrating.md.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from slacktier.errors import ErrorKind, SlackTierError
from slacktier.tables.identity import IdentityCheck, recorded_identity
from slacktier.tables.manifest import Manifest

if TYPE_CHECKING:
    from slacktier.engine import StepEngine

log = logging.getLogger(__name__)

#: the placeholder a control-file path may carry for the process's tensor-parallel rank
TP_RANK_FIELD = "{tp_rank}"
_LAYER_IN_PREFIX = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def control_path(template: str, tp_rank: int) -> Path:
    """The control file of rank `tp_rank`: "/etc/st/rank{tp_rank}.toml", 2 -> /etc/st/rank2.toml."""
    if not template.strip():
        raise SlackTierError(ErrorKind.BAD_INPUT, "the control-file variable is empty",
                             fix="name a control file, or unset the variable to leave the serving engine alone")
    return Path(template.replace(TP_RANK_FIELD, str(int(tp_rank))))


def layer_in_prefix(prefix: str, engine: str) -> int:
    """The decoder layer id in a serving engine's module prefix: "model.layers.3.ple.ple_embedding" -> 3.

    PLE tables are keyed by it in control files (as models/qwen38.py keys them).
    """
    m = _LAYER_IN_PREFIX.search(prefix)
    if m is None:
        raise SlackTierError(ErrorKind.UNSUPPORTED, f"a PLE table with module prefix {prefix!r} names no decoder "
                             "layer", fix=f"{engine} builds PLE tables under model.layers.N.ple; report this with "
                             "the model config")
    return int(m.group(1))


def check_ple_layout(binding: Any, layer: int, head_sizes: Sequence[int]) -> None:
    """Refuse a served PLE table that is not the model's: other head sizes (the manifest's column bounds, from
    another ngram_vocab_size_base or PLE layer index) or not all its rows. `binding` has path, engine, table()."""
    t = binding.table(layer)
    bounds = tuple(int(v) for v in np.cumsum([0, *head_sizes]))
    staged = Manifest.load(t.manifest).layout.column_bounds.get(layer)
    if staged is not None and tuple(staged) != bounds:
        raise SlackTierError(ErrorKind.BAD_INPUT, f"{t.manifest} was staged for another PLE hash layout than the "
                             f"model's (layer {layer}: {len(staged) - 1} columns ending at row {staged[-1]}, the "
                             f"model's {len(bounds) - 1} ending at {bounds[-1]})", layer=layer,
                             fix="stage the table from this model's checkpoint (its ngram_vocab_size_base and "
                             "PLE layer index)")
    spec = binding.engine.table(layer)
    if (spec.row_start, spec.rows) != (0, bounds[-1]):
        raise SlackTierError(ErrorKind.BAD_INPUT, f"layer {layer}: {binding.path} serves rows [{spec.row_start}, "
                             f"{spec.row_start + spec.rows}), the model's PLE table has rows [0, {bounds[-1]})",
                             layer=layer, fix="stage the whole table (--ranks 1) and set rank = -1")


#: identity checks made since the last step began: each is reported once if its engine's loader never completed it
_PENDING_CHECKS: list[IdentityCheck] = []


def identity_check(manifest: str | Path, layer: int, engine: str, loaded_from: str,
                   parts: tuple[str, ...] = ("values", "scales")) -> IdentityCheck | None:
    """The check a served table's weight loader feeds (tables.identity.IdentityCheck); None, with a warning, for a
    manifest staged before identities were recorded.

    Checkpoint identity: the manifest recorded sampled rows' digests of the rows it staged (a checkpoint's, or a
    synthetic generator's); the engine's loader is handed the checkpoint's tensors, whose rows the table stands
    for, and skips them: the check compares the two before anything is served.
    """
    m = Manifest.load(manifest)
    recorded = recorded_identity(m, layer)
    if recorded is None:
        log.warning("layer %d: %s records no checkpoint identity (staged by an older SlackTier), so the checkpoint "
                    "%s loads is not compared with the table: restage it to record one", layer, manifest, engine)
        return None
    check = IdentityCheck(recorded, engine, loaded_from, parts)
    _PENDING_CHECKS.append(check)
    return check


def checking_loader(check: IdentityCheck | None, part: str, name: str = "") -> Callable[..., None]:
    """A served table's weight loader: the engine hands it the checkpoint's tensor for `part` ("values" or
    "scales"; `name`, the engine's parameter, for messages), compared with the table's identity (`check`;
    None: not recorded), then skipped (the rows are read from SlackTier's regions)."""
    def load(param: Any, loaded_weight: Any, *args: Any, **kwargs: Any) -> None:
        if check is not None:
            check.feed(part, loaded_weight, name=name)

    return load


def report_unchecked() -> None:
    """At the first step after tables were built: warn, naming each, of tables whose checkpoint tensors the
    engine's loader never handed over (dummy weights, or a checkpoint without its tables), so their identity
    was not compared. One list check per step after that."""
    if not _PENDING_CHECKS:
        return
    for check in _PENDING_CHECKS:
        if not check.done:
            r = check.recorded
            missing = check.pending_parts()
            log.warning("layer %d: %s's loader was not handed the whole %s of the table %s stands for (%s), so "
                        "the checkpoint was not compared with it (dummy weights, or a checkpoint without the "
                        "table's tensors)", r.layer, check.engine, " and ".join(missing), r.manifest, r.source)
    _PENDING_CHECKS.clear()


def finish_step(engine: StepEngine | None, failed: bool) -> None:
    """end_step if a step is open; after a failed forward its own error is logged, not raised over the forward's."""
    if engine is None or not engine.in_step:
        return
    if not failed:
        engine.end_step()
        return
    try:
        engine.end_step()
    except SlackTierError as exc:
        log.warning("end_step after a failed forward: %s", exc)


@contextmanager
def ending_step(engine: StepEngine | None, on_failure: Callable[[], object] | None = None) -> Iterator[None]:
    """Run the block (a serving engine's forward), then `finish_step`, also when it raised; `on_failure` first
    when it raised (a plug-in's own per-step state to drop)."""
    failed = True
    try:
        yield
        failed = False
    finally:
        if failed and on_failure is not None:
            on_failure()
        finish_step(engine, failed)


@contextmanager
def ending_on_error(engine: StepEngine) -> Iterator[None]:
    """Run the block (an eager break of a CUDA graph replay); when it raises, end the step first: a replay that
    raises skips the breaks after it, the one that ends the step included."""
    try:
        yield
    except BaseException:
        finish_step(engine, True)
        raise


def close_engines(bindings: dict) -> None:
    """Close the engine of every binding (an object with an `engine`, or None) and forget them all."""
    for binding in bindings.values():
        if binding.engine is not None:
            binding.engine.close()
    bindings.clear()


__all__ = ["TP_RANK_FIELD", "check_ple_layout", "checking_loader", "close_engines", "control_path", "ending_on_error",
           "ending_step", "finish_step", "identity_check", "layer_in_prefix", "report_unchecked"]
