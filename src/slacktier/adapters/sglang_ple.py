"""SGLang plug-in, PLE part: Qwen3.8's per-layer n-gram table (`Qwen4ExpPinnedHostEmbedding`) served by the engine.

Loaded with the Engram part (adapters.sglang: one entry point, one variable,
one control file per rank). SGLang 0.5.23 keeps an offloaded PLE table in host
memory (`ple_offload_embedding`), stored as the checkpoint stores it: fp8 E4M3
with one per-tensor `weight_scale` (bf16 [1]), or bf16. Its `gather(ids, out)`
emits bf16 rows; the caller multiplies by `weight_scale` afterwards
(`Qwen4ExpNGramEmbedding._embed_ngram_ids`, `Qwen4ExpPLELayer._consume_prefetched_embeddings`).

Row format (the decision). SlackTier's row is 256 fp8 E4M3 values and 8 E8M0
block scales, dequantized as bf16(fp32(v) * 2^(e - 127)). An fp8 PLE row of 256
values is staged with every block scale 0x7F (2^0): the engine then returns
bf16(v), exactly what SGLang's Triton gather writes (an fp8 -> bf16 conversion
is exact), and SGLang's own code applies the per-tensor scale after the gather,
as on its stock path. So the per-tensor scale never enters SlackTier's rows and
the output equals the stock output bit for bit. Refused at start-up
(UNSUPPORTED, naming the fix): a bf16 table (a bf16 row has no exact fp8 form;
a bf16 row codec is not built), rows of another width than 256 values
(`ple_embed_dim` != 16 * 256), added vocabulary rows, a quantized embedding
method, and `ple_offload_embedding = false` (SGLang would then allocate the
whole table on the GPU: the plug-in serves a table in place of SGLang's
offloaded host table).

Patched through SGLang's `HookRegistry`, checked against SGLang 0.5.23:

| target | hook | what it does for a served PLE table |
|---|---|---|
| `sglang.srt.models.qwen4_exp.Qwen4ExpNGramEmbedding.__init__` | AROUND | checks (scope, offload on, hash layout = the manifest's), marks the layer (from the module prefix `...layers.N...`) being built |
| `sglang.srt.models.qwen4_exp.Qwen4ExpPinnedHostEmbedding.__init__` | AROUND | a zero-row `weight` (no host table allocated, no-op loader), SGLang's `weight_scale` kept |
| `sglang.srt.models.qwen4_exp.Qwen4ExpPinnedHostEmbedding.gather` | AROUND | `gather(layer)` from the engine, into SGLang's `out` buffer when one is given |
| `sglang.srt.models.qwen4_exp._prepare_ple_batch` | AFTER | `begin_step` of every served PLE layer's ids (each layer's own `compute_ngram_ids`) once the step's n-gram context exists |
| `sglang.srt.models.qwen4_exp._commit_ple_batch` | AFTER | `end_step()`: every PLE layer has read its rows |
| `sglang.srt.models.qwen4_exp.Qwen4ExpModel.forward` | AROUND | `end_step()` after the forward, also when it raised |
| `sglang.srt.models.qwen4_exp.Qwen4ExpForConditionalGeneration.load_weights` | AROUND | drops a served table's row tensors (`...ngram_embedding.weight`, `...ngram_embedding.shard_N.weight`) from the checkpoint stream, after comparing their sampled rows with the manifest's identity (tables.identity); its `weight_scale` still loads |

Control files key a PLE table by the decoder layer id of the layer that reads
it (as models/qwen38.py does), the number in SGLang's module prefix
`model.layers.N.ple.ple_embedding`.

Scope (beyond adapters.sglang's): TP 1 (SGLang's VocabParallelEmbedding
splits the padded table into equal row blocks, not at SlackTier's rank
regions). CUDA graphs: SGLang runs every PLE call of a prefill batch
(`_prepare_ple_batch`, the prefetch, the PLE forward, `_commit_ple_batch`) as
eager breaks under `--cuda-graph-backend-prefill breakable`, so the plug-in's
begin_step, gather and end_step would run at every replay; that is not yet
run on a GPU and stays refused unless SLACKTIER_SGLANG_UNVERIFIED names
`breakable-ple-prefill` (the GPU check script's opt-in). Decode graphs capture
the PLE prefetch itself (SGLang's UVA gather is a device kernel) and stay refused.
"""

from __future__ import annotations

import contextvars
import re
from collections.abc import Iterable, Iterator
from typing import Any, Callable

import numpy as np
import torch

from slacktier.adapters import check_ple_layout, finish_step, identity_check, layer_in_prefix, report_unchecked
from slacktier.adapters import sglang_binding as core
from slacktier.config import tier_facts
from slacktier.errors import ErrorKind, SlackTierError
from slacktier.tables.layout import ROW_VALUES

MODULE = "sglang.srt.models.qwen4_exp"
NGRAM_INIT = f"{MODULE}.Qwen4ExpNGramEmbedding.__init__"
HOST_INIT = f"{MODULE}.Qwen4ExpPinnedHostEmbedding.__init__"
HOST_GATHER = f"{MODULE}.Qwen4ExpPinnedHostEmbedding.gather"
PREPARE_BATCH = f"{MODULE}._prepare_ple_batch"
COMMIT_BATCH = f"{MODULE}._commit_ple_batch"
MODEL_FORWARD = f"{MODULE}.Qwen4ExpModel.forward"
LOAD_WEIGHTS = f"{MODULE}.Qwen4ExpForConditionalGeneration.load_weights"
#: every SGLang function the PLE part patches, with its hook type
PATCHED: tuple[tuple[str, str], ...] = ((NGRAM_INIT, "AROUND"), (HOST_INIT, "AROUND"), (HOST_GATHER, "AROUND"),
                                       (PREPARE_BATCH, "AFTER"), (COMMIT_BATCH, "AFTER"), (MODEL_FORWARD, "AROUND"),
                                       (LOAD_WEIGHTS, "AROUND"))

#: the PLE table being built inside Qwen4ExpNGramEmbedding.__init__: (binding, decoder layer id)
_BUILDING: contextvars.ContextVar[tuple[Any, int] | None] = contextvars.ContextVar("slacktier_ple", default=None)
_SERVED_ROWS = re.compile(r"(.+\.ngram_embedding)\.(?:shard_(\d+)\.)?weight")


def layer_of(prefix: str) -> int:
    """The decoder layer id in SGLang's module prefix: "model.layers.3.ple.ple_embedding" -> 3."""
    return layer_in_prefix(prefix, f"SGLang {core.CHECKED_VERSION}")


def served_row_tensor(name: str, served: set[str]) -> bool:
    """Whether checkpoint tensor `name` holds rows of a served table (module names in `served`); its scale does not.

    "model.language_model.layers.1.ple.ple_embedding.ngram_embedding.shard_3.weight" with the module
    "model.layers.1.ple.ple_embedding.ngram_embedding" served -> True; "...ngram_embedding.weight_scale" -> False.
    """
    return served_rows_of(name, served) is not None


def served_rows_of(name: str, served: Iterable[str]) -> tuple[str, int | None] | None:
    """(served module name, shard index or None for the whole table) of a checkpoint row tensor; None otherwise.

    "model.language_model.layers.1.ple.ple_embedding.ngram_embedding.shard_3.weight" -> ("model.layers.1.ple.
    ple_embedding.ngram_embedding", 3).
    """
    for candidate in (name, name.replace("model.language_model.", "model.")):
        m = _SERVED_ROWS.fullmatch(candidate)
        if m is not None and m.group(1) in served:
            return m.group(1), (int(m.group(2)) if m.group(2) is not None else None)
    return None


def _refuse(layer: int, what: str, fix: str) -> SlackTierError:
    return SlackTierError(ErrorKind.UNSUPPORTED, f"PLE table of layer {layer}: {what}", layer=layer,
                          fix=f"{fix}, or source = \"dram\" on its [[table]] to keep SGLang's own host table")


# ---- the hooks --------------------------------------------------------------------------------------


def _around_ngram_init(original: Callable[..., None], module: torch.nn.Module, config: Any, embedding_dim: int,
                       ple_layer_index: int = 0, quant_config: Any = None, prefix: str = "") -> None:
    """Qwen4ExpNGramEmbedding.__init__: a table the control file serves from a non-DRAM tier is built without rows."""
    args = (config, embedding_dim)
    kwargs = dict(ple_layer_index=ple_layer_index, quant_config=quant_config, prefix=prefix)
    columns = (int(config.ngram_size) - 1) * int(config.heads_per_ngram)
    binding = core.bind(columns, "PLE", PATCHED, NGRAM_INIT)
    if binding is None:
        original(module, *args, **kwargs)
        return
    layer = layer_of(prefix)
    t = binding.table(layer)
    if t is None:
        raise SlackTierError(ErrorKind.MISSING, f"{binding.path} lists no table for PLE layer {layer}", layer=layer,
                             fix='add a [[table]] for it (source = "dram" leaves it to SGLang)')
    if tier_facts(t.source).holds_host_copy:
        original(module, *args, **kwargs)
        return
    if not getattr(config, "ple_offload_embedding", False):
        raise _refuse(layer, "ple_offload_embedding is false, so SGLang would allocate the whole table on the GPU "
                      "(the plug-in serves a table in place of SGLang's offloaded host table)",
                      "set ple_offload_embedding = true (--json-model-override-args "
                      "'{\"ple_offload_embedding\": true}')")
    token = _BUILDING.set((binding, layer))
    try:
        original(module, *args, **kwargs)
    finally:
        _BUILDING.reset(token)
    if module.ngram_embedding.__dict__.get("_slacktier_layer") != layer:
        raise SlackTierError(ErrorKind.UNSUPPORTED, f"SGLang built PLE layer {layer}'s table without the plug-in's "
                             f"hook on {HOST_INIT}", layer=layer, fix="load plug-ins through SGLang "
                             "(sglang.srt.plugins.load_plugins) and look for 'Failed to apply hooks' in its log")
    check_ple_layout(binding, layer, module.ngram_heads_vocab_sizes.tolist())
    binding.ple[layer] = module


def _around_host_init(original: Callable[..., None], module: torch.nn.Module, embedding: torch.nn.Module,
                      *args: Any, **kwargs: Any) -> None:
    """Qwen4ExpPinnedHostEmbedding.__init__: a served table allocates no host rows; SGLang's scale stays."""
    building = _BUILDING.get()
    if building is None:
        original(module, embedding, *args, **kwargs)
        return
    binding, layer = building
    from sglang.srt.layers.quantization.unquant import UnquantizedEmbeddingMethod

    weight = embedding.weight
    if not isinstance(embedding.quant_method, UnquantizedEmbeddingMethod):
        raise _refuse(layer, f"a quantized embedding method ({type(embedding.quant_method).__name__})",
                      "serve an fp8 table with its per-tensor weight_scale")
    if weight.dtype != torch.float8_e4m3fn:
        raise _refuse(layer, f"the table is {str(weight.dtype).removeprefix('torch.')}; SlackTier's rows are fp8 "
                      "E4M3 with E8M0 block scales, and a bf16 row has no exact fp8 form (no bf16 row codec is "
                      "built)", "an fp8 PLE checkpoint (text_config.ple_embedding_dtype = \"float8_e4m3fn\")")
    if embedding.embedding_dim != ROW_VALUES:
        raise _refuse(layer, f"rows of {embedding.embedding_dim} values; SlackTier's rows hold {ROW_VALUES} (no "
                      "row codec of another width is built)", f"ple_embed_dim = heads * {ROW_VALUES}")
    if embedding.num_added_embeddings:
        raise _refuse(layer, "added vocabulary rows", "a table without added rows")
    torch.nn.Module.__init__(module)
    for name in type(module)._COPIED_ATTRIBUTES:   # what SGLang 0.5.23's own methods read (reduce, allocate_output)
        setattr(module, name, getattr(embedding, name))
    module.quant_method = None
    rows = torch.nn.Parameter(torch.empty(0, embedding.embedding_dim, dtype=weight.dtype), requires_grad=False)
    rows.weight_loader = core.skip_rows
    module.register_parameter("weight", rows)
    module.register_buffer("weight_scale", embedding.weight_scale, persistent=True)
    del embedding.weight
    module._file_prefetcher = None
    module._file_rss_trimmer = None
    module._block_d = ROW_VALUES
    module._slacktier_layer = layer
    # the checkpoint's rows, skipped by the load_weights hook, are compared with the staged table's identity there
    module._slacktier_identity = identity_check(binding.table(layer).manifest, layer, "SGLang",
                                                core.loaded_from(), ("values",))


def _around_gather(original: Callable[..., torch.Tensor], module: torch.nn.Module, input_ids: torch.Tensor,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """Qwen4ExpPinnedHostEmbedding.gather: a served table's bf16 rows [*ids.shape, 256] from the engine."""
    layer = module.__dict__.get("_slacktier_layer")
    if layer is None:
        return original(module, input_ids, out)
    shape = (*input_ids.shape, module.embedding_dim)
    if out is not None and (tuple(out.shape) != shape or out.dtype != torch.bfloat16):
        raise SlackTierError(ErrorKind.BAD_INPUT, f"PLE layer {layer}: SGLang's output buffer is "
                             f"{tuple(out.shape)} {out.dtype}, want {shape} bfloat16", layer=layer,
                             fix="a step's lookups must be the n-gram ids of its batch (no DP gather)")
    if input_ids.numel() == 0:   # an empty batch: no step was begun (begin_step needs ids)
        return out if out is not None else torch.empty(shape, dtype=torch.bfloat16, device=input_ids.device)
    binding = core.current()
    if binding is None or binding.engine is None or not binding.engine.in_step:
        raise SlackTierError(ErrorKind.BAD_INPUT, f"SGLang looked up PLE layer {layer} with no SlackTier step open",
                             layer=layer, fix=f"the {PREPARE_BATCH} hook begins each step: check that it runs "
                             f"before the layer (the plug-in patches it, with {core.CONTROL_ENV} set)")
    rows = binding.engine.gather(layer)   # [T, C, 256] bf16 on the engine's device
    if rows.shape[:2] != input_ids.shape:
        raise SlackTierError(ErrorKind.BAD_INPUT, f"SGLang looked up PLE ids of shape {tuple(input_ids.shape)}, the "
                             f"step began with {tuple(rows.shape[:2])}", layer=layer,
                             fix="a step's lookups must be the n-gram ids of its batch (no DP gather)")
    if out is None:
        return rows.to(input_ids.device, non_blocking=True)
    out.copy_(rows, non_blocking=True)
    return out


def _after_prepare_batch(batch: Any, *args: Any, **kwargs: Any) -> None:
    """_prepare_ple_batch: begin_step with every served PLE layer's ids, [T, L, C], as soon as they can be hashed."""
    binding = core.current()
    if binding is None or binding.engine is None or batch is None or not batch.processed_tokens:
        return
    report_unchecked()
    engine = binding.engine
    per_layer = [binding.ple[layer].compute_ngram_ids(batch) for layer in engine.ids_layers]   # each [T, C]
    ids = torch.stack(per_layer, dim=1).detach().to("cpu").numpy()
    engine.begin_step(np.ascontiguousarray(ids, dtype=np.int64))


def _after_commit_batch(result: Any, *args: Any, **kwargs: Any) -> None:
    """_commit_ple_batch: every PLE layer has read its rows; end the step (an eager break under breakable graphs)."""
    binding = core.current()
    finish_step(binding.engine if binding is not None else None, False)


def _around_model_forward(original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Qwen4ExpModel.forward: end_step after it, also when it raised."""
    with core.step():
        return original(*args, **kwargs)


def _around_load_weights(original: Callable[..., Any], model: torch.nn.Module,
                         weights: Iterable[tuple[str, torch.Tensor]]) -> Any:
    """Qwen4ExpForConditionalGeneration.load_weights: a served table's rows are skipped (they live on the tier)."""
    served = {name: m for name, m in model.named_modules() if "_slacktier_layer" in m.__dict__}
    if not served:
        return original(model, weights)
    config = getattr(model.config, "text_config", model.config)
    parts = int(getattr(config, "split_ngram_parts", getattr(model.config, "split_ngram_parts", 512)))

    def kept() -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            hit = served_rows_of(name, served)
            if hit is None:
                yield name, tensor
                continue
            module, shard = served[hit[0]], hit[1]
            check = module.__dict__.get("_slacktier_identity")
            if check is None:
                continue
            if shard is None:
                check.feed("values", tensor, name=name)
            else:   # SGLang's shard rule: shard i holds rows from i * ceil(org_vocab_size / split_ngram_parts)
                check.feed("values", tensor, shard * -(-int(module.org_vocab_size) // parts), name=name, whole=False)

    return original(model, kept())


_HOOKS = {NGRAM_INIT: _around_ngram_init, HOST_INIT: _around_host_init, HOST_GATHER: _around_gather,
          PREPARE_BATCH: _after_prepare_batch, COMMIT_BATCH: _after_commit_batch, MODEL_FORWARD: _around_model_forward,
          LOAD_WEIGHTS: _around_load_weights}


def register_hooks(registry: Any, hook_type: Any, constructors: bool) -> None:
    """Register the PLE hooks on SGLang's HookRegistry (called by adapters.sglang.register): the table
    constructor's (which refuses an unchecked SGLang when the model is built) or all the others."""
    for target, kind in PATCHED:
        if (target == NGRAM_INIT) == constructors:
            registry.register(target, _HOOKS[target], getattr(hook_type, kind))


__all__ = ["PATCHED", "layer_of", "register_hooks", "served_row_tensor", "served_rows_of"]
