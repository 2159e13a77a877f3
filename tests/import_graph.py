"""The import graph of the ``stoa`` package, read from its source (nothing is imported or run).

``tests/test_imports.py`` holds the rules (layer order, no cycles, lazy imports only where they save a heavy
or optional import); ``python scripts/import_graph.py`` prints the figures.
"""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STOA = ROOT / "stoa"

LAYERS: tuple[frozenset[str], ...] = (
    frozenset({"stoa", "layout", "untrusted", "schemas", "machine", "stopflag", "tokenize", "models"}),
    frozenset({"bucket", "weights", "rollouts", "contract", "lifecycle"}),
    frozenset({"tasks", "envs", "algorithms", "retrieval", "identity"}),
    frozenset({"config"}),
    frozenset({"engines", "episodes", "telemetry"}),
    frozenset({"worker", "trainer", "local", "evaluator"}),
    frozenset({"observe", "join", "export"}),
    frozenset({"cli", "bench", "__main__"}),
)
"""Rooms (the first name under ``stoa``) from the foundation up: a module imports only its own layer or lower."""

SEALED = frozenset({"worker", "trainer", "local", "evaluator"})
"""Rooms of one layer that never import one another: the processes share code only through lower layers."""


@dataclass(frozen=True)
class Import:
    """One module named by one import statement.

    Args:
        source: the importing module (``stoa.trainer.loop``).
        target: the dotted name of the module imported (internal: the deepest module of ``stoa`` it names).
        line: the statement's line in the source module.
        lazy: whether the statement sits inside a function.
        internal: whether ``target`` is a module of ``stoa``.
        guarded: whether a ``try`` around it catches ``ImportError`` (an optional import, wherever it is).
    """

    source: str
    target: str
    line: int
    lazy: bool
    internal: bool
    guarded: bool = False


def modules(root: Path = STOA) -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its own name)."""
    out = {}
    for f in sorted(root.rglob("*.py")):
        parts = f.relative_to(root.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = f
    return out


def room(module: str) -> str:
    """``stoa.trainer.loop`` -> ``trainer``; ``stoa.layout`` -> ``layout``; ``stoa`` -> ``stoa``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def layer(module: str) -> int:
    """The layer of a module's room; a room in no layer is an error the test names."""
    for i, rooms in enumerate(LAYERS):
        if room(module) in rooms:
            return i
    raise KeyError(f"stoa room {room(module)!r} ({module}) is in no layer of tests/import_graph.py LAYERS")


def _inside(tree: ast.AST, outer) -> set[int]:
    """ids of the nodes strictly inside the nodes for which ``outer(node)`` holds."""
    return {id(c) for n in ast.walk(tree) if outer(n) for c in ast.walk(n) if c is not n}


def _is_function(node: ast.AST) -> bool:
    return isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)


def _is_type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def _guarded(tree: ast.AST) -> set[int]:
    """ids of the nodes in the body of a ``try`` that catches ``ImportError`` or ``ModuleNotFoundError``."""
    out: set[int] = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Try) and any(h.type is not None and re.search(r"\b(ImportError|ModuleNotFoundError)\b",
                                                                        ast.unparse(h.type)) for h in n.handlers):
            out.update(id(c) for stmt in n.body for c in ast.walk(stmt))
    return out


def _targets(source: str, is_package: bool, node: ast.Import | ast.ImportFrom, known: dict[str, Path]) -> list[str]:
    """The modules one statement names: internal dotted names (deepest existing) or outside top-level names."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        base = node.module or ""
        if node.level:
            pkg = source.split(".") if is_package else source.split(".")[:-1]
            pkg = pkg[: len(pkg) - node.level + 1]
            base = ".".join([*pkg, base] if base else pkg)
        names = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
    out = []
    for name in names:
        if name.split(".")[0] != "stoa":
            out.append(name)
            continue
        while name not in known:
            name = name.rpartition(".")[0]
        out.append(name)
    return list(dict.fromkeys(out))


def imports(root: Path = STOA) -> list[Import]:
    """Every import of every module (``TYPE_CHECKING`` blocks left out: they never run)."""
    known = modules(root)
    out = []
    for name, path in known.items():
        tree = ast.parse(path.read_text(), str(path))
        in_function, type_only, guarded = _inside(tree, _is_function), _inside(tree, _is_type_checking), _guarded(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import | ast.ImportFrom) and id(node) not in type_only:
                for target in _targets(name, path.name == "__init__.py", node, known):
                    if target != name:
                        out.append(Import(name, target, node.lineno, id(node) in in_function,
                                          target.split(".")[0] == "stoa", id(node) in guarded))
    return out


def base_dependencies(pyproject: Path = ROOT / "pyproject.toml") -> frozenset[str]:
    """Import names of the packages every install has (``[project] dependencies``)."""
    deps = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    names = {d.split(">")[0].split("=")[0].split("<")[0].split("[")[0].strip().lower() for d in deps}
    return frozenset(n.replace("-", "_") for n in names)


def is_optional(module: str, base: frozenset[str]) -> bool:
    """An outside module that is neither the standard library nor a base dependency, or a base dependency's
    module for a framework that is not one (``safetensors.torch`` loads torch).

    Args:
        module: the dotted name imported (``torch``, ``safetensors.torch``, ``json``).
        base: the import names of the base dependencies.
    """
    top, *rest = module.split(".")
    if top == "__future__" or top in sys.stdlib_module_names:
        return False
    return top not in base or any(part in FRAMEWORKS for part in rest)


FRAMEWORKS = frozenset({"torch", "mlx", "jax", "flax", "tensorflow", "paddle", "transformers"})
"""Names of heavy frameworks that a light package's submodule may load (``safetensors.torch``)."""


def _ancestors(module: str) -> Iterable[str]:
    parts = module.split(".")
    return (".".join(parts[:i]) for i in range(1, len(parts)))


def heavy(imps: list[Import], base: frozenset[str]) -> set[str]:
    """Internal modules whose import (top-level statements, parents included) loads an optional package."""
    top: dict[str, set[str]] = {}
    for i in imps:
        if not i.lazy:
            top.setdefault(i.source, set()).add(i.target)
    for m in list(top):
        for t in list(top[m]):
            top[m].update(a for a in _ancestors(t) if a != m)
    found: set[str] = set()
    changed = True
    while changed:
        changed = False
        for m, targets in top.items():
            if m not in found and any((t in found) if t.startswith("stoa") else is_optional(t, base)
                                      for t in targets):
                found.add(m)
                changed = True
    return found


def cycles(imps: list[Import]) -> list[list[str]]:
    """Groups of internal modules that import one another, directly or not (Tarjan's algorithm)."""
    graph: dict[str, set[str]] = {}
    for i in imps:
        if i.internal:
            graph.setdefault(i.source, set()).add(i.target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def layer_violations(imps: list[Import]) -> list[str]:
    """Internal imports that go up the layers, or across sealed rooms."""
    bad = []
    for i in imps:
        if not i.internal or room(i.source) == room(i.target):
            continue
        src, dst = layer(i.source), layer(i.target)
        if dst > src or (dst == src and {room(i.source), room(i.target)} <= SEALED):
            bad.append(f"{i.source}:{i.line} imports {i.target} (layer {src} -> {dst})")
    return bad


def lazy_violations(imps: list[Import], base: frozenset[str]) -> list[str]:
    """Imports inside functions that load nothing heavy or optional: they belong at the top of the module."""
    slow = heavy(imps, base)
    return [f"{i.source}:{i.line} imports {i.target} inside a function" for i in imps
            if i.lazy and not (i.guarded or (i.internal and i.target in slow)
                               or (not i.internal and is_optional(i.target, base)))]


def counts(imps: list[Import]) -> dict[str, int]:
    """The figures ``scripts/import_graph.py`` prints."""
    statements = {(i.source, i.line, i.lazy) for i in imps}
    edges: dict[tuple[str, str], bool] = {}
    for i in imps:
        if i.internal:
            edges[(i.source, i.target)] = edges.get((i.source, i.target), True) and i.lazy
    return {"modules": len(modules()), "import statements": len(statements),
            "inside functions": sum(1 for s in statements if s[2]),
            "internal edges": len(edges), "lazy internal edges": sum(edges.values()),
            "cycles": len(cycles(imps))}
