"""The row codec: 256 FP8 E4M3 values + 8 E8M0 block scales (block 32) = 264 bytes.

Dequantization is defined by the torch reference that SGLang's CPU path runs:
``(fp32(w) * fp32(scale)).to(bf16)`` with e8m0 byte e meaning 2**(e - 127),
e == 0 meaning 2**-127 and e == 0xFF meaning NaN, fp8 0x7F / 0xFF meaning NaN.

Where the references differ: SGLang's Triton gather builds the scale as the
float with exponent bits e (``e << 23``), special-casing only e == 0. For
e == 0xFF that is +inf, not NaN, so a finite nonzero value times it is +-inf
where torch gives NaN (and 0 * inf is NaN in both). We match torch: it is the
reference the DESIGN names, the arithmetic of the host-table lookup SGLang
replaces, and NaN is the safer answer for a byte the format reserves for NaN.
No real checkpoint contains e8m0 0xFF; the difference is documented, not hidden.
"""

from __future__ import annotations

import numpy as np
import torch

from slacktier.errors import ErrorKind, SlackTierError
from slacktier.tables.layout import ROW_BYTES, ROW_SCALES, ROW_VALUES, SCALE_BLOCK

FP8_MAX = 448.0  # largest finite float8_e4m3fn


def _check_raw(raw: torch.Tensor) -> None:
    if raw.dtype != torch.uint8 or raw.shape[-1] != ROW_BYTES:
        raise SlackTierError(ErrorKind.BAD_INPUT, f"raw rows must be [..., {ROW_BYTES}] uint8, got "
                             f"{tuple(raw.shape)} {raw.dtype}", fix="pass rows as stored on a tier")


def split_raw(raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """raw [..., 264] uint8 -> (weight [..., 256] float8_e4m3fn, scale [..., 8] float8_e8m0fnu) views."""
    _check_raw(raw)
    return (raw[..., :ROW_VALUES].view(torch.float8_e4m3fn),
            raw[..., ROW_VALUES:].view(torch.float8_e8m0fnu))


def join_raw(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """(weight [N, 256] fp8, scale [N, 8] e8m0) -> raw [N, 264] uint8."""
    if weight.dtype != torch.float8_e4m3fn or scale.dtype != torch.float8_e8m0fnu:
        raise SlackTierError(ErrorKind.BAD_INPUT, f"want float8_e4m3fn weight and float8_e8m0fnu scale, got "
                             f"{weight.dtype} and {scale.dtype}", fix="convert the checkpoint tensors first")
    if weight.shape[-1] != ROW_VALUES or scale.shape[-1] != ROW_SCALES or weight.shape[:-1] != scale.shape[:-1]:
        raise SlackTierError(ErrorKind.BAD_INPUT, f"weight {tuple(weight.shape)} and scale {tuple(scale.shape)} "
                             f"are not [N, {ROW_VALUES}] and [N, {ROW_SCALES}]", fix="check the checkpoint's shapes")
    return torch.cat([weight.contiguous().view(torch.uint8), scale.contiguous().view(torch.uint8)], dim=-1)


def reference_dequant(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The torch reference: weight [..., 256] fp8, scale [..., 8] e8m0 -> bf16 [..., 256]."""
    rows = weight.float().unflatten(-1, (-1, SCALE_BLOCK))
    return (rows * scale.float().unsqueeze(-1)).flatten(-2).to(torch.bfloat16)


def dequantize(raw: torch.Tensor) -> torch.Tensor:
    """raw [..., 264] uint8 -> bf16 [..., 256], bit-identical to `reference_dequant`."""
    weight, scale = split_raw(raw)
    return reference_dequant(weight, scale)


def quantize(values: torch.Tensor) -> torch.Tensor:
    """fp32/bf16 rows [N, 256] -> raw [N, 264] uint8 (for synthetic and test tables).

    Each block of 32 gets the power-of-two scale 2**ceil(log2(amax / 448)), so
    every value fits in e4m3 after division; an all-zero block gets scale 1.
    """
    if values.ndim != 2 or values.shape[1] != ROW_VALUES:
        raise SlackTierError(ErrorKind.BAD_INPUT, f"values must be [N, {ROW_VALUES}], got {tuple(values.shape)}",
                             fix="reshape rows to 256 values each")
    blocks = values.float().unflatten(-1, (ROW_SCALES, SCALE_BLOCK))
    amax = blocks.abs().amax(-1)
    exp = torch.where(amax > 0, torch.ceil(torch.log2(amax / FP8_MAX)), torch.zeros_like(amax))
    exp = exp.clamp(-127, 127)
    scale = torch.exp2(exp)
    weight = (blocks / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).flatten(-2)
    scale_bytes = (exp + 127).to(torch.uint8).view(torch.float8_e8m0fnu)
    return join_raw(weight, scale_bytes)


def synthetic_rows(seed: int, row_start: int, rows: int) -> np.ndarray:
    """Deterministic raw rows [rows, 264] uint8 for global rows [row_start, row_start + rows).

    A row's bytes depend only on (seed, global row id), so any shard, page or
    single row can be regenerated independently to verify a staged table.
    Values are drawn as varied fp32 and quantized; scales span a wide range.
    """
    ids = np.arange(row_start, row_start + rows, dtype=np.uint64)
    # splitmix64 of (seed, row) seeds a per-row stream; vectorized over rows.
    x = ids * np.uint64(0x9E3779B97F4A7C15) + np.uint64(seed & 0xFFFFFFFFFFFFFFFF)
    cols = np.arange(ROW_VALUES // 2, dtype=np.uint64)
    with np.errstate(over="ignore"):
        z = x[:, None] + cols[None, :] * np.uint64(0xD1B54A32D192ED03)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    halves = z.view(np.uint32).reshape(rows, ROW_VALUES)
    unit = (halves >> np.uint32(8)).astype(np.float32) / np.float32(1 << 24)  # [0, 1)
    values = (unit * 2.0 - 1.0)
    # Give each block its own magnitude so the scales vary (2**-12 .. 2**4).
    block_mag = np.exp2(((ids[:, None] * np.uint64(7) + np.arange(ROW_SCALES, dtype=np.uint64)[None, :])
                         % np.uint64(17)).astype(np.float32) - 12.0)
    values = values.reshape(rows, ROW_SCALES, SCALE_BLOCK) * block_mag[:, :, None]
    return quantize(torch.from_numpy(values.reshape(rows, ROW_VALUES))).numpy()
