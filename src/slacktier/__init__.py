"""SlackTier: serve token-indexed LLM lookup tables by each layer's prefetch deadline."""

from __future__ import annotations

import logging
import os
import sys
import tempfile

from slacktier.errors import SlackTierError

__all__ = ["SlackTierError"]
__version__ = "0.1.0"

log = logging.getLogger(__name__)

# Where numba's compiled-kernel cache went when neither of its default places could be written ("" when unused).
NUMBA_CACHE_FALLBACK = ""


def _writable_dir(path: str) -> bool:
    """numba's own test of a cache directory: create it, then a temporary file inside it."""
    try:
        os.makedirs(path, exist_ok=True)
        tempfile.TemporaryFile(dir=path).close()
    except OSError:
        return False
    return True


def _private_temp_dir() -> str:
    """`<tmp>/slacktier-numba-<uid>`, reused across runs when it is ours alone, else a fresh private one.

    numba loads the cached code it finds there, so a directory another user
    could have written is never used.
    """
    path = os.path.join(tempfile.gettempdir(), f"slacktier-numba-{os.getuid()}")
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if os.path.isdir(path) and not os.path.islink(path) and st.st_uid == os.getuid() and not st.st_mode & 0o022 \
            and _writable_dir(path):
        return path
    return tempfile.mkdtemp(prefix="slacktier-numba-")


def _numba_cache_fallback() -> str:
    """Point NUMBA_CACHE_DIR at a private temp directory when numba's default cache places are not writable.

    numba caches a `cache=True` kernel in `__pycache__` beside its source file,
    else in the user cache (`$XDG_CACHE_HOME` or `~/.cache`, then `numba`), and
    raises "no locator available" at import when neither can be written (a
    read-only install run without a writable HOME). NUMBA_CACHE_DIR, when set,
    is always used as is. Must run before any numba-decorated module imports.
    """
    if os.environ.get("NUMBA_CACHE_DIR"):
        return ""
    package = os.path.dirname(os.path.abspath(__file__))
    source_dirs = [root for root, dirs, files in os.walk(package) if os.path.basename(root) != "__pycache__"
                   and any(f.endswith(".py") for f in files)]
    if all(_writable_dir(os.path.join(d, "__pycache__")) for d in source_dirs):
        return ""
    user_cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    if _writable_dir(os.path.join(user_cache, "numba")):
        return ""
    try:
        path = _private_temp_dir()
    except OSError as exc:
        log.warning("numba cannot cache compiled kernels: %s/**/__pycache__ and %s are not writable and no temp "
                    "directory could be made (%s); set NUMBA_CACHE_DIR to a writable directory", package,
                    user_cache, exc)
        return ""
    os.environ["NUMBA_CACHE_DIR"] = path
    if "numba" in sys.modules:  # numba read its config at import: tell it too
        sys.modules["numba"].config.CACHE_DIR = path
    log.warning("numba's cache places (%s/**/__pycache__, %s/numba) are not writable: caching compiled kernels "
                "in %s instead (set NUMBA_CACHE_DIR to choose the directory)", package,
                user_cache, path)
    return path


NUMBA_CACHE_FALLBACK = _numba_cache_fallback()

# Every kernel's cache stamped with all of the package's numba sources, not only its own file (a kernel that
# compiles in another file's kernel ran the old one from the cache after that file changed: see _kernel_cache),
# from the moment numba is imported.
from slacktier import _kernel_cache  # noqa: E402

_kernel_cache.install_when_imported(os.path.dirname(os.path.abspath(__file__)))
