"""vLLM plug-in, PLE part: Qwen3.8's per-layer n-gram table as a third `Qwen4ExpPLEEmbedding` backend.

Loaded with the Engram part (adapters.vllm: one entry point, one variable, one
control file per rank). vLLM 0.33.0 picks a PLE table's storage class in
`Qwen4ExpNGramEmbedding.__init__` (vllm/models/qwen4_exp/nvidia/ngram_embedding.py):
`Qwen4ExpPLEPinnedHostEmbedding` with `engram_config.cpu_offload`, else
`Qwen4ExpPLEDeviceEmbedding`. Both subclass `Qwen4ExpPLEEmbedding`
(models/qwen4_exp/common/ngram_embedding.py), whose prefetch interface is
`supports_prefetch`, `start_prefetch(ids)` (before the layer ahead runs) and
`finalize_prefetch(total_tokens)` (at the layer). For a table the control file
serves from a non-DRAM tier, the patched `__init__` builds `ServedPLEEmbedding`,
the third backend, in their place:

| vLLM function (0.33.0) | what it does for a served PLE table |
|---|---|
| `vllm.models.qwen4_exp.nvidia.ngram_embedding.Qwen4ExpNGramEmbedding.__init__` | builds `ServedPLEEmbedding` (checks: scope, format, the manifest's hash layout) |
| `vllm.models.qwen4_exp.nvidia.model.Qwen4ExpModel.forward` | an eager break at its end: `end_step()`; also when it raised |

`ServedPLEEmbedding` allocates no rows (a zero-row `weight` whose loader compares
the checkpoint's rows and shards with the manifest's identity, tables.identity,
then skips them; vLLM's per-tensor `weight_scale` loads as usual). `start_prefetch(ids)` hands the layer's ids to the binding, which calls
`begin_step` once every served PLE layer's ids are in; `finalize_prefetch`
returns `gather(layer)`'s rows, [T, C * 256] bf16. vLLM then applies its own
`dequantize` (rows to bf16, times the per-tensor scale), so the output equals
the stock fp8 path's bit for bit: the rows are staged as SlackTier rows with
unit E8M0 block scales (adapters.sglang_ple's module docstring), for which the
engine returns bf16(fp8) exactly, as vLLM's fp8-to-bf16 conversion does.

Refused at start-up (UNSUPPORTED, naming the fix): any format but
`Qwen4ExpPLEFp8EmbeddingMethod` (bf16: no exact fp8 form; NVFP4: E2M1 values
with E4M3 block scales, another row format), rows of another width than 256
values, TP or ETP > 1 (vLLM splits the padded table into equal row blocks), and
everything adapters.vllm refuses (full CUDA graphs, ...). Breakable CUDA graphs
(VLLM_USE_BREAKABLE_CUDAGRAPH=1, cudagraph_mode PIECEWISE) are served:
`start_prefetch` and the finalize step carry vLLM's `eager_break_during_capture`,
as its pinned-host backend's do, and `Qwen4ExpModel.forward` ends the step with
an eager break, so all three run at every replay (tests/test_adapters_graphs.py
on the CPU; a GPU capture is not yet run).
"""

from __future__ import annotations

import contextvars
import functools
import importlib
import logging
from typing import Any, Callable

import torch

from slacktier.adapters import check_ple_layout, identity_check, layer_in_prefix
from slacktier.adapters import vllm_binding as core
from slacktier.config import tier_facts
from slacktier.errors import ErrorKind, SlackTierError
from slacktier.tables.layout import ROW_VALUES

log = logging.getLogger(__name__)

NGRAM_MODULE = "vllm.models.qwen4_exp.nvidia.ngram_embedding"
MODEL_MODULE = "vllm.models.qwen4_exp.nvidia.model"
#: every vLLM function the PLE part patches (module, class, method)
PATCHED: tuple[tuple[str, str, str], ...] = ((NGRAM_MODULE, "Qwen4ExpNGramEmbedding", "__init__"),
                                            (MODEL_MODULE, "Qwen4ExpModel", "forward"))
#: the storage classes vLLM's Qwen4ExpNGramEmbedding.__init__ chooses between (module globals of NGRAM_MODULE)
STOCK_BACKENDS = ("Qwen4ExpPLEPinnedHostEmbedding", "Qwen4ExpPLEDeviceEmbedding")

#: the PLE table being built inside Qwen4ExpNGramEmbedding.__init__: (binding, decoder layer id)
_BUILDING: contextvars.ContextVar[tuple[Any, int] | None] = contextvars.ContextVar("slacktier_vllm_ple",
                                                                                   default=None)


def _refuse(layer: int, what: str, fix: str) -> SlackTierError:
    return SlackTierError(ErrorKind.UNSUPPORTED, f"PLE table of layer {layer}: {what}", layer=layer,
                          fix=f"{fix}, or source = \"dram\" on its [[table]] to keep vLLM's own table")


def check_format(layer: int, method: Any, embedding_dim: int) -> None:
    """Refuse a PLE table SlackTier's rows cannot hold exactly: only fp8 with a per-tensor scale, 256 values."""
    name = type(method).__name__
    if name != "Qwen4ExpPLEFp8EmbeddingMethod":
        what = {"Qwen4ExpPLEUnquantizedEmbeddingMethod": "the table is unquantized (bf16); SlackTier's rows are fp8 "
                "E4M3 with E8M0 block scales, and a bf16 row has no exact fp8 form (no bf16 row codec is built)",
                "Qwen4ExpPLENvFp4EmbeddingMethod": "the table is NVFP4 (E2M1 values, E4M3 block scales of 16), "
                "another row format than SlackTier's (no NVFP4 row codec is built)"}.get(name, f"format {name}")
        raise _refuse(layer, what, "an fp8 PLE checkpoint (ple_embedding_dtype = \"float8_e4m3fn\")")
    if embedding_dim != ROW_VALUES:
        raise _refuse(layer, f"rows of {embedding_dim} values; SlackTier's rows hold {ROW_VALUES} (no row codec of "
                      "another width is built)", f"ple_embed_dim = heads * {ROW_VALUES}")


@functools.cache
def served_embedding_class() -> type:
    """`ServedPLEEmbedding`, a subclass of vLLM's Qwen4ExpPLEEmbedding (built on first use: vLLM is imported lazily)."""
    from vllm.compilation.breakable_cudagraph import eager_break_during_capture
    from vllm.models.qwen4_exp.common.ngram_embedding import Qwen4ExpPLEEmbedding

    class ServedPLEEmbedding(Qwen4ExpPLEEmbedding):
        """A PLE table whose rows SlackTier serves: no rows in vLLM, vLLM's prefetch interface."""

        supports_prefetch = True

        def __init__(self, num_embeddings: int, embedding_dim: int, *, params_dtype: torch.dtype, padding_size: int,
                     prefix: str, embedding_method: Any, num_ngram_heads: int = 1, max_total_tokens: int = 0,
                     data_parallel_rank: int = 0, reduce_results: bool = True) -> None:
            building = _BUILDING.get()
            if building is None:
                raise SlackTierError(ErrorKind.BAD_INPUT, "a ServedPLEEmbedding is built by the plug-in's "
                                     f"{NGRAM_MODULE}.Qwen4ExpNGramEmbedding.__init__ only",
                                     fix=f"set {core.CONTROL_ENV} and let vLLM build the model")
            _, layer = building
            check_format(layer, embedding_method, embedding_dim)
            super().__init__(num_embeddings, embedding_dim, params_dtype=params_dtype, padding_size=padding_size,
                             prefix=prefix, embedding_method=embedding_method, num_ngram_heads=num_ngram_heads,
                             max_total_tokens=max_total_tokens, data_parallel_rank=data_parallel_rank,
                             reduce_results=reduce_results)
            if self.tp_size != 1:
                raise _refuse(layer, f"the ETP group has {self.tp_size} ranks (vLLM splits the padded table into "
                              "equal row blocks, not SlackTier's rank regions)", "ETP size 1")
            self.layer = layer
            self.num_ngram_heads = num_ngram_heads
            # the checkpoint's rows the loader skips are compared with the staged table's identity first
            self._slacktier_identity = identity_check(building[0].table(layer).manifest, layer, "vLLM",
                                                      core.loaded_from(), ("values",))

        def allocate_embedding_weight(self, num_embeddings: int, embedding_dim: int,
                                      dtype: torch.dtype) -> torch.Tensor:
            """No rows: they live on the tier."""
            return torch.empty(0, embedding_dim, dtype=dtype)

        def weight_loader(self, param: torch.Tensor, loaded_weight: torch.Tensor,
                          checkpoint_start: int | None = None) -> None:
            """The checkpoint's rows (whole or in shards) are compared with the table's identity, then skipped;
            the per-tensor scale loads as vLLM's."""
            if param is self.weight:
                if self._slacktier_identity is not None:
                    self._slacktier_identity.feed("values", loaded_weight, checkpoint_start or 0,
                                                  whole=checkpoint_start is None)
                return
            super().weight_loader(param, loaded_weight, checkpoint_start)

        @eager_break_during_capture
        def start_prefetch(self, ngram_ids: torch.Tensor) -> None:
            """This layer's ids [T, C]: begin_step once every served PLE layer's are in."""
            binding = core.current()
            if binding is None or binding.engine is None:
                raise SlackTierError(ErrorKind.BAD_INPUT, f"PLE layer {self.layer}: no SlackTier binding in this "
                                     "worker", layer=self.layer, fix=f"keep {core.CONTROL_ENV} set in every worker")
            binding.collect(self.layer, ngram_ids)

        def finalize_prefetch(self, total_tokens: int) -> torch.Tensor:
            """The layer's rows [T, C * 256] bf16; vLLM's own dequantize applies the per-tensor scale after it."""
            output = torch.empty((total_tokens, self.num_ngram_heads * self.embedding_dim), dtype=torch.bfloat16,
                                 device=self.weight_scale.device)
            self._finalize(output)
            return output

        @eager_break_during_capture
        def _finalize(self, output: torch.Tensor) -> None:
            binding = core.current()
            if binding is None or binding.engine is None or not binding.engine.in_step:
                raise SlackTierError(ErrorKind.BAD_INPUT, f"vLLM finalized PLE layer {self.layer} with no SlackTier "
                                     "step open", layer=self.layer,
                                     fix="start_prefetch of every served PLE layer begins the step: check that vLLM "
                                     "calls it before the layer")
            rows = binding.engine.gather(self.layer)   # [T, C, 256] bf16 on the engine's device
            if rows.shape[0] != output.shape[0]:
                raise SlackTierError(ErrorKind.BAD_INPUT, f"vLLM wants {output.shape[0]} tokens' PLE rows, the step "
                                     f"began with {rows.shape[0]}", layer=self.layer,
                                     fix="a step's lookups must be the ids start_prefetch received")
            output.copy_(rows.flatten(-2), non_blocking=True)

        def forward(self, ngram_ids: torch.Tensor) -> torch.Tensor:
            """Never called: vLLM uses the prefetch interface when supports_prefetch is set."""
            raise SlackTierError(ErrorKind.BAD_INPUT, f"vLLM asked a SlackTier-served PLE table (layer {self.layer}) "
                                 "for a lookup of its own", layer=self.layer,
                                 fix=f"this path is outside the plug-in's scope; unset {core.CONTROL_ENV}")

    return ServedPLEEmbedding


# ---- the hooks --------------------------------------------------------------------------------------


def _ngram_init(original: Callable[..., None], module: torch.nn.Module, config: Any, embedding_dim: int,
                *args: Any, prefix: str, **kwargs: Any) -> None:
    """Qwen4ExpNGramEmbedding.__init__: a table the control file serves from a non-DRAM tier gets the third backend."""
    columns = (int(config.ngram_size) - 1) * int(config.heads_per_ngram)
    binding = core.bind(columns, "PLE")
    if binding is None:
        original(module, config, embedding_dim, *args, prefix=prefix, **kwargs)
        return
    layer = layer_in_prefix(prefix, f"vLLM {core.CHECKED_VERSION}")
    t = binding.table(layer)
    if t is None:
        raise SlackTierError(ErrorKind.MISSING, f"{binding.path} lists no table for PLE layer {layer}", layer=layer,
                             fix='add a [[table]] for it (source = "dram" leaves it to vLLM)')
    if tier_facts(t.source).holds_host_copy:
        original(module, config, embedding_dim, *args, prefix=prefix, **kwargs)
        return
    stock = importlib.import_module(NGRAM_MODULE)
    saved = {name: getattr(stock, name) for name in STOCK_BACKENDS}
    token = _BUILDING.set((binding, layer))
    try:   # the class choice reads these module globals; model building is single-threaded
        for name in STOCK_BACKENDS:
            setattr(stock, name, served_embedding_class())
        original(module, config, embedding_dim, *args, prefix=prefix, **kwargs)
    finally:
        for name, cls in saved.items():
            setattr(stock, name, cls)
        _BUILDING.reset(token)
    check_ple_layout(binding, layer, module.ngram_heads_vocab_sizes.tolist())


def _model_forward(original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Qwen4ExpModel.forward: end_step after it (an eager break, so at every replay too), also when it raised."""
    with core.step():
        out = original(*args, **kwargs)
        core.end_break()()
        return out


_HOOKS = {"__init__": _ngram_init, "forward": _model_forward}


def patch() -> None:
    """Patch vLLM's Qwen4Exp seams (idempotent; called by adapters.vllm.register).

    A vLLM whose Qwen4Exp CUDA model does not import here (another platform) is logged and left alone: no PLE
    table can then be built, so none is served wrongly.
    """
    try:
        classes = [(getattr(importlib.import_module(module), cls_name), method) for module, cls_name, method in PATCHED]
    except ImportError as exc:
        log.warning("SlackTier's PLE backend is not installed: vLLM's Qwen4Exp CUDA model does not import (%s)", exc)
        return
    for cls, method in classes:
        current = cls.__dict__[method]
        if not getattr(current, "__slacktier__", False):
            setattr(cls, method, core.wrap(current, _HOOKS[method]))


__all__ = ["PATCHED", "STOCK_BACKENDS", "check_format", "patch", "served_embedding_class"]
