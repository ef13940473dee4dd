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


__all__ = ["TP_RANK_FIELD", "check_ple_layout", "close_engines", "control_path", "ending_on_error", "ending_step",
           "finish_step", "layer_in_prefix"]
