"""One vLLM TP rank process, as tests/test_tp_ranks.py starts 2 or 4 of them: vLLM's Engram lookup across ranks.

Each process builds vLLM 0.33.0's own process groups on gloo
(`init_distributed_environment`, `initialize_model_parallel`: the all-gather of
`Engram.embed` goes through torch.distributed), loads plug-ins through vLLM's
`load_general_plugins()` (VLLM_PLUGINS=slacktier; SLACKTIER_VLLM_CONTROL is the
test's `{tp_rank}` template), and per step runs vLLM's own Engram seams:
`prepare_embeddings(hash ids)` (stock: `ParallelEngramEmbedding.lookup`, vLLM's
Triton kernel under TRITON_INTERPRET=1; served: the plug-in's begin_step) and
`embed(hash ids)` (`_ready_rows`, then vLLM's TP all-gather), inside the
plug-in's `step()` (what its DeepseekV4Model.forward hook wraps the forward in).

What stands in for a server: the Engram module is vLLM's class with the
attributes its __init__ sets for the lookup (`embed_tokens` from the real, patched
`_create_embedding`, `staged_rows` from its own `_init_staging`), not the gate and
projection (wkv needs vLLM's linear layers and a GPU); the vLLM config is the few
fields the lookup path reads; ParallelEngramEmbedding reads the GPU's SM count,
stated here (1). The hash ids are SlackTier's hasher's (vLLM's hash is a GPU
kernel; SlackTier's equals SGLang's, whose primes vLLM's layout shares).

Writes <out>/rank<r>.json like tests/tp_rank_worker.py (`--die-at-step K --die-rank R` too: SIGKILL in step K
after every layer's prepare_embeddings, before the all-gather).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import sys
import traceback
from pathlib import Path
from types import SimpleNamespace
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

LAYERS = (1, 14)


def preload() -> None:
    """Import what a rank runs (tp_world.py does it once, before it forks the ranks)."""
    import torch  # noqa: F401
    from engines import import_vllm

    from slacktier.adapters import vllm as plug

    for name in ("vllm.config", "vllm.config.engram", "vllm.distributed.parallel_state", "vllm.plugins",
                 plug.ENGRAM_MODULE):
        import_vllm(name)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--init", required=True)
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--controls", nargs="*", default=[])
    ap.add_argument("--tokens", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--die-at-step", type=int, default=-1)
    ap.add_argument("--die-rank", type=int, default=-1)
    ap.add_argument("--skip-stock", action="store_true")
    args = ap.parse_args()
    out: dict[str, Any] = {"rank": args.rank, "runs": {}}
    try:
        _run(args, out)
    except BaseException as exc:
        out["error"] = {"type": type(exc).__name__, "message": str(exc)[:2000],
                        "traceback": traceback.format_exc()[-4000:]}
    Path(args.out, f"rank{args.rank}.json").write_text(json.dumps(out, indent=1))
    return 0


def _run(args: argparse.Namespace, out: dict[str, Any]) -> None:
    import numpy as np
    import torch

    torch.set_num_threads(1)
    from engines import import_vllm

    vconfig = import_vllm("vllm.config")
    engram_config = import_vllm("vllm.config.engram")
    tokens = np.load(args.tokens)
    # the fields vLLM's process groups, its Engram lookup and the plug-in read; tables in device memory (no
    # cpu_offload: no pinned host memory on a CPU)
    vllm_config = SimpleNamespace(
        parallel_config=vconfig.ParallelConfig(tensor_parallel_size=args.world),
        engram_config=engram_config.EngramConfig(cpu_offload=False), additional_config={}, speculative_config=None,
        model_config=SimpleNamespace(enforce_eager=True, architecture="DeepseekV41ForCausalLM", is_moe=False),
        scheduler_config=SimpleNamespace(max_num_batched_tokens=int(tokens.shape[1])))
    with vconfig.set_current_vllm_config(vllm_config):
        _ranks(args, out, tokens)


def _ranks(args: argparse.Namespace, out: dict[str, Any], tokens: Any) -> None:
    import numpy as np
    import torch
    from engines import import_vllm

    from slacktier.adapters import vllm as plug
    from slacktier.tables.engram_hash import EngramHasher, EngramLayout

    ps = import_vllm("vllm.distributed.parallel_state")
    plugins = import_vllm("vllm.plugins")
    engram = import_vllm(plug.ENGRAM_MODULE)
    from safetensors.torch import load_file

    ps.init_distributed_environment(world_size=args.world, rank=args.rank, distributed_init_method=args.init,
                                    local_rank=args.rank, backend="gloo")
    ps.initialize_model_parallel(tensor_model_parallel_size=args.world, backend="gloo")
    control_env = os.environ.pop(plug.CONTROL_ENV, None)
    os.environ["VLLM_PLUGINS"] = "slacktier"
    os.environ[plug.CONTROL_ENV] = args.controls[0] if args.controls else (control_env or "unused.toml")
    plugins.load_general_plugins()
    os.environ.pop(plug.CONTROL_ENV)
    torch.cuda.get_device_properties = lambda i: SimpleNamespace(multi_processor_count=1)
    torch.accelerator.current_device_index = lambda: 0

    config_d = json.loads(Path(args.checkpoint, "config.json").read_text())
    config = SimpleNamespace(**config_d)
    layout = engram.EngramLayout(config)
    weights = load_file(str(next(Path(args.checkpoint).glob("*.safetensors"))))
    st_layout = EngramLayout.scaled(config.engram_vocab_size, tuple(config.engram_layer_ids))
    hash_ids = [torch.from_numpy(EngramHasher(st_layout).prefill(t)) for t in tokens]   # [T, L, 24] per step

    def modules() -> dict[int, Any]:
        built = {}
        for i, layer in enumerate(layout.layer_ids):
            m = engram.Engram.__new__(engram.Engram)
            torch.nn.Module.__init__(m)
            m.layer_hash_index, m.use_sequence_parallel = i, False
            m.embed_tokens = m._create_embedding(layout, i)   # patched: vLLM's table, or the plug-in's
            m._init_staging(int(tokens.shape[1]), layout.head_dim)
            for part, name in (("weight", "weight"), ("weight_scale_inv", "scale")):
                param = getattr(m.embed_tokens, part)
                param.weight_loader(param, weights[f"layers.{layer}.engram.embed.{name}"])
            built[layer] = m
        return built

    def run(mods: dict[int, Any], record: dict[str, Any]) -> list[np.ndarray]:
        steps = []
        record["digests"] = []
        for k, ids in enumerate(hash_ids):
            with plug.step():
                for i, layer in enumerate(layout.layer_ids):
                    mods[layer].prepare_embeddings(ids[:, i])
                if (k, args.rank) == (args.die_at_step, args.die_rank):   # after begin_step, before the all-gather
                    os.kill(os.getpid(), signal.SIGKILL)
                got = [mods[layer].embed(ids[:, i]) for i, layer in enumerate(layout.layer_ids)]
            steps.append(torch.stack(got, 1).contiguous().view(torch.int16).numpy())   # [T, L, 24, 256]
            record["digests"].append(hashlib.sha256(steps[-1].tobytes()).hexdigest())
        return steps

    stock = None
    if not args.skip_stock:
        out["runs"]["stock"] = {}
        stock = run(modules(), out["runs"]["stock"])
    for template in args.controls:
        os.environ[plug.CONTROL_ENV] = template
        record: dict[str, Any] = {}
        out["runs"][template] = record
        try:
            mods = modules()
            record["table_rows"] = {str(k): int(m.embed_tokens.weight.shape[0]) for k, m in mods.items()}
            record["served_layers"] = [k for k, m in mods.items() if isinstance(m.embed_tokens, plug.ServedTable)]
            steps = run(mods, record)
            binding = plug.current()
            if binding is not None and binding.engine is not None:
                record["engine_rows"] = int(sum(c.lookups for c in binding.engine.totals.values()))
                record["in_step"] = bool(binding.engine.in_step)
            if stock is not None:
                record["rows"] = int(sum(s.shape[0] * s.shape[1] * s.shape[2] for s in steps))
                record["mismatches"] = int(sum((g != w).any(axis=-1).sum() for g, w in zip(steps, stock)))
                # the same comparison against the stock rows of the neighbouring token must see differences (a
                # comparison that could not fail would pass any table)
                record["mismatches_shifted"] = int(sum((g != np.roll(w, 1, axis=0)).any(axis=-1).sum()
                                                        for g, w in zip(steps, stock)))
        except BaseException as exc:
            binding = plug.current()
            record["error"] = {"type": type(exc).__name__, "message": str(exc)[:2000],
                               "traceback": traceback.format_exc()[-3000:],
                               "in_step": bool(binding.engine.in_step) if binding is not None and binding.engine
                               else None}
        finally:
            os.environ.pop(plug.CONTROL_ENV, None)
    plug.close()


if __name__ == "__main__":
    sys.exit(main())
