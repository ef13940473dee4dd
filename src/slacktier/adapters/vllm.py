"""vLLM plug-in: DeepSeek-V4.1's Engram tables served by the step engine inside vLLM's own forward.

Turning it on (every worker loads the `vllm.general_plugins` entry point before
it builds the model; `VLLM_PLUGINS=slacktier` allowlists it):

    SLACKTIER_VLLM_CONTROL=/etc/slacktier/rank{tp_rank}.toml VLLM_USE_BREAKABLE_CUDAGRAPH=1 \
        vllm serve ... -cc.cudagraph_mode=PIECEWISE

Without the variable the plug-in patches nothing. With it, vLLM's `Engram`
(vllm/models/deepseek_v41/common/engram.py) is patched at its seams, checked
against vLLM 0.33.0 (another version is refused when the plug-in loads):

| target | what it does for a table SlackTier serves |
|---|---|
| `Engram._create_embedding` | builds a `ServedTable` instead of vLLM's `ParallelEngramEmbedding`: zero-row `weight` / `weight_scale_inv` whose loader compares the checkpoint's copy with the manifest's identity (tables.identity) and skips it, and vLLM's own head shard geometry |
| `Engram.prepare_embeddings` | an eager break: collects the rank's hash columns of every served layer; `begin_step` once, when the last one arrives |
| `Engram._ready_rows` | an eager break: fills the persistent `staged_rows` slice from `gather(layer)`; returns the slice |
| `Engram.embed` | under a partition other than columns, puts the all-gathered columns back in column order |
| `nvidia.model.DeepseekV4Model.forward` | an eager break at its end: `end_step()`; also when it raised |

Rows equal vLLM's own `_engram_lookup_kernel`: the engine serves in its "vllm"
dequant convention (an E8M0 scale byte 0x00 reads as 0.0 and 0xFF as +inf,
where SGLang and torch read 2**-127 and NaN; ids outside the rank's rows, the
table or the pad id give +0.0 rows), checked against that kernel run under
TRITON_INTERPRET=1 on a CPU (tests/test_adapters_vllm_parity.py).

A table placed in host DRAM (`source = "dram"`) keeps vLLM's own table and
lookup. vLLM shards the 24 hash columns (heads) over TP and each rank looks up
its own columns only, then all-gathers them: each rank's control file serves
its own region (`rank = N`, staged with `--ranks TP` from the model's hash
layout; a table staged for another TP or without hash-column bounds is refused
at start-up, tables.tp_sharding), and the engine takes
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

CUDA graphs: vLLM's breakable graphs (`VLLM_USE_BREAKABLE_CUDAGRAPH=1` with a
piecewise-only `cudagraph_mode`, PIECEWISE; DeepseekV4Model is not
torch-compiled, so its piecewise graphs are breakable captures) are served, as
vLLM's own host-offloaded Engram prefetch is: the plug-in's host work runs as
eager breaks (vLLM's `eager_break_during_capture`), `begin_step` when the
last served layer's ids are collected, each layer's wait and gather into the
persistent `staged_rows` (the all-gather and projection after it stay
captured), and `end_step` at the end of the forward. A replay whose break
raises ends the step there. Every capture runs one real step with the
capture's dummy ids. Full graphs (vLLM's default FULL_AND_PIECEWISE decode)
are refused: they replay kernels only, so the host work would run once.

First version's scope, the rest refused at start-up (UNSUPPORTED): eager mode
or breakable graphs as above; a TP size dividing the 24 columns; pipeline and
prefill-context parallel sizes 1; tables not sharded across DP ranks
(`embedding_across_dp` with DP > 1 is refused; DP replicas each with their own
TP-sharded table are fine); the stock decode backend (not
`latency_specialized`); no speculative decoding; the CUDA model file (not
ROCm's).

What runs on a CPU: vLLM's modules import and the plug-in loads through its
entry point; the head shard geometry is checked against vLLM's own
`ParallelEngramEmbedding` and SlackTier's rank regions; refusals; the rows
against vLLM's lookup kernel under Triton's interpreter (above). vLLM's hash
and its lookup compiled for a GPU need one (benchmarks/engine/gpu_check_vllm.py).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch

from slacktier.adapters import checking_loader, ending_on_error, finish_step, identity_check
from slacktier.adapters.vllm_binding import CHECKED_VERSION, CONTROL_ENV, Binding, VllmServing, bind, check_scope, \
    check_version, close, current, eager_break, end_break, installed_version, loaded_from, read_serving, step, wrap
from slacktier.config import tier_facts
from slacktier.errors import ErrorKind, SlackTierError
from slacktier.tables.manifest import Manifest, check_tp_sharding
from slacktier.tables.partition import RankPartition
from slacktier.tables.tp_sharding import VLLM, check_rank_rows

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

log = logging.getLogger(__name__)


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


def _served_table(binding: Binding, layer: int, num_embeddings: int, dim: int,
                  head_sizes: tuple[int, ...]) -> ServedTable:
    """The served table of `layer`, checked against the engine's region and the manifest's layout."""
    assert binding.engine is not None
    t = binding.table(layer)
    assert t is not None
    s = binding.serving
    m = Manifest.load(t.manifest)
    table = ServedTable(layer, num_embeddings, dim, head_sizes, s.tp_size, s.tp_rank, m.partition)
    check = identity_check(t.manifest, layer, "vLLM", loaded_from())   # the checkpoint must be the staged one
    prefix = f"model.layers.{layer}.engram.embed_tokens"
    table.weight.weight_loader = checking_loader(check, "values", f"{prefix}.weight")
    table.weight_scale_inv.weight_loader = checking_loader(check, "scales", f"{prefix}.weight_scale_inv")
    bounds = m.layout.column_bounds.get(layer)
    model_bounds = tuple(int(b) for b in np.cumsum((0, *head_sizes)))
    if bounds is not None and tuple(bounds) != model_bounds:
        raise SlackTierError(ErrorKind.BAD_INPUT, f"{t.manifest} was staged for another hash layout than the model's",
                             layer=layer, fix="stage the table from this model's checkpoint (or its config's layout)")
    spec = binding.engine.table(layer)
    if t.partition != "columns":   # not vLLM's head shards, by design: the manifest must be cut for this TP
        check_tp_sharding(m, s.tp_size, [layer])
    else:   # vLLM's own head shard: the region must be exactly its rows
        check_rank_rows(m, str(binding.path), VLLM, s.tp_size, s.tp_rank, layer,
                        (table.vocab_start_idx, table.vocab_end_idx), (spec.row_start, spec.row_start + spec.rows))
    return table


# ---- the hooks --------------------------------------------------------------------------------------


def _create_embedding(original: Callable[..., Any], engram: Any, layout: Any, layer_hash_index: int) -> Any:
    layer = int(layout.layer_ids[layer_hash_index])
    head_sizes = tuple(int(size) for order in layout.primes[layer_hash_index] for size in order)
    binding = bind(len(head_sizes))
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
    columns = table.columns if isinstance(table.columns, slice) else table.columns.to(hash_ids.device)
    _breaks()["collect"](table.layer, hash_ids[:, columns])
    return None


def _collect(layer: int, ids: torch.Tensor) -> None:
    """An eager break: one layer's ids (the rank's columns); begin_step once every served layer's are in."""
    binding = current()
    assert binding is not None, f"a served table exists only while {CONTROL_ENV} is set"
    engine = binding.engine
    if not binding.pending and engine is not None and engine.in_step:
        # A replay that raised in a break skips the breaks after it, end_step's included.
        log.warning("a step was left open by a failed forward; ending it before the next one")
        finish_step(engine, True)
    binding.collect(layer, ids)


def _ready_rows(original: Callable[..., torch.Tensor], engram: Any, num_tokens: int) -> torch.Tensor:
    table = engram.embed_tokens
    if not isinstance(table, ServedTable):
        return original(engram, num_tokens)
    staged = engram.staged_rows[:num_tokens]   # persistent: its address stays what later kernels read
    _breaks()["rows"](table.layer, staged)
    return staged


def _fill_rows(layer: int, staged: torch.Tensor) -> None:
    """An eager break: waits for the layer's reads and gathers its rows into vLLM's staging buffer."""
    binding = current()
    assert binding is not None and binding.engine is not None
    with ending_on_error(binding.engine):
        rows = binding.engine.gather(layer)   # [T, 24 / TP, 256] bf16 on the engine's device
        if rows.shape[0] != staged.shape[0]:
            raise SlackTierError(ErrorKind.BAD_INPUT, f"vLLM wants {staged.shape[0]} tokens' rows, the step began "
                                 f"with {rows.shape[0]}", layer=layer,
                                 fix="a step's lookups must be the hash ids prepare_embeddings received")
        staged.copy_(rows, non_blocking=True)


def _embed(original: Callable[..., torch.Tensor], engram: Any, hash_ids: torch.Tensor) -> torch.Tensor:
    rows = original(engram, hash_ids)   # [T, 24, 256]: vLLM's all-gather of the ranks' columns, in rank order
    order = getattr(engram.embed_tokens, "gathered_order", None)
    if order is None:
        return rows
    return rows.index_select(1, order.to(rows.device))


def _model_forward(original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """end_step after the forward (an eager break, so at every replay too), also when it raised."""
    with step():
        out = original(*args, **kwargs)
        end_break()()
        return out


#: the plug-in's eager breaks, built on first use (vLLM is imported lazily)
_BREAKS: dict[str, Callable[..., None]] = {}


def _breaks() -> dict[str, Callable[..., None]]:
    if not _BREAKS:
        _BREAKS.update(collect=eager_break(_collect), rows=eager_break(_fill_rows))
    return _BREAKS


_HOOKS = {"_create_embedding": _create_embedding, "prepare_embeddings": _prepare_embeddings,
          "_ready_rows": _ready_rows, "embed": _embed, "forward": _model_forward}


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
        present = cls.__dict__[method]
        if not getattr(present, "__slacktier__", False):
            setattr(cls, method, wrap(present, _HOOKS[method]))
    from slacktier.adapters import vllm_ple

    vllm_ple.patch()


__all__ = ["CHECKED_VERSION", "CONTROL_ENV", "PATCHED", "HeadShard", "ServedTable", "VllmServing", "check_scope",
           "check_version", "close", "head_shard", "installed_version", "read_serving", "register", "step"]
