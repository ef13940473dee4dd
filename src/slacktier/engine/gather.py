"""`gather`'s data pass: fill missed rows' new slots, then dequantize every lookup's row.

Two implementations of the same pass, bit-identical to `codec.reference_dequant`
(NaN as some NaN, the codec's contract):
- `gather_cpu` (device "cpu"): one compiled loop; a lookup's row is read where
  it lies (a cache slot, or a row inside a page buffer) and dequantized through
  the codec's exact 65,536-entry table, one output row at a time, no
  intermediate [N, 264] copy.
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

from slacktier.tables.codec import DEQUANT_LUT, dequantize
from slacktier.tables.layout import ROW_BYTES, ROW_SCALES, ROW_VALUES, ROWS_PER_PAGE, SCALE_BLOCK

_LUT = np.ascontiguousarray(DEQUANT_LUT, dtype=np.uint16)   # [65536] bf16 bits at fp8 * 256 + e8m0


@njit(nogil=True, cache=True)
def fill_slots(miss_buf, miss_inpage, miss_slot, n_miss, pool, weight, scale):
    """Copy each missed row's raw bytes from its page buffer into its new slot (slot -1: skip)."""
    for m in range(n_miss):
        s = miss_slot[m]
        if s < 0:
            continue
        b = miss_buf[m]
        off = miss_inpage[m] * ROW_BYTES
        for j in range(ROW_VALUES):
            weight[s, j] = pool[b, off + j]
        for j in range(ROW_SCALES):
            scale[s, j] = pool[b, off + ROW_VALUES + j]


@njit(nogil=True, cache=True)
def gather_cpu(desc_kind, desc_idx, n, miss_buf, miss_inpage, miss_slot, n_miss, pool, weight, scale, lut, out):
    """Fill new slots, then out[i] = dequant(row of lookup i) as bf16 bits; out: [n, 256] uint16."""
    fill_slots(miss_buf, miss_inpage, miss_slot, n_miss, pool, weight, scale)
    for i in range(n):
        k = desc_kind[i]
        if k == 0:
            s = desc_idx[i]
            for b in range(ROW_SCALES):
                e = np.int64(scale[s, b])
                for j in range(b * SCALE_BLOCK, (b + 1) * SCALE_BLOCK):
                    out[i, j] = lut[np.int64(weight[s, j]) * 256 + e]
        elif k == 1:
            m = desc_idx[i]
            pb = miss_buf[m]
            off = miss_inpage[m] * ROW_BYTES
            for b in range(ROW_SCALES):
                e = np.int64(pool[pb, off + ROW_VALUES + b])
                for j in range(b * SCALE_BLOCK, (b + 1) * SCALE_BLOCK):
                    out[i, j] = lut[np.int64(pool[pb, off + j]) * 256 + e]
        else:
            for j in range(ROW_VALUES):
                out[i, j] = 0


def lut() -> np.ndarray:
    """The codec's exact dequant table [65536] uint16 (bf16 bits at fp8_byte * 256 + e8m0_byte)."""
    return _LUT


def gather_torch(desc_kind: np.ndarray, desc_idx: np.ndarray, miss_buf: np.ndarray, miss_inpage: np.ndarray,
                 miss_slot: np.ndarray, pool_pages: np.ndarray, weight: torch.Tensor, scale: torch.Tensor,
                 staging: torch.Tensor | None = None) -> torch.Tensor:
    """The same pass with torch ops on `weight.device`: -> bf16 [N, 256].

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
    # Zero rows stay all-zero bytes: fp8 0x00 times any finite scale is +0, bf16 0x0000.
    return dequantize(raw)
