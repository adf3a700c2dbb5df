"""The package's layers: the runtime, data and artifacts import nothing from the stages, flows or
CLI above them, errors come from one module at the bottom, and no two modules import each other."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).parents[1] / "jaxtune"
LOW = ("runtime", "data", "artifacts", "errors", "config")
HIGH = ("tasks", "flows", "cli", "chat", "doctor", "preflight", "launch")


def module_name(path: Path) -> str:
    parts = ("jaxtune", *path.relative_to(PACKAGE).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path, modules: set[str]) -> set[str]:
    """The jaxtune modules `path` imports, at its top or inside functions, absolutely or relatively."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            # `from jaxtune.data import rows` imports the module jaxtune.data.rows
            found |= {f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names}
    return {m for m in found if m in modules and m != name}


def import_graph() -> dict[str, set[str]]:
    paths = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    return {name: imported_modules(path, set(paths)) for name, path in paths.items()}


def layer(module: str) -> str:
    return module.split(".")[1] if "." in module else ""


def test_the_graph_reads_relative_and_function_level_imports():
    graph = import_graph()
    assert "jaxtune.artifacts.store" in graph["jaxtune.artifacts"]  # `from .store import ...`
    assert "jaxtune.data.loading" in graph["jaxtune.data.tokenize"]  # `from jaxtune.data import loading`
    assert "jaxtune.runtime.devices.compile_cache" in graph["jaxtune.flows.finetune"]  # imported inside a function


@pytest.mark.parametrize("low", LOW)
def test_a_low_layer_imports_no_higher_one(low):
    upward = sorted(f"{m} -> {d}" for m, deps in import_graph().items() if layer(m) == low
                    for d in deps if layer(d) in HIGH)
    assert upward == []


def test_errors_import_nothing_of_jaxtune():
    assert import_graph()["jaxtune.errors"] == set()


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, frontier = set(), [start]
    while frontier:
        for d in graph[frontier.pop()] - seen:
            seen.add(d)
            frontier.append(d)
    return seen


def test_no_modules_import_each_other():
    graph = import_graph()
    assert sorted(m for m in graph if m in reachable(graph, m)) == []


def test_a_cycle_would_be_found():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert sorted(m for m in graph if m in reachable(graph, m)) == ["a", "b", "c"]
