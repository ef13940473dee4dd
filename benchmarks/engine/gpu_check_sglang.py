"""GPU check of the SGLang plug-in: SGLang 0.5.23's own Engram modules against the plug-in, on one GPU.

One engine per process (SGLang and vLLM pin different torch, xgrammar and
flashinfer; gpu_check_vllm.py is vLLM's). What it carries: the working tree's
src/ (the slacktier package, on sys.path by path) and SGLang's `--no-deps`
wheel; no pytest, nothing of tests/. What it makes: a tiny V4-shaped checkpoint
and its staged table (gpu_check_common.py). Parts, each under its own budget,
each printing one line `PART <name> PASS|FAIL|SKIP <s>s <facts>`:

- rows: SGLang's stock table as its host-table path builds it on a GPU
  (SGLANG_ENABLE_DSV41_ENGRAM_HOST_TABLE=1, per-rank layout: pinned host memory
  read by its Triton `engram_gather` through UVA) is the reference; the plug-in
  (SlackTier's engine on the GPU, loaded through SGLang's `load_plugins()` and
  `HookRegistry`) serves the same checkpoint through the real, patched
  `DeepseekV4Model.forward`, SGLang's own hasher and `EngramEmbedding`. Rows bit
  for bit over three steps; the plug-in is active (its engine counted every
  lookup, SGLang's served tables hold zero rows and no host table); negative
  control: a table staged from another checkpoint mismatches.
- bcg: a decode step (B requests, SGLang's decode hasher) captured as SGLang's
  own BreakableCUDAGraph on a side stream, the plug-in's begin_step, gathers and
  end_step as its eager breaks; replayed on new tokens and compared with the
  stock rows of the hash ids the graph computed; the breaks counted.
- time: a step's lookup path at B = 1, 8, 64 decode tokens, medians: SGLang's
  hasher and stock UVA gather of both layers against the same through the
  plug-in (begin_step, both gathers, end_step), eager, and the plug-in's
  captured graph replayed (hasher included).
- ple: Qwen3.8's PLE tables (two scaled fp8 tables with a per-tensor scale):
  SGLang's own `Qwen4ExpNGramEmbedding` with its offloaded table
  (`Qwen4ExpPinnedHostEmbedding`, its Triton UVA gather) against the plug-in's
  served table, through SGLang's `_prepare_ple_batch`, the PLE module and
  `_commit_ple_batch`, over a prefill of two requests and five decode steps;
  the plug-in active; another checkpoint's table as negative control. (PLE
  under graphs stays refused in SGLang: adapters.sglang_ple.)

`--cpu` dress-rehearses all of it on the CPU: SGLang's torch paths in place of
its Triton kernels (they take the torch path off CUDA), its device table in
place of the host table and its resident PLE table in place of the offloaded
one (cudaHostRegister needs a GPU), and SGLang's own capture
class with recorded segments in place of CUDA graphs (a replay runs the
recorded breaks; the hash ids the captured hasher kernel would write are
written into its buffer first). tests/test_gpu_check_scripts.py runs it in CI.

On the device machine (Python 3.12, CUDA torch 2.11, Triton 3.6, no network).
Once, here, from this checkout's root (it measures what it packed: the
engine's Python sources are about 15 MB compressed; the wheels are not yet
measured, and the working tree travels too, within the 64 MiB a call carries):

    benchmarks/engine/gpu_check_pack.sh sglang

then the `run` tool with carry [".gpucheck"] and timeout_s 540, command:

    mkdir -p /tmp/site && tar xzf .gpucheck/engine.tgz -C /tmp/site && python3 -m pip install -q --no-index \
      --no-deps --no-compile --no-cache-dir --target /tmp/site .gpucheck/whl/*.whl && export PYTHONPATH=/tmp/site \
      && PYTHONUNBUFFERED=1 timeout 500 python3 benchmarks/engine/gpu_check_sglang.py

Its summary lines come back in $OUT/summary.txt. SGLang's capture weak-references
a break's tensor arguments through `sgl_kernel`, a CUDA package not carried: without
it a strong reference stands in, and the SETUP line says so. Not yet run on a GPU.
"""

from __future__ import annotations

import sys
import types
from pathlib import Path
from types import SimpleNamespace
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_check_common as C  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

CONTROL_ENV = "SLACKTIER_SGLANG_CONTROL"
HOST_TABLE_ENV = "SGLANG_ENABLE_DSV41_ENGRAM_HOST_TABLE"


class _HFTokenizer:
    """What SGLang's build_compressed_token_map reads from a transformers tokenizer."""

    def __init__(self, backend: Any) -> None:
        self.backend_tokenizer = backend

    def __len__(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)


def load_sglang(cpu: bool, out: Path) -> SimpleNamespace:
    """SGLang's modules, a published server context (overlap scheduler off, breakable decode graphs), the plug-in
    loaded through SGLang's own load_plugins()."""
    import os

    if cpu:
        C.torchvision_without_compiled_ops()
    notes = []
    try:
        import sgl_kernel  # noqa: F401
    except ImportError:
        # SGLang's capture weak-references a break's tensor arguments through sgl_kernel (a CUDA build not
        # carried here); a strong reference keeps the same memory alive instead.
        stand_in = types.ModuleType("sgl_kernel")
        stand_in.weak_ref_tensor = lambda t: t
        sys.modules["sgl_kernel"] = stand_in
        notes.append("sgl_kernel absent: breaks hold strong references")
    from sglang.srt import runtime_context as rc
    from sglang.srt.layers import engram
    from sglang.srt.model_executor import forward_batch_info as modes
    from sglang.srt.model_executor.runner_backend_utils.breakable_cuda_graph import breakable_cuda_graph as bcg
    from sglang.srt.models import deepseek_v4, qwen4_exp
    from sglang.srt.plugins import load_plugins

    rc.get_context().override_server_args(disable_overlap_schedule=True).install()
    rc.get_parallel().override_permanently(tp_size=1, tp_rank=0, attn_tp_size=1, moe_tp_size=1, tp_group=None)
    os.environ["SGLANG_PLUGINS"] = "slacktier"
    note = C.ensure_entry_point("sglang.srt.plugins", "slacktier.adapters.sglang:register", out / "site")
    if note:
        notes.append(note)
    with C.env(CONTROL_ENV, "set-when-a-table-is-built.toml"):
        load_plugins()
    from slacktier.adapters import sglang as plug

    return SimpleNamespace(engram=engram, modes=modes, bcg=bcg, model=deepseek_v4, qwen=qwen4_exp, plug=plug, rc=rc,
                           notes=notes)


def build(sg: SimpleNamespace, world: SimpleNamespace, device: str) -> None:
    """SGLang's hasher and layout for the world, on the device."""
    from slacktier.tables.tokenizer import load_deepseek_tokenizer

    world.sg_layout = sg.engram.EngramLayout.from_config(world.config)
    world.hasher = sg.engram.EngramHasher(world.sg_layout, _HFTokenizer(load_deepseek_tokenizer()), 2,
                                          99_092).to(device)
    world.hasher.init_history(80, device)


def stock_tables(sg: SimpleNamespace, world: SimpleNamespace, cpu: bool) -> dict[int, Any]:
    """SGLang's own tables loaded through its own weight loader: the host table (UVA) on a GPU."""
    out = {}
    with C.env(HOST_TABLE_ENV, None if cpu else "1"), C.env("SGLANG_DSV41_ENGRAM_HOST_TABLE_LAYOUT", "per_rank"):
        for i, layer in enumerate(C.LAYERS):
            emb = sg.engram.EngramEmbedding(world.sg_layout.num_embeddings[i], C.DIM, layer,
                                            column_bounds=world.sg_layout.column_bounds(i))
            w, s = world.tables["ckpt"][layer]
            emb.weight.weight_loader(emb.weight, w)
            emb.scale.weight_loader(emb.scale, s)
            emb.finish_load(f"layer {layer}")
            if cpu:
                emb.to("cpu")
            elif emb.host_table is None:
                emb.to("cuda")
            out[layer] = emb
    return out


def served_tables(sg: SimpleNamespace, world: SimpleNamespace, control: str) -> dict[int, Any]:
    """The plug-in's tables (CONTROL_ENV must stay set while they serve)."""
    import os

    os.environ[CONTROL_ENV] = control
    return {layer: sg.engram.EngramEmbedding(world.sg_layout.num_embeddings[i], C.DIM, layer,
                                             column_bounds=world.sg_layout.column_bounds(i))
            for i, layer in enumerate(C.LAYERS)}


class Body:
    """DeepseekV4Model's body as far as Engram goes: SGLang's hasher, then each layer's table lookup. The patched
    DeepseekV4Model.forward calls _forward_impl; `hash_ids` is the buffer the hasher wrote."""

    def __init__(self, hasher: Any, tables: dict[int, Any]) -> None:
        self.hasher, self.tables = hasher, tables
        self.hash_ids: torch.Tensor | None = None

    def _forward_impl(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: Any, *rest: Any) -> list:
        self.hash_ids = self.hasher(input_ids, batch)
        return [self.tables[layer](self.hash_ids[:, i]) for i, layer in enumerate(C.LAYERS)]


def extend_batch(sg: SimpleNamespace, n: int, slot: int, device: str) -> SimpleNamespace:
    """A one-request prefill batch: what SGLang's hasher reads of a ForwardBatch."""
    return SimpleNamespace(forward_mode=sg.modes.ForwardMode.EXTEND,
                           req_pool_indices=torch.tensor([slot], device=device),
                           positions=torch.arange(n, device=device), extend_seq_lens=torch.tensor([n], device=device),
                           extend_start_loc=torch.tensor([0], device=device), extend_seq_lens_cpu=[n],
                           engram_history=None, out_cache_loc=torch.arange(1, n + 1, device=device), spec_info=None)


def decode_batch(sg: SimpleNamespace, b: int, device: str) -> SimpleNamespace:
    """B requests (slots 1..B) with one token each; out_cache_loc > 0 marks every row real."""
    return SimpleNamespace(forward_mode=sg.modes.ForwardMode.DECODE, req_pool_indices=torch.arange(1, b + 1,
                           device=device), positions=torch.full((b,), 100, device=device), extend_seq_lens=None,
                           extend_start_loc=None, extend_seq_lens_cpu=None, engram_history=None,
                           out_cache_loc=torch.arange(1, b + 1, device=device), spec_info=None)


def tokens(n: int, seed: int) -> np.ndarray:
    """Real text's token ids (the DeepSeek-V4 tokenizer), a window chosen by `seed`."""
    from slacktier.testing.engine import real_text
    from slacktier.tables.tokenizer import encode

    ids = np.asarray(encode(real_text(8 * (n + 64 * seed)))[64 * seed:64 * seed + n], dtype=np.int64)
    assert len(ids) == n, f"real text gave {len(ids)} tokens of {n}"
    return ids


def stock_rows(sg: SimpleNamespace, stock: dict[int, Any], hash_ids: torch.Tensor) -> list[torch.Tensor]:
    with C.env(CONTROL_ENV, None):
        return [stock[layer](hash_ids[:, i]) for i, layer in enumerate(C.LAYERS)]


# ---- parts ----------------------------------------------------------------------------------------------


def part_rows(sg: SimpleNamespace, world: SimpleNamespace, stock: dict, device: str) -> tuple[bool, str]:
    forward = sg.model.DeepseekV4Model.forward
    served = served_tables(sg, world, str(world.controls["ckpt"]))
    compared = differ = 0
    for step in range(3):
        ids = torch.from_numpy(tokens(256, step)).to(device)
        batch = extend_batch(sg, len(ids), 0, device)
        with C.env(CONTROL_ENV, None):
            want = Body(world.hasher, stock)._forward_impl(ids, batch.positions, batch)
        got = forward(Body(world.hasher, served), ids, batch.positions, batch, None)
        for g, w in zip(got, want):
            n, d = C.same_rows(g, w)
            compared, differ = compared + n, differ + d
    engine = sg.plug.current().engine
    lookups = sum(c.lookups for c in engine.totals.values())
    host_rows = sum(t.weight.shape[0] + t.scale.shape[0] + (t.host_table is not None) for t in served.values())
    active = lookups == compared and host_rows == 0 and not engine.in_step
    # negative control: another checkpoint's table through the same path
    other = served_tables(sg, world, str(world.controls["other"]))
    ids = torch.from_numpy(tokens(256, 0)).to(device)
    batch = extend_batch(sg, len(ids), 0, device)
    with C.env(CONTROL_ENV, None):
        want = Body(world.hasher, stock)._forward_impl(ids, batch.positions, batch)
    got = forward(Body(world.hasher, other), ids, batch.positions, batch, None)
    control_differ = sum(C.same_rows(g, w)[1] for g, w in zip(got, want))
    ok = differ == 0 and active and control_differ > 0
    return ok, (f"rows {compared} mismatches {differ}; plug-in lookups {lookups}, SGLang rows held {host_rows}; "
                f"negative control (other checkpoint) mismatches {control_differ}; stock "
                f"{'UVA host table' if any(t.host_table is not None for t in stock.values()) else 'device table'}")


class _Segment:
    def replay(self) -> None:
        """A recorded segment stands for kernels: nothing of the forward's Python runs at a replay."""


def _cpu_capture(sg: SimpleNamespace) -> Any:
    bcg = sg.bcg

    class CpuCapture(bcg.BreakableCUDAGraphCapture):
        def __enter__(self) -> Any:
            self._capture_token = bcg._current_capture_var.set(self)
            self._begin_new_segment()
            return self

        def __exit__(self, *exc: object) -> bool:
            try:
                self._end_current_segment()
            finally:
                bcg._current_capture_var.reset(self._capture_token)
            return False

        def _begin_new_segment(self) -> None:
            pass

        def _end_current_segment(self) -> None:
            self.cuda_graph._segments.append(_Segment())

    return CpuCapture(bcg.BreakableCUDAGraph())


def _replay(graph: Any) -> None:
    """BreakableCUDAGraph.replay's order: segment i, then break i."""
    for i, seg in enumerate(graph._segments):
        seg.replay()
        if i < len(graph._break_fns):
            graph._break_fns[i]()


def capture_decode(sg: SimpleNamespace, world: SimpleNamespace, served: dict, b: int, cpu: bool,
                   device: str) -> SimpleNamespace:
    """A decode step of `b` requests captured as SGLang's breakable graph (a side stream on a GPU)."""
    body = Body(world.hasher, served)
    batch = decode_batch(sg, b, device)
    input_ids = torch.from_numpy(tokens(b, 5)).to(device)   # the graph's static input
    forward = sg.model.DeepseekV4Model.forward
    if cpu:
        capture = _cpu_capture(sg)
        with capture:
            outs = forward(body, input_ids, batch.positions, batch, None)
        graph = capture.cuda_graph
        stream = None
    else:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            forward(body, input_ids, batch.positions, batch, None)   # warm-up, eager
        torch.cuda.synchronize()
        graph = sg.bcg.BreakableCUDAGraph()
        with sg.bcg.BreakableCUDAGraphCapture(graph, pool=torch.cuda.graph_pool_handle(), stream=stream):
            outs = forward(body, input_ids, batch.positions, batch, None)
        torch.cuda.synchronize()
    return SimpleNamespace(graph=graph, outs=outs, body=body, input_ids=input_ids, batch=batch, stream=stream)


def replay(sg: SimpleNamespace, world: SimpleNamespace, cap: SimpleNamespace, new_tokens: torch.Tensor,
           cpu: bool) -> None:
    cap.input_ids.copy_(new_tokens)
    if cpu:   # what the captured hasher kernel writes at a GPU replay
        with C.env(CONTROL_ENV, None):
            cap.body.hash_ids.copy_(world.hasher(cap.input_ids, cap.batch))
        _replay(cap.graph)
    else:
        with torch.cuda.stream(cap.stream):
            cap.graph.replay()
        torch.cuda.synchronize()


def part_bcg(sg: SimpleNamespace, world: SimpleNamespace, stock: dict, cpu: bool, device: str) -> tuple[bool, str]:
    served = served_tables(sg, world, str(world.controls["ckpt"]))
    engine = sg.plug.current().engine
    cap = capture_decode(sg, world, served, 8, cpu, device)
    breaks = len(cap.graph._break_fns)
    before = engine.totals[C.LAYERS[0]].lookups
    compared = differ = moved = 0
    for step in range(3):
        old = [o.clone() for o in cap.outs]
        replay(sg, world, cap, torch.from_numpy(tokens(8, 10 + step)).to(device), cpu)
        want = stock_rows(sg, stock, cap.body.hash_ids)
        for g, w, o in zip(cap.outs, want, old):
            n, d = C.same_rows(g, w)
            compared, differ, moved = compared + n, differ + d, moved + C.same_rows(g, o)[1]
    counted = engine.totals[C.LAYERS[0]].lookups - before
    ok = differ == 0 and breaks == 4 and counted == 3 * 8 * 24 and moved > 0 and not engine.in_step
    notes = ("; " + "; ".join(sg.notes)) if sg.notes else ""
    return ok, (f"breaks {breaks} (begin, 2 gathers, end); replayed rows {compared} mismatches {differ}; rows "
                f"changed between replays {moved} (negative control); lookups counted at replay {counted}"
                f"{'; segments recorded, not CUDA graphs' if cpu else '; side stream'}{notes}")


def part_time(sg: SimpleNamespace, world: SimpleNamespace, stock: dict, cpu: bool, device: str) -> tuple[bool, str]:
    served = served_tables(sg, world, str(world.controls["ckpt"]))
    engine = sg.plug.current().engine
    facts = []
    repeats = 3 if cpu else 20
    for b in (1, 8, 64):
        batch = decode_batch(sg, b, device)
        ids = torch.from_numpy(tokens(b, 20)).to(device)

        def stock_step() -> None:   # SGLang's hasher, then its UVA gather of both layers
            with C.env(CONTROL_ENV, None):
                Body(world.hasher, stock)._forward_impl(ids, batch.positions, batch)

        def plug_step() -> None:    # the same through the patched forward: begin_step, both gathers, end_step
            sg.model.DeepseekV4Model.forward(Body(world.hasher, served), ids, batch.positions, batch, None)

        t_stock = C.median_us(stock_step, cpu, repeats)
        t_plug = C.median_us(plug_step, cpu, repeats)
        cap = capture_decode(sg, world, served, b, cpu, device)
        new = torch.from_numpy(tokens(b, 21)).to(device)
        t_graph = C.median_us(lambda: replay(sg, world, cap, new, cpu), cpu, repeats)
        facts.append(f"B={b}: stock {t_stock:.0f} us, plug-in {t_plug:.0f} us, plug-in graph replay "
                     f"{t_graph:.0f} us")
    return (not engine.in_step), "medians; " + "; ".join(facts) + (" (CPU: not a measurement)" if cpu else "")


class RequestPool:
    """SGLang's request pool as its PLE batch code reads it: per-request n-gram history, [R, n - 1]."""

    def __init__(self, requests: int, device: str) -> None:
        self.history = torch.full((requests, 2), C.PLE_EOS, dtype=torch.long, device=device)
        self.ple_window_cache = None

    def get_mamba_indices(self, req_pool_indices: torch.Tensor) -> torch.Tensor:
        return req_pool_indices

    def get_ngram_context(self, state_indices: torch.Tensor) -> torch.Tensor:
        return self.history[state_indices]

    def set_ngram_context(self, state_indices: torch.Tensor, context: torch.Tensor) -> None:
        self.history[state_indices] = context


def ple_batches(sg: SimpleNamespace, world: SimpleNamespace, device: str) -> list[tuple[torch.Tensor, Any]]:
    """A prefill of both requests, then decode steps: (input_ids, what SGLang's PLE code reads of a ForwardBatch)."""
    lens = [len(p) for p in world.prompts]
    common = dict(tbo_parent_token_range=None, spec_algorithm=None, spec_info=None, _original_forward_mode=None,
                  global_num_token_non_padded_cpu=None, req_pool_indices=torch.tensor([0, 1], device=device),
                  mamba_track_indices=None, mamba_track_mask=None)
    mode = sg.modes.ForwardMode
    ids = torch.from_numpy(np.concatenate(world.prompts)).to(device)
    out = [(ids, SimpleNamespace(forward_mode=mode.EXTEND, extend_seq_lens=torch.tensor(lens, device=device),
                                 extend_seq_lens_cpu=lens, out_cache_loc=torch.arange(1, len(ids) + 1, device=device),
                                 **common))]
    for step in range(len(world.next_tokens) // 2):
        ids = torch.from_numpy(world.next_tokens[2 * step:2 * step + 2]).to(device)
        out.append((ids, SimpleNamespace(forward_mode=mode.DECODE, extend_seq_lens=None, extend_seq_lens_cpu=None,
                                         out_cache_loc=torch.tensor([7, 9], device=device), **common)))
    return out


def ple_modules(sg: SimpleNamespace, world: SimpleNamespace, offload: bool, rows: dict | None) -> dict[int, Any]:
    """SGLang's Qwen4ExpNGramEmbedding per PLE layer (its text config at the scaled size), rows loaded through its
    own weight_loader when given, its per-tensor scale set as its loader would."""
    from sglang.srt.configs.qwen4_exp import Qwen4ExpTextConfig

    config = Qwen4ExpTextConfig(ple_embed_dim=C.PLE_DIM, ngram_vocab_size_base=C.PLE_BASE, vocab_size=C.PLE_VOCAB,
                                eos_token_id=C.PLE_EOS, ple_embedding_dtype="float8_e4m3fn",
                                ple_layer_ids=[layer + 1 for layer in C.PLE_LAYERS], ple_offload_embedding=offload)
    out = {}
    for i, layer in enumerate(C.PLE_LAYERS):
        module = sg.qwen.Qwen4ExpNGramEmbedding(config, config.ple_embed_dim, ple_layer_index=i,
                                                prefix=f"model.layers.{layer}.ple.ple_embedding")
        emb = module.ngram_embedding
        if rows is not None:
            emb.weight_loader(emb.weight, C.padded(rows[layer], world.layouts[layer].padded_rows))
        emb.weight_scale.fill_(C.PLE_SCALE)
        out[layer] = module
    return out


def ple_step(sg: SimpleNamespace, modules: dict[int, Any], ids: torch.Tensor, batch: Any) -> dict[int, torch.Tensor]:
    """One step as Qwen4ExpModel.forward runs PLE: _prepare_ple_batch, each layer's PLE embedding, the commit."""
    pb = sg.qwen._prepare_ple_batch(input_ids=ids, forward_batch=batch, ngram_size=3, ngram_eos_token_id=C.PLE_EOS)
    out = {layer: modules[layer](pb, batch) for layer in C.PLE_LAYERS}
    sg.qwen._commit_ple_batch(pb, batch)
    return out


def part_ple(sg: SimpleNamespace, cpu: bool, device: str, folder: Path) -> tuple[bool, str]:
    """Qwen3.8's PLE tables: SGLang's offloaded table (its UVA gather) on a GPU, its resident one on the CPU,
    against the plug-in's served table, over a prefill of two requests and five decode steps."""
    import os

    world = C.make_ple_world(folder, device)
    with C.env(CONTROL_ENV, None), torch.device(device):   # SGLang builds a model under its device
        stock = ple_modules(sg, world, offload=not cpu, rows=world.tables["ckpt"])

    def run(modules: dict[int, Any], control: str | None) -> list[dict[int, torch.Tensor]]:
        pool = RequestPool(2, device)
        sg.qwen.get_req_to_token_pool = lambda: pool   # the request pool SGLang's PLE batch code reads
        with C.env(CONTROL_ENV, control):
            return [ple_step(sg, modules, ids, batch) for ids, batch in ple_batches(sg, world, device)]

    want = run(stock, None)
    os.environ[CONTROL_ENV] = str(world.controls["ckpt"])
    with torch.device(device):
        served = ple_modules(sg, world, offload=True, rows=None)
    got = run(served, str(world.controls["ckpt"]))
    compared = differ = 0
    for g, w in zip(got, want):
        for layer in C.PLE_LAYERS:
            n, d = C.same_rows(g[layer], w[layer])
            compared, differ = compared + n, differ + d
    engine = sg.plug.current().engine
    lookups = sum(c.lookups for c in engine.totals.values())
    held = sum(m.ngram_embedding.weight.shape[0] for m in served.values())
    os.environ[CONTROL_ENV] = str(world.controls["other"])
    with torch.device(device):
        other = run(ple_modules(sg, world, offload=True, rows=None), str(world.controls["other"]))
    control_differ = sum(C.same_rows(o[layer], w[layer])[1] for o, w in zip(other, want) for layer in C.PLE_LAYERS)
    ok = differ == 0 and lookups > 0 and held == 0 and control_differ > 0 and not engine.in_step
    return ok, (f"embedding rows {compared} (x16 heads) mismatches {differ}; plug-in lookups {lookups}, SGLang rows "
                f"held {held}; negative control (other checkpoint) mismatches {control_differ}; stock "
                f"{'resident table (CPU rehearsal)' if cpu else 'offloaded table (UVA)'}")


def main() -> int:
    args = C.arguments("sglang", __doc__)
    device = "cpu" if args.cpu else "cuda"
    report = C.Report(args.out / "summary.txt")
    report.line(f"DEVICE {C.device_facts(args.cpu)}")
    sg = load_sglang(args.cpu, args.out)
    report.line("SETUP " + ("; ".join(sg.notes) or "engine and plug-in loaded"))
    world = C.make_world(args.out, args.vocab, device)
    build(sg, world, device)
    stock = stock_tables(sg, world, args.cpu)
    share = args.budget_s / 4
    C.run_part(report, "rows", share, lambda: part_rows(sg, world, stock, device))
    C.run_part(report, "bcg", share, lambda: part_bcg(sg, world, stock, args.cpu, device))
    C.run_part(report, "time", share, lambda: part_time(sg, world, stock, args.cpu, device))
    C.run_part(report, "ple", share, lambda: part_ple(sg, args.cpu, device, args.out))
    sg.plug.close()
    return C.finish(report)


if __name__ == "__main__":
    sys.exit(main())
