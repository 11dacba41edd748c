"""The packages' arrows point one way: tokenmill (CLI) -> workers -> ingest -> storage; engine imports none of
them; nothing imports the CLI's modules; no cycle among the top-level packages (Alembic's env.py reading the
models is the one allowed back-arrow). Read from the source with `ast`, every import counted, also those inside
functions."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("engine", "storage", "ingest", "workers", "tokenmill", "migrations")
SERVICE = ("storage", "ingest", "workers", "tokenmill", "migrations")
LAYERS = ("storage", "ingest", "workers", "tokenmill")  # each may import only those before it
BENCH_CLI_FILES = "tokenmill/bench/*_cli.py"  # `tokenmill bench <name>`'s arguments and run, beside the benchmark
CLI_MODULES = ("tokenmill.cli", "tokenmill.commands", "tokenmill.options", "tokenmill.progress",
               "tokenmill.__main__", *(f"tokenmill.bench.{path.stem}" for path in ROOT.glob(BENCH_CLI_FILES)))
ALLOWED_BACK_ARROWS = {ROOT / "migrations" / "env.py"}


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def source_files(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


def imports_by_file() -> dict[Path, set[str]]:
    files = [f for package in PACKAGES for f in source_files(package)] + sorted((ROOT / "ops").rglob("*.py"))
    return {path: imported_modules(path) for path in files}


def top(module: str) -> str:
    return module.partition(".")[0]


def package_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = defaultdict(set)
    for path, modules in imports_by_file().items():
        if path in ALLOWED_BACK_ARROWS:
            continue
        owner = path.relative_to(ROOT).parts[0]
        graph[owner].update(top(m) for m in modules if top(m) in PACKAGES and top(m) != owner)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    def visit(node: str, path: list[str]) -> list[str] | None:
        if node in path:
            return path[path.index(node):] + [node]
        for target in sorted(graph.get(node, ())):
            cycle = visit(target, [*path, node])
            if cycle:
                return cycle
        return None

    for start in sorted(graph):
        cycle = visit(start, [])
        if cycle:
            return cycle
    return None


def test_the_checker_sees_imports_inside_functions_and_finds_cycles(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text("import a.b\n\ndef f():\n    from c.d import e\n    from . import sibling\n")
    assert imported_modules(module) == {"a.b", "c.d", "c.d.e"}
    assert find_cycle({"x": {"y"}, "y": {"z"}, "z": {"x"}}) == ["x", "y", "z", "x"]
    assert find_cycle({"x": {"y"}, "y": set()}) is None


def test_no_cycle_among_the_top_level_packages() -> None:
    graph = package_graph()
    assert find_cycle(graph) is None, f"import cycle: {' -> '.join(find_cycle(graph))}"


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def engine_module_graph() -> dict[str, set[str]]:
    """Each engine module -> the engine modules it imports (type-only and in-function imports included)."""
    modules = {module_name(path): path for path in source_files("engine")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets = set()
        for imported in imported_modules(path):
            target = imported if imported in modules else imported.rpartition(".")[0]
            if target in modules and target != name:
                targets.add(target)
        graph[name] = targets
    return graph


def test_no_import_cycle_inside_the_engine() -> None:
    graph = engine_module_graph()
    assert graph["engine.model_runner"] >= {"engine.sampler", "engine.step_types"}  # the graph sees imports
    assert "engine.step_types" in graph["engine.logits_processors"]  # type-only ones too
    cycle = find_cycle(graph)
    assert cycle is None, f"import cycle: {' -> '.join(cycle)}"


def test_the_model_runner_only_runs() -> None:
    runner = ROOT / "engine" / "model_runner.py"
    assert len(runner.read_text().splitlines()) < 200
    assert not {m for m in imported_modules(runner) if m.startswith("engine.spec_decode")}


def test_engine_imports_nothing_of_the_service() -> None:
    offenders = {f"{path.relative_to(ROOT)}: {m}" for path in source_files("engine")
                 for m in imported_modules(path) if top(m) in SERVICE}
    assert not offenders, sorted(offenders)


@pytest.mark.parametrize("index", range(len(LAYERS)))
def test_the_service_layers_point_one_way(index: int) -> None:
    package, above = LAYERS[index], set(LAYERS[index + 1:])
    offenders = {f"{path.relative_to(ROOT)}: {m}" for path in source_files(package)
                 for m in imported_modules(path) if top(m) in above}
    assert not offenders, f"{package} imports a layer above it: {sorted(offenders)}"


def test_nothing_imports_the_cli_modules() -> None:
    offenders = set()
    for path, modules in imports_by_file().items():
        inside_cli = path.match(BENCH_CLI_FILES) or path.relative_to(ROOT).as_posix().startswith(
            ("tokenmill/cli.py", "tokenmill/commands/", "tokenmill/__main__.py"))
        for module in modules:
            if not inside_cli and any(module == cli or module.startswith(cli + ".") for cli in CLI_MODULES):
                offenders.add(f"{path.relative_to(ROOT)}: {module}")
    assert not offenders, sorted(offenders)
