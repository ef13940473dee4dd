"""The row codec: 256 FP8 E4M3 values + 8 E8M0 block scales (block 32) = 264 bytes.

Dequantization is defined by the torch reference that SGLang's CPU path runs
(`EngramEmbedding._owned_rows` without CUDA kernels):
``(fp32(w) * fp32(scale)).to(bf16)``, where fp32(scale) of e8m0 byte e is
2**(e - 127), e == 0x00 is 2**-127 (an fp32 subnormal, kept, not flushed) and
e == 0xFF is NaN; fp8 bytes 0x7F / 0xFF are NaN and 0x80 is -0.

Our fast path (`dequantize` on CPU, `dequantize_bits`) is a 65,536-entry table
of bf16 bit patterns indexed by (fp8 byte, e8m0 byte), computed here from the
bit-level definitions of the three formats in numpy (no torch), with IEEE fp32
multiplication and round-to-nearest-even to bf16. The test suite checks every
one of the 65,536 entries against torch.

NaN bits. torch's own NaN output is not one pattern: its AVX2/AVX-512 fp32->bf16
path writes 0xFFFF for every NaN and its scalar path (ATEN_CPU_CAPABILITY=default)
writes 0x7FC0 (both measured on torch 2.13 CPU); CUDA's conversion has its own
canonical NaN. So the contract is: every
non-NaN result is bit-identical, and every NaN result is a NaN. We write the
canonical quiet NaN 0x7FC0. Real checkpoints hold no NaN bytes.

Where the references differ from torch (e8m0 0x00 and 0xFF):
- SGLang 0.5.23's Triton gather (`kernels/ops/embeddings/engram_gather.py`)
  builds the scale as the fp32 whose exponent field is e (``e << 23``) and
  special-cases e == 0 to 2**-127. So 0x00 matches torch. For 0xFF it gets
  +inf, not NaN: a finite nonzero value times it is +-inf where torch gives NaN
  (zero * inf and NaN * inf are NaN in both).
- vLLM 0.33.0's `_engram_lookup_kernel` (`models/deepseek_v41/common/engram.py`)
  uses ``e << 23`` with no special case: 0x00 becomes scale 0.0, so every value
  of that block comes out +-0 instead of value * 2**-127 (which in bf16 is a
  subnormal, or +-0 once below 2**-133); 0xFF is +inf as in SGLang's kernel.
We match torch by default: it is the reference DESIGN.md names, the arithmetic
of the host-table lookup both kernels replace, and NaN is the honest answer for
a byte the format reserves for NaN. `quantize` never writes 0xFF, and writes
0x00 only for blocks whose largest magnitude is at most 448 * 2**-127.

Conventions (`DEQUANT_CONVENTIONS`): a serving engine's plug-in must equal that
engine's own lookup, so every dequant entry point takes `convention`:
- "torch" (the default): the reading above, SGLang's host-table path;
- "vllm": vLLM's `_engram_lookup_kernel`, the fp32 whose exponent field is the
  byte (0x00 -> 0.0, 0xFF -> +inf), every other byte as in torch. Its table is
  built the same way from that scale reading, so the compiled gather stays one
  table lookup per value.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numba
import numpy as np

from slacktier.errors import ErrorKind, SlackTierError
from slacktier.tables.layout import ROW_BYTES, ROW_SCALES, ROW_VALUES, ROW_WORDS, SCALE_BLOCK

if TYPE_CHECKING:   # the functions that take tensors import torch: staging or verifying a table needs none
    import torch

FP8_MAX = 448.0  # largest finite float8_e4m3fn
BF16_NAN_BITS = 0x7FC0  # the NaN we write (see the module docstring)
SYNTHETIC_SCALE_MIN = 115  # synthetic rows use e8m0 bytes 115..131: scales 2**-12 .. 2**4
SYNTHETIC_SCALE_SPAN = 17


def _fp8_e4m3fn_to_f32() -> np.ndarray:
    """[256] float32: the value of every float8_e4m3fn byte, from its bit fields."""
    b = np.arange(256)
    sign = np.where(b & 0x80, -1.0, 1.0)
    exp = (b >> 3) & 0xF
    man = b & 0x7
    value = np.where(exp == 0, man / 8.0 * 2.0**-6, (1.0 + man / 8.0) * np.exp2(exp - 7.0))
    value = sign * value  # float64, exact
    value[(b & 0x7F) == 0x7F] = np.nan  # e4m3fn: only S.1111.111 is NaN, no inf
    return value.astype(np.float32)


def _e8m0_to_f32() -> np.ndarray:
    """[256] float32: 2**(e - 127) for every e8m0 byte, 0x00 -> 2**-127, 0xFF -> NaN."""
    value = np.full(256, np.nan, dtype=np.float32)
    value[:255] = np.ldexp(1.0, np.arange(255) - 127)  # 2**-127 is an exact fp32 subnormal
    return value


def _e8m0_exponent_field_to_f32() -> np.ndarray:
    """[256] float32 whose exponent field is the e8m0 byte (vLLM's ``e << 23``): 0x00 -> 0.0, 0xFF -> +inf."""
    return (np.arange(256, dtype=np.uint32) << np.uint32(23)).view(np.float32)


def _f32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bit patterns (uint16), round to nearest even, NaN -> 0x7FC0."""
    bits = x.view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    out = rounded.astype(np.uint16)
    out[np.isnan(x)] = BF16_NAN_BITS
    return out


def _build_dequant_lut(scales: np.ndarray) -> np.ndarray:
    """[65536] uint16: bf16 bits of fp32(fp8 byte w) * scales[e8m0 byte s], at index w * 256 + s."""
    with np.errstate(invalid="ignore", over="ignore"):
        product = _fp8_e4m3fn_to_f32()[:, None] * scales[None, :]  # [256, 256] fp32, IEEE
    return _f32_to_bf16_bits(product.astype(np.float32)).reshape(-1)


DEQUANT_CONVENTIONS = ("torch", "vllm")   # how an E8M0 byte reads as fp32 (module docstring)
FP8_TO_F32 = _fp8_e4m3fn_to_f32()   # [256] float32
E8M0_TO_F32 = _e8m0_to_f32()        # [256] float32
E8M0_FIELD_TO_F32 = _e8m0_exponent_field_to_f32()   # [256] float32, the "vllm" reading
DEQUANT_LUT = _build_dequant_lut(E8M0_TO_F32)  # [65536] uint16, index fp8_byte * 256 + e8m0_byte
DEQUANT_LUT_VLLM = _build_dequant_lut(E8M0_FIELD_TO_F32)   # the same for the "vllm" convention


def check_convention(convention: str) -> str:
    """`convention` when it is one of DEQUANT_CONVENTIONS; refused (BAD_INPUT) otherwise."""
    if convention not in DEQUANT_CONVENTIONS:
        raise SlackTierError(ErrorKind.BAD_INPUT, f"unknown dequant convention {convention!r}",
                             fix=f"choose one of {', '.join(DEQUANT_CONVENTIONS)}")
    return convention


def dequant_lut(convention: str = "torch") -> np.ndarray:
    """The exact dequant table [65536] uint16 of `convention` (bf16 bits at fp8_byte * 256 + e8m0_byte)."""
    return DEQUANT_LUT_VLLM if check_convention(convention) == "vllm" else DEQUANT_LUT


@numba.njit(nogil=True, cache=True)
def _dequant_rows_lut(raw: np.ndarray, lut: np.ndarray, out: np.ndarray) -> None:
    # raw: [N, 264] uint8, out: [N, 256] uint16 (bf16 bits)
    for i in range(raw.shape[0]):
        for b in range(ROW_SCALES):
            s = np.int64(raw[i, ROW_VALUES + b])
            for j in range(b * SCALE_BLOCK, (b + 1) * SCALE_BLOCK):
                out[i, j] = lut[np.int64(raw[i, j]) * 256 + s]


def _check_raw(raw: torch.Tensor) -> None:
    import torch

    if raw.dtype != torch.uint8 or raw.shape[-1] != ROW_BYTES:
        raise SlackTierError(ErrorKind.BAD_INPUT, f"raw rows must be [..., {ROW_BYTES}] uint8, got "
                             f"{tuple(raw.shape)} {raw.dtype}", fix="pass rows as stored on a tier")


def split_raw(raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """raw [..., 264] uint8 -> (weight [..., 256] float8_e4m3fn, scale [..., 8] float8_e8m0fnu) views."""
    import torch

    _check_raw(raw)
    return (raw[..., :ROW_VALUES].view(torch.float8_e4m3fn),
            raw[..., ROW_VALUES:].view(torch.float8_e8m0fnu))


def join_raw(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """(weight [N, 256] fp8, scale [N, 8] e8m0) -> raw [N, 264] uint8."""
    import torch

    if weight.dtype != torch.float8_e4m3fn or scale.dtype != torch.float8_e8m0fnu:
        raise SlackTierError(ErrorKind.BAD_INPUT, f"want float8_e4m3fn weight and float8_e8m0fnu scale, got "
                             f"{weight.dtype} and {scale.dtype}", fix="convert the checkpoint tensors first")
    if weight.shape[-1] != ROW_VALUES or scale.shape[-1] != ROW_SCALES or weight.shape[:-1] != scale.shape[:-1]:
        raise SlackTierError(ErrorKind.BAD_INPUT, f"weight {tuple(weight.shape)} and scale {tuple(scale.shape)} "
                             f"are not [N, {ROW_VALUES}] and [N, {ROW_SCALES}]", fix="check the checkpoint's shapes")
    return torch.cat([weight.contiguous().view(torch.uint8), scale.contiguous().view(torch.uint8)], dim=-1)


def reference_dequant(weight: torch.Tensor, scale: torch.Tensor, convention: str = "torch") -> torch.Tensor:
    """The torch reference: weight [..., 256] fp8, scale [..., 8] e8m0 -> bf16 [..., 256]; "vllm" reads each
    scale byte as vLLM's kernel does (the fp32 with that exponent field)."""
    import torch

    rows = weight.float().unflatten(-1, (-1, SCALE_BLOCK))
    if check_convention(convention) == "vllm":
        factor = (scale.view(torch.uint8).to(torch.int32) << 23).view(torch.float32)
    else:
        factor = scale.float()
    return (rows * factor.unsqueeze(-1)).flatten(-2).to(torch.bfloat16)


def dequantize_bits(raw: np.ndarray, out: np.ndarray | None = None, convention: str = "torch") -> np.ndarray:
    """raw [N, 264] uint8 (numpy) -> bf16 bit patterns [N, 256] uint16, via `convention`'s exact table."""
    if raw.dtype != np.uint8 or raw.ndim != 2 or raw.shape[1] != ROW_BYTES:
        raise SlackTierError(ErrorKind.BAD_INPUT, f"raw rows must be [N, {ROW_BYTES}] uint8, got "
                             f"{raw.shape} {raw.dtype}", fix="pass rows as stored on a tier")
    if out is None:
        out = np.empty((raw.shape[0], ROW_VALUES), dtype=np.uint16)
    elif out.dtype != np.uint16 or out.shape != (raw.shape[0], ROW_VALUES):
        raise SlackTierError(ErrorKind.BAD_INPUT, f"out must be [{raw.shape[0]}, {ROW_VALUES}] uint16, got "
                             f"{out.shape} {out.dtype}", fix="preallocate out with the rows' count")
    _dequant_rows_lut(raw, dequant_lut(convention), out)
    return out


def dequantize(raw: torch.Tensor, convention: str = "torch") -> torch.Tensor:
    """raw [..., 264] uint8 -> bf16 [..., 256], bit-identical to `reference_dequant` (NaN as any NaN).

    CPU tensors go through the exact lookup table; tensors on an accelerator run
    the torch reference arithmetic itself on that device.
    """
    import torch

    _check_raw(raw)
    if raw.device.type != "cpu":
        weight, scale = split_raw(raw)
        return reference_dequant(weight, scale, convention)
    lead = raw.shape[:-1]
    flat = raw.reshape(-1, ROW_BYTES).contiguous().numpy()
    bits = dequantize_bits(flat, convention=convention)
    return torch.from_numpy(bits).view(torch.bfloat16).reshape(*lead, ROW_VALUES)


def quantize(values: torch.Tensor) -> torch.Tensor:
    """fp32/bf16 rows [N, 256] -> raw [N, 264] uint8 (for synthetic and test tables).

    Each block of 32 gets the smallest power-of-two scale 2**e with
    amax / 2**e <= 448, found exactly from amax's binary exponent (no log2
    rounding): amax = m * 2**k with m in [0.5, 1) gives e = k - 9 when
    m <= 0.875 (448 = 0.875 * 2**9), else k - 8. e is clamped to [-127, 127]
    (e8m0 bytes 0..254, never the NaN byte); an all-zero block gets scale 1.
    Values are rounded to e4m3 by torch (nearest even). -0 stays -0.
    """
    import torch

    if values.ndim != 2 or values.shape[1] != ROW_VALUES:
        raise SlackTierError(ErrorKind.BAD_INPUT, f"values must be [N, {ROW_VALUES}], got {tuple(values.shape)}",
                             fix="reshape rows to 256 values each")
    blocks = values.float().unflatten(-1, (ROW_SCALES, SCALE_BLOCK))  # [N, 8, 32] fp32
    if not bool(torch.isfinite(blocks).all()):
        raise SlackTierError(ErrorKind.BAD_INPUT, "values contain NaN or inf, which the codec does not quantize",
                             fix="replace non-finite values before quantizing")
    amax = blocks.abs().amax(-1)  # [N, 8]
    mantissa, exponent = torch.frexp(amax)
    exp = torch.where(mantissa <= 0.875, exponent - 9, exponent - 8)
    exp = torch.where(amax > 0, exp, torch.zeros_like(exp)).clamp(-127, 127)  # [N, 8] int32
    inv_scale = torch.ldexp(torch.ones_like(amax), -exp)  # 2**-e, exact in fp32 for |e| <= 127
    weight = (blocks * inv_scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).flatten(-2)
    scale_bytes = (exp + 127).to(torch.uint8).view(torch.float8_e8m0fnu)
    return join_raw(weight, scale_bytes)


@numba.njit(nogil=True, cache=True, inline="always")
def _mix64(z: np.uint64) -> np.uint64:
    # splitmix64's finalizer
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


_NAN_LOW7 = 0x7F7F7F7F7F7F7F7F
_ONES = 0x0101010101010101
_HIGHS = 0x8080808080808080


@numba.njit(nogil=True, cache=True, inline="always")
def synthetic_row_into(seed: np.uint64, row: np.int64, out64: np.ndarray, at: np.int64) -> None:
    """Write global row `row`'s 33 synthetic 8-byte words into uint64 `out64[at:at + 33]` (little endian)."""
    base = _mix64(np.uint64(seed) ^ _mix64(np.uint64(row) * np.uint64(0x9E3779B97F4A7C15)))
    for w in range(ROW_VALUES // 8):
        z = _mix64(base + np.uint64(w + 1) * np.uint64(0xD1B54A32D192ED03))
        # A byte with low 7 bits 0x7F is an fp8 NaN: flip its bit 0 (-> +-448). t + 1 carries
        # into bit 7 only for t == 0x7F, and never across bytes since t <= 0x7F.
        t = z & np.uint64(_NAN_LOW7)
        z ^= ((t + np.uint64(_ONES)) & np.uint64(_HIGHS)) >> np.uint64(7)
        out64[at + w] = z
    z = _mix64(base + np.uint64(ROW_VALUES // 8 + 1) * np.uint64(0xD1B54A32D192ED03))
    word = np.uint64(0)
    for k in range(ROW_SCALES):
        byte = (z >> np.uint64(8 * k)) & np.uint64(0xFF)
        word |= (np.uint64(SYNTHETIC_SCALE_MIN) + byte % np.uint64(SYNTHETIC_SCALE_SPAN)) << np.uint64(8 * k)
    out64[at + ROW_VALUES // 8] = word


@numba.njit(nogil=True, cache=True)
def _synthetic_fill(seed: np.uint64, row_start: np.int64, out64: np.ndarray) -> None:
    # out64: [rows * 33] uint64, the [rows, 264] uint8 output viewed as words
    for i in range(out64.shape[0] // ROW_WORDS):
        synthetic_row_into(seed, row_start + i, out64, i * ROW_WORDS)


def synthetic_seed(seed: int) -> np.uint64:
    """The 64-bit generator seed for a user seed (any int; negative ints wrap)."""
    return np.uint64(seed & 0xFFFFFFFFFFFFFFFF)


def synthetic_rows(seed: int, row_start: int, rows: int) -> np.ndarray:
    """Deterministic raw rows [rows, 264] uint8 for global rows [row_start, row_start + rows).

    A row's bytes depend only on (seed, global row id), so any shard, page or
    single row can be regenerated independently to verify a staged table. The
    256 fp8 bytes are uniform over the finite e4m3 codes (NaN bytes 0x7F/0xFF
    become +-448), so values span subnormals, -0 and the full range; the 8 scale
    bytes are uniform in 115..131 (2**-12 .. 2**4). Every dequantized value is
    finite. Compiled, so staging a table is bound by its writes, not by this.
    """
    if rows < 0 or row_start < 0:
        raise SlackTierError(ErrorKind.BAD_INPUT, f"rows {rows} and row_start {row_start} must be >= 0",
                             fix="pass a non-negative row range")
    out = np.empty((rows, ROW_BYTES), dtype=np.uint8)
    _synthetic_fill(synthetic_seed(seed), np.int64(row_start), out.reshape(-1).view(np.uint64))
    return out
