"""Issue 30's GPU checks of the serving-engine plug-ins, one prepared script for a lent GPU (CI never runs it).

1. sglang-rows: SGLang 0.5.23's own EngramEmbedding on the GPU (its Triton
   engram_gather over the table in device memory, and over the pinned host table
   read through UVA where SGLang's host-table path can be built here) against the
   plug-in (SlackTier's engine on cuda), through SGLang's real HookRegistry:
   rows bit for bit (NaN as any NaN, slacktier.tables.codec), per layer, per step.
2. vllm-rows: vLLM 0.33.0's Engram with its ParallelEngramEmbedding in pinned host
   memory (cpu_offload, its Triton UVA lookup) against the plug-in's ServedTable:
   `prepare_embeddings` then `embed` for both layers, rows bit for bit.
3. sglang-bcg: a decode step captured with SGLang's BreakableCUDAGraph, the
   plug-in's begin_step / gather / end_step as eager breaks around a captured
   segment that reads the rows; replayed on later steps' ids and compared with
   the same step run eagerly. The plug-in refuses CUDA graphs today; this
   checks the shape its next version would take.
4. lookup time per step, stock against plug-in, at B = 1, 8, 64 tokens: each
   engine's whole lookup of both layers (SGLang: the device table's and the
   UVA host table's gather; vLLM: its UVA prefetch), synchronized, medians.
6. ple: the plug-ins' PLE parts (benchmarks/engine/gpu_checks_ple.py, UNVERIFIED:
   written without a GPU): SGLang's offloaded PLE table (its UVA gather) and
   vLLM's pinned-host PLE backend against the plug-ins, rows bit for bit; the
   PLE calls as eager breaks of SGLang's BreakableCUDAGraph.
5. servers (only with --model DIR, a V4.1-shaped checkpoint both engines load,
   with its staged table and control files): SGLang and vLLM each launched stock
   and with the plug-in on the same greedy prompts; the completions must be
   equal; time per output token from two lengths of the same prompt.

Tables: a scaled V4.1 layout (EngramLayout.scaled(--vocab)) written as a
checkpoint and staged by `stage_checkpoint` on local disk; ids are real text
through SGLang's hasher (equal to SlackTier's: tests/test_adapters_sglang.py).

Needs, on the GPU machine: torch with CUDA and Triton, SGLang 0.5.23 and vLLM
0.33.0 with their own dependencies (the device machine reaches no registry, and
vLLM's wheel alone is larger than what the device tool carries: use an image that
has them). A part whose engine is missing is reported as not run, with why.

Run there: `python3 benchmarks/gpu_checks_plugins.py [--model DIR]` (writes
runs/gpu_checks_plugins/ or $OUT). Without a GPU, `--quick` runs part 1 on the
CPU (SGLang's torch path) as a smoke test of the script, and says so first.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import traceback
import urllib.request
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # the repo root: benchmarks.* imports
from benchmarks._harness import ROOT, machine, utc_stamp  # noqa: E402

from engines import import_sglang, import_vllm  # noqa: E402
from benchmarks.engine.gpu_checks_ple import ple_checks, vllm_with_plugin  # noqa: E402
from slacktier.adapters import sglang as sg_plug  # noqa: E402
from slacktier.adapters import vllm as vl_plug  # noqa: E402
from slacktier.config import ControlFile, DiskOptions, EngineConfig, TableConfig, write_control  # noqa: E402
from slacktier.testing.engine import real_text  # noqa: E402
from slacktier.tables.engram_hash import EngramHasher as StHasher  # noqa: E402
from slacktier.tables.engram_hash import EngramLayout  # noqa: E402
from slacktier.tables.stage import stage_checkpoint  # noqa: E402
from slacktier.tables.tokenizer import encode, load_deepseek_tokenizer  # noqa: E402

LAYERS = (1, 14)
DIM = 256


class _HFTokenizer:
    """What SGLang's build_compressed_token_map reads from a transformers tokenizer."""

    def __init__(self, backend: Any) -> None:
        self.backend_tokenizer = backend

    def __len__(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)


def same_rows(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Bit for bit, a NaN's payload free (slacktier.tables.codec's contract)."""
    got, want = got.detach().cpu(), want.detach().cpu()
    if got.shape != want.shape or got.dtype != want.dtype:
        return False
    nan = torch.isnan(want)
    return bool(torch.equal(torch.isnan(got), nan)
                and torch.equal(got.view(torch.int16)[~nan], want.view(torch.int16)[~nan]))


def timed(fn: Callable[[], Any], cuda: bool) -> tuple[Any, float]:
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter_ns()
    out = fn()
    if cuda:
        torch.cuda.synchronize()
    return out, (time.perf_counter_ns() - t0) / 1e3


def build_world(vocab: int, folder: Path) -> SimpleNamespace:
    """The scaled layout, its table as a checkpoint, staged for one rank, and a control file serving both layers."""
    from safetensors.torch import save_file

    layout = EngramLayout.scaled(vocab)
    rng = np.random.default_rng(0)
    tables = {}
    for layer in LAYERS:
        rows = layout.layer_rows(layer)
        w = rng.integers(0, 256, size=(rows, DIM), dtype=np.uint8)
        w[(w & 0x7F) == 0x7F] ^= 1   # no NaN bytes, as in a real checkpoint
        s = rng.integers(115, 128, size=(rows, DIM // 32), dtype=np.uint8)
        tables[layer] = (torch.from_numpy(w).view(torch.float8_e4m3fn), torch.from_numpy(s).view(torch.float8_e8m0fnu))
    folder.mkdir(parents=True, exist_ok=True)
    ckpt = folder / "engram.safetensors"
    save_file({f"layers.{layer}.engram.embed.{part}": t for layer, (w, s) in tables.items()
               for part, t in (("weight", w), ("scale", s))}, str(ckpt))
    manifest = stage_checkpoint(ckpt, [folder / "tp1.bin"], ranks=1, expected=layout, overwrite=True).path
    config = SimpleNamespace(engram_layer_ids=list(LAYERS), engram_max_ngram_size=4, engram_n_heads=8,
                             engram_vocab_size=vocab, engram_num_embeddings=list(layout.rows_per_layer),
                             engram_head_dim=DIM, engram_pad_token_id=2, engram_compressed_vocab_size=99_092,
                             rms_norm_eps=1e-6, hidden_size=64, hc_mult=2)
    return SimpleNamespace(layout=layout, tables=tables, manifest=manifest, config=config, folder=folder)


def control(world: SimpleNamespace, device: str, name: str) -> Path:
    tables = tuple(TableConfig(layer=layer, manifest=world.manifest, source="disk",
                               options=DiskOptions(queue_depth=64), cache_share=0.5, order=i)
                   for i, layer in enumerate(LAYERS))
    return write_control(ControlFile(engine=EngineConfig(cache_rows=200_000, device=device), tables=tables),
                         world.folder / name)


# ---- 1, 3, 4 (SGLang) -----------------------------------------------------------------------------------


def sglang_checks(world: SimpleNamespace, device: str, batches: list[int], steps: int) -> dict:
    engram = import_sglang("sglang.srt.layers.engram")
    rc = import_sglang("sglang.srt.runtime_context")
    plugins = import_sglang("sglang.srt.plugins")
    modes = import_sglang("sglang.srt.model_executor.forward_batch_info")
    rc.get_context().override_server_args(disable_overlap_schedule=True).install()
    os.environ["SGLANG_PLUGINS"] = "slacktier"
    os.environ[sg_plug.CONTROL_ENV] = str(control(world, device, "sglang.toml"))
    plugins.load_plugins()
    cuda = device == "cuda"
    out: dict[str, Any] = {"steps": [], "time": []}
    with rc.get_parallel().override(tp_size=1, tp_rank=0):
        layout = engram.EngramLayout.from_config(world.config)
        hasher = engram.EngramHasher(layout, _HFTokenizer(load_deepseek_tokenizer()), 2, 99_092)
        hasher.init_history(max(batches) + 1, "cpu")

        def table(layer: int, host: bool = False) -> Any:
            i = LAYERS.index(layer)
            if host:
                os.environ["SGLANG_ENABLE_DSV41_ENGRAM_HOST_TABLE"] = "1"
                os.environ["SGLANG_DSV41_ENGRAM_HOST_TABLE_LAYOUT"] = "per_rank"
            try:
                with torch.device(device):
                    return engram.EngramEmbedding(layout.num_embeddings[i], DIM, layer,
                                                  column_bounds=layout.column_bounds(i))
            finally:
                os.environ.pop("SGLANG_ENABLE_DSV41_ENGRAM_HOST_TABLE", None)

        served = {layer: table(layer) for layer in LAYERS}
        env = os.environ.pop(sg_plug.CONTROL_ENV)
        stocks: dict[str, dict[int, Any]] = {"device table": {layer: table(layer) for layer in LAYERS}}
        if cuda:
            try:
                stocks["UVA host table"] = {layer: table(layer, host=True) for layer in LAYERS}
            except Exception as exc:   # noqa: BLE001 - recorded: SGLang's host table needs its TP group
                out["uva_host_table"] = f"not built here: {type(exc).__name__}: {exc}"
        for tabs in stocks.values():
            for layer, emb in tabs.items():
                w, s = world.tables[layer]
                emb.weight.weight_loader(emb.weight, w)
                emb.scale.weight_loader(emb.scale, s)
                emb.finish_load(f"layer {layer}")
        tokens = np.asarray(encode(real_text(20 * max(batches) * steps)), dtype=np.int64)

        def ids_of(n: int, at: int) -> torch.Tensor:
            chunk = torch.from_numpy(tokens[at:at + n])
            batch = SimpleNamespace(forward_mode=modes.ForwardMode.EXTEND, req_pool_indices=torch.tensor([0]),
                                    positions=torch.arange(at, at + n), extend_seq_lens=torch.tensor([n]),
                                    extend_start_loc=torch.tensor([0]), extend_seq_lens_cpu=[n],
                                    engram_history=None, out_cache_loc=torch.arange(1, n + 1), spec_info=None)
            return hasher(chunk, batch)   # [n, 2, 24]; with the variable set, the plug-in's begin_step runs

        at = 0
        for n in batches:
            for k in range(steps):
                os.environ[sg_plug.CONTROL_ENV] = env
                with sg_plug.step():
                    hash_ids = ids_of(n, at)
                    got, t_plug = timed(lambda: [served[layer](hash_ids[:, i].to(device))
                                                 for i, layer in enumerate(LAYERS)], cuda)
                os.environ.pop(sg_plug.CONTROL_ENV)
                row = {"batch": n, "step": k, "plug-in": t_plug}
                for name, tabs in stocks.items():
                    want, t = timed(lambda: [tabs[layer](hash_ids[:, i].to(device))
                                             for i, layer in enumerate(LAYERS)], cuda)
                    row[name] = t
                    row[f"equal to {name}"] = all(same_rows(g, w) for g, w in zip(got, want))
                out["steps"].append(row)
                at += n
        if cuda:
            out["bcg"] = breakable_graph_check(served, ids_of, env, at, steps)
    os.environ[sg_plug.CONTROL_ENV] = env
    return out


def breakable_graph_check(served: dict[int, Any], ids_of: Callable[[int, int], torch.Tensor], env: str, at: int,
                          steps: int) -> dict:
    """Part 3: begin / gather / end as eager breaks of a BreakableCUDAGraph; replay against eager."""
    bcg = import_sglang("sglang.srt.model_executor.runner_backend_utils.breakable_cuda_graph.breakable_cuda_graph")
    n = 8
    weight = torch.randn(24 * DIM, 64, device="cuda", dtype=torch.bfloat16) * 0.02
    static_ids = torch.zeros(n, 2, 24, dtype=torch.int64, device="cuda")
    host = {"at": at}

    @bcg.eager_on_graph
    def begin(ids_buffer: torch.Tensor) -> torch.Tensor:
        ids_buffer.copy_(ids_of(n, host["at"]).to("cuda"))   # the hook's begin_step runs on the host ids
        return ids_buffer

    @bcg.eager_on_graph
    def rows(ids_buffer: torch.Tensor, i: int) -> torch.Tensor:
        return served[LAYERS[i]](ids_buffer[:, i])

    @bcg.eager_on_graph
    def end(x: torch.Tensor) -> torch.Tensor:
        sg_plug.end_step()
        return x

    def decode(ids_buffer: torch.Tensor) -> torch.Tensor:
        ids_buffer = begin(ids_buffer)
        y = sum(rows(ids_buffer, i).flatten(-2) @ weight for i in range(2))   # captured segment
        return end(y)

    os.environ[sg_plug.CONTROL_ENV] = env
    result: dict[str, Any] = {}
    try:
        graph = bcg.BreakableCUDAGraph()
        decode(static_ids)   # warm-up step, eager (each decode begins, gathers and ends its step)
        with bcg.BreakableCUDAGraphCapture(graph):
            static_out = decode(static_ids)
        equal = 0
        for k in range(steps):
            host["at"] = at + (k + 1) * n
            graph.replay()
            replayed = static_out.clone()
            eager = decode(static_ids.clone())
            equal += same_rows(replayed, eager)
        result = {"captured": True, "replays_equal_to_eager": f"{equal} of {steps}"}
    except Exception as exc:   # noqa: BLE001 - the probe records what stops it
        result = {"captured": False, "error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()[-1500:]}
    finally:
        os.environ.pop(sg_plug.CONTROL_ENV, None)
    return result


# ---- 2, 4 (vLLM) -------------------------------------------------------------------------------------------


def vllm_checks(world: SimpleNamespace, batches: list[int], steps: int) -> dict:
    engram = import_vllm(vl_plug.ENGRAM_MODULE)
    dist = import_vllm("vllm.distributed")
    config_mod, vc = vllm_with_plugin(control(world, "cuda", "vllm.toml"))
    layout = engram.EngramLayout(world.config)
    out: dict[str, Any] = {"steps": []}
    with config_mod.set_current_vllm_config(vc):
        dist.init_distributed_environment(world_size=1, rank=0, local_rank=0,
                                          distributed_init_method="tcp://127.0.0.1:29517", backend="nccl")
        dist.initialize_model_parallel(1)
        with torch.device("cuda"):
            served = [engram.Engram(world.config, None, layout, i, False, f"layers.{layer}.engram")
                      for i, layer in enumerate(LAYERS)]
            env = os.environ.pop(vl_plug.CONTROL_ENV)
            stock = [engram.Engram(world.config, None, layout, i, False, f"layers.{layer}.engram")
                     for i, layer in enumerate(LAYERS)]
        for e, layer in zip(stock, LAYERS):
            w, s = world.tables[layer]
            e.embed_tokens.weight.weight_loader(e.embed_tokens.weight, w)
            e.embed_tokens.weight_scale_inv.weight_loader(e.embed_tokens.weight_scale_inv, s.view(torch.uint8))
        hasher_ids = StHasher(world.layout)
        tokens = np.asarray(encode(real_text(20 * max(batches) * steps)), dtype=np.int64)
        at = 0
        for n in batches:
            for k in range(steps):
                ids = torch.from_numpy(hasher_ids.prefill(tokens[at:at + n])).cuda()   # [n, 2, 24]
                os.environ[vl_plug.CONTROL_ENV] = env

                def plug_step() -> list[torch.Tensor]:
                    with vl_plug.step():
                        for i, e in enumerate(served):
                            e.prepare_embeddings(ids[:, i])
                        return [e.embed(ids[:, i]).clone() for i, e in enumerate(served)]

                got, t_plug = timed(plug_step, True)
                os.environ.pop(vl_plug.CONTROL_ENV)

                def stock_step() -> list[torch.Tensor]:
                    for i, e in enumerate(stock):
                        e.prepare_embeddings(ids[:, i])
                    return [e.embed(ids[:, i]).clone() for i, e in enumerate(stock)]

                want, t_stock = timed(stock_step, True)
                out["steps"].append({"batch": n, "step": k, "plug-in": t_plug, "UVA host table": t_stock,
                                     "equal to UVA host table": all(same_rows(g, w) for g, w in zip(got, want))})
                at += n
    return out


# ---- 5 (servers) ----------------------------------------------------------------------------------------------


def _wait(url: str, proc: subprocess.Popen, timeout_s: float) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            urllib.request.urlopen(url, timeout=2)
            return
        except OSError:
            time.sleep(2)
    raise TimeoutError(f"{url} not up in {timeout_s} s")


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())


def server_checks(model: Path, controls: dict[str, str], prompts: list[str], tokens: int) -> dict:
    """Part 5: each engine stock and with its plug-in; equal greedy completions; time per output token."""
    runs = {
        "sglang": ([sys.executable, "-m", "sglang.launch_server", "--model-path", str(model), "--port", "30123",
                    "--disable-overlap-schedule", "--cuda-graph-backend-decode", "disabled",
                    "--cuda-graph-backend-prefill", "disabled"], "http://127.0.0.1:30123",
                   sg_plug.CONTROL_ENV, "/generate"),
        "vllm": (["vllm", "serve", str(model), "--port", "30124", "--enforce-eager"], "http://127.0.0.1:30124",
                 vl_plug.CONTROL_ENV, "/v1/completions"),
    }
    out: dict[str, Any] = {}
    for name, (cmd, base, var, path) in runs.items():
        texts: dict[str, list[str]] = {}
        for mode in ("stock", "plug-in"):
            env = dict(os.environ)
            env.pop(var, None)
            if mode == "plug-in":
                env[var] = controls[name]
            proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            try:
                _wait(base + ("/health" if name == "sglang" else "/v1/models"), proc, 1800)
                per_token, texts[mode] = [], []
                for prompt in prompts:
                    durations = []
                    for n in (1, tokens + 1):
                        body = ({"text": prompt, "sampling_params": {"temperature": 0, "max_new_tokens": n}}
                                if name == "sglang" else
                                {"model": str(model), "prompt": prompt, "temperature": 0, "max_tokens": n})
                        r, t = timed(lambda: _post(base + path, body), False)
                        durations.append(t)
                    texts[mode].append(r["text"] if name == "sglang" else r["choices"][0]["text"])
                    per_token.append((durations[1] - durations[0]) / tokens / 1e3)
                out[f"{name} {mode}"] = {"ms_per_token_median": statistics.median(per_token)}
            except Exception as exc:   # noqa: BLE001 - recorded with the server's last words
                err = proc.stderr.read()[-2000:] if proc.poll() is not None and proc.stderr else ""
                out[f"{name} {mode}"] = {"error": f"{type(exc).__name__}: {exc}", "stderr": err}
            finally:
                proc.terminate()
                proc.wait(60)
        if "stock" in texts and "plug-in" in texts:
            out[f"{name} completions equal"] = texts["stock"] == texts["plug-in"]
    return out


# ---- report ---------------------------------------------------------------------------------------------------


def summary(rows: list[dict], refs: list[str]) -> list[str]:
    lines = []
    for n in sorted({r["batch"] for r in rows}):
        sel = [r for r in rows if r["batch"] == n]
        cells = [f"plug-in {statistics.median(r['plug-in'] for r in sel):.0f} us"]
        for ref in refs:
            if ref in sel[0]:
                cells.append(f"{ref} {statistics.median(r[ref] for r in sel):.0f} us, equal in "
                             f"{sum(r[f'equal to {ref}'] for r in sel)} of {len(sel)} steps")
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or ROOT / "runs" / "gpu_checks_plugins"))
    ap.add_argument("--vocab", type=int, default=50_000, help="EngramLayout.scaled size (50,000: ~1.2M rows/layer)")
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--model", type=Path, help="a V4.1-shaped checkpoint both engines load (part 5)")
    ap.add_argument("--control", action="append", default=[], metavar="ENGINE=PATH",
                    help="part 5's control file per engine (sglang=..., vllm=...; {tp_rank} allowed)")
    ap.add_argument("--quick", action="store_true", help="small table, part 1 only when there is no GPU")
    args = ap.parse_args()
    if args.quick:
        args.vocab, args.batches, args.steps = 2_000, "1,8", 3
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    batches = [int(b) for b in args.batches.split(",")]
    out: dict[str, Any] = {"stamp": utc_stamp(), "machine": machine(), "device": device,
                           "gpu": torch.cuda.get_device_name(0) if cuda else "no GPU",
                           "command": "python3 benchmarks/gpu_checks_plugins.py " + " ".join(sys.argv[1:])}
    world = build_world(args.vocab, args.out / "tables")
    parts: list[tuple[str, Callable[[], dict]]] = [("sglang", lambda: sglang_checks(world, device, batches,
                                                                                     args.steps))]
    if cuda:
        parts.append(("vllm", lambda: vllm_checks(world, batches, args.steps)))
        parts.append(("ple", lambda: ple_checks(args.out / "ple_tables", vllm=True)))
    if args.model is not None:
        controls = dict(c.split("=", 1) for c in args.control)
        parts.append(("servers", lambda: server_checks(args.model, controls, [real_text(400, k) for k in range(4)],
                                                       64)))
    for name, run in parts:
        print(f"{name} ...", flush=True)
        try:
            out[name] = run()
        except BaseException as exc:   # noqa: BLE001 - a part that cannot run is reported, the others go on
            out[name] = {"not run": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()[-1500:]}
    lines = [f"### Plug-in GPU checks (issue 30), {out['stamp']}", ""]
    if not cuda:
        lines += ["**No GPU here: a smoke test of the script.** Part 1 ran SGLang's torch path on the CPU; "
                  "parts 2-4 did not run.", ""]
    lines += [f"`{out['command']}`; {out['machine']}; {out['gpu']}; EngramLayout.scaled({args.vocab}).", ""]
    for name, refs in (("sglang", ["device table", "UVA host table"]), ("vllm", ["UVA host table"])):
        part = out.get(name)
        if part is None:
            continue
        if "not run" in part:
            lines += [f"{name}: not run ({part['not run']})", ""]
            continue
        lines += [f"{name}: both layers' lookup per step, medians", "", "| B | timings and equality |", "|---|---|"]
        lines += summary(part["steps"], refs) + [""]
        if "uva_host_table" in part:
            lines += [f"SGLang's UVA host table: {part['uva_host_table']}", ""]
        if "bcg" in part:
            lines += [f"breakable CUDA graph: {json.dumps({k: v for k, v in part['bcg'].items() if k != 'trace'})}",
                      ""]
    for engine, part in out.get("ple", {}).items():
        if isinstance(part, dict):
            steps = part.get("steps", [])
            lines += [f"ple {engine} (unverified script, first run): " + (
                part["not run"] if "not run" in part else
                f"{sum(r['equal to UVA host table'] for r in steps)} of {len(steps)} steps equal to the UVA host "
                f"table; plug-in {statistics.median(r['plug-in'] for r in steps):.0f} us, stock "
                f"{statistics.median(r['UVA host table'] for r in steps):.0f} us per step (median)"), ""]
            if "bcg" in part:
                lines += [f"ple {engine} breakable CUDA graph: "
                          f"{json.dumps({k: v for k, v in part['bcg'].items() if k != 'trace'})}", ""]
    if "servers" in out:
        lines += [f"servers: {json.dumps(out['servers'], default=str)[:3000]}", ""]
    text = "\n".join(lines)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_checks_plugins.json").write_text(json.dumps(out, indent=1, default=str))
    (args.out / "gpu_checks_plugins.md").write_text(text)
    print(text)
    ple = [p for p in out.get("ple", {}).values() if isinstance(p, dict)]
    bad = [r for part in [out.get("sglang", {}), out.get("vllm", {}), *ple] for r in part.get("steps", [])
           if not all(v for k, v in r.items() if k.startswith("equal to"))]
    return 1 if bad or any("not run" in out.get(p, {}) for p in ("sglang",)) else 0


if __name__ == "__main__":
    raise SystemExit(main())
