"""The layout shows the architecture: no import circles (imports inside functions
counted), app/ -> engine/ -> metal_kernels/ and never back, every module <= 300 lines."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("app", "engine", "metal_kernels")
MAX_LINES = 300


def modules() -> dict[str, Path]:
    """Dotted module name -> file, for every Python file of the three packages."""
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def import_graph(mods: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the project modules it imports anywhere in its file (functions too).

    ``from a.b import c`` is an edge to the module a.b.c when c is one, else to a.b.
    """
    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {m: set() for m in mods}
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            targets = []
            if isinstance(node, ast.Import):
                targets = [resolve(a.name) for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*parts, base] if base else parts)
                targets = [resolve(f"{base}.{a.name}") if f"{base}.{a.name}" in mods
                           else resolve(base) for a in node.names]
            graph[name].update(t for t in targets if t and t != name)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, on_stack, stack, found, counter = {}, {}, set(), [], [], [0]
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter[0]
                    counter[0] += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[v] = min(low[v], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                component = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    component.append(w)
                    if w == v:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_checker_finds_a_circle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_circles():
    assert cycles(import_graph(modules())) == []


@pytest.mark.parametrize(("lower", "upper"), [("engine", "app"), ("metal_kernels", "engine"),
                                              ("metal_kernels", "app")])
def test_dependencies_point_one_way(lower, upper):
    graph = import_graph(modules())
    wrong = sorted((m, t) for m, ts in graph.items() for t in ts
                   if m.split(".")[0] == lower and t.split(".")[0] == upper)
    assert wrong == []


def test_engine_never_imports_textual():
    for name, path in modules().items():
        if name.startswith("engine"):
            tree = ast.parse(path.read_text(encoding="utf-8"))
            for node in ast.walk(tree):
                names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                         else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
                assert not any(n.split(".")[0] == "textual" for n in names), name


def test_every_module_is_at_most_300_lines():
    sources = [p for package in ("app", "engine") for ext in ("*.py", "*.cpp", "*.h")
               for p in (ROOT / package).rglob(ext)]
    long = {str(p.relative_to(ROOT)): n for p in sources
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_LINES}
    assert long == {}
