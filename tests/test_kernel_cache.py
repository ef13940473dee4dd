"""The package's numba kernels are cached under a stamp of all its numba sources (slacktier._kernel_cache)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import slacktier
from slacktier import _kernel_cache
from slacktier.cache import compiled as steppass


def test_the_package_kernels_use_the_stamped_locator() -> None:
    root = str(Path(slacktier.__file__).parent)
    for kernel in (steppass.run_layers, steppass.resolve_layer):
        locator = kernel._cache._impl._locator
        assert getattr(type(locator), "root", None) == root
        assert locator.get_source_stamp() == _kernel_cache.source_stamp(root)


def test_stamp_follows_numba_sources_only(tmp_path: Path) -> None:
    (tmp_path / "k.py").write_text("from numba import njit\n")
    (tmp_path / "plain.py").write_text("X = 1\n")
    first = _kernel_cache.source_stamp(str(tmp_path))
    _kernel_cache.source_stamp.cache_clear()
    (tmp_path / "plain.py").write_text("X = 2\n")
    assert _kernel_cache.source_stamp(str(tmp_path)) == first
    _kernel_cache.source_stamp.cache_clear()
    (tmp_path / "k.py").write_text("from numba import njit\nY = 1\n")
    assert _kernel_cache.source_stamp(str(tmp_path)) != first
    _kernel_cache.source_stamp.cache_clear()


def test_a_kernel_recompiles_when_the_kernel_it_calls_changes(tmp_path: Path) -> None:
    """numba alone keeps g() == 1 from its cache after a.py changes; with the stamp it recompiles g."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from numba import njit\n\n\n@njit(cache=True)\ndef f():\n    return 1\n")
    (pkg / "b.py").write_text("from numba import njit\nfrom pkg.a import f\n\n\n@njit(cache=True)\ndef g():\n"
                              "    return f()\n")
    run = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(tmp_path)!r})
        from slacktier import _kernel_cache
        if sys.argv[1] == "stamped":
            assert _kernel_cache.install({str(pkg)!r})
        from pkg.b import g
        print(g())
    """)

    def g(mode: str) -> str:
        return subprocess.run([sys.executable, "-c", run, mode], check=True, capture_output=True,
                              text=True).stdout.strip()

    assert g("plain") == "1"
    (pkg / "a.py").write_text("from numba import njit\n\n\n@njit(cache=True)\ndef f():\n    return 2\n")
    assert g("plain") == "1"      # numba's own stamp: b.py did not change, so g's cache is still "valid"
    assert g("stamped") == "2"    # a.py is part of the stamp: g compiled again
    assert g("stamped") == "2"    # and cached again under the new stamp


def test_importing_slacktier_does_not_import_numba() -> None:
    """`slacktier --help` stays quick: the stamp is installed when numba is first imported, not before."""
    code = ("import sys, slacktier; assert 'numba' not in sys.modules; import numba.core.caching as c; "
            "impl = getattr(c, 'CacheImpl', None) or c._CacheImpl; "
            "print(any(getattr(k, 'root', None) for k in impl._locator_classes))")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    assert out.strip() == "True"
