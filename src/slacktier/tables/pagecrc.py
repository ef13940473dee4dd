"""CRC32C of whole 4 KiB pages: the SSE4.2 crc32 instruction from compiled code, or the `crc32c` package.

Both give the standard CRC-32C (Castagnoli; init and final xor 0xFFFFFFFF) of the
page's bytes, so a checksum file written by one path verifies with the other.
The compiled path runs without the GIL and without a Python call per page,
which matters when a staging thread checksums a million pages. On a CPU
without SSE4.2 (or not x86-64) `page_crcs` uses the package; that choice is
made once at import, logged, and visible as `HW_CRC32C`.
"""

from __future__ import annotations

import logging
import platform

import crc32c
import numba
import numpy as np
from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic

from slacktier.errors import ErrorKind, SlackTierError
from slacktier.tables.layout import PAGE_BYTES, PAGE_WORDS

log = logging.getLogger(__name__)


def _cpu_has_sse42() -> bool:
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return "sse4_2" in line.split()
    except OSError:
        return False
    return False


HW_CRC32C = _cpu_has_sse42()
if not HW_CRC32C:
    log.info("no SSE4.2 crc32 instruction: page checksums use the crc32c package (same values, slower)")


@intrinsic
def _crc32_u64(typingctx, crc, data):  # type: ignore[no-untyped-def]
    """crc32 (Castagnoli) of one 8-byte word onto `crc`: the SSE4.2 instruction."""
    sig = types.uint64(types.uint64, types.uint64)

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        fnty = ir.FunctionType(ir.IntType(64), [ir.IntType(64), ir.IntType(64)])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.x86.sse42.crc32.64.64")
        return builder.call(fn, args)

    return sig, codegen


# A page is checksummed as three interleaved streams (words 0..170, 171..341, 342..511), since the crc32
# instruction's latency is three times its throughput; the streams are then joined by linearity:
# crc register after (A, B, C) = Z(|B|+|C|)(reg A) ^ Z(|C|)(reg B from 0) ^ (reg C from 0), where
# Z(n) is "feed n zero bytes", a 32x32 GF(2) matrix applied here as four 256-entry tables.
_LEN_A, _LEN_B, _LEN_C = 171, 171, 170  # words


def _zeros_operator(nbytes: int) -> np.ndarray:
    """[4, 256] uint32 tables of Z(nbytes) on the raw CRC32C register, built with the crc32c package."""
    basis = [crc32c.crc32c(bytes(nbytes), (1 << i) ^ 0xFFFFFFFF) ^ 0xFFFFFFFF for i in range(32)]
    tables = np.zeros((4, 256), dtype=np.uint32)
    for k in range(4):
        for b in range(256):
            v = 0
            for bit in range(8):
                if (b >> bit) & 1:
                    v ^= basis[8 * k + bit]
            tables[k, b] = v
    return tables


_Z_BC = _zeros_operator(8 * (_LEN_B + _LEN_C))  # [4, 256] uint32
_Z_C = _zeros_operator(8 * _LEN_C)              # [4, 256] uint32


@numba.njit(nogil=True, cache=True, inline="always")
def _apply(tables: np.ndarray, x: np.uint64) -> np.uint64:
    byte = np.uint64(0xFF)
    return np.uint64(tables[0, x & byte] ^ tables[1, (x >> np.uint64(8)) & byte]
                     ^ tables[2, (x >> np.uint64(16)) & byte] ^ tables[3, (x >> np.uint64(24)) & byte])


@numba.njit(nogil=True, cache=True, inline="always")
def crc_page_words(words64: np.ndarray, base: np.int64) -> np.uint32:
    """CRC32C of the page at uint64 word `base` of `words64` (compiled callers only, needs HW_CRC32C)."""
    a = np.uint64(0xFFFFFFFF)
    b = np.uint64(0)
    c = np.uint64(0)
    for i in range(_LEN_C):
        a = _crc32_u64(a, words64[base + i])
        b = _crc32_u64(b, words64[base + _LEN_A + i])
        c = _crc32_u64(c, words64[base + _LEN_A + _LEN_B + i])
    a = _crc32_u64(a, words64[base + _LEN_A - 1])
    b = _crc32_u64(b, words64[base + _LEN_A + _LEN_B - 1])
    r = _apply(_Z_BC, a) ^ _apply(_Z_C, b) ^ c
    return np.uint32((r ^ np.uint64(0xFFFFFFFF)) & np.uint64(0xFFFFFFFF))


@numba.njit(nogil=True, cache=True)
def _page_crcs_hw(pages64: np.ndarray, out: np.ndarray) -> None:
    # pages64: [P * 512] uint64 (little-endian words of P pages); out: [P] uint32
    for p in range(out.shape[0]):
        out[p] = crc_page_words(pages64, p * PAGE_WORDS)


def page_crcs_package(pages: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """pages [P, 4096] uint8 -> [P] uint32 CRC32C via the `crc32c` package (one call per page)."""
    if out is None:
        out = np.empty(pages.shape[0], dtype=np.uint32)
    for i in range(pages.shape[0]):
        out[i] = crc32c.crc32c(pages[i])
    return out


def page_crcs(pages: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """pages [P, 4096] uint8 (C-contiguous) -> [P] uint32 CRC32C of each whole page."""
    if pages.dtype != np.uint8 or pages.ndim != 2 or pages.shape[1] != PAGE_BYTES or not pages.flags.c_contiguous:
        raise SlackTierError(ErrorKind.BAD_INPUT, f"pages must be C-contiguous [P, {PAGE_BYTES}] uint8, got "
                             f"{pages.shape} {pages.dtype}", fix="pass whole pages")
    if out is None:
        out = np.empty(pages.shape[0], dtype=np.uint32)
    if not HW_CRC32C:
        return page_crcs_package(pages, out)
    _page_crcs_hw(pages.reshape(-1).view(np.uint64), out)
    return out
