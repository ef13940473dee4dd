"""The serving engines' installed packages as test oracles: SGLang 0.5.23 and vLLM 0.33.0 on a CPU.

`make setup` installs each engine with `pip install --no-deps` plus only the small
dependencies its modules need to import (pyproject's `engines-cpu` extra, also
installed without dependencies), never its CUDA stack, into a folder of their
own (`.venv/engines`, or SLACKTIER_ENGINES_DIR). Only the tests that use them put
that folder on sys.path, at its end, when they first need it: PyPI's torchvision
(a CUDA build, see below) would otherwise be seen by transformers in every test
process and break its model imports. Where an engine is missing or of another
version, the tests that need it skip and say so.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from importlib import metadata
from pathlib import Path
from types import ModuleType

import pytest
import torch

from slacktier.adapters.sglang import CHECKED_VERSION as SGLANG_VERSION
from slacktier.adapters.vllm import CHECKED_VERSION as VLLM_VERSION


ENGINES_DIR = Path(os.environ.get("SLACKTIER_ENGINES_DIR") or Path(__file__).resolve().parents[1] / ".venv" / "engines")


def _engines_on_path() -> None:
    if ENGINES_DIR.is_dir() and str(ENGINES_DIR) not in sys.path:
        sys.path.append(str(ENGINES_DIR))
        importlib.invalidate_caches()


def _version(dist: str) -> str | None:
    _engines_on_path()
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def skip_reason(dist: str, version: str) -> str | None:
    """Why a test of `dist`=`version` cannot run here, or None when it can."""
    found = _version(dist)
    if found is None:
        return (f"{dist} {version} is not installed here ({ENGINES_DIR} has no {dist}): make setup installs it "
                f"(pip install --no-deps --target .venv/engines {dist}=={version} and pyproject's engines-cpu extra)")
    if found != version:
        return f"{dist} {found} is installed; these tests read {dist} {version}"
    return None


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


@contextmanager
def sglang_plugin_loaded(control_env: str) -> Iterator[ModuleType]:
    """SGLang's runtime context published for a test (overlap scheduler off), with the slacktier plug-in loaded the
    way a server loads it: load_plugins() finds its entry point and HookRegistry.apply_hooks() patches SGLang."""
    rc = import_sglang("sglang.srt.runtime_context")
    plugins = import_sglang("sglang.srt.plugins")
    context = rc.get_context().override_server_args(disable_overlap_schedule=True)
    context.install()
    mp = pytest.MonkeyPatch()
    try:
        mp.setenv("SGLANG_PLUGINS", "slacktier")
        mp.setenv(control_env, "unused-until-a-table-is-built.toml")
        plugins.load_plugins()
        mp.delenv(control_env)
        yield rc
    finally:
        mp.undo()
        context.restore()
