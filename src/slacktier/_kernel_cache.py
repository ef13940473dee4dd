"""numba's kernel cache, stamped with every compiled source file of the package, not only the kernel's own.

numba stamps a cached kernel with its own source file's mtime and size. A
kernel that calls a kernel of another file compiles that callee into itself,
so after the other file changed it kept running the old callee from the cache
until its own file changed too. It happened here:
`cache.compiled.run_layers` compiles `cache.directory.resolve_layer` into
itself, and an edit of the directory pass was absent from begin_step's compiled
entry while the per-layer path ran it (the tests compare the two paths, and both
passes were right, so they stayed green).

`install(root)` puts, in front of each of numba's locators that back a cache
with a source file (NUMBA_CACHE_DIR, `__pycache__`, the user cache), a locator
that takes the same place for files under `root` and stamps them with one
digest of the contents of every file under `root` that imports numba. An edit
to any of those files recompiles every kernel of the package on first use;
files without numba code do not count.

`install_when_imported(root)` does it as soon as numba is imported (at once
when it already is), so `import slacktier` itself does not import numba (half a
second, which `slacktier --help` would pay).

Worked example: edit `cache/directory.py`; the next process finds the stamp of
`compiled.run_layers`'s cache index changed, ignores the index and compiles
`run_layers` again, with the new pass inlined.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.abc
import importlib.machinery
import os
import sys


@functools.lru_cache(maxsize=None)
def source_stamp(root: str) -> str:
    """Digest of every .py file under `root` that mentions numba: relative path and contents."""
    digest = hashlib.sha256()
    for base, dirs, files in sorted(os.walk(root)):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for name in sorted(files):
            if not name.endswith(".py"):
                continue
            path = os.path.join(base, name)
            with open(path, "rb") as f:
                text = f.read()
            if b"numba" in text:
                digest.update(os.path.relpath(path, root).encode() + b"\0" + text + b"\0")
    return digest.hexdigest()


def _stamped(locator: type, root: str) -> type:
    """A subclass of numba's `locator` for files under `root`, stamped with `source_stamp(root)`."""
    prefix = os.path.join(os.path.realpath(root), "")

    def get_source_stamp(self) -> str:
        return source_stamp(root)

    @classmethod
    def from_function(cls, py_func, py_file):
        if not os.path.realpath(py_file).startswith(prefix):
            return None
        return super(new, cls).from_function(py_func, py_file)

    new = type(f"PackageStamped{locator.__name__.lstrip('_')}", (locator,),
               {"get_source_stamp": get_source_stamp, "from_function": from_function, "root": root,
                "__doc__": f"numba's {locator.__name__}, stamped with every numba source file under the root."})
    return new


def install(root: str) -> bool:
    """Stamp the kernel caches of files under `root` with `source_stamp(root)`; False when this numba's cache
    machinery has no place for it (the caches then work as numba's own). Idempotent; must run before the
    kernels under `root` are decorated."""
    from numba.core import caching

    impl = getattr(caching, "CacheImpl", None) or getattr(caching, "_CacheImpl", None)
    classes = getattr(impl, "_locator_classes", None)
    if not isinstance(classes, list):
        return False
    if any(getattr(c, "root", None) == root for c in classes):
        return True
    backed = [c for c in classes if "UserProvided" in c.__name__ or "InTree" in c.__name__
              or "UserWide" in c.__name__]
    if not backed:
        return False
    impl._locator_classes = [_stamped(c, root) for c in backed] + classes
    return True


class _AfterNumba(importlib.abc.MetaPathFinder):
    """Finds numba as the path finder does, and runs `install(root)` right after numba's module has run."""

    def __init__(self, root: str) -> None:
        self.root = root
        self.done = False   # one use; it stays in sys.meta_path (removing it there mid-import skips a finder)

    def find_spec(self, name, path=None, target=None):
        if name != "numba" or self.done:
            return None
        self.done = True
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        loader, root = spec.loader, self.root

        class Loader(importlib.abc.Loader):
            def create_module(self, spec):
                return loader.create_module(spec)

            def exec_module(self, module):
                loader.exec_module(module)
                install(root)

        spec.loader = Loader()
        return spec


def install_when_imported(root: str) -> None:
    """`install(root)` now if numba is imported, else right after it is (the first `import numba`)."""
    if "numba" in sys.modules:
        install(root)
    elif not any(isinstance(f, _AfterNumba) and f.root == root and not f.done for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterNumba(root))
