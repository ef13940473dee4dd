"""vLLM plug-in, shared part: version and scope checks, one worker's binding (control file, engine), step ends.

adapters.vllm (DeepSeek-V4.1's Engram tables) and adapters.vllm_ple (Qwen3.8's
PLE tables) patch vLLM's classes (`wrap`); both build their tables through
`bind`, find the worker's binding with `current` and end steps with `step`. The
settings, what is refused and why: adapters.vllm's module docstring and
docs/integrating.md.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from slacktier.adapters import close_engines, control_path, ending_step, finish_step, report_unchecked
from slacktier.config import ControlFile, TableConfig, load_control, tier_facts
from slacktier.engine import StepEngine
from slacktier.errors import ErrorKind, SlackTierError
from slacktier.tables.manifest import Manifest
from slacktier.tables.tp_sharding import VLLM, check_staged_for

log = logging.getLogger(__name__)

CHECKED_VERSION = "0.33.0"
CONTROL_ENV = "SLACKTIER_VLLM_CONTROL"


def check_version(found: str) -> None:
    """Refuse a vLLM the plug-in was not checked against (UNSUPPORTED, naming the fix)."""
    if found != CHECKED_VERSION:
        raise SlackTierError(ErrorKind.UNSUPPORTED, f"vLLM {found or '(none)'} is installed; the SlackTier plug-in "
                             f"was checked against vLLM {CHECKED_VERSION} only (it replaces Engram's seams)",
                             fix=f"pip install vllm=={CHECKED_VERSION}, or unset {CONTROL_ENV} to serve with vLLM's "
                             "own tables")


def installed_version() -> str:
    """The installed vLLM's version ("" when it is not installed)."""
    try:
        return metadata.version("vllm")
    except metadata.PackageNotFoundError:
        return ""


@dataclass(frozen=True)
class VllmServing:
    """The vLLM settings the plug-in's scope depends on, as one worker sees them at start-up."""

    version: str
    tp_size: int
    tp_rank: int
    pp_size: int = 1
    dp_size: int = 1
    pcp_size: int = 1                  # prefill_context_parallel_size
    enforce_eager: bool = True
    cudagraph_mode: str = "NONE"       # compilation_config.cudagraph_mode's name (NONE under --enforce-eager)
    breakable: bool = False            # VLLM_USE_BREAKABLE_CUDAGRAPH: piecewise graphs as breakable captures
    embedding_across_dp: bool = False
    decode_backend: str = "auto"       # additional_config["decode_backend"]
    speculative: bool = False
    rocm: bool = False


def check_scope(s: VllmServing, hash_columns: int, table: str = "Engram") -> None:
    """Refuse (UNSUPPORTED) settings outside the first version's scope, all of them in one error.

    `table` is "Engram" or "PLE" (adapters.vllm_ple), which adds TP 1 only.
    """
    check_version(s.version)
    found: list[tuple[str, str]] = []
    if table == "PLE" and s.tp_size != 1:
        found.append((f"a PLE table at TP {s.tp_size} (vLLM's VocabParallelEmbedding splits the padded table into "
                      "equal row blocks over the ETP group, not SlackTier's rank regions)",
                      'TP 1, or source = "dram" on the PLE table to keep vLLM\'s own table'))
    if not s.enforce_eager:
        found.extend(graph_refusals(s, table))
    if hash_columns % s.tp_size:
        sizes = [n for n in range(1, hash_columns + 1) if hash_columns % n == 0]
        found.append((f"TP {s.tp_size} leaves ranks with unequal hash heads", f"a TP size in {sizes}"))
    if s.pp_size != 1:
        found.append((f"pipeline parallelism (size {s.pp_size})", "--pipeline-parallel-size 1"))
    if s.pcp_size != 1:
        found.append((f"prefill context parallelism (size {s.pcp_size})", "--prefill-context-parallel-size 1"))
    if s.embedding_across_dp and s.dp_size > 1:
        found.append(("Engram tables sharded across DP ranks", "engram_config.embedding_across_dp = false"))
    if s.decode_backend != "auto":
        found.append((f"decode_backend {s.decode_backend!r}", 'additional_config decode_backend "auto"'))
    if s.speculative:
        found.append(("speculative decoding", "no --speculative-config"))
    if s.rocm:
        found.append(("ROCm (its DeepSeek-V4.1 model file was not checked)", "a CUDA platform"))
    if found:
        raise SlackTierError(ErrorKind.UNSUPPORTED, "vLLM settings outside the SlackTier plug-in's first version: "
                             + "; ".join(what for what, _ in found),
                             fix="; ".join(fix for _, fix in found) + f" (or unset {CONTROL_ENV})")


#: the cudagraph modes whose graphs, under VLLM_USE_BREAKABLE_CUDAGRAPH, are all breakable (no full graph)
BREAKABLE_MODES = ("NONE", "PIECEWISE")


def graph_refusals(s: VllmServing, table: str) -> list[tuple[str, str]]:
    """What a worker that is not eager refuses of its graph settings: (what, fix) pairs, none when served.

    Engram and PLE tables run under vLLM's breakable graphs (the plug-in's calls are eager breaks: adapters.vllm,
    adapters.vllm_ple): a piecewise-only cudagraph mode with VLLM_USE_BREAKABLE_CUDAGRAPH=1. A full graph replays
    its kernels only, so begin_step's CPU pass, each layer's wait and end_step would run once, at capture."""
    fix = "VLLM_USE_BREAKABLE_CUDAGRAPH=1 and -cc.cudagraph_mode=PIECEWISE (or --enforce-eager)"
    if not s.breakable:
        return [(f"CUDA graphs (cudagraph_mode {s.cudagraph_mode}) without VLLM_USE_BREAKABLE_CUDAGRAPH=1: piecewise "
                 "graphs would be torch.compile's, full ones replay kernels only, and the plug-in's hooks are Python "
                 "that must run at every step", fix)]
    if s.cudagraph_mode not in BREAKABLE_MODES:
        return [(f"full CUDA graphs (cudagraph_mode {s.cudagraph_mode}): a full graph replays its kernels only, so "
                 "begin_step's CPU pass, each layer's wait and end_step would run once, at capture", fix)]
    return []


def read_serving(vllm_config: Any) -> VllmServing:
    """This worker's settings from vLLM's config and its TP group."""
    import vllm.envs as envs
    from vllm.distributed import get_tensor_model_parallel_rank
    from vllm.platforms import current_platform

    p = vllm_config.parallel_config
    extra = vllm_config.additional_config
    engram = vllm_config.engram_config
    return VllmServing(
        version=installed_version(), tp_size=int(p.tensor_parallel_size), tp_rank=int(get_tensor_model_parallel_rank()),
        pp_size=int(p.pipeline_parallel_size), dp_size=int(p.data_parallel_size),
        pcp_size=int(p.prefill_context_parallel_size), enforce_eager=bool(vllm_config.model_config.enforce_eager),
        cudagraph_mode=_mode_name(vllm_config), breakable=bool(envs.VLLM_USE_BREAKABLE_CUDAGRAPH),
        embedding_across_dp=bool(engram is not None and engram.embedding_across_dp),
        decode_backend=str(extra.get("decode_backend", "auto")) if isinstance(extra, dict) else "auto",
        speculative=vllm_config.speculative_config is not None, rocm=bool(current_platform.is_rocm()))


def _mode_name(vllm_config: Any) -> str:
    """The cudagraph mode's name; NONE under --enforce-eager (vLLM resolves it so) or where none is set."""
    if vllm_config.model_config.enforce_eager:
        return "NONE"
    mode = getattr(getattr(vllm_config, "compilation_config", None), "cudagraph_mode", None)
    return "NONE" if mode is None else str(getattr(mode, "name", mode))


def eager_break(body: Callable[..., None]) -> Callable[..., None]:
    """`body` as an eager break of vLLM's breakable CUDA graphs (its own `eager_break_during_capture`): under a
    capture it ends the segment, runs once, and is recorded to run again between the segments at every replay;
    anywhere else it simply runs. It writes its results into buffers it is given and returns None. Inside a full
    CUDA graph (refused at start-up; vLLM runs breaks inline there) it refuses to run rather than be captured."""
    from vllm.compilation.breakable_cudagraph import eager_break_during_capture

    @functools.wraps(body)
    def checked(*args: Any, **kwargs: Any) -> None:
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise SlackTierError(ErrorKind.UNSUPPORTED, f"SlackTier's {body.__name__} ran inside a CUDA graph capture "
                                 "that is not vLLM's breakable one: its host work would run once, at capture",
                                 fix="VLLM_USE_BREAKABLE_CUDAGRAPH=1 and -cc.cudagraph_mode=PIECEWISE")
        body(*args, **kwargs)

    return eager_break_during_capture(checked)


@dataclass
class Binding:
    """One worker's control file and the engine serving its non-DRAM tables."""

    path: Path
    control: ControlFile
    serving: VllmServing
    engine: StepEngine | None
    pending: dict[int, torch.Tensor] = field(default_factory=dict)   # this step's ids, per served layer

    def table(self, layer: int) -> TableConfig | None:
        for t in self.control.tables:
            if t.layer == layer:
                return t
        return None

    def collect(self, layer: int, ids: torch.Tensor) -> None:
        """One layer's [T, C] ids (the rank's columns); begin_step once every served layer's are in."""
        engine = self.engine
        assert engine is not None
        if layer in self.pending:
            raise SlackTierError(ErrorKind.BAD_INPUT, f"layer {layer}'s ids arrived twice in one step", layer=layer,
                                 fix="one forward looks each table layer up once")
        report_unchecked()
        self.pending[layer] = ids
        if len(self.pending) < len(engine.layers):
            return
        ids = torch.stack([self.pending[layer] for layer in engine.ids_layers], dim=1)   # [T, L, 24 / TP]
        self.pending.clear()
        engine.begin_step(np.ascontiguousarray(ids.detach().to("cpu").numpy(), dtype=np.int64),
                          decode=decode_flags(ids.shape[0]))


_BINDINGS: dict[Path, Binding] = {}


def bind(hash_columns: int, table: str = "Engram") -> Binding | None:
    """This worker's binding, built (checks, engine) on its first table; `table` "Engram" or "PLE"."""
    template = os.environ.get(CONTROL_ENV)
    if not template:
        return None
    from vllm.config import get_current_vllm_config

    serving = read_serving(get_current_vllm_config())
    path = control_path(template, serving.tp_rank)
    found = _BINDINGS.get(path)
    if found is not None:
        return found
    check_scope(serving, hash_columns, table)
    cfg = load_control(path)
    served = tuple(t for t in cfg.tables if not tier_facts(t.source).holds_host_copy)
    if serving.tp_size > 1:
        for t in served:
            if t.rank != serving.tp_rank:
                raise SlackTierError(ErrorKind.BAD_INPUT, f"{path}: at TP {serving.tp_size} rank {serving.tp_rank} "
                                     f"serves its own region, but layer {t.layer} has rank = {t.rank}", layer=t.layer,
                                     fix=f"one control file per rank with rank = {serving.tp_rank} on every table "
                                     f"(stage with --ranks {serving.tp_size}); {CONTROL_ENV} takes {{tp_rank}} in its "
                                     "path to give each rank its own file")
            check_staged_for(Manifest.load(t.manifest), str(path), VLLM, serving.tp_size, serving.tp_rank, t.layer)
    heads = -(-hash_columns // serving.tp_size)
    # vLLM's own lookup reads an E8M0 byte 0x00 as 0.0 and fills rows it does not hold with +0.0: the engine's
    # rows follow it ("vllm" convention), so the plug-in equals vLLM's stock rows, not SGLang's.
    engine = (StepEngine.from_config(ControlFile(engine=cfg.engine, tables=served), columns=heads, convention="vllm")
              if served else None)
    binding = _BINDINGS[path] = Binding(path, cfg, serving, engine)
    log.info("SlackTier serves %s layers %s of TP rank %d from %s; layers %s stay on vLLM's tables",
             table, [t.layer for t in served], serving.tp_rank, path,
             [t.layer for t in cfg.tables if tier_facts(t.source).holds_host_copy])
    return binding


def loaded_from() -> str:
    """The checkpoint vLLM loads (its model), as identity refusals name it."""
    try:
        from vllm.config import get_current_vllm_config

        return str(get_current_vllm_config().model_config.model)
    except (ImportError, AttributeError, ValueError, RuntimeError):
        return "the checkpoint vLLM loads"


def current() -> Binding | None:
    template = os.environ.get(CONTROL_ENV)
    if not template or not _BINDINGS:
        return None
    from vllm.distributed import get_tensor_model_parallel_rank

    return _BINDINGS.get(control_path(template, get_tensor_model_parallel_rank()))


def _end() -> None:
    """end_step of this worker's open step (its ids collected so far dropped)."""
    binding = current()
    if binding is not None:
        binding.pending.clear()
        finish_step(binding.engine, False)


@functools.cache
def end_break() -> Callable[[], None]:
    """end_step as an eager break, for the end of a patched model forward (built on first use: vLLM is imported
    lazily)."""
    return eager_break(_end)


@contextmanager
def step() -> Iterator[None]:
    """End this worker's step after the block, also when it raised: the patched DeepseekV4Model.forward is
    `with step(): original forward`; a forward of one's own (a check script) can use it too."""
    binding = current()
    if binding is None:
        yield
        return
    with ending_step(binding.engine, binding.pending.clear):
        yield


def wrap(original: Callable[..., Any], hook: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def patched(*args: Any, **kwargs: Any) -> Any:
        return hook(original, *args, **kwargs)

    patched.__slacktier__ = True
    return patched


def close() -> None:
    """Close every engine this process built (tests; a worker ends with its engines)."""
    close_engines(_BINDINGS)


__all__ = ["BREAKABLE_MODES", "CHECKED_VERSION", "CONTROL_ENV", "Binding", "VllmServing", "bind", "check_scope",
           "check_version", "close", "current", "eager_break", "end_break", "graph_refusals", "installed_version",
           "read_serving", "step", "wrap"]


def decode_flags(tokens: int) -> np.ndarray | None:
    """Per token of vLLM's batch in flight, whether it is a decode token: [tokens] bool, or None (unknown).

    vLLM puts a batch's decode tokens first, and the DeepSeek-V4.1 attention's metadata counts them
    (`num_decode_tokens`, which its kernels slice the batch by); read from the forward context, as set for
    this forward (also at a graph replay's breaks). No forward context, or no metadata that counts them:
    None, which the engine takes as all decode (its admission rule then leaves the step as it is).
    Worked example: 5 tokens, num_decode_tokens 2 -> [True, True, False, False, False]."""
    try:
        from vllm.forward_context import get_forward_context, is_forward_context_available
    except ImportError:
        return None
    if not is_forward_context_available():
        return None
    meta = get_forward_context().attn_metadata
    if not isinstance(meta, dict):   # none, or a list per micro-batch
        return None
    for m in meta.values():
        n = getattr(m, "num_decode_tokens", None)
        if isinstance(n, int) and not isinstance(n, bool) and 0 <= n <= tokens:
            flags = np.zeros(tokens, dtype=bool)
            flags[:n] = True
            return flags
    return None
