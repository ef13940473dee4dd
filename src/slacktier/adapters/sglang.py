"""SGLang plug-in: DeepSeek-V4.1's Engram tables served by the step engine inside SGLang's own forward.

Turning it on (each TP rank's scheduler process loads it from the
`sglang.srt.plugins` entry-point group; `SGLANG_PLUGINS=slacktier` allowlists it):

    SLACKTIER_SGLANG_CONTROL=/etc/slacktier/rank{tp_rank}.toml python -m sglang.launch_server ... \
        --cuda-graph-backend-decode breakable --disable-overlap-schedule

Without the variable the plug-in registers nothing. With it, each rank loads
its own control file (`{tp_rank}` is replaced by the process's TP rank) and:

- a table the control file places in host DRAM (`source = "dram"`) is left to
  SGLang's stock table and gather: SlackTier's DRAM tier copies whole 4 KiB
  pages for 264 B rows, several times the cost of SGLang's own row gather;
- every other table allocates no rows in SGLang (zero-row `weight`/`scale`
  parameters whose loader compares the checkpoint's copy with the manifest's
  identity, tables.identity, then skips it), its rows come from
  `StepEngine.gather(layer)`, which replaces `EngramEmbedding._owned_rows`, so
  SGLang's all-reduce stays its own; rows another rank owns are +0.0 (SGLang's
  own fill), so each rank's output, and the TP sum, equal the stock path's bit
  for bit.

Patched through SGLang's `HookRegistry`, checked against SGLang 0.5.23 (any
other version is refused at start-up, when the first Engram table is built):

| target | hook | what it does |
|---|---|---|
| `sglang.srt.layers.engram.EngramLayout.from_config` | AFTER | records the model's Engram layer order (the hash ids' layer axis) |
| `sglang.srt.layers.engram.EngramEmbedding.__init__` | AROUND | a served table: checks, zero-row parameters, identity-checking loader; others stock |
| `sglang.srt.layers.engram.EngramEmbedding._owned_rows` | AROUND | a served table: an output buffer, then an eager break: `gather(layer)` into it, +0.0 in rows of other ranks |
| `sglang.srt.layers.engram.EngramHasher.forward` | AFTER | an eager break: `begin_step(hash ids)` as soon as the step's ids exist |
| `sglang.srt.models.deepseek_v4.DeepseekV4Model.forward` | AROUND | an eager break at its end: `end_step()`; also when it raised |

A served table's `__init__` sets the attributes SGLang 0.5.23's own
`EngramEmbedding` methods read (dim, tp_size, row_start, rows, host_table,
peer, staged_by_scheduler, _sort_host_reads): that coupling to one version's
internals is why another version is refused rather than tried.

CUDA graphs: SGLang's breakable graphs (`--cuda-graph-backend-decode breakable`,
and its default breakable prefill graphs) are served. The plug-in's host work
runs as eager breaks, SGLang's own `eager_on_graph`, which end the captured
segment, run the call, and run it again between the segments at every replay:
`begin_step` right after the hasher (it reads the step's hash ids from the
graph's buffer), each served layer's wait and gather (it writes the rows into a
buffer allocated in the captured part, so the all-reduce and the projection
after it stay captured), and `end_step` at the end of the forward. A replay
whose break raises ends the step there (the breaks after it do not run). Every
capture runs one real step with the capture's dummy ids. Full graphs (SGLang's
default for decode) are refused: they replay kernels only, so the host work
would run once, at capture.

First version's scope (anything else is refused at start-up with
SlackTierError kind UNSUPPORTED naming the setting and its fix): pipeline,
attention-DP and attention-CP sizes 1; a TP size dividing the 24 hash columns
(ranks own whole heads, as SlackTier's rank regions); the overlap scheduler off
(`--disable-overlap-schedule`: it launches batch N+1 before N's tokens reach
the host, while begin_step needs N+1's hash ids on the host, so the launch
would wait for N and no result processing would overlap a forward; the reason
in full is sglang_binding.OVERLAP_REFUSAL); decode and prefill graphs breakable
or disabled; no speculative decoding; no two-batch overlap. At
TP > 1 each rank's control file serves that rank's region (`rank = N`,
`owned_only = true`), staged with `--ranks TP` from the model's hash layout
(`slacktier stage --checkpoint DIR` reads DIR/config.json); a table staged for
another TP, without the hash-column bounds, under another partition, or whose
region is not SGLang's `shard_range` of the table (tables.tp_sharding), or a
table staged for another hash layout, is refused at start-up.

Qwen3.8's PLE tables (`Qwen4ExpPinnedHostEmbedding`) are served by the same
entry point, variable and control file: adapters.sglang_ple (its hooks are in
its PATCHED; `check_scope(..., "PLE")` adds TP 1 only).

Rank partitions (tables.partition): a table staged with `--partition balanced`
(and `partition = "balanced"` on its [[table]]s) gives every rank as many heads
of each n-gram order instead of SGLang's contiguous columns, so no rank reads
most of the step's pages. SGLang's all-reduce sums whatever each rank fills, so
nothing else changes: each rank's `_owned_rows` is the rows of its partition's
columns' row spans, +0.0 in the others (by row, as SGLang's own shards mask, so
an id that is not its column's also sums to SGLang's row), and the TP sum is
the stock one bit for bit.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Callable

import torch

from slacktier.adapters import checking_loader, ending_on_error, finish_step, identity_check
from slacktier.adapters.sglang_binding import BREAKABLE_PLE_PREFILL, CHECKED_VERSION, CONTROL_ENV, UNVERIFIED_ENV, \
    Binding, SglangServing, bind, check_scope, check_version, close, current, decode_flags, eager_break, end_step, \
    installed_version, loaded_from, read_serving, record_layer_order, step, unverified_allowed
from slacktier.config import tier_facts
from slacktier.errors import ErrorKind, SlackTierError
from slacktier.tables.manifest import Manifest, check_tp_sharding
from slacktier.tables.tp_sharding import SGLANG, check_rank_rows

LAYOUT_FROM_CONFIG = "sglang.srt.layers.engram.EngramLayout.from_config"
EMBEDDING_INIT = "sglang.srt.layers.engram.EngramEmbedding.__init__"
OWNED_ROWS = "sglang.srt.layers.engram.EngramEmbedding._owned_rows"
HASHER_FORWARD = "sglang.srt.layers.engram.EngramHasher.forward"
MODEL_FORWARD = "sglang.srt.models.deepseek_v4.DeepseekV4Model.forward"
#: every SGLang function the plug-in patches, with its hook type
PATCHED: tuple[tuple[str, str], ...] = ((LAYOUT_FROM_CONFIG, "AFTER"), (EMBEDDING_INIT, "AROUND"),
                                       (OWNED_ROWS, "AROUND"), (HASHER_FORWARD, "AFTER"), (MODEL_FORWARD, "AROUND"))

_FP8_BLOCK = 32   # values per E8M0 scale

log = logging.getLogger(__name__)


def _adopt(binding: Binding, module: torch.nn.Module, num_embeddings: int, dim: int, layer_id: int,
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
    owned_spans = None
    if t.partition != "columns":
        # Another partition than SGLang's own: the region is not SGLang's shard_range, by design; the manifest
        # must be cut for this TP size, and the rows this rank serves are its partition's columns' row spans.
        m = Manifest.load(t.manifest)
        check_tp_sharding(m, s.tp_size, [layer_id])
        if s.tp_size > 1:
            owned_spans = torch.tensor(m.partition.spans(column_bounds, s.tp_rank), dtype=torch.int64)   # [S, 2]
    else:   # SGLang's own shard_range: the region must be exactly its rows
        check_rank_rows(Manifest.load(t.manifest), str(binding.path), SGLANG, s.tp_size, s.tp_rank, layer_id,
                        (start, end), (spec.row_start, spec.row_start + spec.rows))
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
    check = identity_check(t.manifest, layer_id, "SGLang", loaded_from())   # the checkpoint must be the staged one
    module.weight.weight_loader = checking_loader(check, "values", f"model.layers.{layer_id}.engram.embed.weight")
    module.scale.weight_loader = checking_loader(check, "scales", f"model.layers.{layer_id}.engram.embed.scale")
    module._slacktier_layer = layer_id
    module._slacktier_owned_spans = owned_spans   # [S, 2] global row spans under a non-columns partition at TP > 1
    binding.adopted.add(layer_id)


# ---- the hooks --------------------------------------------------------------------------------------


def _after_layout(layout: Any, *args: Any, **kwargs: Any) -> None:
    """EngramLayout.from_config: keep its layer order, the order of the hash ids' layer axis."""
    if layout is not None:
        record_layer_order(tuple(int(i) for i in layout.layer_ids))


def _around_embedding_init(original: Callable[..., None], module: torch.nn.Module, num_embeddings: int, dim: int,
                           layer_id: int, column_bounds: tuple[int, ...]) -> None:
    """EngramEmbedding.__init__: a table the control file serves from a non-DRAM tier is adopted."""
    binding = bind(len(column_bounds) - 1, "Engram", PATCHED, EMBEDDING_INIT)
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
    """EngramEmbedding._owned_rows: a served table's rows from gather, +0.0 where another rank owns the row.

    The rows are written by an eager break (`_BREAKS`) into a buffer allocated here, in the captured part of a
    breakable CUDA graph, so the graph's later kernels (the all-reduce, the projection) read them at a fixed
    address, as SGLang's own breakable Engram lookup does."""
    layer = module.__dict__.get("_slacktier_layer")
    if layer is None:
        return original(module, indices)
    out = module.new_rows(indices)
    _BREAKS["rows"](module, indices, out)
    return out


def _served_rows(module: torch.nn.Module, indices: torch.Tensor, out: torch.Tensor) -> None:
    """An eager break: waits for the layer's reads, gathers its rows into `out` (+0.0 in other ranks' rows)."""
    layer = module._slacktier_layer
    binding = current()
    if binding is None or binding.engine is None or not binding.engine.in_step:
        raise SlackTierError(ErrorKind.BAD_INPUT, f"SGLang looked up Engram layer {layer} with no SlackTier step "
                             "open", layer=layer, fix=f"the hasher hook begins each step: check that {HASHER_FORWARD} "
                             f"runs before the layer (the plug-in patches it, with {CONTROL_ENV} set)")
    with ending_on_error(binding.engine):
        rows = binding.engine.gather(layer)   # [T, 24, 256] bf16 on the engine's device
        if rows.shape[:2] != indices.shape:
            raise SlackTierError(ErrorKind.BAD_INPUT, f"SGLang looked up ids of shape {tuple(indices.shape)}, the step "
                                 f"began with {tuple(rows.shape[:2])}", layer=layer,
                                 fix="a step's lookups must be the hash ids its hasher returned (no DP or CP gather)")
        rows = rows.to(indices.device, non_blocking=True)
        if module.tp_size > 1:
            spans = module.__dict__.get("_slacktier_owned_spans")
            if spans is not None:   # a partition other than SGLang's: this rank owns its columns' row spans
                # by row, as SGLang's own shards: an id in another column's rows is still served by its row's owner,
                # so the TP sum is SGLang's for every id (an id outside the table is +0.0 on every rank)
                spans = spans.to(indices.device)
                at = indices.unsqueeze(-1)
                owned = ((at >= spans[:, 0]) & (at < spans[:, 1])).any(-1)
            else:
                local = indices - module.row_start
                owned = (local >= 0) & (local < module.rows)
            rows = rows.masked_fill(~owned.unsqueeze(-1), 0.0)   # +0.0, SGLang's own fill (the engine's is -0.0)
        out.copy_(rows)


def _after_hash(hash_ids: torch.Tensor, *args: Any, **kwargs: Any) -> None:
    """EngramHasher.forward(input_ids, forward_batch): begin_step as soon as the step's hash ids exist (an eager
    break), with the batch's per-token decode flags for the cache's admission rule."""
    binding = current()
    if binding is not None:
        batch = kwargs.get("forward_batch", args[2] if len(args) > 2 else None)
        binding.decode = decode_flags(batch, hash_ids.shape[0]) if batch is not None else None
        _BREAKS["begin"](hash_ids)


def _begin(hash_ids: torch.Tensor) -> None:
    """An eager break: begin_step on this rank's layers of the step's hash ids (read from the graph's buffer)."""
    binding = current()
    if binding is not None:
        if binding.engine is not None and binding.engine.in_step:
            # A replay that raised in a break skips the breaks after it, end_step's included.
            log.warning("a step was left open by a failed forward; ending it before the next one")
            finish_step(binding.engine, True)
        binding.begin(hash_ids)


def _around_model_forward(original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """DeepseekV4Model.forward: end_step after it (an eager break, so at every replay too), also when it raised."""
    with step():
        out = original(*args, **kwargs)
        _BREAKS["end"]()
        return out


#: the plug-in's eager breaks, built when the hooks are registered (SGLang is imported lazily)
_BREAKS: dict[str, Callable[..., None]] = {}


def _build_breaks() -> None:
    if not _BREAKS:
        _BREAKS.update(begin=eager_break(_begin), rows=eager_break(_served_rows), end=eager_break(end_step))


def register() -> None:
    """The `sglang.srt.plugins` entry point: registers the hooks when SLACKTIER_SGLANG_CONTROL is set."""
    if not os.environ.get(CONTROL_ENV):
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from slacktier.adapters import sglang_ple

    # The tables' constructors refuse an unchecked version when the model is built: SGLang logs and goes on
    # after an error in a plug-in, so raising here alone would leave the stock tables serving silently.
    _build_breaks()
    HookRegistry.register(EMBEDDING_INIT, _around_embedding_init, HookType.AROUND)
    sglang_ple.register_hooks(HookRegistry, HookType, constructors=True)
    check_version(installed_version())
    HookRegistry.register(LAYOUT_FROM_CONFIG, _after_layout, HookType.AFTER)
    HookRegistry.register(OWNED_ROWS, _around_owned_rows, HookType.AROUND)
    HookRegistry.register(HASHER_FORWARD, _after_hash, HookType.AFTER)
    HookRegistry.register(MODEL_FORWARD, _around_model_forward, HookType.AROUND)
    sglang_ple.register_hooks(HookRegistry, HookType, constructors=False)


__all__ = ["BREAKABLE_PLE_PREFILL", "CHECKED_VERSION", "CONTROL_ENV", "PATCHED", "UNVERIFIED_ENV", "SglangServing",
           "check_scope", "check_version", "close", "end_step", "installed_version", "read_serving", "register", "step",
           "unverified_allowed"]
