"""The serving engines' installed packages as test oracles: SGLang 0.5.23 and vLLM 0.33.0 on a CPU.

`make setup` installs each engine with `pip install --no-deps` plus only the small
dependencies its modules need to import (the `sglang-cpu` and `vllm-cpu` extras),
never its CUDA stack. Where a package is missing or of another version, the tests
that need it skip and say so.
"""

from __future__ import annotations

import importlib
import importlib.util
from importlib import metadata
from pathlib import Path
from types import ModuleType

import pytest
import torch

SGLANG_VERSION = "0.5.23"
VLLM_VERSION = "0.33.0"


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def skip_reason(dist: str, version: str) -> str | None:
    """Why a test of `dist`=`version` cannot run here, or None when it can."""
    found = _version(dist)
    if found is None:
        return f"{dist} {version} is not installed (make setup installs it: pip install --no-deps {dist}=={version})"
    if found != version:
        return f"{dist} {found} is installed; these tests read {dist} {version}"
    return None


def package_dir(dist: str, version: str) -> Path:
    """The installed package's folder, without importing it; skips the test when it is not there."""
    reason = skip_reason(dist, version)
    if reason:
        pytest.skip(reason)
    spec = importlib.util.find_spec(dist)
    assert spec is not None and spec.submodule_search_locations, f"{dist} has metadata but no package"
    return Path(next(iter(spec.submodule_search_locations)))


def _torchvision_without_compiled_ops() -> None:
    """Let torchvision's Python modules import where its compiled ops cannot load.

    SGLang's multimodal config modules import torchvision.transforms at import
    time. PyPI's Linux torchvision wheel is built against CUDA torch, so its
    _C library does not load beside the CPU torch these tests run on, and its
    import then fails registering fake kernels for two ops that were never
    defined. Declaring those two ops' schemas lets the pure-Python parts load;
    no torchvision op runs in these tests.
    """
    spec = importlib.util.find_spec("torchvision")
    if spec is None or not spec.submodule_search_locations:
        return
    folder = Path(next(iter(spec.submodule_search_locations)))
    library = next(iter(sorted(folder.glob("_C*.so"))), None)
    try:
        if library is not None:
            torch.ops.load_library(str(library))
            return
    except OSError:
        pass
    for op in ("nms", "qnms"):
        try:
            torch.library.define(f"torchvision::{op}", "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        except RuntimeError:
            pass   # defined by an earlier call in this process


def import_sglang(module: str) -> ModuleType:
    """An SGLang module, imported on this CPU; skips the test when SGLang 0.5.23 is not installed."""
    reason = skip_reason("sglang", SGLANG_VERSION)
    if reason:
        pytest.skip(reason)
    _torchvision_without_compiled_ops()
    return importlib.import_module(module)


def import_vllm(module: str) -> ModuleType:
    """A vLLM module, imported on this CPU; skips the test when vLLM 0.33.0 is not installed."""
    reason = skip_reason("vllm", VLLM_VERSION)
    if reason:
        pytest.skip(reason)
    _torchvision_without_compiled_ops()
    return importlib.import_module(module)
