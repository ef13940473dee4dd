"""The C device queue's boundary as Python sees it: the one mirror of `store/csrc/st_io.h`.

Every entry point of the C helper is declared here once, with its ctypes
prototype (`PROTOTYPES`); the record `st_eng_wait` fills (`WaitInfo`, a
ctypes structure, and `WAIT_INFO`, the same layout as a numpy dtype); and the
signature of the submit that compiled code calls by address (`SUBMIT`), in the
three forms its callers need: ctypes (`submit_prototype`), numba
(`submit_numba_signature`, for a lane written as a numba cfunc) and LLVM
(`submit_llvm_type`, for the compiled pass's indirect call). The store loads
the helper with these; the cache's compiled pass calls whatever submit a layer
names through `submit_llvm_type`, so it never names a store symbol.

tests/test_native_abi.py reads the header and compiles a probe against it, and
fails when this mirror and the header disagree.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np

#: the header this module mirrors
HEADER = Path(__file__).resolve().parents[1] / "store" / "csrc" / "st_io.h"

_vp, _i32, _u32, _i64, _u64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_uint, ctypes.c_int64, ctypes.c_uint64
_int_p = ctypes.POINTER(ctypes.c_int)


class WaitInfo(ctypes.Structure):
    """`struct st_wait_info`: what `st_eng_wait` reports of a done job (field meanings in the header)."""

    _fields_ = [("first_bad", _i64), ("submit_ns", _i64), ("end_ns", _i64), ("cpu_ns", _i64),
                ("buffers_refused", _i64), ("files_refused", _i64), ("first_ns", _i64)]


#: `struct st_wait_info` as a numpy record, for code that reads it from an array
WAIT_INFO = np.dtype([(name, np.int64) for name, _ in WaitInfo._fields_], align=True)

#: the submit compiled code calls by address (`st_submit_fn`): client, n, region (int32[n]), page (int64[n]),
#: buffer (int32[n]), pool address, pool buffers, err (int64[1]) -> job (0: refused, see err)
SUBMIT: tuple[type, list[type]] = (_u64, [_u64, _i32, _u64, _u64, _u64, _u64, _i64, _u64])

#: every entry point: name -> (restype, argtypes); pointers and opaque handles are c_void_p
PROTOTYPES: dict[str, tuple[type | None, list[type]]] = {
    "st_ring_create": (_vp, [_u32, _int_p]),
    "st_ring_destroy": (None, [_vp]),
    "st_eng_create": (_vp, [_u32, _u32, _u32, _u32, _i32, _int_p]),
    "st_eng_attach": (_vp, [_vp, _i32, _vp, _vp, _vp, _vp, _vp, _int_p]),
    "st_eng_detach": (_i32, [_vp, _vp]),
    "st_eng_strict": (None, [_vp, _i32]),
    "st_eng_batch": (_i32, [_vp, _i32]),
    "st_eng_hold": (None, [_vp, _i32]),
    "st_eng_defer": (None, [_vp, _i32]),
    "st_eng_submit": SUBMIT,
    "st_eng_cancel": (_i32, [_vp, _vp]),
    "st_eng_wait": (_i32, [_vp, _vp, _i64, ctypes.POINTER(WaitInfo)]),
    "st_eng_reads": (None, [_vp, _vp, _vp, _vp, _vp]),
    "st_eng_release": (None, [_vp, _vp]),
    "st_eng_registered": (_i32, [_vp, _vp]),
    "st_eng_trace": (_i32, [_vp, _i64]),
    "st_eng_trace_read": (_i64, [_vp, _vp, _vp, _vp, _i64]),
    "st_eng_destroy": (None, [_vp]),
}


def declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    """`lib` with every entry point's prototype set from `PROTOTYPES`."""
    for name, (restype, argtypes) in PROTOTYPES.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes
    return lib


def submit_prototype(fn: ctypes._CFuncPtr) -> ctypes._CFuncPtr:
    """`fn` (a submit of the helper's) typed as `SUBMIT`, every pointer as an address, for numba to call."""
    fn.restype, fn.argtypes = SUBMIT
    return fn


def _numba_type(t: type):
    from numba import types
    return {_u64: types.uint64, _i64: types.int64, _i32: types.int32}[t]


def submit_numba_signature(handle):
    """`SUBMIT` as a numba signature with typed pointers, for a lane whose submit is a numba cfunc: the client
    handle points at `handle` words (the lane's own table; opaque to the caller), the arrays at their element
    types, `err` at one int64."""
    from numba import types
    p = types.CPointer
    return types.uint64(p(handle), types.int32, p(types.int32), p(types.int64), p(types.int32), types.uint64,
                        types.int64, p(types.int64))


def submit_llvm_type():
    """`SUBMIT` as an LLVM function type (every 64-bit word as i64, the count as i32), for an indirect call."""
    from llvmlite import ir
    width = {_u64: 64, _i64: 64, _i32: 32}
    restype, argtypes = SUBMIT
    return ir.FunctionType(ir.IntType(width[restype]), [ir.IntType(width[t]) for t in argtypes])
