"""GPU checks of the plug-ins' PLE parts. UNVERIFIED: never run yet, and it has no entry point of its own.

Written on a CPU-only machine; nothing here has run on a GPU. Its runner
(gpu_checks_plugins.py) was replaced by gpu_check_sglang.py and gpu_check_vllm.py,
which do not run these parts yet; `ple_checks(folder, vllm)` is what one calls:

6a. sglang ple-rows: SGLang 0.5.23's own offloaded PLE table
    (`Qwen4ExpPinnedHostEmbedding`: its pinned host table, loaded through its
    weight_loader, read by its Triton UVA gather) against the plug-in's served
    table (engine on cuda), through SGLang's real HookRegistry: a prefill of two
    requests and five decode steps, both layers, gather outputs bit for bit;
    per-step lookup time of each.
6b. sglang ple-bcg: the plug-in's PLE calls as eager breaks of SGLang's
    BreakableCUDAGraph (SGLang's `_prepare_ple_batch` = begin_step, the served
    `gather(ids, out=static buffer)`, `_commit_ple_batch` = end_step) around a
    captured segment that reads the rows; each replay (the next decode step's
    ids) against the same step run eagerly. This is what the plug-in refuses
    until it passes (SLACKTIER_SGLANG_UNVERIFIED=breakable-ple-prefill opts in).
6c. vllm ple-rows: vLLM 0.33.0's `Qwen4ExpPLEPinnedHostEmbedding`
    (engram_config.cpu_offload: its Triton UVA lookup on a side stream) against
    the plug-in's `ServedPLEEmbedding`, both through `start_prefetch` /
    `finalize_prefetch` and vLLM's `dequantize`, rows bit for bit.

Tables: tests/ple_common.py's two scaled PLE tables (~16,800 rows each), staged
on local disk; the CPU tests (tests/test_adapters_*_ple.py) check the same rows
against the engines' resident tables.
"""

from __future__ import annotations

import os
import traceback
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

import torch

from engines import import_sglang, import_vllm
from ple_common import EOS, LAYERS, SCALE, RequestPool, padded, ple_control, ple_world, same_rows, sglang_batches, \
    sglang_ngram, sglang_text_config
from slacktier.adapters import sglang as sg_plug
from slacktier.adapters import sglang_ple as sg_ple
from slacktier.adapters import vllm as vl_plug
from slacktier.adapters import vllm_ple as vl_ple


def _timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    import time

    torch.cuda.synchronize()
    t0 = time.perf_counter_ns()
    out = fn()
    torch.cuda.synchronize()
    return out, (time.perf_counter_ns() - t0) / 1e3


def sglang_ple(world: SimpleNamespace) -> dict:
    """6a and 6b."""
    qwen = import_sglang(sg_ple.MODULE)
    rc = import_sglang("sglang.srt.runtime_context")
    plugins = import_sglang("sglang.srt.plugins")
    modes = import_sglang("sglang.srt.model_executor.forward_batch_info")
    rc.get_context().override_server_args(disable_overlap_schedule=True).install()
    os.environ["SGLANG_PLUGINS"] = "slacktier"
    os.environ[sg_plug.UNVERIFIED_ENV] = sg_plug.BREAKABLE_PLE_PREFILL
    env = str(ple_control(world.dir / "sglang_ple.toml", world.manifest, device="cuda"))
    os.environ[sg_plug.CONTROL_ENV] = env
    plugins.load_plugins()
    pool = RequestPool(2)
    qwen.get_req_to_token_pool = lambda: pool   # the request pool SGLang's PLE batch code reads
    out: dict[str, Any] = {"steps": []}
    with rc.get_parallel().override(tp_size=1, tp_rank=0, attn_tp_size=1, moe_tp_size=1, tp_group=None):
        served = {layer: sglang_ngram(qwen, sglang_text_config(offload=True), layer) for layer in LAYERS}
        os.environ.pop(sg_plug.CONTROL_ENV)
        stock = {layer: sglang_ngram(qwen, sglang_text_config(offload=True), layer) for layer in LAYERS}
        for layer, module in stock.items():
            emb = module.ngram_embedding
            emb.weight_loader(emb.weight, padded(world.tables[layer], world.layouts[layer].padded_rows))
        for module in (*served.values(), *stock.values()):
            module.ngram_embedding.weight_scale.fill_(SCALE)
        batches = list(sglang_batches(modes.ForwardMode, world))
        for step, (ids, batch) in enumerate(batches):
            os.environ[sg_plug.CONTROL_ENV] = env
            with sg_plug.step():
                pb = qwen._prepare_ple_batch(input_ids=ids, forward_batch=batch, ngram_size=3,
                                             ngram_eos_token_id=EOS)   # the plug-in's begin_step
                lookup = {layer: served[layer].compute_ngram_ids(pb).cuda() for layer in LAYERS}
                got, t_plug = _timed(lambda: {layer: served[layer].ngram_embedding.gather(lookup[layer])
                                              for layer in LAYERS})
                qwen._commit_ple_batch(pb, batch)   # the plug-in's end_step; SGLang's history advances
            os.environ.pop(sg_plug.CONTROL_ENV)
            want, t_stock = _timed(lambda: {layer: stock[layer].ngram_embedding.gather(lookup[layer])
                                            for layer in LAYERS})
            out["steps"].append({"step": step, "tokens": len(ids), "plug-in": t_plug, "UVA host table": t_stock,
                                 "equal to UVA host table": all(same_rows(got[k], want[k]) for k in LAYERS)})
        out["bcg"] = _sglang_ple_bcg(qwen, served, batches[1:], pool, env)
    os.environ[sg_plug.CONTROL_ENV] = env
    return out


def _sglang_ple_bcg(qwen: Any, served: dict[int, Any], batches: list, pool: RequestPool, env: str) -> dict:
    """6b: begin / gather / end as eager breaks of a BreakableCUDAGraph; each replay against the same step eagerly."""
    bcg = import_sglang("sglang.srt.model_executor.runner_backend_utils.breakable_cuda_graph.breakable_cuda_graph")
    heads = served[LAYERS[0]].ngram_heads
    static_rows = {layer: torch.zeros(2, heads, 256, dtype=torch.bfloat16, device="cuda") for layer in LAYERS}
    weight = torch.randn(heads * 256, 64, device="cuda", dtype=torch.bfloat16) * 0.02
    host: dict[str, Any] = {"k": 0}

    @bcg.eager_on_graph
    def begin(x: torch.Tensor) -> torch.Tensor:
        ids, batch = batches[host["k"]]
        host["pb"] = qwen._prepare_ple_batch(input_ids=ids, forward_batch=batch, ngram_size=3,
                                             ngram_eos_token_id=EOS)
        return x

    @bcg.eager_on_graph
    def rows(x: torch.Tensor, layer: int) -> torch.Tensor:
        lookup = served[layer].compute_ngram_ids(host["pb"]).cuda()
        served[layer].ngram_embedding.gather(lookup, out=static_rows[layer])
        return x

    @bcg.eager_on_graph
    def end(x: torch.Tensor) -> torch.Tensor:
        qwen._commit_ple_batch(host["pb"], batches[host["k"]][1])
        return x

    def step(x: torch.Tensor) -> torch.Tensor:
        x = begin(x)
        for layer in LAYERS:
            x = rows(x, layer)
        y = sum(static_rows[layer].flatten(-2) @ weight for layer in LAYERS)   # the captured segment
        return end(y + x.sum())

    os.environ[sg_plug.CONTROL_ENV] = env
    x = torch.zeros(1, device="cuda")
    try:
        graph = bcg.BreakableCUDAGraph()
        history = pool.history.clone()
        step(x)   # warm-up, eager, on step 0; then the capture replays step 0 too
        pool.history.copy_(history)
        with bcg.BreakableCUDAGraphCapture(graph):
            static_out = step(x)
        equal = 0
        for k in range(1, len(batches)):
            host["k"] = k
            before = pool.history.clone()
            graph.replay()
            replayed = static_out.clone()
            pool.history.copy_(before)
            eager = step(x)
            equal += same_rows(replayed, eager)
        return {"captured": True, "replays_equal_to_eager": f"{equal} of {len(batches) - 1}"}
    except Exception as exc:   # noqa: BLE001 - the probe records what stops it
        return {"captured": False, "error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()[-1500:]}
    finally:
        os.environ.pop(sg_plug.CONTROL_ENV, None)


def vllm_with_plugin(control: Path) -> tuple[Any, Any]:
    """vLLM's config module and a VllmConfig with Engram CPU offload (eager, no model: the tables alone), the
    plug-in loaded through load_general_plugins() with `control` as its control file (the variable stays set)."""
    config_mod = import_vllm("vllm.config")
    engram_config = import_vllm("vllm.config.engram")
    plugins = import_vllm("vllm.plugins")
    os.environ["VLLM_PLUGINS"] = "slacktier"
    os.environ[vl_plug.CONTROL_ENV] = str(control)
    plugins.load_general_plugins()
    vc = config_mod.VllmConfig(engram_config=engram_config.EngramConfig(cpu_offload=True))
    object.__setattr__(vc, "model_config", SimpleNamespace(enforce_eager=True))
    return config_mod, vc


def vllm_ple(world: SimpleNamespace) -> dict:
    """6c."""
    ngram = import_vllm(vl_ple.NGRAM_MODULE)
    dist = import_vllm("vllm.distributed")
    from transformers import Qwen4ExpTextConfig

    env = str(ple_control(world.dir / "vllm_ple.toml", world.manifest, device="cuda"))
    config_mod, vc = vllm_with_plugin(Path(env))
    layout = world.layouts[LAYERS[0]]
    hf = Qwen4ExpTextConfig(ple_embed_dim=16 * 256, ngram_vocab_size_base=layout.ngram_vocab_size_base,
                            vocab_size=layout.vocab_size, eos_token_id=EOS, ple_embedding_dtype="float8_e4m3fn")
    out: dict[str, Any] = {"steps": []}
    with config_mod.set_current_vllm_config(vc):
        if not dist.model_parallel_is_initialized():
            dist.init_distributed_environment(world_size=1, rank=0, local_rank=0,
                                              distributed_init_method="tcp://127.0.0.1:29518", backend="nccl")
            dist.initialize_model_parallel(1)

        def build(layer: int) -> Any:
            with torch.device("cuda"):
                return ngram.Qwen4ExpNGramEmbedding(hf, hf.ple_embed_dim, LAYERS.index(layer), 1024,
                                                    data_parallel_rank=0,
                                                    prefix=f"model.layers.{layer}.ple.ple_embedding")

        served = {layer: build(layer) for layer in LAYERS}
        os.environ.pop(vl_plug.CONTROL_ENV)
        stock = {layer: build(layer) for layer in LAYERS}
        for layer in LAYERS:
            for module, rows in ((served[layer], None), (stock[layer], world.tables[layer])):
                emb = module.ngram_embedding
                if rows is not None:
                    emb.weight.weight_loader(emb.weight, padded(rows, emb.org_vocab_size), checkpoint_start=0)
                emb.weight_scale.weight_loader(emb.weight_scale, torch.tensor([SCALE]))
        p0, p1 = (torch.from_numpy(p) for p in world.prompts)
        steps = [(torch.cat([p0, p1]), torch.tensor([0, len(p0), len(p0) + len(p1)]),
                  torch.full((2, 2), EOS, dtype=torch.long)),   # a prefill of both requests, then one decode step
                 (torch.from_numpy(world.next_tokens[:2]), torch.tensor([0, 1, 2]), torch.stack([p0[-2:], p1[-2:]]))]
        for step, (ids, qsl, context) in enumerate(steps):
            ids, qsl, context = ids.cuda(), qsl.cuda(), context.cuda()

            def run(modules: dict[int, Any]) -> dict[int, torch.Tensor]:
                for layer in LAYERS:
                    modules[layer].start_prefetch(ids, qsl, context)
                return {layer: modules[layer].ngram_embedding.dequantize(modules[layer](None, ids, qsl, context),
                                                                         torch.bfloat16) for layer in LAYERS}

            os.environ[vl_plug.CONTROL_ENV] = env
            with vl_plug.step():
                got, t_plug = _timed(lambda: run(served))
            os.environ.pop(vl_plug.CONTROL_ENV)
            want, t_stock = _timed(lambda: run(stock))
            out["steps"].append({"step": step, "tokens": len(ids), "plug-in": t_plug, "UVA host table": t_stock,
                                 "equal to UVA host table": all(same_rows(got[k], want[k]) for k in LAYERS)})
    return out


def ple_checks(folder: Path, vllm: bool) -> dict:
    """Part 6: each sub-part's result, or why it did not run."""
    world = ple_world(folder)
    out: dict[str, Any] = {"unverified": "written without a GPU; this is its first run"}
    for name, run in (("sglang", lambda: sglang_ple(world)), ("vllm", lambda: vllm_ple(world))):
        if name == "vllm" and not vllm:
            out[name] = {"not run": "vLLM's part needs the vLLM process groups part 2 builds (run with a GPU)"}
            continue
        try:
            out[name] = run()
        except BaseException as exc:   # noqa: BLE001 - a part that cannot run is reported, the others go on
            out[name] = {"not run": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()[-1500:]}
    return out


__all__ = ["ple_checks", "vllm_with_plugin"]
