"""The Python mirror of the C helper's boundary (`slacktier.tables.native`) agrees with its header (`st_io.h`).

The header is read for its prototypes and compared with `PROTOTYPES` type by
type; a small C probe compiled against the header prints the wait record's
size and field offsets, compared with the ctypes structure and the numpy
dtype. The helper itself includes the header, so the C compiler holds the
definitions to it; these tests hold the mirror to it.
"""

from __future__ import annotations

import ctypes
import re
import shutil
import subprocess

import numpy as np
import pytest

from slacktier.tables import native

#: C parameter/return types in the header -> the ctypes type the mirror must use
_C_TO_CTYPES = {
    "void": None, "int": ctypes.c_int, "unsigned": ctypes.c_uint, "int64_t": ctypes.c_int64,
    "uint64_t": ctypes.c_uint64,
}


def _header_prototypes(text: str) -> dict[str, tuple[str, list[str]]]:
    """name -> (return type, [parameter types]) of every `st_*` function declared in the header text."""
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    out = {}
    for m in re.finditer(r"^([\w ]+?\**)\s*\b(st_\w+)\(([^)]*)\);", text, flags=re.M):
        ret, name, params = m.group(1).strip(), m.group(2), m.group(3)
        types = []
        for p in params.split(","):
            p = " ".join(p.split())
            p = re.sub(r"\s*\b\w+$", "", p) if not p.endswith("*") else p   # drop the parameter's name
            types.append(p.replace(" *", "*").strip())
        out[name] = (ret.replace(" *", "*"), types)
    return out


def _expected_ctype(c_type: str):
    """The ctypes type the mirror must declare for a header type: pointers are addresses, except the wait
    record's, which is typed."""
    c_type = c_type.replace("const ", "")
    if c_type == "struct st_wait_info*":
        return "WaitInfo*"
    if c_type == "int*":
        return ctypes.POINTER(ctypes.c_int)
    if c_type.endswith("*"):
        return ctypes.c_void_p
    return _C_TO_CTYPES[c_type]


def _mirror_ctype(t):
    if t is not None and isinstance(t, type) and issubclass(t, ctypes._Pointer) and t._type_ is native.WaitInfo:
        return "WaitInfo*"
    return t


def test_every_header_prototype_is_mirrored_type_by_type():
    declared = _header_prototypes(native.HEADER.read_text(encoding="utf-8"))
    assert len(declared) == 18   # the parser found the header's entry points (it would find none if it broke)
    assert set(declared) == set(native.PROTOTYPES)
    for name, (ret, params) in declared.items():
        restype, argtypes = native.PROTOTYPES[name]
        want_ret = _expected_ctype(ret)
        if name == "st_eng_submit":   # compiled code passes every pointer and handle as a 64-bit address
            assert native.SUBMIT == native.PROTOTYPES[name]
            assert [ctypes.sizeof(t) for t in argtypes] == [8 if p.endswith("*") else ctypes.sizeof(
                _expected_ctype(p)) for p in params], name
            continue
        assert _mirror_ctype(restype) == want_ret, name
        assert [_mirror_ctype(t) for t in argtypes] == [_expected_ctype(p) for p in params], name


def test_the_parser_sees_a_drifted_prototype():
    """Negative control: a header whose wait takes another type is read as such."""
    text = native.HEADER.read_text(encoding="utf-8").replace(
        "int64_t timeout_ns, struct st_wait_info *info", "int timeout_ns, struct st_wait_info *info")
    _, params = _header_prototypes(text)["st_eng_wait"]
    assert _expected_ctype(params[2]) != native.PROTOTYPES["st_eng_wait"][1][2]


def test_the_submit_typedef_matches_the_submit():
    text = re.sub(r"\s+", " ", native.HEADER.read_text(encoding="utf-8"))
    fn = re.search(r"struct st_job \*st_eng_submit\(([^)]*)\);", text).group(1)
    typedef = re.search(r"typedef struct st_job \*\(\*st_submit_fn\)\(([^)]*)\);", text).group(1)
    assert fn == typedef


@pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler")
def test_the_wait_record_has_the_headers_layout(tmp_path):
    fields = [name for name, _ in native.WaitInfo._fields_]
    probe = tmp_path / "probe.c"
    probe.write_text('#include <stdio.h>\n#include <stddef.h>\n#include "st_io.h"\nint main(void) {\n'
                     '  printf("%zu\\n", sizeof(struct st_wait_info));\n'
                     + "".join(f'  printf("%zu %zu\\n", offsetof(struct st_wait_info, {f}), '
                               f'sizeof(((struct st_wait_info *)0)->{f}));\n' for f in fields)
                     + "  return 0;\n}\n", encoding="utf-8")
    exe = tmp_path / "probe"
    subprocess.run(["cc", "-std=gnu11", f"-I{native.HEADER.parent}", str(probe), "-o", str(exe)], check=True)
    size, *pairs = [int(x) for x in subprocess.run([str(exe)], check=True, capture_output=True,
                                                   text=True).stdout.split()]
    offsets, sizes = pairs[0::2], pairs[1::2]
    assert size == ctypes.sizeof(native.WaitInfo) == native.WAIT_INFO.itemsize
    assert offsets == [getattr(native.WaitInfo, f).offset for f in fields]
    assert sizes == [getattr(native.WaitInfo, f).size for f in fields]
    assert offsets == [native.WAIT_INFO.fields[f][1] for f in fields]
    assert sizes == [native.WAIT_INFO.fields[f][0].itemsize for f in fields]


def test_the_submit_signature_in_its_three_forms_agrees():
    restype, argtypes = native.SUBMIT
    llvm = native.submit_llvm_type()
    assert [a.width for a in llvm.args] == [8 * ctypes.sizeof(t) for t in argtypes]
    assert llvm.return_type.width == 8 * ctypes.sizeof(restype)
    from numba import types
    sig = native.submit_numba_signature(types.int64)
    assert [8 if isinstance(a, types.CPointer) else np.dtype(str(a)).itemsize for a in sig.args] == \
        [ctypes.sizeof(t) for t in argtypes]
    assert np.dtype(str(sig.return_type)).itemsize == ctypes.sizeof(restype)
    text = re.sub(r"\s+", " ", native.HEADER.read_text(encoding="utf-8"))
    params = re.search(r"struct st_job \*st_eng_submit\(([^)]*)\);", text).group(1).split(", ")
    pointees = {"int32_t": types.int32, "int64_t": types.int64}
    for a, p in zip(sig.args[1:], params[1:]):   # every typed array pointer points at the header's element type
        if "*" in p:
            assert a.dtype == pointees[p.replace("const ", "").split()[0]], p
