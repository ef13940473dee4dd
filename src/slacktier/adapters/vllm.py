"""vLLM plug-in: DeepSeek-V4.1's Engram tables served by the step engine inside vLLM's own forward.

Turning it on (every worker loads the `vllm.general_plugins` entry point before
it builds the model; `VLLM_PLUGINS=slacktier` allowlists it):

    SLACKTIER_VLLM_CONTROL=/etc/slacktier/rank{tp_rank}.toml vllm serve ... --enforce-eager

Without the variable the plug-in patches nothing. With it, vLLM's `Engram`
(vllm/models/deepseek_v41/common/engram.py) is patched at its seams, checked
against vLLM 0.33.0 (another version is refused when the plug-in loads):

| target | what it does for a table SlackTier serves |
|---|---|
| `Engram._create_embedding` | builds a `ServedTable` instead of vLLM's `ParallelEngramEmbedding`: zero-row `weight` / `weight_scale_inv` whose loader skips the checkpoint's copy, and vLLM's own head shard geometry |
| `Engram.prepare_embeddings` | collects the rank's hash columns of every served layer; `begin_step` once, when the last one arrives |
| `Engram._ready_rows` | fills the persistent `staged_rows` slice from `gather(layer)` and returns it |
| `Engram.embed` | under a partition other than columns, puts the all-gathered columns back in column order |
| `nvidia.model.DeepseekV4Model.forward` | `end_step()` after the forward, also when it raised |

A table placed in host DRAM (`source = "dram"`) keeps vLLM's own table and
lookup. vLLM shards the 24 hash columns (heads) over TP and each rank looks up
its own columns only, then all-gathers them: each rank's control file serves
its own region (`rank = N`, staged with `--ranks TP`), and the engine takes
ids of that rank's columns only ([T, L, 24 / TP]), so no foreign row exists.

Qwen3.8's PLE tables are served by the same entry point, variable and control
file, as a third `Qwen4ExpPLEEmbedding` backend: adapters.vllm_ple (its patched
functions are in its PATCHED; `check_scope(..., "PLE")` adds TP 1 only).

Rank partitions (tables.partition): a table staged with `--partition balanced`
(`partition = "balanced"` on its [[table]]s) gives every rank as many heads of
each n-gram order. Each rank then looks up its partition's columns (not vLLM's
contiguous head shard) and vLLM's all-gather concatenates them in rank order;
the patched `embed` indexes the gathered columns back into column order (one
index_select on the device), so the projection sees vLLM's own layout.

First version's scope, the rest refused at start-up (UNSUPPORTED): eager mode
(`--enforce-eager`: the hooks are Python, outside any torch.compile or CUDA
graph); a TP size dividing the 24 columns; pipeline and prefill-context
parallel sizes 1; tables not sharded across DP ranks (`embedding_across_dp`
with DP > 1 is refused; DP replicas each with their own TP-sharded table are
fine); the stock decode backend (not `latency_specialized`); no speculative
decoding; the CUDA model file (not ROCm's).

What runs on a CPU: vLLM's modules import and the plug-in loads through its
entry point; the head shard geometry is checked against vLLM's own
`ParallelEngramEmbedding` and SlackTier's rank regions; refusals. vLLM's lookup
and hash are Triton kernels, so the rows themselves need a GPU
(benchmarks/engine/gpu_checks_plugins.py).
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

from slacktier.adapters import close_engines, control_path, ending_step
from slacktier.config import ControlFile, TableConfig, load_control, tier_facts
from slacktier.engine import StepEngine
from slacktier.errors import ErrorKind, SlackTierError
from slacktier.tables.manifest import Manifest, check_tp_sharding
from slacktier.tables.partition import RankPartition

log = logging.getLogger(__name__)

CHECKED_VERSION = "0.33.0"
CONTROL_ENV = "SLACKTIER_VLLM_CONTROL"

ENGRAM_MODULE = "vllm.models.deepseek_v41.common.engram"
MODEL_MODULE = "vllm.models.deepseek_v41.nvidia.model"
#: every vLLM function the plug-in patches (module, class, method)
PATCHED: tuple[tuple[str, str, str], ...] = (
    (ENGRAM_MODULE, "Engram", "_create_embedding"),
    (ENGRAM_MODULE, "Engram", "prepare_embeddings"),
    (ENGRAM_MODULE, "Engram", "_ready_rows"),
    (ENGRAM_MODULE, "Engram", "embed"),
    (MODEL_MODULE, "DeepseekV4Model", "forward"),
)

_FP8_BLOCK = 32


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
        found.append(("torch.compile / CUDA graphs (the hooks run in Python)", "--enforce-eager"))
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


def read_serving(vllm_config: Any) -> VllmServing:
    """This worker's settings from vLLM's config and its TP group."""
    from vllm.distributed import get_tensor_model_parallel_rank
    from vllm.platforms import current_platform

    p = vllm_config.parallel_config
    extra = vllm_config.additional_config
    engram = vllm_config.engram_config
    return VllmServing(
        version=installed_version(), tp_size=int(p.tensor_parallel_size), tp_rank=int(get_tensor_model_parallel_rank()),
        pp_size=int(p.pipeline_parallel_size), dp_size=int(p.data_parallel_size),
        pcp_size=int(p.prefill_context_parallel_size), enforce_eager=bool(vllm_config.model_config.enforce_eager),
        embedding_across_dp=bool(engram is not None and engram.embedding_across_dp),
        decode_backend=str(extra.get("decode_backend", "auto")) if isinstance(extra, dict) else "auto",
        speculative=vllm_config.speculative_config is not None, rocm=bool(current_platform.is_rocm()))


@dataclass(frozen=True)
class HeadShard:
    """One TP rank's share of a layer's table as vLLM 0.33.0 shards it (one table replica per DP rank).

    Worked example: 24 heads of 100 rows, TP 4 -> rank 1 holds heads 6..11, rows [600, 1200).
    """

    head_start: int
    heads: int            # part_n_hash_cols: ceil(columns / TP)
    row_start: int        # vocab_start_idx
    row_end: int          # vocab_end_idx


def head_shard(head_sizes: tuple[int, ...], tp_size: int, tp_rank: int) -> HeadShard:
    """vLLM's head split of a table whose columns hold `head_sizes` rows, for rank `tp_rank` of `tp_size`."""
    heads = -(-len(head_sizes) // tp_size)
    start = tp_rank * heads
    end = min(start + heads, len(head_sizes))
    return HeadShard(start, heads, sum(head_sizes[:start]), sum(head_sizes[:end]))


def _skip_rows(param: torch.nn.Parameter, loaded_weight: torch.Tensor, *args: Any, **kwargs: Any) -> None:
    """Weight loader of a served table: its rows are read from SlackTier's regions, the checkpoint's are skipped."""


class ServedTable(torch.nn.Module):
    """Stands where vLLM's ParallelEngramEmbedding would: no rows, vLLM's shard geometry, the attributes Engram reads.

    dp_size 1 and cpu_offload False keep Engram on its plain path: no prefetch stream, no EngramBatch, no DP
    gather; the rows come from the step engine through the patched `_ready_rows`.
    """

    def __init__(self, layer: int, num_embeddings: int, dim: int, head_sizes: tuple[int, ...], tp_size: int,
                 tp_rank: int, partition: RankPartition | None = None) -> None:
        super().__init__()
        shard = head_shard(head_sizes, tp_size, tp_rank)
        self.layer = layer
        self.num_embeddings = num_embeddings
        self.dim = dim
        self.block_size = _FP8_BLOCK
        self.n_hash_cols = len(head_sizes)
        self.tp_size = tp_size
        self.dp_size = 1
        self.cpu_offload = False
        self.dp_shared_memory = False
        self.peer_rows = 0
        self.part_n_hash_cols = shard.heads
        self.head_start = shard.head_start
        self.vocab_start_idx = shard.row_start
        self.vocab_end_idx = shard.row_end
        self.part_num_embeddings = shard.row_end - shard.row_start
        # the hash columns this rank looks up, and (another partition than vLLM's) where each column sits in the
        # all-gather of the ranks' columns: None when that is column order (vLLM's own head shards)
        if partition is None or partition.kind == "columns" or tp_size == 1:
            self.columns = slice(shard.head_start, shard.head_start + shard.heads)
            self.gathered_order: torch.Tensor | None = None
        else:
            self.columns = torch.tensor(partition.columns[tp_rank], dtype=torch.long)
            self.gathered_order = torch.from_numpy(partition.gathered_order())
        self.weight = torch.nn.Parameter(torch.empty(0, dim, dtype=torch.float8_e4m3fn), requires_grad=False)
        self.weight_scale_inv = torch.nn.Parameter(torch.empty(0, dim // _FP8_BLOCK, dtype=torch.uint8),
                                                   requires_grad=False)
        for param in (self.weight, self.weight_scale_inv):
            param.weight_loader = _skip_rows

    def collapse_huge_pages(self) -> None:
        """Nothing to collapse: the table holds no rows."""

    def lookup(self, indices: torch.Tensor, out: torch.Tensor, background: bool = False) -> None:
        """Never called: the patched seams serve the rows."""
        raise SlackTierError(ErrorKind.BAD_INPUT, f"vLLM asked a SlackTier-served table (layer {self.layer}) for a "
                             "lookup of its own", layer=self.layer,
                             fix=f"this path is outside the plug-in's scope; unset {CONTROL_ENV}")

    def forward(self, indices: torch.Tensor) -> torch.Tensor:
        """Never called, as lookup."""
        self.lookup(indices, indices)
        raise AssertionError("unreachable")


@dataclass
class _Binding:
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
        self.pending[layer] = ids
        if len(self.pending) < len(engine.layers):
            return
        ids = torch.stack([self.pending[layer] for layer in engine.ids_layers], dim=1)   # [T, L, 24 / TP]
        self.pending.clear()
        engine.begin_step(np.ascontiguousarray(ids.detach().to("cpu").numpy(), dtype=np.int64))


_BINDINGS: dict[Path, _Binding] = {}


def _bind(hash_columns: int, table: str = "Engram") -> _Binding | None:
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
                                     f"(stage with --ranks {serving.tp_size})")
    heads = -(-hash_columns // serving.tp_size)
    engine = StepEngine.from_config(ControlFile(engine=cfg.engine, tables=served), columns=heads) if served else None
    binding = _BINDINGS[path] = _Binding(path, cfg, serving, engine)
    log.info("SlackTier serves %s layers %s of TP rank %d from %s; layers %s stay on vLLM's tables",
             table, [t.layer for t in served], serving.tp_rank, path,
             [t.layer for t in cfg.tables if tier_facts(t.source).holds_host_copy])
    return binding


def _current() -> _Binding | None:
    template = os.environ.get(CONTROL_ENV)
    if not template or not _BINDINGS:
        return None
    from vllm.distributed import get_tensor_model_parallel_rank

    return _BINDINGS.get(control_path(template, get_tensor_model_parallel_rank()))


def _served_table(binding: _Binding, layer: int, num_embeddings: int, dim: int,
                  head_sizes: tuple[int, ...]) -> ServedTable:
    """The served table of `layer`, checked against the engine's region and the manifest's layout."""
    assert binding.engine is not None
    t = binding.table(layer)
    assert t is not None
    s = binding.serving
    m = Manifest.load(t.manifest)
    table = ServedTable(layer, num_embeddings, dim, head_sizes, s.tp_size, s.tp_rank, m.partition)
    bounds = m.layout.column_bounds.get(layer)
    model_bounds = tuple(int(b) for b in np.cumsum((0, *head_sizes)))
    if bounds is not None and tuple(bounds) != model_bounds:
        raise SlackTierError(ErrorKind.BAD_INPUT, f"{t.manifest} was staged for another hash layout than the model's",
                             layer=layer, fix="stage the table from this model's checkpoint (or its config's layout)")
    spec = binding.engine.table(layer)
    if t.partition != "columns":   # not vLLM's head shards, by design: the manifest must be cut for this TP
        check_tp_sharding(m, s.tp_size, [layer])
    elif (spec.row_start, spec.row_start + spec.rows) != (table.vocab_start_idx, table.vocab_end_idx):
        raise SlackTierError(ErrorKind.BAD_INPUT, f"layer {layer}: {binding.path} serves rows [{spec.row_start}, "
                             f"{spec.row_start + spec.rows}), vLLM's TP {s.tp_size} rank {s.tp_rank} holds "
                             f"[{table.vocab_start_idx}, {table.vocab_end_idx})", layer=layer, rank=s.tp_rank,
                             fix=f"stage with --ranks {s.tp_size} and set rank = {s.tp_rank} (TP 1: rank = -1)")
    return table


# ---- the hooks --------------------------------------------------------------------------------------


def _create_embedding(original: Callable[..., Any], engram: Any, layout: Any, layer_hash_index: int) -> Any:
    layer = int(layout.layer_ids[layer_hash_index])
    head_sizes = tuple(int(size) for order in layout.primes[layer_hash_index] for size in order)
    binding = _bind(len(head_sizes))
    t = binding.table(layer) if binding is not None else None
    if binding is not None and t is None:
        raise SlackTierError(ErrorKind.MISSING, f"{binding.path} lists no table for Engram layer {layer}", layer=layer,
                             fix='add a [[table]] for it (source = "dram" leaves it to vLLM)')
    if t is None or tier_facts(t.source).holds_host_copy:
        return original(engram, layout, layer_hash_index)
    return _served_table(binding, layer, int(layout.num_embeddings[layer_hash_index]), int(layout.head_dim),
                         head_sizes)


def _prepare_embeddings(original: Callable[..., None], engram: Any, hash_ids: torch.Tensor) -> None:
    table = engram.embed_tokens
    if not isinstance(table, ServedTable):
        return original(engram, hash_ids)
    binding = _current()
    assert binding is not None, f"a served table exists only while {CONTROL_ENV} is set"
    columns = table.columns if isinstance(table.columns, slice) else table.columns.to(hash_ids.device)
    binding.collect(table.layer, hash_ids[:, columns])
    return None


def _ready_rows(original: Callable[..., torch.Tensor], engram: Any, num_tokens: int) -> torch.Tensor:
    table = engram.embed_tokens
    if not isinstance(table, ServedTable):
        return original(engram, num_tokens)
    binding = _current()
    assert binding is not None and binding.engine is not None
    rows = binding.engine.gather(table.layer)   # [T, 24 / TP, 256] bf16 on the engine's device
    if rows.shape[0] != num_tokens:
        raise SlackTierError(ErrorKind.BAD_INPUT, f"vLLM wants {num_tokens} tokens' rows, the step began with "
                             f"{rows.shape[0]}", layer=table.layer,
                             fix="a step's lookups must be the hash ids prepare_embeddings received")
    staged = engram.staged_rows[:num_tokens]   # persistent: its address stays what later kernels read
    staged.copy_(rows, non_blocking=True)
    return staged


def _embed(original: Callable[..., torch.Tensor], engram: Any, hash_ids: torch.Tensor) -> torch.Tensor:
    rows = original(engram, hash_ids)   # [T, 24, 256]: vLLM's all-gather of the ranks' columns, in rank order
    order = getattr(engram.embed_tokens, "gathered_order", None)
    if order is None:
        return rows
    return rows.index_select(1, order.to(rows.device))


@contextmanager
def step() -> Iterator[None]:
    """End this worker's step after the block, also when it raised: the patched DeepseekV4Model.forward is
    `with step(): original forward`; a forward of one's own (a check script) can use it too."""
    binding = _current()
    if binding is None:
        yield
        return
    with ending_step(binding.engine, binding.pending.clear):
        yield


def _model_forward(original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    with step():
        return original(*args, **kwargs)


_HOOKS = {"_create_embedding": _create_embedding, "prepare_embeddings": _prepare_embeddings,
          "_ready_rows": _ready_rows, "embed": _embed, "forward": _model_forward}


def _wrap(original: Callable[..., Any], hook: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def patched(*args: Any, **kwargs: Any) -> Any:
        return hook(original, *args, **kwargs)

    patched.__slacktier__ = True
    return patched


def register() -> None:
    """The `vllm.general_plugins` entry point: patches Engram's seams when SLACKTIER_VLLM_CONTROL is set.

    vLLM runs it in every process, possibly more than once: patching is idempotent. An unchecked vLLM is refused
    here (vLLM lets a plug-in's error stop the worker).
    """
    if not os.environ.get(CONTROL_ENV):
        return
    check_version(installed_version())
    import importlib

    for module, cls_name, method in PATCHED:
        cls = getattr(importlib.import_module(module), cls_name)
        current = cls.__dict__[method]
        if not getattr(current, "__slacktier__", False):
            setattr(cls, method, _wrap(current, _HOOKS[method]))
    from slacktier.adapters import vllm_ple

    vllm_ple.patch()


def close() -> None:
    """Close every engine this process built (tests; a worker ends with its engines)."""
    close_engines(_BINDINGS)


__all__ = ["CHECKED_VERSION", "CONTROL_ENV", "PATCHED", "HeadShard", "ServedTable", "VllmServing", "check_scope",
           "check_version", "close", "head_shard", "installed_version", "read_serving", "register", "step"]
