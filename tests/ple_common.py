"""What the PLE plug-in tests and their GPU check share: two scaled Qwen3.8-hash PLE tables, staged, and row checks.

Two PLE layers (decoder layers 1 and 3, PLE layer indices 0 and 1) over the
DeepSeek-V4 tokenizer's ids (the real text's tokens), ngram_vocab_size_base 1,000
(~16,800 rows per table). The rows are fp8 E4M3 with NaN (0x7F, 0xFF) and -0.0
(0x80) bytes; they are staged as SlackTier rows with every E8M0 block scale 0x7F
(2^0), the plug-ins' format for an fp8 PLE table with a per-tensor scale
(adapters.sglang_ple's module docstring).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from slacktier.config import ControlFile, DiskOptions, EngineConfig, TableConfig, write_control
from slacktier.testing.engine import real_text
from slacktier.tables.ple_hash import PleLayout
from slacktier.tables.stage import stage_checkpoint
from slacktier.tables.tokenizer import encode

VOCAB = 129_280          # the DeepSeek-V4 tokenizer's ids
EOS = 1
BASE = 1_000             # ngram_vocab_size_base
LAYERS = (1, 3)          # decoder layers with PLE; PLE layer indices 0 and 1
DIM = 16 * 256           # ple_embed_dim: 16 heads of 256 values, SlackTier's row width
SCALE = 0.0123           # a per-tensor scale that rounds: the engines' multiplication is checked, not skipped
UNIT_SCALE = 0x7F        # E8M0 2^0


class RequestPool:
    """SGLang's request pool as the PLE batch code reads it: per-request n-gram history, [R, n - 1]."""

    def __init__(self, requests: int) -> None:
        self.history = torch.full((requests, 2), EOS, dtype=torch.long)
        self.ple_window_cache = None

    def get_mamba_indices(self, req_pool_indices: torch.Tensor) -> torch.Tensor:
        return req_pool_indices

    def get_ngram_context(self, state_indices: torch.Tensor) -> torch.Tensor:
        return self.history[state_indices]

    def set_ngram_context(self, state_indices: torch.Tensor, context: torch.Tensor) -> None:
        self.history[state_indices] = context


def sglang_text_config(offload: bool, dtype: str | None = "float8_e4m3fn", dim: int = DIM, **more: Any) -> Any:
    """SGLang's Qwen4Exp text config of the scaled tables (`dtype` None: a bf16 table)."""
    from sglang.srt.configs.qwen4_exp import Qwen4ExpTextConfig

    return Qwen4ExpTextConfig(ple_embed_dim=dim, ngram_vocab_size_base=BASE, vocab_size=VOCAB, eos_token_id=EOS,
                              ple_embedding_dtype=dtype, ple_layer_ids=[layer + 1 for layer in LAYERS],
                              ple_offload_embedding=offload, **more)


def sglang_ngram(qwen: Any, config: Any, layer: int) -> Any:
    """SGLang's Qwen4ExpNGramEmbedding of decoder layer `layer`, built under the prefix its model gives it."""
    return qwen.Qwen4ExpNGramEmbedding(config, config.ple_embed_dim, ple_layer_index=LAYERS.index(layer),
                                       prefix=f"model.layers.{layer}.ple.ple_embedding")


def fp8_rows(rows: int, seed: int) -> torch.Tensor:
    """fp8 rows [rows, 256] with NaN (0x7F, 0xFF) and -0.0 (0x80) bytes among random ones."""
    w = np.random.default_rng(seed).integers(0, 256, size=(rows, 256), dtype=np.uint8)
    w[::97, 3] = 0x7F
    w[::89, 5] = 0x80
    w[::83, 7] = 0xFF
    return torch.from_numpy(w).view(torch.float8_e4m3fn)


def padded(rows: torch.Tensor, padded_rows: int) -> torch.Tensor:
    """The checkpoint's table: `rows`, then zero rows up to the engine's padded row count."""
    out = torch.zeros(padded_rows, rows.shape[1], dtype=torch.uint8).view(rows.dtype)
    out[:rows.shape[0]] = rows
    return out


def ple_world(folder: Path) -> SimpleNamespace:
    """Both tables as fp8 rows, staged in `folder` as SlackTier rows with unit E8M0 scales; two requests' tokens."""
    from safetensors.torch import save_file

    layouts = {layer: PleLayout.scaled(BASE, vocab_size=VOCAB, eos_token_id=EOS, ple_layer_index=i, layer_id=layer)
               for i, layer in enumerate(LAYERS)}
    tables = {layer: fp8_rows(lay.rows, seed=layer) for layer, lay in layouts.items()}
    unit = {layer: torch.full((lay.rows, 8), UNIT_SCALE, dtype=torch.uint8).view(torch.float8_e8m0fnu)
            for layer, lay in layouts.items()}
    folder.mkdir(parents=True, exist_ok=True)
    ckpt = folder / "ple.safetensors"
    save_file({f"layers.{layer}.engram.embed.{part}": t for layer in LAYERS
               for part, t in (("weight", tables[layer]), ("scale", unit[layer]))}, str(ckpt))
    manifest = stage_checkpoint(ckpt, [folder / "ple.bin"], ranks=1,
                                expected={layer: lay.rows for layer, lay in layouts.items()},
                                column_bounds={layer: lay.column_bounds() for layer, lay in layouts.items()},
                                overwrite=True, progress=False).path
    tokens = np.asarray(encode(real_text(2_000)), dtype=np.int64)
    return SimpleNamespace(layouts=layouts, tables=tables, manifest=manifest, dir=folder, checkpoint=ckpt,
                           prompts=[tokens[:170], tokens[200:321]], next_tokens=tokens[400:410])


def ple_control(path: Path, manifest: str, dram: tuple[int, ...] = (), device: str = "cpu") -> Path:
    """A control file serving both PLE layers from disk (`dram` ones left to the serving engine)."""
    tables = tuple(TableConfig(layer=layer, manifest=manifest, source="dram" if layer in dram else "disk",
                               options=None if layer in dram else DiskOptions(queue_depth=32), cache_share=0.5,
                               order=i) for i, layer in enumerate(LAYERS))
    return write_control(ControlFile(engine=EngineConfig(cache_rows=20_000, device=device), tables=tables), path)


def same_rows(got: torch.Tensor, want: torch.Tensor) -> bool:
    """bf16 bit for bit, a NaN's payload aside (slacktier.tables.codec)."""
    got, want = got.detach().cpu(), want.detach().cpu()
    if got.dtype != want.dtype or got.dtype != torch.bfloat16 or got.shape != want.shape:
        return False
    nan = torch.isnan(want)
    return bool(torch.equal(torch.isnan(got), nan)
                and torch.equal(got.view(torch.int16)[~nan], want.view(torch.int16)[~nan]))


def assert_same_rows(got: torch.Tensor, want: torch.Tensor) -> None:
    """`same_rows`, naming the first differing element when it fails."""
    if not same_rows(got, want):
        g, w = got.detach().cpu(), want.detach().cpu()
        diff = (g.view(torch.int16) != w.view(torch.int16)) & ~(torch.isnan(g) & torch.isnan(w)) \
            if g.shape == w.shape and g.dtype == w.dtype else None
        where = diff.nonzero()[:1].tolist() if diff is not None else "shape/dtype"
        raise AssertionError(f"rows differ: {tuple(g.shape)} {g.dtype} vs {tuple(w.shape)} {w.dtype}, first at "
                             f"{where}")


def sglang_batches(forward_mode: Any, world: SimpleNamespace) -> Iterator[tuple[torch.Tensor, Any]]:
    """A prefill of both requests, then decode steps: (input_ids, what SGLang's PLE code reads of a ForwardBatch)."""
    lens = [len(p) for p in world.prompts]
    common = dict(tbo_parent_token_range=None, spec_algorithm=None, spec_info=None, _original_forward_mode=None,
                  global_num_token_non_padded_cpu=None, req_pool_indices=torch.tensor([0, 1]),
                  mamba_track_indices=None, mamba_track_mask=None)
    ids = torch.from_numpy(np.concatenate(world.prompts))
    yield ids, SimpleNamespace(forward_mode=forward_mode.EXTEND, extend_seq_lens=torch.tensor(lens),
                               extend_seq_lens_cpu=lens, out_cache_loc=torch.arange(1, len(ids) + 1), **common)
    for step in range(len(world.next_tokens) // 2):
        ids = torch.from_numpy(world.next_tokens[2 * step:2 * step + 2])
        yield ids, SimpleNamespace(forward_mode=forward_mode.DECODE, extend_seq_lens=None,
                                   extend_seq_lens_cpu=None, out_cache_loc=torch.tensor([7, 9]), **common)


def qwen_checkpoint(folder: Path, world: SimpleNamespace, parts: int = 4, seed: int | None = None) -> Path:
    """`world`'s tables (or, with `seed`, other rows of the same shapes) as a Qwen4Exp model directory:
    transformers' save_pretrained names and shards (`parts` = split_ngram_parts, SGLang's shard rule), padding
    rows of nonzero bytes, each table's per-tensor weight_scale, and the config.json its head sizes come from."""
    import json

    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    for layer, lay in world.layouts.items():
        rows = world.tables[layer] if seed is None else fp8_rows(lay.rows, seed=seed + layer)
        full = torch.full((lay.padded_rows, 256), 0xAB, dtype=torch.uint8).view(torch.float8_e4m3fn)
        full[:lay.rows] = rows
        size = -(-lay.padded_rows // parts)
        prefix = f"model.language_model.layers.{layer}.ple.ple_embedding.ngram_embedding"
        for i in range(-(-lay.padded_rows // size)):
            tensors[f"{prefix}.shard_{i}.weight"] = full[i * size:(i + 1) * size].contiguous()
        tensors[f"{prefix}.weight_scale"] = torch.tensor([SCALE], dtype=torch.float32)
    save_file(tensors, str(folder / "model.safetensors"))
    text = {"vocab_size": VOCAB, "eos_token_id": EOS, "ngram_vocab_size_base": BASE, "ngram_size": 3,
            "heads_per_ngram": 8, "seed": 1234, "make_ngram_vocab_size_divisible_by": 128, "split_ngram_parts": parts,
            "ple_layer_ids": [layer + 1 for layer in LAYERS], "ple_embed_dim": DIM,
            "ple_embedding_dtype": "float8_e4m3fn"}
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen4_exp", "text_config": text}))
    return folder


def shard_stream(folder: Path) -> list[tuple[str, torch.Tensor]]:
    """A Qwen4Exp checkpoint's tensors as an engine's loader streams them: (name, tensor), shards in order."""
    from safetensors.torch import load_file

    return sorted(load_file(str(folder / "model.safetensors")).items())
