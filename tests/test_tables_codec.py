"""The row codec against the torch reference: every (fp8 byte, e8m0 byte) pair, special bytes, round trips."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from slacktier.errors import SlackTierError
from slacktier.tables import codec
from slacktier.tables.layout import ROW_BYTES

SETTINGS = settings(max_examples=60, deadline=None)


def _nan_bf16(bits: np.ndarray) -> np.ndarray:
    b = bits.astype(np.uint16)
    return ((b & 0x7F80) == 0x7F80) & ((b & 0x7F) != 0)


def _assert_same_bf16(ours: torch.Tensor, ref: torch.Tensor) -> None:
    """Bit-identical except that a NaN matches any NaN (torch's NaN bits depend on its CPU code path)."""
    a = ours.view(torch.uint16).numpy().astype(np.uint16)
    b = ref.view(torch.uint16).numpy().astype(np.uint16)
    na, nb = _nan_bf16(a), _nan_bf16(b)
    assert np.array_equal(na, nb), "NaN positions differ"
    diff = np.flatnonzero((a != b) & ~na)
    assert diff.size == 0, (f"{diff.size} values differ, first at {diff[0]}: "
                            f"{a.flat[diff[0]]:#06x} vs {b.flat[diff[0]]:#06x}")


def _all_pairs_raw() -> np.ndarray:
    """256 rows: row s holds fp8 bytes 0..255 and all eight scale bytes = s, so every pair appears once."""
    raw = np.empty((256, ROW_BYTES), dtype=np.uint8)
    raw[:, :256] = np.arange(256, dtype=np.uint8)[None, :]
    raw[:, 256:] = np.arange(256, dtype=np.uint8)[:, None]
    return raw


def test_every_byte_pair_matches_torch_reference():
    raw = torch.from_numpy(_all_pairs_raw())
    ours = codec.dequantize(raw)
    ref = codec.reference_dequant(*codec.split_raw(raw))
    _assert_same_bf16(ours, ref)
    # the same 65,536 entries straight from the lookup table, pairs enumerated the other way round
    w = torch.arange(256).repeat_interleave(256).to(torch.uint8)
    s = torch.arange(256).repeat(256).to(torch.uint8)
    ref2 = (w.view(torch.float8_e4m3fn).float() * s.view(torch.float8_e8m0fnu).float()).to(torch.bfloat16)
    _assert_same_bf16(torch.from_numpy(codec.DEQUANT_LUT.copy()).view(torch.bfloat16), ref2)


def test_decode_tables_match_torch_dtypes():
    b = torch.arange(256).to(torch.uint8)
    fp8 = b.view(torch.float8_e4m3fn).float().numpy()
    e8 = b.view(torch.float8_e8m0fnu).float().numpy()
    assert np.array_equal(np.isnan(fp8), np.isnan(codec.FP8_TO_F32))
    assert np.array_equal(fp8[~np.isnan(fp8)].view(np.uint32), codec.FP8_TO_F32[~np.isnan(fp8)].view(np.uint32))
    assert np.array_equal(np.isnan(e8), np.isnan(codec.E8M0_TO_F32))
    assert np.array_equal(e8[:255].view(np.uint32), codec.E8M0_TO_F32[:255].view(np.uint32))


def _one(fp8: int, e8: int) -> int:
    raw = np.zeros((1, ROW_BYTES), dtype=np.uint8)
    raw[0, 0] = fp8
    raw[0, 256:] = e8
    return int(codec.dequantize_bits(raw)[0, 0])


def test_special_bytes():
    # e8m0 0x00 is 2**-127 (not 0 as vLLM's kernel makes it): 1.0 * 2**-127 is the bf16 subnormal 0x0040
    assert _one(0x38, 0x00) == 0x0040
    assert _one(0x7E, 0x00) == 0x0460  # 448 * 2**-127 = 1.75 * 2**-119: exponent field 8, mantissa 0x60
    # e8m0 0xFF is NaN for every value, zero included (SGLang's Triton kernel gives +-inf for nonzero values)
    assert all(_one(w, 0xFF) == codec.BF16_NAN_BITS for w in range(256))
    # fp8 NaN bytes
    assert _one(0x7F, 127) == codec.BF16_NAN_BITS and _one(0xFF, 127) == codec.BF16_NAN_BITS
    # -0 stays -0, +0 stays +0, for any finite scale
    assert all(_one(0x80, e) == 0x8000 for e in range(255))
    assert all(_one(0x00, e) == 0x0000 for e in range(255))
    # largest scale overflows to inf in fp32 then bf16, like torch
    assert _one(0x7E, 0xFE) == 0x7F80 and _one(0xFE, 0xFE) == 0xFF80


def test_dequantize_keeps_leading_dims_and_refuses_bad_rows():
    raw = torch.from_numpy(codec.synthetic_rows(3, 0, 6)).reshape(2, 3, ROW_BYTES)
    out = codec.dequantize(raw)
    assert out.shape == (2, 3, 256) and out.dtype == torch.bfloat16
    _assert_same_bf16(out, codec.reference_dequant(*codec.split_raw(raw)))
    with pytest.raises(SlackTierError):
        codec.dequantize(torch.zeros(2, 263, dtype=torch.uint8))
    with pytest.raises(SlackTierError):
        codec.dequantize_bits(np.zeros((2, 264), dtype=np.int8))


@SETTINGS
@given(hnp.arrays(np.uint8, st.tuples(st.integers(1, 8), st.just(ROW_BYTES))))
def test_random_rows_match_reference(raw):
    t = torch.from_numpy(raw)
    _assert_same_bf16(codec.dequantize(t), codec.reference_dequant(*codec.split_raw(t)))


_floats = st.floats(min_value=-2.0**100, max_value=2.0**100, allow_nan=False, allow_infinity=False, width=32,
                    allow_subnormal=True)


@SETTINGS
@given(hnp.arrays(np.float32, st.tuples(st.integers(1, 4), st.just(256)), elements=_floats))
def test_quantize_round_trip_is_close(values):
    raw = codec.quantize(torch.from_numpy(values))
    assert raw.shape == (values.shape[0], ROW_BYTES) and raw.dtype == torch.uint8
    r = raw.numpy()
    assert not ((r[:, :256] & 0x7F) == 0x7F).any(), "quantize wrote an fp8 NaN"
    assert (r[:, 256:] != 0xFF).all(), "quantize wrote the e8m0 NaN byte"
    back = codec.dequantize(raw).float().numpy().astype(np.float64)
    scale = np.repeat(codec.E8M0_TO_F32[r[:, 256:]].astype(np.float64), 32, axis=1)  # [N, 256]
    x = values.astype(np.float64)
    # e4m3 keeps 4 significant bits (rel. error <= 2**-4), subnormals are spaced 2**-9 (abs. error <= 2**-10)
    bound = 2.0**-4 * np.abs(x) + 2.0**-10 * scale + 2.0**-133
    assert (np.abs(back - x) <= bound).all()
    # and every block's scale is the smallest power of two that fits its largest value
    amax = np.abs(x).reshape(-1, 8, 32).max(-1)
    s = codec.E8M0_TO_F32[r[:, 256:]].astype(np.float64)
    fits = amax / s <= 448.0
    assert fits.all()
    tight = (amax > 448.0 * 2.0**-127) & (r[:, 256:] > 0)
    assert (amax[tight] / (s[tight] / 2) > 448.0).all()


_FINITE_FP8 = [b for b in range(256) if b & 0x7F != 0x7F]


@SETTINGS
@given(st.data())
def test_requantizing_a_dequantized_row_is_exact(data):
    n = data.draw(st.integers(1, 4))
    fp8 = data.draw(hnp.arrays(np.uint8, (n, 256), elements=st.sampled_from(_FINITE_FP8)))
    e8 = data.draw(hnp.arrays(np.uint8, (n, 8), elements=st.integers(10, 240)))
    raw = torch.from_numpy(np.concatenate([fp8, e8], axis=1))
    once = codec.dequantize(raw)
    again = codec.dequantize(codec.quantize(once))
    assert torch.equal(once.view(torch.int16), again.view(torch.int16))


def test_quantize_keeps_negative_zero_and_refuses_non_finite():
    v = torch.zeros(1, 256)
    v[0, 3] = -0.0
    raw = codec.quantize(v)
    assert raw[0, 3] == 0x80 and raw[0, 256] == 127
    for bad in (float("nan"), float("inf")):
        v = torch.ones(1, 256)
        v[0, 7] = bad
        with pytest.raises(SlackTierError):
            codec.quantize(v)
    with pytest.raises(SlackTierError):
        codec.quantize(torch.ones(2, 255))


def test_quantize_accepts_bf16():
    v = torch.linspace(-3, 3, 512).reshape(2, 256).to(torch.bfloat16)
    raw = codec.quantize(v)
    assert torch.allclose(codec.dequantize(raw).float(), v.float(), rtol=2**-4, atol=1e-3)


@SETTINGS
@given(st.integers(0, 2**64 - 1), st.integers(0, 2**40), st.integers(1, 40), st.integers(0, 39))
def test_synthetic_rows_depend_only_on_seed_and_row(seed, start, rows, k):
    k = k % rows
    block = codec.synthetic_rows(seed, start, rows)
    assert block.shape == (rows, ROW_BYTES) and block.dtype == np.uint8
    assert np.array_equal(block[k], codec.synthetic_rows(seed, start + k, 1)[0])
    assert not ((block[:, :256] & 0x7F) == 0x7F).any()
    e8 = block[:, 256:]
    lo, span = codec.SYNTHETIC_SCALE_MIN, codec.SYNTHETIC_SCALE_SPAN
    assert (e8 >= lo).all() and (e8 < lo + span).all()
    assert torch.isfinite(codec.dequantize(torch.from_numpy(block)).float()).all()


def test_synthetic_rows_vary_with_seed_and_row_and_cover_codes():
    a = codec.synthetic_rows(1, 0, 4000)
    b = codec.synthetic_rows(2, 0, 4000)
    assert (a != b).mean() > 0.9
    assert len({a[i].tobytes() for i in range(a.shape[0])}) == a.shape[0]
    codes = np.bincount(a[:, :256].ravel(), minlength=256)
    assert (codes[[0x7F, 0xFF]] == 0).all() and (np.delete(codes, [0x7F, 0xFF]) > 0).all()
    with pytest.raises(SlackTierError):
        codec.synthetic_rows(1, -1, 3)
