"""The package's import graph keeps the rooms' layering (README, "Architecture"): no cycles, no upward imports.

A room may import only the rooms below it (and `errors`, which every room
uses). Imports inside functions count: a lazy import is still a dependency.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG_DIR = Path(__file__).resolve().parents[1] / "src" / "slacktier"

#: room -> the rooms it may import directly; what those may import follows (the closure is taken below)
MAY_USE: dict[str, set[str]] = {
    "errors": set(),
    "config": set(),
    "_kernel_cache": set(),
    "tables": {"config"},
    "cache": {"tables"},
    "store": {"tables", "config"},
    "engine": {"tables", "store", "cache", "config"},
    "plan": {"config"},
    "probe": set(),   # the window probe needs torch alone
    "workloads": {"tables", "cache"},
    "models": {"engine"},
    "testing": {"tables", "store", "engine"},   # stand-ins for tests and benchmarks (testing/__init__.py); no room uses it
    "serve": {"config", "tables", "store", "cache", "engine", "plan", "probe", "workloads", "models"},
    "redknot": {"models", "engine", "store"},
    "adapters": {"engine", "config", "tables"},
    "whatif": {"serve", "engine", "store", "cache", "plan", "tables", "config", "workloads"},
}
TOP = {"commands", "cli", "__main__", ""}   # may import anything; nothing imports them


def _below(room: str) -> set[str]:
    seen, todo = set(), list(MAY_USE[room])
    while todo:
        r = todo.pop()
        if r not in seen:
            seen.add(r)
            todo.extend(MAY_USE[r])
    return seen | {"errors"}


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PKG_DIR.rglob("*.py")):
        rel = path.relative_to(PKG_DIR.parent).with_suffix("")
        name = ".".join(rel.parts)
        out[name.removesuffix(".__init__")] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> list[tuple[str, int]]:
    """Package modules `name` imports, with line numbers (`from x import y` counts x.y when y is a module)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = []
    for node in ast.walk(tree):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            targets = [base] + [f"{base}.{a.name}" for a in node.names]
        for t in targets:
            if t in modules and t != name and not name.startswith(t + "."):
                found.append((t, node.lineno))
    return found


def _room(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _graph() -> tuple[dict[str, set[str]], list[str]]:
    modules = _modules()
    edges: dict[str, set[str]] = {}
    upward = []
    for name, path in modules.items():
        for target, line in _imports(name, path, modules):
            edges.setdefault(name, set()).add(target)
            src, dst = _room(name), _room(target)
            if src == dst or src in TOP:
                continue
            if dst in TOP:
                upward.append(f"{name}:{line} imports {target}: nothing may import the CLI")
            elif src not in MAY_USE:
                upward.append(f"{name}:{line}: room {src!r} is not in the layering; add it to the README and here")
            elif dst not in _below(src):
                upward.append(f"{name}:{line} imports {target}: room {dst!r} is not below room {src!r}")
    return edges, upward


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (iterative Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out = []
    counter = 0
    for root in sorted(set(edges) | {t for ts in edges.values() for t in ts}):
        if root in index:
            continue
        work = [(root, iter(sorted(edges.get(root, ()))))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(edges.get(w, ())))))
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return out


def test_no_import_cycles():
    edges, _ = _graph()
    assert _cycles(edges) == []


def test_no_upward_imports():
    _, upward = _graph()
    assert upward == []


def test_every_room_is_in_the_layering():
    rooms = {_room(m) for m in _modules()}
    assert rooms - set(MAY_USE) - TOP == set()


@pytest.mark.parametrize("bad, expect", [
    ({"a": {"b"}, "b": {"a"}}, [["a", "b"]]),
    ({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}, [["a", "b", "c"]]),
    ({"a": {"b"}, "b": set()}, []),
])
def test_the_cycle_finder_finds_cycles(bad, expect):
    assert _cycles(bad) == expect


def test_the_checker_sees_an_upward_import(tmp_path, monkeypatch):
    """A lazy import of the engine from tables is reported (the test can fail)."""
    pkg = tmp_path / "slacktier"
    (pkg / "tables").mkdir(parents=True)
    (pkg / "engine").mkdir()
    for d in (pkg, pkg / "tables", pkg / "engine"):
        (d / "__init__.py").write_text("")
    (pkg / "engine" / "step.py").write_text("X = 1\n")
    (pkg / "tables" / "layout.py").write_text("def f():\n    from slacktier.engine.step import X\n    return X\n")
    monkeypatch.setattr(__import__(__name__), "PKG_DIR", pkg)
    _, upward = _graph()
    assert upward == ["slacktier.tables.layout:2 imports slacktier.engine.step: room 'engine' is not below room "
                      "'tables'"]


def _importers_of(room: str, rooms: set[str]) -> list[str]:
    """'module:line' of every module in `rooms` that imports a module of `room` (lazy imports count)."""
    modules = _modules()
    return [f"{name}:{line}" for name, path in modules.items() if _room(name) in rooms
            for target, line in _imports(name, path, modules) if _room(target) == room]


def test_no_store_or_engine_module_imports_the_whatif_room():
    """The emulator sits above the engine: the store and the engine have no hook for it and never import it."""
    assert _importers_of("whatif", {"store", "engine"}) == []


def test_the_whatif_check_sees_a_store_module_importing_it(tmp_path, monkeypatch):
    pkg = tmp_path / "slacktier"
    (pkg / "store").mkdir(parents=True)
    (pkg / "whatif").mkdir()
    for d in (pkg, pkg / "store", pkg / "whatif"):
        (d / "__init__.py").write_text("")
    (pkg / "whatif" / "tier.py").write_text("X = 1\n")
    (pkg / "store" / "disk.py").write_text("def f():\n    import slacktier.whatif.tier\n")
    monkeypatch.setattr(__import__(__name__), "PKG_DIR", pkg)
    assert _importers_of("whatif", {"store", "engine"}) == ["slacktier.store.disk:2"]
