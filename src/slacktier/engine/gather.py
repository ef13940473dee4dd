"""`gather`'s data pass: fill missed rows' new slots, then dequantize every lookup's row.

Two implementations of the same pass, bit-identical to `codec.reference_dequant`
(NaN as some NaN, the codec's contract) in either dequant convention (the
serving engine's own reading of an E8M0 byte, codec.DEQUANT_CONVENTIONS: the
CPU pass takes that convention's table, the torch pass its arithmetic):
- `gather_cpu` (device "cpu"): one compiled pass; the missed rows are first
  copied out of the page buffers into a packed [M, 264] staging array (in
  buffer order, word by word), then each lookup's row (a cache slot or a
  staged row) is dequantized through the codec's exact 65,536-entry table,
  stored scale-major, one output row at a time.
- `gather_torch` (any device, the CUDA path): the missed rows' raw bytes are
  picked out of the page pool on the host, copied to the device (non_blocking
  from pinned memory), written into their slots, and every lookup is
  assembled as raw rows and dequantized by `codec.dequantize` on the device.

Worked example: kind [0, 1, 2], idx [7, 0, -1], miss 0 = buffer 3, row-in-page 2
-> output row 0 from slot 7, row 1 from pool page 3 bytes 528..791, row 2 zeros.
"""

from __future__ import annotations

import numpy as np
import torch
from numba import njit

from slacktier.cache.kernels import prefetch
from slacktier.tables.codec import DEQUANT_CONVENTIONS, check_convention, dequant_lut, dequantize
from slacktier.tables.layout import (PAGE_WORDS, ROW_BYTES, ROW_SCALES, ROW_VALUES, ROW_WORDS, ROWS_PER_PAGE,
                                     SCALE_BLOCK)

# per dequant convention (codec.DEQUANT_CONVENTIONS): [65536] bf16 bits at fp8 * 256 + e8m0, and scale-major
_LUT = {c: np.ascontiguousarray(dequant_lut(c), dtype=np.uint16) for c in DEQUANT_CONVENTIONS}
_LUT_BY_SCALE = {c: np.ascontiguousarray(t.reshape(256, 256).T).reshape(-1) for c, t in _LUT.items()}


#: rows ahead of the copy whose lines stage_misses prefetches (8 and 16 measured alike, 4 slower)
PREFETCH_ROWS = 8


@njit(nogil=True, cache=True)
def stage_misses(miss_buf, miss_inpage, n_miss, pool, staged):
    """Copy each missed row's 264 bytes out of its page buffer: staged[m] = row of miss m (33 words).

    Misses are numbered in lookup order and page buffers in first-seen order, so this walks the pool
    in ascending buffer order. A row is 33 independent 8-byte loads with no work between rows, and the
    lines of the row PREFETCH_ROWS ahead are prefetched, so many cache misses are in flight at once; the
    dequant pass then reads rows packed together. Reading the pool row by row inside the dequant loop
    instead stalls on each row's misses (one row's 256 table lookups fill the core's window), which
    made the cold gather slower than index_select + LUT.

    Worked example: miss 4 in buffer 3, row-in-page 2 -> pool words 3 * 512 + 2 * 33 = 1602..1634.
    """
    words = pool.reshape(-1).view(np.uint64)          # [capacity * 512]
    for m in range(n_miss):
        ahead = m + PREFETCH_ROWS
        if ahead < n_miss:   # a row spans 5 cache lines (33 words): prefetch words 0, 8, 16, 24, 32
            o2 = np.int64(miss_buf[ahead]) * PAGE_WORDS + np.int64(miss_inpage[ahead]) * ROW_WORDS
            for w in range(0, ROW_WORDS, 8):
                prefetch(words, o2 + w)
        off = np.int64(miss_buf[m]) * PAGE_WORDS + np.int64(miss_inpage[m]) * ROW_WORDS
        for w in range(ROW_WORDS):
            staged[m, w] = words[off + w]


@njit(nogil=True, cache=True)
def fill_slots(staged_bytes, miss_slot, n_miss, weight, scale):
    """Copy each missed row's raw bytes from the staged rows [M, 264] into its new slot (slot -1: skip).

    The slots are random rows of the cache: the lines of the slot PREFETCH_ROWS ahead are prefetched, so
    the stores do not wait for their lines one row at a time.
    """
    wflat = weight.reshape(-1)
    sflat = scale.reshape(-1)
    for m in range(n_miss):
        ahead = m + PREFETCH_ROWS
        if ahead < n_miss and miss_slot[ahead] >= 0:
            _prefetch_slot(wflat, sflat, np.int64(miss_slot[ahead]))
        s = miss_slot[m]
        if s < 0:
            continue
        for j in range(ROW_VALUES):
            weight[s, j] = staged_bytes[m, j]
        for j in range(ROW_SCALES):
            scale[s, j] = staged_bytes[m, ROW_VALUES + j]


@njit(nogil=True, cache=True, inline="always")
def _prefetch_slot(wflat, sflat, s):
    """Prefetch cache slot s's row: its 256 values (four lines of weight) and its 8 scales."""
    for w in range(0, ROW_VALUES, 64):
        prefetch(wflat, s * ROW_VALUES + w)
    prefetch(sflat, s * ROW_SCALES)


@njit(nogil=True, cache=True)
def _dequant_row(values, scales, lut_t, out_row):
    """out_row[j] = bf16 bits of values[j] scaled by scales[j // 32]; lut_t indexed e8m0 * 256 + fp8."""
    for b in range(ROW_SCALES):
        e = np.int64(scales[b]) * 256
        by_value = lut_t[e:e + 256]          # the 256 entries of this block's scale: 512 B, eight cache lines
        for j in range(b * SCALE_BLOCK, (b + 1) * SCALE_BLOCK):
            out_row[j] = by_value[values[j]]


@njit(nogil=True, cache=True)
def gather_cpu(desc_kind, desc_idx, n, miss_buf, miss_inpage, miss_slot, n_miss, pool, weight, scale, lut_t, out):
    """Stage the missed rows, fill new slots, then out[i] = dequant(row of lookup i) as bf16 bits; out: [n, 256].

    lut_t: `lut_by_scale()`, the codec's table with the scale byte major. A block of 32 values shares
    one scale, so it reads 256 adjacent entries (L1-resident) instead of entries 512 B apart across
    the whole 128 KiB table; they are the same entries, so the output is bit-identical. The row of the
    hit PREFETCH_ROWS lookups ahead is prefetched, so hits in a cold cache do not wait one row at a time.
    weight and scale: C-contiguous [slots, 256] and [slots, 8] uint8 (the cache's arrays).
    """
    staged = np.empty((n_miss, ROW_WORDS), dtype=np.uint64)   # [M, 33] words = [M, 264] bytes
    stage_misses(miss_buf, miss_inpage, n_miss, pool, staged)
    staged_bytes = staged.view(np.uint8)
    fill_slots(staged_bytes, miss_slot, n_miss, weight, scale)
    wflat = weight.reshape(-1)
    sflat = scale.reshape(-1)
    for i in range(n):
        ahead = i + PREFETCH_ROWS
        if ahead < n and desc_kind[ahead] == 0:   # a hit's row is a random row of the cache: start it early
            _prefetch_slot(wflat, sflat, desc_idx[ahead])
        k = desc_kind[i]
        if k == 0:
            s = desc_idx[i]
            _dequant_row(weight[s], scale[s], lut_t, out[i])
        elif k == 1:
            m = desc_idx[i]
            _dequant_row(staged_bytes[m, :ROW_VALUES], staged_bytes[m, ROW_VALUES:], lut_t, out[i])
        else:
            for j in range(ROW_VALUES):
                out[i, j] = 0


def lut(convention: str = "torch") -> np.ndarray:
    """The codec's exact dequant table [65536] uint16 (bf16 bits at fp8_byte * 256 + e8m0_byte)."""
    return _LUT[check_convention(convention)]


def lut_by_scale(convention: str = "torch") -> np.ndarray:
    """The same table [65536] uint16 with the scale byte major: entry e8m0_byte * 256 + fp8_byte (gather_cpu's)."""
    return _LUT_BY_SCALE[check_convention(convention)]


def gather_torch(desc_kind: np.ndarray, desc_idx: np.ndarray, miss_buf: np.ndarray, miss_inpage: np.ndarray,
                 miss_slot: np.ndarray, pool_pages: np.ndarray, weight: torch.Tensor, scale: torch.Tensor,
                 staging: torch.Tensor | None = None, convention: str = "torch") -> torch.Tensor:
    """The same pass with torch ops on `weight.device`: -> bf16 [N, 256], dequantized by `convention`.

    desc_*: [N]; miss_*: [M]; pool_pages: [capacity, 4096] uint8 host array.
    `staging`, if given, is a pinned host uint8 buffer of at least M * 264 bytes.
    """
    device = weight.device
    n = desc_kind.shape[0]
    m = miss_buf.shape[0]
    pool_rows = torch.from_numpy(pool_pages)[:, :ROWS_PER_PAGE * ROW_BYTES].unflatten(1, (ROWS_PER_PAGE, ROW_BYTES))
    raw_miss = pool_rows[torch.from_numpy(miss_buf.astype(np.int64)), torch.from_numpy(miss_inpage.astype(np.int64))]
    if device.type != "cpu":
        if staging is not None and staging.numel() >= m * ROW_BYTES:
            host = staging[:m * ROW_BYTES].view(m, ROW_BYTES)
            host.copy_(raw_miss)
            raw_miss = host
        raw_miss = raw_miss.to(device, non_blocking=True)
    fill = np.flatnonzero(miss_slot >= 0)
    if fill.size:
        fill_dev = torch.from_numpy(fill).to(device, non_blocking=True)
        slots_dev = torch.from_numpy(miss_slot[fill].astype(np.int64)).to(device, non_blocking=True)
        rows = raw_miss.index_select(0, fill_dev)
        weight.index_copy_(0, slots_dev, rows[:, :ROW_VALUES].contiguous())
        scale.index_copy_(0, slots_dev, rows[:, ROW_VALUES:].contiguous())
    raw = torch.zeros((n, ROW_BYTES), dtype=torch.uint8, device=device)
    hit_pos = np.flatnonzero(desc_kind == 0)
    if hit_pos.size:
        pos = torch.from_numpy(hit_pos).to(device, non_blocking=True)
        slots = torch.from_numpy(desc_idx[hit_pos]).to(device, non_blocking=True)
        raw.index_copy_(0, pos, torch.cat([weight.index_select(0, slots), scale.index_select(0, slots)], dim=1))
    miss_pos = np.flatnonzero(desc_kind == 1)
    if miss_pos.size:
        pos = torch.from_numpy(miss_pos).to(device, non_blocking=True)
        which = torch.from_numpy(desc_idx[miss_pos]).to(device, non_blocking=True)
        raw.index_copy_(0, pos, raw_miss.index_select(0, which))
    # Zero rows stay all-zero bytes: fp8 0x00 times any finite scale is +0, bf16 0x0000 (scale byte 0x00 is 2**-127
    # or, in the "vllm" convention, 0.0: finite either way).
    return dequantize(raw, convention)
