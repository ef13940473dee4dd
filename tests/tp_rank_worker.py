"""One SGLang TP rank process, as tests/test_tp_ranks.py starts 2 or 4 of them: the engine's real multi-rank path.

Each process publishes SGLang's runtime context for its TP rank, builds SGLang's
own process groups on gloo (`init_distributed_environment`,
`initialize_model_parallel`: the all-reduce of `EngramEmbedding._lookup` goes
through torch.distributed, as NCCL would on a GPU), loads plug-ins through
SGLang's own `load_plugins()` (SGLANG_PLUGINS=slacktier; SLACKTIER_SGLANG_CONTROL
is the test's `{tp_rank}` template), and runs a few steps through the patched
`DeepseekV4Model.forward` over SGLang's own `EngramHasher` and `EngramEmbedding`:

- stock: the tables built with the variable unset, loaded from the checkpoint
  through SGLang's own weight_loader (each rank its shard_range rows);
- then, per control-file template given, the tables built with the variable
  set to it (the plug-in adopts them and serves rows from the staged regions).

It writes <out>/rank<r>.json: per run, the sha256 of every step's output bits,
the rows compared against the stock run and the mismatches (bf16 bits, sign of
zero included), and the plug-in's evidence (SGLang rows held, rows the step
engine served); or the error a step raised. `--die-at-step K` makes this rank
SIGKILL itself mid-step K (after begin_step, before the layers' all-reduce).
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
DIM = 256
SGLANG_MODULES = ("sglang.srt.runtime_context", "sglang.srt.distributed.parallel_state", "sglang.srt.plugins",
                  "sglang.srt.layers.engram", "sglang.srt.models.deepseek_v4",
                  "sglang.srt.model_executor.forward_batch_info")


def preload() -> None:
    """Import what a rank runs (tp_world.py does it once, before it forks the ranks)."""
    import torch  # noqa: F401
    from engines import import_sglang

    from slacktier.adapters import sglang  # noqa: F401

    for name in SGLANG_MODULES:
        import_sglang(name)


class _HFTokenizer:
    """What SGLang's build_compressed_token_map reads from a transformers tokenizer."""

    def __init__(self, backend: Any) -> None:
        self.backend_tokenizer = backend

    def __len__(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--init", required=True, help="tcp://127.0.0.1:PORT")
    ap.add_argument("--checkpoint", required=True, help="the checkpoint directory (config.json + safetensors)")
    ap.add_argument("--controls", nargs="*", default=[], help="control-file templates with {tp_rank}, one run each")
    ap.add_argument("--tokens", required=True, help=".npy of token ids, [steps, T]")
    ap.add_argument("--out", required=True)
    ap.add_argument("--die-at-step", type=int, default=-1)
    ap.add_argument("--die-rank", type=int, default=-1)
    ap.add_argument("--skip-stock", action="store_true")
    args = ap.parse_args()
    out: dict[str, Any] = {"rank": args.rank, "runs": {}}
    try:
        _run(args, out)
    except BaseException as exc:   # reported to the test, which decides
        out["error"] = {"type": type(exc).__name__, "message": str(exc)[:2000],
                        "traceback": traceback.format_exc()[-4000:]}
    Path(args.out, f"rank{args.rank}.json").write_text(json.dumps(out, indent=1))
    return 0


def _run(args: argparse.Namespace, out: dict[str, Any]) -> None:
    import numpy as np
    import torch

    torch.set_num_threads(1)
    from engines import import_sglang

    from slacktier.adapters import sglang as plug
    from slacktier.tables.tokenizer import load_deepseek_tokenizer

    rc, ps, plugins, engram, model, modes = (import_sglang(name) for name in SGLANG_MODULES)
    from safetensors.torch import load_file

    context = rc.get_context().override_server_args(disable_overlap_schedule=True)
    context.install()
    rc.get_parallel().override_permanently(tp_size=args.world, tp_rank=args.rank, attn_tp_size=args.world,
                                           attn_tp_rank=args.rank, moe_tp_size=args.world)
    ps.init_distributed_environment(world_size=args.world, rank=args.rank, distributed_init_method=args.init,
                                    local_rank=args.rank, backend="gloo", timeout=60)
    ps.initialize_model_parallel(backend="gloo")
    control_env = os.environ.pop(plug.CONTROL_ENV, None)   # the plug-in loads as a server loads it
    os.environ["SGLANG_PLUGINS"] = "slacktier"
    os.environ[plug.CONTROL_ENV] = args.controls[0] if args.controls else (control_env or "unused.toml")
    plugins.load_plugins()
    os.environ.pop(plug.CONTROL_ENV)

    config_d = json.loads(Path(args.checkpoint, "config.json").read_text())
    config = SimpleNamespace(**config_d, rms_norm_eps=1e-6, hidden_size=64, hc_mult=2)
    weights = load_file(str(next(Path(args.checkpoint).glob("*.safetensors"))))
    tokens = np.load(args.tokens)
    hasher = engram.EngramHasher(engram.EngramLayout.from_config(config), _HFTokenizer(load_deepseek_tokenizer()),
                                 config.engram_pad_token_id, config.engram_compressed_vocab_size)
    hasher.init_history(4, "cpu")

    def tables(load: bool) -> dict[int, Any]:
        layout = engram.EngramLayout.from_config(config)   # the plug-in records the layer order here
        built = {}
        for i, layer in enumerate(LAYERS):
            emb = engram.EngramEmbedding(layout.num_embeddings[i], DIM, layer, column_bounds=layout.column_bounds(i))
            for part in ("weight", "scale"):   # SGLang's own weight_loader: the stock one, or the plug-in's no-op
                param = getattr(emb, part)
                param.weight_loader(param, weights[f"layers.{layer}.engram.embed.{part}"])
            built[layer] = emb
        return built

    def batch(n: int) -> SimpleNamespace:
        return SimpleNamespace(forward_mode=modes.ForwardMode.EXTEND, req_pool_indices=torch.tensor([0]),
                               positions=torch.arange(n), extend_seq_lens=torch.tensor([n]),
                               extend_start_loc=torch.tensor([0]), extend_seq_lens_cpu=[n], engram_history=None,
                               out_cache_loc=torch.arange(1, n + 1), spec_info=None)

    class Body:
        """DeepseekV4Model's body: the real (patched) DeepseekV4Model.forward calls _forward_impl."""

        def __init__(self, embeds: dict[int, Any], step: int) -> None:
            self.embeds, self.step = embeds, step

        def _forward_impl(self, input_ids: torch.Tensor, positions: torch.Tensor, fb: Any, *rest: Any) -> list:
            hash_ids = hasher(input_ids, fb)   # [T, 2, 24]: the plug-in's begin_step runs here
            if (self.step, args.rank) == (args.die_at_step, args.die_rank):
                os.kill(os.getpid(), signal.SIGKILL)
            # EngramEmbedding.forward -> _lookup: _owned_rows, then SGLang's TP all-reduce over gloo
            return [self.embeds[layer](hash_ids[:, i]) for i, layer in enumerate(LAYERS)]

    def run(embeds: dict[int, Any], record: dict[str, Any]) -> list[np.ndarray]:
        """Every step's output bits; each step's digest goes to record["digests"] as soon as it returns."""
        steps = []
        record["digests"] = []
        for k in range(tokens.shape[0]):
            ids = torch.from_numpy(tokens[k])
            got = model.DeepseekV4Model.forward(Body(embeds, k), ids, torch.arange(len(ids)), batch(len(ids)), None)
            steps.append(torch.stack(got, 1).contiguous().view(torch.int16).numpy())   # [T, L, 24, 256] bf16 bits
            record["digests"].append(hashlib.sha256(steps[-1].tobytes()).hexdigest())
        return steps

    stock = None
    if not args.skip_stock:
        out["runs"]["stock"] = {}
        stock = run(tables(load=True), out["runs"]["stock"])
    for template in args.controls:
        os.environ[plug.CONTROL_ENV] = template
        try:
            embeds = tables(load=False)
            record: dict[str, Any] = {"table_rows": {str(k): int(e.weight.shape[0]) for k, e in embeds.items()}}
            out["runs"][template] = record
            binding = plug.current()
            record["served_layers"] = sorted(binding.adopted) if binding is not None else []
            steps = run(embeds, record)
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
            out["runs"].setdefault(template, {})["error"] = {
                "type": type(exc).__name__, "message": str(exc)[:2000],
                "in_step": bool(binding.engine.in_step) if binding is not None and binding.engine else None}
        finally:
            os.environ.pop(plug.CONTROL_ENV, None)
    plug.close()


if __name__ == "__main__":
    sys.exit(main())
