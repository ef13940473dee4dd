"""SGLang plug-in, shared part: version and scope checks, one rank's binding (control file, engine), step ends.

adapters.sglang (DeepSeek-V4.1's Engram tables) and adapters.sglang_ple
(Qwen3.8's PLE tables) hook SGLang's classes; both build their tables through
`bind`, find the process's binding with `current` and end steps with `step` /
`end_step`. The settings, what is refused and why: adapters.sglang's module
docstring and docs/integrating.md.
"""

from __future__ import annotations

import functools
import logging
import os
import pkgutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np
import torch

from slacktier.adapters import close_engines, control_path, ending_step, finish_step, report_unchecked
from slacktier.config import ControlFile, TableConfig, load_control, tier_facts
from slacktier.engine import StepEngine
from slacktier.errors import ErrorKind, SlackTierError
from slacktier.tables.manifest import Manifest
from slacktier.tables.tp_sharding import SGLANG, check_staged_for

log = logging.getLogger(__name__)

CHECKED_VERSION = "0.5.23"
CONTROL_ENV = "SLACKTIER_SGLANG_CONTROL"


@dataclass(frozen=True)
class SglangServing:
    """The SGLang settings the plug-in's scope depends on, as one rank's process sees them at start-up."""

    version: str
    tp_size: int
    tp_rank: int
    pp_size: int = 1
    attn_dp_size: int = 1
    attn_cp_size: int = 1
    overlap_schedule: bool = False
    decode_graph: str = "disabled"      # SGLang's cuda_graph_config[decode].backend: full | breakable | disabled
    prefill_graph: str = "disabled"
    speculative: str | None = None      # speculative_algorithm
    two_batch_overlap: bool = False


def check_version(found: str) -> None:
    """Refuse an SGLang the plug-in was not checked against (UNSUPPORTED, naming the fix)."""
    if found != CHECKED_VERSION:
        raise SlackTierError(ErrorKind.UNSUPPORTED, f"SGLang {found} is installed; the SlackTier plug-in was "
                             f"checked against SGLang {CHECKED_VERSION} only (it replaces internals of its Engram "
                             "table)", fix=f"pip install sglang=={CHECKED_VERSION}, or unset {CONTROL_ENV} to serve "
                             "with SGLang's own tables")


#: why the overlap scheduler is refused (docs/integrating.md quotes it)
OVERLAP_REFUSAL = (
    "the overlap scheduler (it launches batch N+1 before batch N's tokens reach the host, but begin_step needs "
    "N+1's hash ids on the host, which SGLang computes on the GPU from N's sampled tokens: the launch would wait "
    "for N to finish, and end_step synchronizes the forward stream before its pinned staging is reused, so no "
    "result processing would overlap a forward; it would run as the non-overlap scheduler does)")


def check_scope(s: SglangServing, hash_columns: int, table: str = "Engram") -> None:
    """Refuse (UNSUPPORTED) settings outside the first version's scope, all of them in one error.

    `table` is "Engram" or "PLE" (adapters.sglang_ple): PLE adds TP 1 only. Engram tables run under breakable CUDA
    graphs (the plug-in's calls are eager breaks: adapters.sglang); full graphs are refused for both, and PLE
    keeps graphs off (module docstring of adapters.sglang_ple).
    """
    check_version(s.version)
    found: list[tuple[str, str]] = []
    if table == "PLE" and s.tp_size != 1:
        found.append((f"a PLE table at TP {s.tp_size} (SGLang's VocabParallelEmbedding splits the padded table "
                      "into equal row blocks, not SlackTier's rank regions)",
                      'TP 1, or source = "dram" on the PLE table to keep SGLang\'s own host table'))
    if s.pp_size != 1:
        found.append((f"pipeline parallelism (pp_size {s.pp_size})", "--pp-size 1"))
    if s.attn_dp_size != 1:
        found.append((f"DP attention (attn_dp_size {s.attn_dp_size})", "run without DP attention"))
    if s.attn_cp_size != 1:
        found.append((f"attention context parallelism (attn_cp_size {s.attn_cp_size})", "attn_cp_size 1"))
    if hash_columns % s.tp_size:
        sizes = [n for n in range(1, hash_columns + 1) if hash_columns % n == 0]
        found.append((f"TP {s.tp_size} does not split the {hash_columns} hash columns into whole heads",
                      f"a TP size in {sizes}"))
    if s.overlap_schedule:
        found.append((OVERLAP_REFUSAL, "--disable-overlap-schedule"))
    for phase, backend in (("decode", s.decode_graph), ("prefill", s.prefill_graph)):
        if backend == "disabled" or (table == "Engram" and backend == "breakable") or (
                table == "PLE" and phase == "prefill" and backend == "breakable"
                and unverified_allowed(BREAKABLE_PLE_PREFILL)):
            continue
        if backend == "full":
            why = (" (a full graph replays its kernels only: begin_step's CPU pass, each layer's wait and end_step "
                   "would run once, at capture)")
            fix = f"--cuda-graph-backend-{phase} breakable" if table == "Engram" else \
                f"--cuda-graph-backend-{phase} disabled"
        elif phase == "prefill":
            why = (" (SGLang runs every PLE call of a prefill as an eager break, so the plug-in's calls would run "
                   "at each replay, but this has not been run on a GPU)")
            fix = f"--cuda-graph-backend-{phase} disabled"
        else:
            why = (" (SGLang captures the PLE prefetch into a decode graph, on its prefetch stream; the plug-in's "
                   "gather is not built as an eager break there)")
            fix = f"--cuda-graph-backend-{phase} disabled"
        found.append((f"{backend} CUDA graphs for {phase}{why}", fix))
    if s.speculative:
        found.append((f"speculative decoding ({s.speculative})", "no --speculative-algorithm"))
    if s.two_batch_overlap:
        found.append(("two-batch overlap", "drop --enable-two-batch-overlap"))
    if found:
        raise SlackTierError(ErrorKind.UNSUPPORTED, "SGLang settings outside the SlackTier plug-in's first version: "
                             + "; ".join(what for what, _ in found),
                             fix="; ".join(fix for _, fix in found) + f" (or unset {CONTROL_ENV})")


#: a scope the plug-in refuses until a GPU run has checked it; the GPU check script opts in through UNVERIFIED_ENV
BREAKABLE_PLE_PREFILL = "breakable-ple-prefill"
UNVERIFIED_ENV = "SLACKTIER_SGLANG_UNVERIFIED"


def unverified_allowed(name: str) -> bool:
    """Whether UNVERIFIED_ENV (a comma-separated list, for GPU checks only) opts in to the unverified scope `name`."""
    return name in {part.strip() for part in os.environ.get(UNVERIFIED_ENV, "").split(",")}


def installed_version() -> str:
    """The installed SGLang's version ("" when it is not installed)."""
    try:
        return metadata.version("sglang")
    except metadata.PackageNotFoundError:
        return ""


def read_serving() -> SglangServing:
    """This process's settings, from SGLang's published runtime context."""
    from sglang.srt.runtime_context import get_exec, get_parallel, get_schedule, get_spec

    try:
        p = get_parallel()
        graphs = get_exec().graph.cuda_graph_config
        return SglangServing(
            version=installed_version(), tp_size=int(p.tp_size), tp_rank=int(p.tp_rank), pp_size=int(p.pp_size),
            attn_dp_size=int(p.attn_dp_size), attn_cp_size=int(p.attn_cp_size),
            overlap_schedule=not get_schedule().disable_overlap_schedule,
            # SGLang resolves a graph config for every server; none is published where nothing is captured
            # (its CPU unit-test contexts).
            decode_graph=graphs.decode.backend if graphs is not None else "disabled",
            prefill_graph=graphs.prefill.backend if graphs is not None else "disabled",
            speculative=get_spec().speculative_algorithm,
            two_batch_overlap=bool(get_exec().overlap.enable_two_batch_overlap))
    except (ValueError, RuntimeError) as exc:
        raise SlackTierError(ErrorKind.UNSUPPORTED, f"SGLang's settings are not published in this process ({exc})",
                             fix="build Engram tables inside an SGLang scheduler process (or a test context "
                             "that publishes its server args and TP rank)") from exc


# ---- one rank's binding: its control file, engine and served layers ------------------------------


@dataclass
class Binding:
    """One rank's control file and the engine serving its non-DRAM tables."""

    path: Path
    control: ControlFile
    serving: SglangServing
    engine: StepEngine | None
    layer_ids: tuple[int, ...] | None          # the hash ids' layer axis (SGLang's layout order)
    axis: list[int] | None = None               # positions of the engine's layers in that axis
    decode: np.ndarray | None = None            # the next begin's per-token decode flags (decode_flags), or None
    adopted: set[int] = field(default_factory=set)
    ple: dict[int, Any] = field(default_factory=dict)   # PLE layer -> its Qwen4ExpNGramEmbedding (adapters.sglang_ple)

    def table(self, layer: int) -> TableConfig | None:
        for t in self.control.tables:
            if t.layer == layer:
                return t
        return None

    def begin(self, hash_ids: torch.Tensor) -> None:
        """begin_step on the engine's layers of SGLang's [T, L, 24] hash ids."""
        engine = self.engine
        if engine is None or hash_ids.shape[0] == 0:
            return
        if self.axis is None:
            order = self.layer_ids
            if order is None or len(order) != hash_ids.shape[1]:
                raise SlackTierError(ErrorKind.UNSUPPORTED, f"hash ids of shape {tuple(hash_ids.shape)} for Engram "
                                     f"layers {order}", fix=f"SGLang {CHECKED_VERSION} builds EngramLayout.from_config "
                                     "before its tables; report this with the model config")
            self.axis = [order.index(layer) for layer in engine.ids_layers]
        report_unchecked()
        ids = hash_ids.detach().to("cpu").numpy()
        if len(self.axis) != ids.shape[1]:
            ids = ids[:, self.axis, :]
        # The flags the hasher's forward left for this step, once: a graph replay runs this break without
        # that forward, so its step (a decode graph's) finds none and counts as decode.
        decode, self.decode = self.decode, None
        if decode is not None and decode.shape[0] != ids.shape[0]:
            decode = None
        engine.begin_step(np.ascontiguousarray(ids, dtype=np.int64), decode=decode)


_BINDINGS: dict[Path, Binding] = {}
_LAYER_IDS: list[tuple[int, ...] | None] = [None]   # the last EngramLayout SGLang built in this process


def record_layer_order(layer_ids: tuple[int, ...]) -> None:
    """The Engram layer order of the layout SGLang built last: the layer axis of the hash ids (adapters.sglang)."""
    _LAYER_IDS[0] = layer_ids


def _rank() -> int:
    from sglang.srt.runtime_context import get_parallel

    return int(get_parallel().tp_rank)


def current() -> Binding | None:
    """This rank's binding if one was made (no engine is built here)."""
    template = os.environ.get(CONTROL_ENV)
    if not template:
        return None
    return _BINDINGS.get(control_path(template, _rank()))


def bind(hash_columns: int, table: str, targets: tuple[tuple[str, str], ...], running: str) -> Binding | None:
    """This rank's binding, built (checks, engine) on its first table; `table` "Engram" or "PLE", whose hooks
    `targets` (module, hook type) must all be applied (`running` is the one calling this). None without the
    variable."""
    template = os.environ.get(CONTROL_ENV)
    if not template:
        return None
    check_version(installed_version())
    serving = read_serving()
    path = control_path(template, serving.tp_rank)
    found = _BINDINGS.get(path)
    if found is not None:
        return found
    check_scope(serving, hash_columns, table)
    _check_patched(targets, running)
    cfg = load_control(path)
    served = tuple(t for t in cfg.tables if not tier_facts(t.source).holds_host_copy)
    if serving.tp_size > 1:
        for t in served:
            if t.rank != serving.tp_rank or not cfg.engine.owned_only:
                raise SlackTierError(ErrorKind.BAD_INPUT, f"{path}: at TP {serving.tp_size} rank {serving.tp_rank} "
                                     f"serves only its own region, but layer {t.layer} has rank = {t.rank} and "
                                     f"owned_only = {str(cfg.engine.owned_only).lower()}", layer=t.layer,
                                     fix=f"one control file per rank: [engine] owned_only = true and rank = "
                                     f"{serving.tp_rank} on every table (stage with --ranks {serving.tp_size}); {CONTROL_ENV} "
                                     f"takes {{tp_rank}} in its path to give each rank its own file")
            check_staged_for(Manifest.load(t.manifest), str(path), SGLANG, serving.tp_size, serving.tp_rank, t.layer)
    engine = (StepEngine.from_config(ControlFile(engine=cfg.engine, tables=served), columns=hash_columns)
              if served else None)
    binding = Binding(path, cfg, serving, engine, _LAYER_IDS[0])
    _BINDINGS[path] = binding
    log.info("SlackTier serves %s layers %s of TP rank %d from %s; layers %s stay on SGLang's tables",
             table, [t.layer for t in served], serving.tp_rank, path,
             [t.layer for t in cfg.tables if tier_facts(t.source).holds_host_copy])
    return binding


def _check_patched(targets: tuple[tuple[str, str], ...], running: str) -> None:
    """Refuse to serve when SGLang did not apply a hook (its HookRegistry logs such a failure and goes on)."""
    for target, _ in targets:
        if target == running:
            continue   # this check is called from it
        try:
            wrapped = hasattr(pkgutil.resolve_name(target), "__wrapped__")
        except (ImportError, AttributeError) as exc:
            raise SlackTierError(ErrorKind.UNSUPPORTED, f"{target} does not resolve ({exc})",
                                 fix=f"install sglang=={CHECKED_VERSION} with its DeepSeek-V4 model") from exc
        if not wrapped:
            raise SlackTierError(ErrorKind.UNSUPPORTED, f"SGLang did not apply the SlackTier hook on {target}",
                                 fix="load plug-ins through SGLang (sglang.srt.plugins.load_plugins) and look for "
                                 "'Failed to apply hooks' in its log")


def loaded_from() -> str:
    """The checkpoint SGLang loads (its model path), as identity refusals name it."""
    try:
        from sglang.srt.runtime_context import get_server_args

        return str(get_server_args().model_path)
    except (ImportError, AttributeError, ValueError, RuntimeError):
        return "the checkpoint SGLang loads"


def eager_break(body: Callable[..., None]) -> Callable[..., None]:
    """`body` as an eager break of SGLang's breakable CUDA graphs (its own `eager_on_graph`): under a capture it
    ends the segment, runs once, and is recorded to run again between the segments at every replay; anywhere else
    it simply runs. Its tensor arguments keep their capture-time addresses (the graph's static buffers), so it
    writes its results into a buffer it is given and returns None. Inside a full CUDA graph (refused at start-up)
    it refuses to run rather than be captured as the kernels of one step."""
    from sglang.srt.model_executor.runner_backend_utils.breakable_cuda_graph import eager_on_graph

    @functools.wraps(body)
    def checked(*args: Any, **kwargs: Any) -> None:
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise SlackTierError(ErrorKind.UNSUPPORTED, f"SlackTier's {body.__name__} ran inside a CUDA graph capture "
                                 "that is not SGLang's breakable one: its host work would run once, at capture",
                                 fix="--cuda-graph-backend-decode breakable (or disabled)")
        body(*args, **kwargs)

    return eager_on_graph(checked)


def skip_rows(param: torch.nn.Parameter, loaded_weight: torch.Tensor) -> None:
    """Weight loader of a served table: its rows are read from SlackTier's regions, the checkpoint's are skipped."""


def end_step() -> None:
    """End this rank's step if one is open (an eager break that closes a step, as in a breakable CUDA graph)."""
    binding = current()
    finish_step(binding.engine if binding is not None else None, False)


@contextmanager
def step() -> Iterator[None]:
    """End this rank's step after the block, also when it raised: the patched DeepseekV4Model.forward is
    `with step(): original forward`; a forward of one's own (a check script, another model) can use it too."""
    binding = current()
    if binding is None:
        yield
        return
    with ending_step(binding.engine):
        yield


def close() -> None:
    """Close every engine this process built (tests; a server process ends with its engines)."""
    close_engines(_BINDINGS)


__all__ = ["BREAKABLE_PLE_PREFILL", "CHECKED_VERSION", "CONTROL_ENV", "OVERLAP_REFUSAL", "UNVERIFIED_ENV", "Binding",
           "SglangServing", "bind", "check_scope", "check_version", "close", "current", "eager_break", "end_step",
           "installed_version", "loaded_from", "read_serving", "record_layer_order", "skip_rows", "step",
           "unverified_allowed"]


def decode_flags(forward_batch: Any, tokens: int) -> np.ndarray | None:
    """Per token of SGLang's forward batch, whether it is a decode token: [tokens] bool, or None (unknown).

    DECODE and TARGET_VERIFY batches are decode tokens, EXTEND batches prefill tokens; a MIXED batch (chunked
    prefill with the running requests mixed in) holds both: a request extended by one token is a running
    request's decode token. A batch whose lengths do not add up to `tokens` says None, which the engine
    takes as all decode (its admission rule then leaves the step as it is).
    Worked example: MIXED, extend_seq_lens_cpu [3, 1, 1] -> [False, False, False, True, True]."""
    mode = getattr(forward_batch, "forward_mode", None)
    if mode is None:
        return None
    if mode.is_decode() or mode.is_target_verify():
        return np.ones(tokens, dtype=bool)
    if mode.is_mixed():
        lens = getattr(forward_batch, "extend_seq_lens_cpu", None)
        if lens is None or sum(lens) != tokens:
            return None
        lens = np.asarray(lens, dtype=np.int64)
        return np.repeat(lens == 1, lens)
    if mode.is_extend():
        return np.zeros(tokens, dtype=bool)
    return None
