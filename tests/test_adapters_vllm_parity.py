"""The vLLM plug-in's rows against vLLM 0.33.0's own `_engram_lookup_kernel`, run under Triton's interpreter.

vLLM reads an E8M0 scale byte as the fp32 whose exponent field is that byte (`scale << 23`): 0x00 is 0.0 and
0xFF is +inf, where SGLang's host path and torch read 2**-127 and NaN; and every id it does not hold (another
rank's row, past the table, the pad id) comes out +0.0 from its masked loads. The plug-in must give exactly
that. Here a checkpoint whose blocks hold scale bytes 0x00 and 0xFF beside ordinary ones is staged per rank at
TP 1, 2 and 4; each rank's rows come through the plug-in's own seams (`bind`, `prepare_embeddings`,
`_ready_rows`) and are compared bit for bit (NaN as any NaN, the codec's contract) with vLLM's kernel, the
Python source vLLM ships, jitted by the installed Triton with TRITON_INTERPRET=1 on this CPU. vLLM's import
finds no GPU driver and hands out a stand-in for Triton, so the kernel's own function is jitted again here with
the real `triton` and `triton.language` in its globals; nothing of its body is changed.

Negative control: the same rows in the "torch" convention (SGLang's) differ from vLLM's kernel, in the rows
whose blocks hold those bytes.
"""

from __future__ import annotations

import types
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from engines import import_vllm
from slacktier.adapters import vllm as plug
from slacktier.adapters import vllm_binding as core
from slacktier.config import from_dict, write_control
from slacktier.engine.checker import mismatching_rows
from slacktier.tables import codec
from slacktier.tables.engram_hash import EngramLayout
from slacktier.tables.stage import stage_checkpoint

pytestmark = pytest.mark.usefixtures("one_torch_thread")

LAYOUT = EngramLayout.scaled(200)
LAYER = LAYOUT.layer_ids[0]
BOUNDS = tuple(int(b) for b in LAYOUT.layer_column_bounds(LAYER))   # 24 columns, 6,660 rows
ROWS = BOUNDS[-1]
HEAD_SIZES = tuple(int(b) for b in np.diff(BOUNDS))
TOKENS = 12


@pytest.fixture(scope="module")
def vl() -> SimpleNamespace:
    return SimpleNamespace(engram=import_vllm(plug.ENGRAM_MODULE), config=import_vllm("vllm.config"),
                           engram_config=import_vllm("vllm.config.engram"),
                           distributed=import_vllm("vllm.distributed"))


@pytest.fixture(scope="module")
def raw() -> np.ndarray:
    """[ROWS, 264] rows: synthetic values (every finite fp8 byte, -0 and +0 among them), one block in eight with
    scale byte 0x00 and one in sixteen with 0xFF."""
    rows = codec.synthetic_rows(11, 0, ROWS)
    rng = np.random.default_rng(3)
    pick = rng.random((ROWS, 8))
    scales = rows[:, 256:]
    scales[pick < 1 / 8] = 0x00
    scales[(pick >= 1 / 8) & (pick < 3 / 16)] = 0xFF
    return rows


@pytest.fixture(scope="module")
def checkpoint(raw: np.ndarray, o_direct_module_dir: Path) -> Path:
    from safetensors.torch import save_file

    path = o_direct_module_dir / "engram.safetensors"
    t = torch.from_numpy(raw)
    save_file({f"layers.{LAYER}.engram.embed.weight": t[:, :256].contiguous().view(torch.float8_e4m3fn),
               f"layers.{LAYER}.engram.embed.scale": t[:, 256:].contiguous().view(torch.float8_e8m0fnu)}, str(path))
    return path


@pytest.fixture(scope="module")
def vllm_lookup(vl, monkeypatch_module):
    """vLLM's `_engram_lookup_kernel` jitted by the installed Triton in interpreter mode."""
    import triton
    import triton.language as tl

    monkeypatch_module.setenv("TRITON_INTERPRET", "1")
    fn = vl.engram._engram_lookup_kernel
    fn = getattr(fn, "fn", fn)   # the function itself, whatever vLLM's Triton stand-in wrapped it in
    kernel = triton.jit(types.FunctionType(fn.__code__, {**fn.__globals__, "tl": tl, "triton": triton},
                                           fn.__name__, fn.__defaults__))

    def lookup(weight: torch.Tensor, scales: torch.Tensor, ids: torch.Tensor, head_start: int, local_heads: int,
               vocab_start: int, vocab_end: int) -> torch.Tensor:
        """What ParallelEngramEmbedding.lookup writes for `ids` [T, 24] from its shard's rows `weight` [R, 256]
        fp8 and `scales` [R, 8] uint8 (rows [vocab_start, vocab_end)): bf16 [T, local_heads, 256]."""
        out = torch.empty(ids.shape[0], local_heads, 256, dtype=torch.bfloat16)
        rows = ids.shape[0] * local_heads
        kernel[(1,)](weight, scales, ids, ids, out, vocab_start, vocab_end, rows, ids.stride(0), ids.stride(1),
                     HEAD_START=head_start, LOCAL_HEADS=local_heads, TOTAL_HEADS=ids.shape[1], DIM=256,
                     QUANT_BLOCK=32, BLOCK_R=16, GRID=1, SORTED=False, PACKED=False, OUT_STRIDE=out.stride(0),
                     PEER_ROWS=0)
        return out

    return lookup


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


def _ids(rng: np.random.Generator) -> torch.Tensor:
    """[T, 24] hash ids: each column's id in its own rows, then edge cases: the table's last row and the rows
    past it, another column's rows (another rank's at TP > 1), the pad id -1 and another negative id."""
    b = np.asarray(BOUNDS)
    ids = b[:-1] + rng.integers(0, np.diff(b), size=(TOKENS, 24))
    ids[0, :6] = [ROWS - 1, ROWS, ROWS + 3, 2**40, -1, -7]
    ids[1, :] = rng.integers(0, ROWS, size=24)
    ids[2, ::5] = BOUNDS[12]
    return torch.from_numpy(ids.astype(np.int64))


def _worker(vl, monkeypatch, tp: int, rank: int) -> None:
    """This process as vLLM's worker `rank` of TP `tp`, stated through vLLM's own getters."""
    config = SimpleNamespace(parallel_config=vl.config.ParallelConfig(tensor_parallel_size=tp),
                             engram_config=vl.engram_config.EngramConfig(), additional_config={},
                             model_config=SimpleNamespace(enforce_eager=True), speculative_config=None)
    monkeypatch.setattr(vl.config, "get_current_vllm_config", lambda: config)
    monkeypatch.setattr(vl.distributed, "get_tensor_model_parallel_rank", lambda: rank)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_plugin_rows_equal_vllms_own_lookup_kernel(vl, raw, checkpoint, vllm_lookup, monkeypatch, tmp_path, tp):
    m = stage_checkpoint(checkpoint, [tmp_path / "t.bin"], tp, column_bounds={LAYER: BOUNDS}, progress=False)
    for rank in range(tp):
        doc = {"engine": {"cache_rows": 300, "check": True, "owned_only": tp > 1},
               "table": [{"layer": LAYER, "manifest": str(m.path), "rank": rank if tp > 1 else -1,
                          "cache_share": 1.0}]}
        write_control(from_dict(doc), tmp_path / f"rank{rank}.toml")
    monkeypatch.setenv(plug.CONTROL_ENV, str(tmp_path / "rank{tp_rank}.toml"))
    weight = torch.from_numpy(raw[:, :256].copy()).view(torch.float8_e4m3fn)
    scales = torch.from_numpy(raw[:, 256:].copy())
    rng = np.random.default_rng(tp)
    special = 0
    for rank in range(tp):
        _worker(vl, monkeypatch, tp, rank)
        try:
            binding = core.bind(24)
            table = plug._served_table(binding, LAYER, ROWS, 256, HEAD_SIZES)
            engram = SimpleNamespace(embed_tokens=table, staged_rows=torch.empty(TOKENS, table.part_n_hash_cols, 256,
                                                                                 dtype=torch.bfloat16))
            for _ in range(2):   # a cold step (rows read) and a warm one (rows from the cache)
                ids = _ids(rng)
                with core.step():
                    plug._prepare_embeddings(None, engram, ids)
                    ours = plug._ready_rows(None, engram, TOKENS).clone()
                # vLLM's rank holds its shard's rows only (its weight loader narrows the checkpoint's)
                shard = slice(table.vocab_start_idx, table.vocab_end_idx)
                theirs = vllm_lookup(weight[shard], scales[shard], ids, table.head_start, table.part_n_hash_cols,
                                     table.vocab_start_idx, table.vocab_end_idx)
                assert not mismatching_rows(ours.reshape(-1, 256), theirs.reshape(-1, 256)).any()
                # the comparison can fail: SGLang's reading of the same rows differs from vLLM's kernel
                local = ids[:, table.head_start:table.head_start + table.part_n_hash_cols].reshape(-1)
                held = (local >= table.vocab_start_idx) & (local < table.vocab_end_idx)
                rows = raw[local[held].numpy()]
                torch_rows = codec.dequantize(torch.from_numpy(rows), "torch")
                differ = mismatching_rows(torch_rows, theirs.reshape(-1, 256)[held])
                has_special = torch.from_numpy(np.isin(rows[:, 256:], (0x00, 0xFF)).any(axis=1))
                assert torch.equal(differ, has_special)
                special += int(has_special.sum())
            counters = binding.engine.totals[LAYER]
            assert counters.mismatches == 0 and counters.checked_rows > 0
            # ROWS, ROWS + 3, 2**40 and -7 sit in columns 0..5, rank 0's at every TP: two steps of four
            assert counters.out_of_table == (8 if rank == 0 else 0)
        finally:
            core.close()
    assert special > 0


def test_the_vllm_table_is_vllms_arithmetic_on_every_byte_pair():
    """Every (fp8 byte, e8m0 byte) entry of the "vllm" table equals torch running vLLM's kernel arithmetic
    (fp32(value) * the fp32 with the scale byte as exponent field, to bf16); the "torch" table differs exactly
    where that reading differs: scale bytes 0x00 and 0xFF (NaN as any NaN)."""
    values = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()[:, None]   # [256, 1]
    field = (torch.arange(256, dtype=torch.int32) << 23).view(torch.float32)[None, :]          # [1, 256]
    want = (values * field).to(torch.bfloat16).reshape(-1)
    for convention, special in (("vllm", False), ("torch", True)):
        got = torch.from_numpy(codec.dequant_lut(convention).astype(np.int16)).view(torch.bfloat16)
        differ = (got.view(torch.int16) != want.view(torch.int16)) & ~(torch.isnan(got) & torch.isnan(want))
        scale_bytes = set((torch.nonzero(differ).flatten() % 256).tolist())
        assert scale_bytes == ({0x00, 0xFF} if special else set())
