"""The package's layers, as each package declares them: every package's `__init__` docstring (and
each module at the package root) has a line `May import: jaxtune.x, jaxtune.y.z`, and every import
of a module, at its top or inside a function, is of its own package, of a package above it, or of
what that line names. Only the runtime imports torchax, packages import each other in one
direction only, and no two modules import each other."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).parents[1] / "jaxtune"
DECLARATION = "May import:"
NOTHING = "nothing from jaxtune"


def module_name(path: Path, root: Path = PACKAGE) -> str:
    parts = ("jaxtune", *path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path, modules: set[str], root: Path = PACKAGE) -> set[str]:
    """The jaxtune modules `path` imports, at its top or inside functions, absolutely or relatively."""
    name = module_name(path, root)
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


def imports_torchax(path: Path) -> bool:
    for node in ast.walk(ast.parse(path.read_text())):
        names = (
            [a.name for a in node.names]
            if isinstance(node, ast.Import)
            else [node.module or ""]
            if isinstance(node, ast.ImportFrom) and not node.level
            else []
        )
        if any(n.split(".")[0] == "torchax" for n in names):
            return True
    return False


def sources(root: Path = PACKAGE) -> dict[str, Path]:
    return {module_name(p, root): p for p in sorted(root.rglob("*.py")) if "__pycache__" not in p.parts}


def import_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    paths = sources(root)
    return {name: imported_modules(path, set(paths), root) for name, path in paths.items()}


def declared(path: Path) -> set[str] | None:
    """The names on the `May import:` line of a module's docstring; None where it has none."""
    for line in (ast.get_docstring(ast.parse(path.read_text())) or "").splitlines():
        if line.startswith(DECLARATION):
            text = line.removeprefix(DECLARATION).strip().rstrip(".")
            return set() if text == NOTHING else {n.strip() for n in text.split(",")}
    return None


def units(root: Path = PACKAGE) -> dict[str, Path]:
    """What declares rules: every package (by its `__init__`) and every module at the root."""
    return {name: path for name, path in sources(root).items() if path.name == "__init__.py" or path.parent == root}


def unit_of(module: str, unit_names: set[str]) -> str:
    """The package (or root module) whose declaration rules `module`: itself, or its package."""
    return module if module in unit_names else module.rpartition(".")[0]


def within(module: str, names: set[str]) -> bool:
    return any(module == n or module.startswith(n + ".") for n in names)


def violations(root: Path = PACKAGE) -> list[str]:
    """Every import no declaration allows, as 'importer -> imported (rules of unit)'."""
    rules = {name: declared(path) or set() for name, path in units(root).items()}
    found = []
    for module, deps in import_graph(root).items():
        unit = unit_of(module, set(rules))
        for dep in sorted(deps):
            own = unit_of(dep, set(rules)) == unit
            above = unit.startswith(dep + ".")  # a package above runs before anything in it
            if not (own or above or within(dep, rules[unit])):
                found.append(f"{module} -> {dep} (rules of {unit})")
    return found


def unit_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    """Which packages (and root modules) import which, leaving out imports of a package above."""
    names = set(units(root))
    graph = {name: set() for name in names}
    for module, deps in import_graph(root).items():
        unit = unit_of(module, names)
        graph[unit] |= {unit_of(d, names) for d in deps} - {unit} - {u for u in names if unit.startswith(u + ".")}
    return graph


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, frontier = set(), [start]
    while frontier:
        for d in graph[frontier.pop()] - seen:
            seen.add(d)
            frontier.append(d)
    return seen


def in_cycles(graph: dict[str, set[str]]) -> list[str]:
    return sorted(m for m in graph if m in reachable(graph, m))


def test_the_graph_reads_relative_and_function_level_imports():
    graph = import_graph()
    assert "jaxtune.artifacts.store" in graph["jaxtune.artifacts"]  # `from .store import ...`
    assert "jaxtune.data.loading" in graph["jaxtune.data.tokenize"]  # `from jaxtune.data import loading`
    assert "jaxtune.runtime.devices.compile_cache" in graph["jaxtune.flows.finetune"]  # imported inside a function


def test_every_package_and_root_module_declares_what_it_may_import():
    undeclared = sorted(name for name, path in units().items() if declared(path) is None)
    assert undeclared == []


def test_every_declared_name_is_a_package_or_module():
    known = set(sources())
    unknown = sorted(
        f"{unit}: {name}" for unit, path in units().items() for name in declared(path) or set() if name not in known
    )
    assert unknown == []


def test_every_import_is_one_its_package_declares():
    assert violations() == []


def test_only_the_runtime_imports_torchax():
    outside = sorted(
        name for name, path in sources().items() if imports_torchax(path) and not within(name, {"jaxtune.runtime"})
    )
    assert outside == []


def test_errors_import_nothing_of_jaxtune():
    assert import_graph()["jaxtune.errors"] == set()


def test_no_packages_import_each_other():
    assert in_cycles(unit_graph()) == []


def test_no_modules_import_each_other():
    assert in_cycles(import_graph()) == []


def test_a_cycle_would_be_found():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert in_cycles(graph) == ["a", "b", "c"]


def _write(root: Path, files: dict[str, str]) -> Path:
    for relative, text in files.items():
        (root / relative).parent.mkdir(parents=True, exist_ok=True)
        (root / relative).write_text(text)
    return root


@pytest.fixture
def toy(tmp_path: Path) -> Path:
    """A package laid out like jaxtune: low may import errors; high may import low."""
    return _write(
        tmp_path / "jaxtune",
        {
            "__init__.py": '"""Root.\n\nMay import: nothing from jaxtune\n"""\n',
            "errors.py": '"""Errors.\n\nMay import: nothing from jaxtune\n"""\n',
            "low/__init__.py": '"""Low.\n\nMay import: jaxtune.errors\n"""\n',
            "low/a.py": "from jaxtune.errors import X\nfrom jaxtune.low import b\n",
            "low/b.py": "",
            "high/__init__.py": '"""High.\n\nMay import: jaxtune.errors, jaxtune.low\n"""\n',
            "high/c.py": "def f():\n    from jaxtune.low.a import Y\n",
        },
    )


def test_the_toy_package_keeps_its_rules(toy):
    assert violations(toy) == [] and in_cycles(unit_graph(toy)) == []


def test_an_undeclared_import_is_found(toy):
    _write(toy, {"low/b.py": "def g():\n    from jaxtune.high import c\n"})  # inside a function, upward
    assert violations(toy) == ["jaxtune.low.b -> jaxtune.high.c (rules of jaxtune.low)"]
    assert in_cycles(unit_graph(toy)) == ["jaxtune.high", "jaxtune.low"]


def test_a_missing_declaration_is_found(toy):
    _write(toy, {"low/__init__.py": '"""Low, with no rules."""\n'})
    assert violations(toy) == ["jaxtune.low.a -> jaxtune.errors (rules of jaxtune.low)"]
    assert declared(toy / "low" / "__init__.py") is None


def test_torchax_outside_the_runtime_would_be_found(tmp_path):
    path = _write(tmp_path, {"m.py": "def f():\n    import torchax.interop\n"}) / "m.py"
    assert imports_torchax(path)
    assert not imports_torchax(_write(tmp_path, {"n.py": "import torch\n"}) / "n.py")
