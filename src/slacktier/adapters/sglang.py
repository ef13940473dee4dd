"""SGLang plug-in: DeepSeek-V4.1's Engram tables served by the step engine inside SGLang's own forward.

Turning it on (each TP rank's scheduler process loads it from the
`sglang.srt.plugins` entry-point group; `SGLANG_PLUGINS=slacktier` allowlists it):

    SLACKTIER_SGLANG_CONTROL=/etc/slacktier/rank{tp_rank}.toml python -m sglang.launch_server ...

Without the variable the plug-in registers nothing. With it, each rank loads
its own control file (`{tp_rank}` is replaced by the process's TP rank) and:

- a table the control file places in host DRAM (`source = "dram"`) is left to
  SGLang's stock table and gather: SlackTier's DRAM tier copies whole 4 KiB
  pages for 264 B rows, several times the cost of SGLang's own row gather;
- every other table allocates no rows in SGLang (zero-row `weight`/`scale`
  parameters whose loader skips the checkpoint's copy), its rows come from
  `StepEngine.gather(layer)`, which replaces `EngramEmbedding._owned_rows`, so
  SGLang's all-reduce stays its own; rows another rank owns are +0.0 (SGLang's
  own fill), so each rank's output, and the TP sum, equal the stock path's bit
  for bit.

Patched through SGLang's `HookRegistry`, checked against SGLang 0.5.23 (any
other version is refused at start-up, when the first Engram table is built):

| target | hook | what it does |
|---|---|---|
| `sglang.srt.layers.engram.EngramLayout.from_config` | AFTER | records the model's Engram layer order (the hash ids' layer axis) |
| `sglang.srt.layers.engram.EngramEmbedding.__init__` | AROUND | a served table: checks, zero-row parameters, no-op loader; others stock |
| `sglang.srt.layers.engram.EngramEmbedding._owned_rows` | AROUND | a served table: `gather(layer)`, +0.0 in rows of other ranks |
| `sglang.srt.layers.engram.EngramHasher.forward` | AFTER | `begin_step(hash ids)` as soon as the step's ids exist |
| `sglang.srt.models.deepseek_v4.DeepseekV4Model.forward` | AROUND | `end_step()` after the forward, also when it raised |

A served table's `__init__` sets the attributes SGLang 0.5.23's own
`EngramEmbedding` methods read (dim, tp_size, row_start, rows, host_table,
peer, staged_by_scheduler, _sort_host_reads): that coupling to one version's
internals is why another version is refused rather than tried.

First version's scope (anything else is refused at start-up with
SlackTierError kind UNSUPPORTED naming the setting and its fix): pipeline,
attention-DP and attention-CP sizes 1; a TP size dividing the 24 hash columns
(ranks own whole heads, as SlackTier's rank regions); the overlap scheduler off
(`--disable-overlap-schedule`); no CUDA graphs for decode or prefill (the
wait in `gather` and the CPU pass of `begin_step` cannot be captured; SGLang's
breakable graphs would need both as eager breaks and `end_step` at each replay,
not yet checked on a GPU); no speculative decoding; no two-batch overlap. At
TP > 1 each rank's control file serves that rank's region (`rank = N`,
`owned_only = true`), staged with `--ranks TP`; a region that is not SGLang's
shard of the table, or a table staged for another hash layout, is refused.

Qwen3.8's PLE tables (`Qwen4ExpPinnedHostEmbedding`) are served by the same
entry point, variable and control file: adapters.sglang_ple (its hooks are in
its PATCHED; `check_scope(..., "PLE")` adds TP 1 only).

Rank partitions (tables.partition): a table staged with `--partition balanced`
(and `partition = "balanced"` on its [[table]]s) gives every rank as many heads
of each n-gram order instead of SGLang's contiguous columns, so no rank reads
most of the step's pages. SGLang's all-reduce sums whatever each rank fills, so
nothing else changes: each rank's `_owned_rows` is its partition's columns'
rows, +0.0 in the others, and the TP sum is the stock one bit for bit.
"""

from __future__ import annotations

import logging
import os
import pkgutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from slacktier.adapters import close_engines, control_path, ending_step, finish_step
from slacktier.config import ControlFile, TableConfig, load_control, tier_facts
from slacktier.engine import StepEngine
from slacktier.errors import ErrorKind, SlackTierError
from slacktier.tables.manifest import Manifest, check_tp_sharding

log = logging.getLogger(__name__)

CHECKED_VERSION = "0.5.23"
CONTROL_ENV = "SLACKTIER_SGLANG_CONTROL"

LAYOUT_FROM_CONFIG = "sglang.srt.layers.engram.EngramLayout.from_config"
EMBEDDING_INIT = "sglang.srt.layers.engram.EngramEmbedding.__init__"
OWNED_ROWS = "sglang.srt.layers.engram.EngramEmbedding._owned_rows"
HASHER_FORWARD = "sglang.srt.layers.engram.EngramHasher.forward"
MODEL_FORWARD = "sglang.srt.models.deepseek_v4.DeepseekV4Model.forward"
#: every SGLang function the plug-in patches, with its hook type
PATCHED: tuple[tuple[str, str], ...] = ((LAYOUT_FROM_CONFIG, "AFTER"), (EMBEDDING_INIT, "AROUND"),
                                       (OWNED_ROWS, "AROUND"), (HASHER_FORWARD, "AFTER"), (MODEL_FORWARD, "AROUND"))

_FP8_BLOCK = 32   # values per E8M0 scale


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


def check_scope(s: SglangServing, hash_columns: int, table: str = "Engram") -> None:
    """Refuse (UNSUPPORTED) settings outside the first version's scope, all of them in one error.

    `table` is "Engram" or "PLE" (adapters.sglang_ple): PLE adds TP 1 only, and its refusal of graphs names what
    SGLang runs eagerly for PLE (module docstring of adapters.sglang_ple).
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
        found.append(("the overlap scheduler", "--disable-overlap-schedule"))
    for phase, backend in (("decode", s.decode_graph), ("prefill", s.prefill_graph)):
        if backend == "disabled" or (table == "PLE" and phase == "prefill" and backend == "breakable"
                                     and unverified_allowed(BREAKABLE_PLE_PREFILL)):
            continue
        why = ""
        if table == "PLE" and phase == "prefill" and backend == "breakable":
            why = (" (SGLang runs every PLE call of a prefill as an eager break, so the plug-in's calls would run "
                   "at each replay, but this has not been run on a GPU: benchmarks/engine/gpu_checks_plugins.py, "
                   "part ple-bcg)")
        found.append((f"{backend} CUDA graphs for {phase}{why}", f"--cuda-graph-backend-{phase} disabled"))
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
class _Binding:
    """One rank's control file and the engine serving its non-DRAM tables."""

    path: Path
    control: ControlFile
    serving: SglangServing
    engine: StepEngine | None
    layer_ids: tuple[int, ...] | None          # the hash ids' layer axis (SGLang's layout order)
    axis: list[int] | None = None               # positions of the engine's layers in that axis
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
        ids = hash_ids.detach().to("cpu").numpy()
        if len(self.axis) != ids.shape[1]:
            ids = ids[:, self.axis, :]
        engine.begin_step(np.ascontiguousarray(ids, dtype=np.int64))


_BINDINGS: dict[Path, _Binding] = {}
_LAYER_IDS: list[tuple[int, ...] | None] = [None]   # the last EngramLayout SGLang built in this process


def _rank() -> int:
    from sglang.srt.runtime_context import get_parallel

    return int(get_parallel().tp_rank)


def _current() -> _Binding | None:
    """This rank's binding if one was made (no engine is built here)."""
    template = os.environ.get(CONTROL_ENV)
    if not template:
        return None
    return _BINDINGS.get(control_path(template, _rank()))


def _bind(hash_columns: int, table: str = "Engram",
          targets: tuple[tuple[str, str], ...] = PATCHED, running: str = EMBEDDING_INIT) -> _Binding | None:
    """This rank's binding, built (checks, engine) on its first table; `table` "Engram" or "PLE", whose hooks
    `targets` must all be applied (`running` is the one calling this)."""
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
                                     f"{serving.tp_rank} on every table (stage with --ranks {serving.tp_size})")
    engine = (StepEngine.from_config(ControlFile(engine=cfg.engine, tables=served), columns=hash_columns)
              if served else None)
    binding = _Binding(path, cfg, serving, engine, _LAYER_IDS[0])
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


def _skip_rows(param: torch.nn.Parameter, loaded_weight: torch.Tensor) -> None:
    """Weight loader of a served table: its rows are read from SlackTier's regions, the checkpoint's are skipped."""


def _adopt(binding: _Binding, module: torch.nn.Module, num_embeddings: int, dim: int, layer_id: int,
           column_bounds: tuple[int, ...]) -> None:
    """Make `module` a served table: SGLang's own shard rule checked against the engine's, zero-row parameters."""
    from sglang.srt.layers.engram import shard_range

    assert binding.engine is not None
    t = binding.table(layer_id)
    assert t is not None
    s = binding.serving
    start, end = shard_range(num_embeddings, tuple(column_bounds), s.tp_rank, s.tp_size)
    spec = binding.engine.table(layer_id)
    bounds = Manifest.load(t.manifest).layout.column_bounds.get(layer_id)
    if bounds is not None and tuple(bounds) != tuple(column_bounds):
        raise SlackTierError(ErrorKind.BAD_INPUT, f"{t.manifest} was staged for another hash layout than the model's "
                             f"(layer {layer_id}: {len(bounds) - 1} columns ending at row {bounds[-1]}, the model's "
                             f"{len(column_bounds) - 1} ending at {column_bounds[-1]})", layer=layer_id,
                             fix="stage the table from this model's checkpoint (or its config's layout)")
    owned_columns = None
    if t.partition != "columns":
        # Another partition than SGLang's own: the region is not SGLang's shard_range, by design; the manifest
        # must be cut for this TP size, and the rows this rank serves are its partition's columns.
        m = Manifest.load(t.manifest)
        check_tp_sharding(m, s.tp_size, [layer_id])
        if s.tp_size > 1:
            owned_columns = torch.zeros(len(column_bounds) - 1, dtype=torch.bool)
            owned_columns[list(m.partition.columns[s.tp_rank])] = True
    elif (spec.row_start, spec.rows) != (start, end - start):
        raise SlackTierError(ErrorKind.BAD_INPUT, f"layer {layer_id}: {binding.path} serves rows [{spec.row_start}, "
                             f"{spec.row_start + spec.rows}), SGLang's TP {s.tp_size} rank {s.tp_rank} owns "
                             f"[{start}, {end})", layer=layer_id, rank=s.tp_rank,
                             fix=f"stage with --ranks {s.tp_size} and set rank = {s.tp_rank} (TP 1: rank = -1)")
    torch.nn.Module.__init__(module)
    # What SGLang 0.5.23's EngramEmbedding methods read (see the module docstring).
    module.dim = dim
    module.tp_size = s.tp_size
    module.row_start = start
    module.rows = end - start
    module.host_table = None
    module._sort_host_reads = False
    module.staged_by_scheduler = False
    module.peer = None
    module.weight = torch.nn.Parameter(torch.empty(0, dim, dtype=torch.float8_e4m3fn), requires_grad=False)
    module.scale = torch.nn.Parameter(torch.empty(0, dim // _FP8_BLOCK, dtype=torch.float8_e8m0fnu),
                                      requires_grad=False)
    module.weight.weight_loader = _skip_rows
    module.scale.weight_loader = _skip_rows
    module._slacktier_layer = layer_id
    module._slacktier_owned_columns = owned_columns   # [24] bool under a non-columns partition at TP > 1
    binding.adopted.add(layer_id)


# ---- the hooks --------------------------------------------------------------------------------------


def _after_layout(layout: Any, *args: Any, **kwargs: Any) -> None:
    """EngramLayout.from_config: keep its layer order, the order of the hash ids' layer axis."""
    if layout is not None:
        _LAYER_IDS[0] = tuple(int(i) for i in layout.layer_ids)


def _around_embedding_init(original: Callable[..., None], module: torch.nn.Module, num_embeddings: int, dim: int,
                           layer_id: int, column_bounds: tuple[int, ...]) -> None:
    """EngramEmbedding.__init__: a table the control file serves from a non-DRAM tier is adopted."""
    binding = _bind(len(column_bounds) - 1)
    t = binding.table(layer_id) if binding is not None else None
    if binding is not None and t is None:
        raise SlackTierError(ErrorKind.MISSING, f"{binding.path} lists no table for Engram layer {layer_id}",
                             layer=layer_id, fix='add a [[table]] for it (source = "dram" leaves it to SGLang)')
    if t is None or tier_facts(t.source).holds_host_copy:
        original(module, num_embeddings, dim, layer_id, column_bounds)
        return
    _adopt(binding, module, num_embeddings, dim, layer_id, column_bounds)


def _around_owned_rows(original: Callable[..., torch.Tensor], module: torch.nn.Module,
                       indices: torch.Tensor) -> torch.Tensor:
    """EngramEmbedding._owned_rows: a served table's rows from gather, +0.0 where another rank owns the row."""
    layer = module.__dict__.get("_slacktier_layer")
    if layer is None:
        return original(module, indices)
    binding = _current()
    if binding is None or binding.engine is None or not binding.engine.in_step:
        raise SlackTierError(ErrorKind.BAD_INPUT, f"SGLang looked up Engram layer {layer} with no SlackTier step "
                             "open", layer=layer, fix=f"the hasher hook begins each step: check that {HASHER_FORWARD} "
                             f"runs before the layer (the plug-in patches it, with {CONTROL_ENV} set)")
    rows = binding.engine.gather(layer)   # [T, 24, 256] bf16 on the engine's device
    if rows.shape[:2] != indices.shape:
        raise SlackTierError(ErrorKind.BAD_INPUT, f"SGLang looked up ids of shape {tuple(indices.shape)}, the step "
                             f"began with {tuple(rows.shape[:2])}", layer=layer,
                             fix="a step's lookups must be the hash ids its hasher returned (no DP or CP gather)")
    rows = rows.to(indices.device, non_blocking=True)
    if module.tp_size > 1:
        columns = module.__dict__.get("_slacktier_owned_columns")
        if columns is not None:   # a partition other than SGLang's: this rank owns whole columns
            owned = columns.to(indices.device).expand(indices.shape)
        else:
            local = indices - module.row_start
            owned = (local >= 0) & (local < module.rows)
        rows = rows.masked_fill(~owned.unsqueeze(-1), 0.0)   # +0.0, SGLang's own fill (the engine's is -0.0)
    return rows


def _after_hash(hash_ids: torch.Tensor, *args: Any, **kwargs: Any) -> None:
    """EngramHasher.forward: begin_step as soon as the step's hash ids exist."""
    binding = _current()
    if binding is not None:
        binding.begin(hash_ids)


def end_step() -> None:
    """End this rank's step if one is open (an eager break that closes a step, as in a breakable CUDA graph)."""
    binding = _current()
    finish_step(binding.engine if binding is not None else None, False)


@contextmanager
def step() -> Iterator[None]:
    """End this rank's step after the block, also when it raised: the patched DeepseekV4Model.forward is
    `with step(): original forward`; a forward of one's own (a check script, another model) can use it too."""
    binding = _current()
    if binding is None:
        yield
        return
    with ending_step(binding.engine):
        yield


def _around_model_forward(original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """DeepseekV4Model.forward: end_step after it, also when it raised."""
    with step():
        return original(*args, **kwargs)


def register() -> None:
    """The `sglang.srt.plugins` entry point: registers the hooks when SLACKTIER_SGLANG_CONTROL is set."""
    if not os.environ.get(CONTROL_ENV):
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from slacktier.adapters import sglang_ple

    # The tables' constructors refuse an unchecked version when the model is built: SGLang logs and goes on
    # after an error in a plug-in, so raising here alone would leave the stock tables serving silently.
    HookRegistry.register(EMBEDDING_INIT, _around_embedding_init, HookType.AROUND)
    sglang_ple.register_hooks(HookRegistry, HookType, constructors=True)
    check_version(installed_version())
    HookRegistry.register(LAYOUT_FROM_CONFIG, _after_layout, HookType.AFTER)
    HookRegistry.register(OWNED_ROWS, _around_owned_rows, HookType.AROUND)
    HookRegistry.register(HASHER_FORWARD, _after_hash, HookType.AFTER)
    HookRegistry.register(MODEL_FORWARD, _around_model_forward, HookType.AROUND)
    sglang_ple.register_hooks(HookRegistry, HookType, constructors=False)


def close() -> None:
    """Close every engine this process built (tests; a server process ends with its engines)."""
    close_engines(_BINDINGS)


__all__ = ["BREAKABLE_PLE_PREFILL", "CHECKED_VERSION", "CONTROL_ENV", "PATCHED", "UNVERIFIED_ENV", "SglangServing",
           "check_scope", "check_version", "close", "end_step", "installed_version", "read_serving", "register", "step",
           "unverified_allowed"]
