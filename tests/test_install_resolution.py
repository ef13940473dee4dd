"""`pip install 'slacktier[sglang]'` and `'slacktier[vllm]'` resolve in one environment with the engine's own pins.

Two checks. Online: scripts/resolve_extras.py runs uv's resolver against PyPI's metadata for a Linux x86_64
serving machine (no wheel is downloaded: uv unpacks every wheel it downloads into its cache, and the fresh
cache holds none), with a negative control: the core's old `transformers>=5.20` beside sglang 0.5.23 (which
pins transformers==5.19.0) does not resolve. Offline: our core requirements admit every exact pin in each
engine's published Requires-Dist (the METADATA of the engines `make setup` installs, without their
dependencies, as CPU oracles), with the same negative control.
"""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from engines import ENGINES_DIR

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "resolve_extras.py"
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
ENGINES = {"sglang": "0.5.23", "vllm": "0.33.0"}
#: a serving machine: Linux x86_64, CPython 3.11 (the markers the engines' Requires-Dist are evaluated under)
MARKERS = {"sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64",
           "python_version": "3.11", "python_full_version": "3.11.7", "implementation_name": "cpython",
           "platform_python_implementation": "CPython", "os_name": "posix", "extra": ""}


def _uv_missing() -> bool:
    try:
        from uv import find_uv_bin
        find_uv_bin()
        return False
    except (ImportError, FileNotFoundError):
        import shutil
        return shutil.which("uv") is None


needs_uv = pytest.mark.skipif(_uv_missing(), reason="uv is not installed (the test extra has it: pip install uv)")


def _resolve(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=900)


@needs_uv
@pytest.mark.parametrize("engine", sorted(ENGINES))
def test_the_engine_extra_resolves_against_the_registry_without_downloading_a_wheel(engine):
    r = _resolve(engine)
    assert r.returncode == 0, r.stderr[-3000:]
    line = r.stdout.strip()
    assert line.startswith(f"slacktier[{engine}] resolves") and f"{engine}=={ENGINES[engine]}" in line, line
    assert line.endswith("no wheel downloaded"), line


@needs_uv
def test_the_old_core_transformers_floor_beside_sglang_does_not_resolve():
    """The negative control: the resolver does see the engine's pins (sglang pins transformers==5.19.0)."""
    r = _resolve("sglang", "--constraint", "transformers>=5.20")
    assert r.returncode == 1, r.stdout
    assert "does not resolve" in r.stderr and "transformers==5.19.0" in r.stderr, r.stderr[-3000:]


def _engine_requirements(engine: str) -> list[Requirement]:
    dist = ENGINES_DIR / f"{engine}-{ENGINES[engine]}.dist-info" / "METADATA"
    if not dist.is_file():
        pytest.skip(f"{dist} is not installed (make setup installs the engines as CPU oracles)")
    reqs = [Requirement(line.split(":", 1)[1].strip()) for line in dist.read_text().splitlines()
            if line.startswith("Requires-Dist:")]
    return [r for r in reqs if r.marker is None or r.marker.evaluate(MARKERS)]


def _conflicts(ours: list[str], theirs: list[Requirement]) -> list[str]:
    """Our requirements that exclude a version the engine pins exactly ('name==V')."""
    pinned = {}
    for req in theirs:
        exact = [s.version for s in req.specifier if s.operator == "=="]
        if exact:
            pinned[canonicalize_name(req.name)] = exact[0]
    out = []
    for text in ours:
        req = Requirement(text)
        version = pinned.get(canonicalize_name(req.name))
        if version is not None and not req.specifier.contains(version, prereleases=True):
            out.append(f"{text} excludes the engine's {req.name}=={version}")
    return out


@pytest.mark.parametrize("engine", sorted(ENGINES))
def test_the_core_admits_every_exact_pin_of_the_engines_published_requirements(engine):
    theirs = _engine_requirements(engine)
    assert len(theirs) > 30   # the engine's real metadata, not an empty file
    assert _conflicts(PROJECT["dependencies"], theirs) == []
    assert PROJECT["optional-dependencies"][engine] == [f"{engine}=={ENGINES[engine]}"]


def test_the_old_core_transformers_floor_conflicts_with_sglangs_published_pin():
    """The negative control of the offline check, and why the model code is an extra of its own."""
    theirs = _engine_requirements("sglang")
    assert _conflicts(["transformers>=5.20"], theirs) == [
        "transformers>=5.20 excludes the engine's transformers==5.19.0"]
    assert _conflicts(PROJECT["optional-dependencies"]["models"], theirs) != []
    assert not any(Requirement(r).name == "transformers" for r in PROJECT["dependencies"])
