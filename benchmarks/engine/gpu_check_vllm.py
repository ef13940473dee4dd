"""GPU check of the vLLM plug-in: vLLM 0.33.0's own Engram table and lookup against the plug-in, on one GPU.

One engine per process (gpu_check_sglang.py is SGLang's). What it carries: the
working tree's src/ (the slacktier package, on sys.path by path) and vLLM's
Python modules; no pytest, nothing of tests/. What it makes: a tiny V4-shaped
checkpoint and its staged table (gpu_check_common.py). Hash ids come from
SlackTier's EngramHasher over real text (equal to the engines' hash: the CPU
tests check vLLM's primes and SGLang's hasher against it). Parts, each under
its own budget, each printing one line `PART <name> PASS|FAIL|SKIP <s>s <facts>`:

- rows: vLLM's own `ParallelEngramEmbedding` with `cpu_offload` (pinned host
  memory read by its Triton `_engram_lookup_kernel` through UVA), loaded
  through its own weight loader, is the reference; the plug-in (loaded through
  vLLM's `load_general_plugins()`) builds its `ServedTable` through the patched
  `Engram._create_embedding` and serves rows through the patched
  `prepare_embeddings`, `_ready_rows` and vLLM's own `Engram.embed`, the step
  ended by the plug-in's `DeepseekV4Model.forward` hook. Rows bit for bit over
  three steps; the plug-in is active (its engine counted every lookup, the
  served tables hold zero rows); negative control: a table staged from another
  checkpoint mismatches.
- bcg: the same forward captured with vLLM's own BreakableCUDAGraphCapture on a
  side stream (VLLM_USE_BREAKABLE_CUDAGRAPH=1, cudagraph_mode PIECEWISE: the
  plug-in's scope check passes), the plug-in's calls as its eager breaks;
  replayed on new ids written into the graph's hash-id buffer and compared with
  the stock lookup of those ids; the breaks counted.
- time: a step's lookup path at B = 1, 8, 64 decode tokens, medians: vLLM's
  stock UVA lookup of both layers against the plug-in (begin_step, both
  gathers, end_step), eager, and the plug-in's captured graph replayed.
- ple: Qwen3.8's PLE tables (two scaled fp8 tables with a per-tensor scale):
  vLLM's own `Qwen4ExpNGramEmbedding` with its pinned-host backend
  (`engram_config.cpu_offload`: its Triton UVA lookup) against the plug-in's
  `ServedPLEEmbedding`, through `start_prefetch`, the module's forward and
  vLLM's `dequantize`, the step ended by the plug-in's `Qwen4ExpModel.forward`
  hook; a prefill of two requests and a decode step; the plug-in active;
  another checkpoint's table as negative control. (Its hash runs on the
  device's torch path; the CPU rehearsal's stock is vLLM's device backend.)

The Engram module itself (its wkv projection needs vLLM's TP groups) is stood
in for by an object holding what the patched seams and `Engram.embed` read
(`embed_tokens`, `staged_rows`); TP 1 is stated through vLLM's own getters.

`--cpu` dress-rehearses all of it on the CPU: vLLM's Triton lookup under
TRITON_INTERPRET=1 over a table in host memory (UVA needs a GPU; vLLM's import
finds no GPU driver and stands Triton in, so its kernel's own function is
jitted again by the installed Triton), and vLLM's own capture class with
recorded segments in place of CUDA graphs.
tests/test_gpu_check_scripts.py runs it in CI.

On the device machine (Python 3.12, CUDA torch 2.11, Triton 3.6, no network).
Once, here, from this checkout's root (it measures what it packed: the
engine's Python sources are about 11 MB compressed; the wheels are not yet
measured, and the working tree travels too, within the 64 MiB a call carries):

    benchmarks/engine/gpu_check_pack.sh vllm

then the `run` tool with carry [".gpucheck"] and timeout_s 540, command:

    mkdir -p /tmp/site && tar xzf .gpucheck/engine.tgz -C /tmp/site && python3 -m pip install -q --no-index \
      --no-deps --no-compile --no-cache-dir --target /tmp/site .gpucheck/whl/*.whl && export PYTHONPATH=/tmp/site \
      && PYTHONUNBUFFERED=1 timeout 500 python3 benchmarks/engine/gpu_check_vllm.py

Its summary lines come back in $OUT/summary.txt. Without vLLM's compiled `_C` (not
carried), a strong reference stands in for its
`weak_ref_tensor` of a break's arguments (the SETUP line says so), and where its UVA view of
the host table fails the rows line says the stock table lived in device memory instead. Not yet run on a GPU.
"""

from __future__ import annotations

import os
import sys
import types
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_check_common as C  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

CONTROL_ENV = "SLACKTIER_VLLM_CONTROL"


def load_vllm(cpu: bool, out: Path) -> SimpleNamespace:
    """vLLM's Engram module and breakable capture, one TP-1 worker stated through vLLM's getters, breakable graphs
    on, the plug-in loaded through vLLM's own load_general_plugins()."""
    if cpu:
        C.torchvision_without_compiled_ops()
    os.environ["VLLM_USE_BREAKABLE_CUDAGRAPH"] = "1"
    os.environ["VLLM_PLUGINS"] = "slacktier"
    import vllm.config as config
    import vllm.distributed as distributed
    from vllm.compilation import breakable_cudagraph as bcg
    from vllm.config.engram import EngramConfig
    from vllm.models.deepseek_v41.common import engram
    from vllm.plugins import load_general_plugins

    notes = []
    for module in (engram, distributed):
        module.get_tensor_model_parallel_rank = lambda: 0
    engram.get_tensor_model_parallel_world_size = lambda: 1
    engram.get_engram_dp_size = lambda: 1
    cfg = SimpleNamespace(parallel_config=config.ParallelConfig(tensor_parallel_size=1),
                          engram_config=EngramConfig(), additional_config={}, speculative_config=None,
                          model_config=SimpleNamespace(enforce_eager=False),
                          compilation_config=SimpleNamespace(cudagraph_mode=config.CUDAGraphMode.PIECEWISE))
    config.get_current_vllm_config = lambda: cfg
    # PLE: vLLM's Qwen4Exp n-gram modules ask for their TP and ETP groups and the config the same way.
    from vllm.model_executor import parameter
    from vllm.models.qwen4_exp.common import ngram_embedding as ple_common
    from vllm.models.qwen4_exp.nvidia import ngram_embedding as ple_ngram

    group = SimpleNamespace(world_size=1, rank_in_group=0)
    for module in (ple_ngram, ple_common):
        module.get_etp_group = lambda: group
        module.get_tp_group = lambda: group
    parameter.get_tensor_model_parallel_rank = lambda: 0
    parameter.get_tensor_model_parallel_world_size = lambda: 1
    ple_ngram.get_current_vllm_config = lambda: cfg
    if cpu:
        # vLLM asks the GPU for its SM count when it builds a table; the rehearsal states one.
        torch.cuda.get_device_properties = lambda index: SimpleNamespace(multi_processor_count=4)
        torch.accelerator.current_device_index = lambda: 0
        # vLLM's import finds no GPU driver and hands out a stand-in for Triton: its lookup kernel's own
        # function is jitted again by the installed Triton (interpreter mode), nothing of its body changed.
        import triton
        import triton.language as tl

        fn = engram._engram_lookup_kernel
        fn = getattr(fn, "fn", fn)
        engram._engram_lookup_kernel = triton.jit(types.FunctionType(
            fn.__code__, {**fn.__globals__, "tl": tl, "triton": triton}, fn.__name__, fn.__defaults__))
        notes.append("vLLM's lookup kernel under the Triton interpreter")
    if not hasattr(torch.ops._C, "weak_ref_tensor"):
        # vLLM's capture weak-references a break's tensor arguments through its compiled _C; a strong reference
        # keeps the same memory alive instead.
        bcg.weak_ref_tensor = lambda t: t
        notes.append("vllm._C absent: breaks hold strong references")
    note = C.ensure_entry_point("vllm.general_plugins", "slacktier.adapters.vllm:register", out / "site")
    if note:
        notes.append(note)
    with C.env(CONTROL_ENV, "set-when-a-table-is-built.toml"):
        load_general_plugins()
    from slacktier.adapters import vllm as plug

    return SimpleNamespace(engram=engram, bcg=bcg, plug=plug, notes=notes, cfg=cfg, ple_ngram=ple_ngram)


def vllm_layout(world: SimpleNamespace) -> SimpleNamespace:
    """What Engram._create_embedding reads of vLLM's EngramLayout: per layer, per order, its heads' primes."""
    lay = world.layout
    return SimpleNamespace(layer_ids=list(C.LAYERS), head_dim=C.DIM,
                           num_embeddings=[lay.layer_rows(layer) for layer in C.LAYERS],
                           primes=[[[int(p) for p in np.diff(lay.layer_column_bounds(layer))][o * 8:(o + 1) * 8]
                                    for o in range(3)] for layer in C.LAYERS])


def stock_tables(vl: SimpleNamespace, world: SimpleNamespace, cpu: bool) -> tuple[dict[int, Any], str]:
    """vLLM's own tables through its own weight loader: in pinned host memory (UVA) on a GPU."""
    out, where = {}, "device table (CPU rehearsal)" if cpu else "pinned host table (UVA)"
    for layer in C.LAYERS:
        sizes = tuple(int(p) for p in np.diff(world.layout.layer_column_bounds(layer)))
        try:
            table = vl.engram.ParallelEngramEmbedding(world.layout.layer_rows(layer), C.DIM, sizes,
                                                      cpu_offload=not cpu)
            table._storage()   # the UVA view of the host table (vLLM's compiled _C) is made here
        except (RuntimeError, AttributeError, ImportError) as exc:
            if cpu:
                raise
            table = vl.engram.ParallelEngramEmbedding(world.layout.layer_rows(layer), C.DIM, sizes)
            where = f"device table (vLLM's UVA path failed: {type(exc).__name__}: {exc})"
        w, s = world.tables["ckpt"][layer]
        table.weight.weight_loader(table.weight, w)
        table.weight_scale_inv.weight_loader(table.weight_scale_inv, s)
        if not cpu and not table.cpu_offload:
            table.to("cuda")
        out[layer] = table
    return out, where


def served_layers(vl: SimpleNamespace, world: SimpleNamespace, control: str, max_tokens: int,
                  device: str) -> list[SimpleNamespace]:
    """The plug-in's tables through the patched Engram._create_embedding, in stand-ins for vLLM's Engram."""
    os.environ[CONTROL_ENV] = control
    Engram = vl.engram.Engram
    layers = []
    for i in range(len(C.LAYERS)):
        ns = SimpleNamespace(embed_tokens=Engram._create_embedding(SimpleNamespace(), vllm_layout(world), i),
                             staged_rows=torch.empty(max_tokens, 24, C.DIM, dtype=torch.bfloat16, device=device),
                             use_sequence_parallel=False)
        ns._ready_rows = lambda n, ns=ns: Engram._ready_rows(ns, n)
        layers.append(ns)
    return layers


def forward(vl: SimpleNamespace, layers: list[SimpleNamespace], hashes: torch.Tensor) -> list[torch.Tensor]:
    """DeepseekV4Model.forward's Engram part, ended by the plug-in's forward hook (what vLLM's patched forward
    runs): every layer's prepare_embeddings, then each layer's embed."""
    Engram = vl.engram.Engram

    def body() -> list[torch.Tensor]:
        for i, ns in enumerate(layers):
            Engram.prepare_embeddings(ns, hashes[:, i])
        return [Engram.embed(ns, hashes[:, i]) for i, ns in enumerate(layers)]

    return vl.plug._model_forward(body)


def stock_rows(stock: dict[int, Any], hashes: torch.Tensor) -> list[torch.Tensor]:
    return [stock[layer](hashes[:, i]) for i, layer in enumerate(C.LAYERS)]


def hash_ids(world: SimpleNamespace, n: int, seed: int, device: str) -> torch.Tensor:
    """[n, 2, 24] row ids of real text (SlackTier's EngramHasher, equal to the engines')."""
    from slacktier.tables.engram_hash import EngramHasher
    from slacktier.testing.engine import real_text
    from slacktier.tables.tokenizer import encode

    tokens = np.asarray(encode(real_text(8 * (n + 64 * seed)))[64 * seed:64 * seed + n], dtype=np.int64)
    assert len(tokens) == n, f"real text gave {len(tokens)} tokens of {n}"
    return torch.from_numpy(EngramHasher(world.layout).prefill(tokens)).to(device)


# ---- parts ----------------------------------------------------------------------------------------------


def part_rows(vl: SimpleNamespace, world: SimpleNamespace, stock: dict, where: str,
              device: str) -> tuple[bool, str]:
    layers = served_layers(vl, world, str(world.controls["ckpt"]), 256, device)
    compared = differ = 0
    for step in range(3):
        hashes = hash_ids(world, 256, step, device)
        for g, w in zip(forward(vl, layers, hashes), stock_rows(stock, hashes)):
            n, d = C.same_rows(g, w)
            compared, differ = compared + n, differ + d
    engine = vl.plug.current().engine
    lookups = sum(c.lookups for c in engine.totals.values())
    held = sum(ns.embed_tokens.weight.shape[0] + ns.embed_tokens.weight_scale_inv.shape[0] for ns in layers)
    active = lookups == compared and held == 0 and not engine.in_step
    other = served_layers(vl, world, str(world.controls["other"]), 256, device)
    hashes = hash_ids(world, 256, 0, device)
    control_differ = sum(C.same_rows(g, w)[1] for g, w in zip(forward(vl, other, hashes), stock_rows(stock, hashes)))
    ok = differ == 0 and active and control_differ > 0
    return ok, (f"rows {compared} mismatches {differ}; plug-in lookups {lookups}, vLLM rows held {held}; negative "
                f"control (other checkpoint) mismatches {control_differ}; stock {where}")


class CaptureRun(SimpleNamespace):
    """A captured forward: its capture, output buffers, hash-id buffer and side stream."""


def capture(vl: SimpleNamespace, layers: list, hashes: torch.Tensor, cpu: bool) -> CaptureRun:
    if cpu:
        class CpuCapture(vl.bcg.BreakableCUDAGraphCapture):
            def _begin_segment(self) -> None:
                self._capturing = True

            def _end_segment(self) -> None:
                if self._capturing:
                    self.segments.append(lambda: None)   # a segment stands for kernels: no Python at a replay
                    self._num_graphs += 1
                    self._capturing = False

        cap = CpuCapture()
        with cap:
            outs = forward(vl, layers, hashes)
        return CaptureRun(cap=cap, outs=outs, hashes=hashes, stream=None)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        forward(vl, layers, hashes)   # warm-up, eager
        torch.cuda.synchronize()
        cap = vl.bcg.BreakableCUDAGraphCapture(pool=torch.cuda.graph_pool_handle())
        with cap:
            outs = forward(vl, layers, hashes)
    torch.cuda.synchronize()
    return CaptureRun(cap=cap, outs=outs, hashes=hashes, stream=stream)


def replay(run: CaptureRun, new: torch.Tensor, cpu: bool) -> None:
    run.hashes.copy_(new)   # what the graph's hash kernel writes (not part of this graph)
    if cpu:
        run.cap.replay()
        return
    with torch.cuda.stream(run.stream):
        run.cap.replay()
    torch.cuda.synchronize()


def part_bcg(vl: SimpleNamespace, world: SimpleNamespace, stock: dict, cpu: bool, device: str) -> tuple[bool, str]:
    import vllm.config

    from slacktier.adapters import vllm_binding

    scope = vllm_binding.read_serving(vllm.config.get_current_vllm_config())
    vl.plug.check_scope(scope, 24)   # breakable PIECEWISE graphs: in scope
    layers = served_layers(vl, world, str(world.controls["ckpt"]), 64, device)
    engine = vl.plug.current().engine
    run = capture(vl, layers, hash_ids(world, 8, 5, device), cpu)
    breaks = run.cap.num_eager_breaks
    before = engine.totals[C.LAYERS[0]].lookups
    compared = differ = moved = 0
    for step in range(3):
        old = [o.clone() for o in run.outs]
        replay(run, hash_ids(world, 8, 10 + step, device), cpu)
        for g, w, o in zip(run.outs, stock_rows(stock, run.hashes), old):
            n, d = C.same_rows(g, w)
            compared, differ, moved = compared + n, differ + d, moved + C.same_rows(g, o)[1]
    counted = engine.totals[C.LAYERS[0]].lookups - before
    ok = differ == 0 and breaks == 5 and counted == 3 * 8 * 24 and moved > 0 and not engine.in_step
    notes = ("; " + "; ".join(vl.notes)) if vl.notes else ""
    return ok, (f"scope {scope.cudagraph_mode} breakable={scope.breakable} accepted; breaks {breaks} (2 collects, "
                f"2 gathers, end); replayed rows {compared} mismatches {differ}; rows changed between replays "
                f"{moved} (negative control); lookups counted at replay {counted}"
                f"{'; segments recorded, not CUDA graphs' if cpu else '; side stream'}{notes}")


def part_time(vl: SimpleNamespace, world: SimpleNamespace, stock: dict, cpu: bool, device: str) -> tuple[bool, str]:
    layers = served_layers(vl, world, str(world.controls["ckpt"]), 64, device)
    engine = vl.plug.current().engine
    facts = []
    repeats = 3 if cpu else 20
    for b in (1, 8, 64):
        hashes = hash_ids(world, b, 20, device)
        stock_step: Callable[[], Any] = lambda: stock_rows(stock, hashes)   # noqa: E731
        plug_step: Callable[[], Any] = lambda: forward(vl, layers, hashes)   # noqa: E731
        t_stock = C.median_us(stock_step, cpu, repeats)
        t_plug = C.median_us(plug_step, cpu, repeats)
        run = capture(vl, layers, hashes.clone(), cpu)
        new = hash_ids(world, b, 21, device)
        t_graph = C.median_us(lambda: replay(run, new, cpu), cpu, repeats)
        facts.append(f"B={b}: stock {t_stock:.0f} us, plug-in {t_plug:.0f} us, plug-in graph replay "
                     f"{t_graph:.0f} us")
    return (not engine.in_step), "medians; " + "; ".join(facts) + (" (CPU: not a measurement)" if cpu else "")


def part_ple(vl: SimpleNamespace, cpu: bool, device: str, folder: Path) -> tuple[bool, str]:
    """Qwen3.8's PLE tables: vLLM's pinned-host backend (cpu_offload: its Triton UVA lookup) on a GPU, its device
    backend on the CPU, against the plug-in's ServedPLEEmbedding; through start_prefetch, the module's forward
    (finalize_prefetch) and vLLM's own dequantize (times the per-tensor scale); a prefill of two requests, then
    one decode step each."""
    from transformers import Qwen4ExpTextConfig

    from slacktier.adapters import vllm_ple

    world = C.make_ple_world(folder, device)
    hf = Qwen4ExpTextConfig(ple_embed_dim=C.PLE_DIM, ngram_vocab_size_base=C.PLE_BASE, vocab_size=C.PLE_VOCAB,
                            eos_token_id=C.PLE_EOS, ple_embedding_dtype="float8_e4m3fn")

    def build(rows: dict | None) -> dict[int, Any]:
        out = {}
        with torch.device(device):
            for i, layer in enumerate(C.PLE_LAYERS):
                module = vl.ple_ngram.Qwen4ExpNGramEmbedding(hf, C.PLE_DIM, i, 1024, data_parallel_rank=0,
                                                             prefix=f"model.layers.{layer}.ple.ple_embedding")
                emb = module.ngram_embedding
                if rows is not None:
                    emb.weight.weight_loader(emb.weight, C.padded(rows[layer], emb.org_vocab_size),
                                             checkpoint_start=0)
                emb.weight_scale.weight_loader(emb.weight_scale, torch.tensor([C.PLE_SCALE]))
                out[layer] = module
        return out

    p0, p1 = (torch.from_numpy(p).to(device) for p in world.prompts)
    eos = torch.full((2, 2), C.PLE_EOS, dtype=torch.long, device=device)
    steps = [(torch.cat([p0, p1]), torch.tensor([0, len(p0), len(p0) + len(p1)], device=device), eos),
             (torch.from_numpy(world.next_tokens[:2]).to(device), torch.tensor([0, 1, 2], device=device),
              torch.stack([p0[-2:], p1[-2:]]))]

    def run(modules: dict[int, Any]) -> list[dict[int, torch.Tensor]]:
        out = []
        for ids, qsl, context in steps:
            def body() -> dict[int, torch.Tensor]:
                for layer in C.PLE_LAYERS:   # vLLM starts each layer's prefetch ahead of the layer
                    modules[layer].start_prefetch(ids, qsl, context)
                return {layer: modules[layer].ngram_embedding.dequantize(modules[layer](None, ids, qsl, context),
                                                                          torch.bfloat16) for layer in C.PLE_LAYERS}
            out.append(vllm_ple._model_forward(body))   # what vLLM's patched Qwen4ExpModel.forward runs
        return out

    offload = vl.cfg.engram_config.cpu_offload
    with C.env(CONTROL_ENV, None):
        vl.cfg.engram_config.cpu_offload = not cpu   # the pinned-host backend on a GPU
        try:
            stock = build(world.tables["ckpt"])
        finally:
            vl.cfg.engram_config.cpu_offload = offload
        want = run(stock)
    backend = type(stock[C.PLE_LAYERS[0]].ngram_embedding).__name__
    os.environ[CONTROL_ENV] = str(world.controls["ckpt"])
    served = build(None)
    got = run(served)
    compared = differ = 0
    for g, w in zip(got, want):
        for layer in C.PLE_LAYERS:
            n, d = C.same_rows(g[layer], w[layer])
            compared, differ = compared + n, differ + d
    engine = vl.plug.current().engine
    lookups = sum(c.lookups for c in engine.totals.values())
    held = sum(m.ngram_embedding.weight.shape[0] for m in served.values())
    kinds = {type(m.ngram_embedding).__name__ for m in served.values()}
    os.environ[CONTROL_ENV] = str(world.controls["other"])
    other = run(build(None))
    control_differ = sum(C.same_rows(o[layer], w[layer])[1] for o, w in zip(other, want) for layer in C.PLE_LAYERS)
    ok = (differ == 0 and lookups > 0 and held == 0 and kinds == {"ServedPLEEmbedding"} and control_differ > 0
          and not engine.in_step)
    return ok, (f"embedding rows {compared} (x16 heads) mismatches {differ}; plug-in lookups {lookups}, vLLM rows "
                f"held {held}; negative control (other checkpoint) mismatches {control_differ}; stock {backend}")


def main() -> int:
    args = C.arguments("vllm", __doc__)
    device = "cpu" if args.cpu else "cuda"
    report = C.Report(args.out / "summary.txt")
    report.line(f"DEVICE {C.device_facts(args.cpu)}")
    vl = load_vllm(args.cpu, args.out)
    report.line("SETUP " + ("; ".join(vl.notes) or "engine and plug-in loaded"))
    world = C.make_world(args.out, args.vocab, device)
    stock, where = stock_tables(vl, world, args.cpu)
    share = args.budget_s / 4
    C.run_part(report, "rows", share, lambda: part_rows(vl, world, stock, where, device))
    C.run_part(report, "bcg", share, lambda: part_bcg(vl, world, stock, args.cpu, device))
    C.run_part(report, "time", share, lambda: part_time(vl, world, stock, args.cpu, device))
    C.run_part(report, "ple", share, lambda: part_ple(vl, args.cpu, device, args.out))
    vl.plug.close()
    return C.finish(report)


if __name__ == "__main__":
    sys.exit(main())
