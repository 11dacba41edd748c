"""The project's import graph: no module imports itself back through others (function-level and TYPE_CHECKING
imports count), and packages import one way: tokenmill -> workers -> ingest -> storage, and engine imports none
of them."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("engine", "storage", "ingest", "workers", "tokenmill", "migrations", "ops", "tests")
# what each package may import from the others: the arrows of docs/architecture.md, plus ingest checking sampling
# settings with the engine's own classes, and storage.migrate running Alembic's revisions (whose env.py reads the
# models)
ALLOWED = {
    "engine": set(),
    "storage": {"migrations"},
    "ingest": {"storage", "engine"},
    "workers": {"ingest", "storage", "engine"},
    "tokenmill": {"workers", "ingest", "storage", "engine"},
    "migrations": {"storage"},
}


def modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imported_names(path: Path, module: str) -> set[str]:
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def import_graph() -> dict[str, set[str]]:
    found = modules()

    def owner(name: str) -> str | None:  # the project module a dotted name lives in
        while name and name not in found:
            name = name.rpartition(".")[0]
        return name or None

    return {module: {target for name in imported_names(path, module)
                     if (target := owner(name)) is not None and target != module}
            for module, path in found.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_cycle_finder_sees_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_module_imports_itself_back():
    graph = import_graph()
    assert len(graph) > 100  # the walk found the project
    assert cycles(graph) == []


def test_packages_import_one_way():
    wrong = sorted(f"{module} -> {target}" for module, targets in import_graph().items() for target in targets
                   if (source := module.split(".")[0]) in ALLOWED
                   and (goal := target.split(".")[0]) != source and goal not in ALLOWED[source])
    assert wrong == []
