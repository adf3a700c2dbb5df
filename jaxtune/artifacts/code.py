"""What a stage's code is: a digest of the jaxtune source it runs and of the library versions
that do its math, so an edit or an upgrade recomputes exactly the stages it could change.

A stage runs its task module and every jaxtune module that module imports, at any depth and
wherever the import stands (the runtime is imported inside functions, so torchax loads only
where it is used). Sources are compared as syntax trees without docstrings: a comment, a
docstring or a reflowed line keeps the digest; a changed expression does not.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import json
from importlib import metadata
from pathlib import Path

PACKAGE = "jaxtune"
PACKAGE_ROOT = Path(__file__).resolve().parents[1]
# The libraries whose versions change what a stage computes: model code, tracing, compiling,
# optimizers, adapters and tokenizers. pydantic, Prefect and the like only move data around.
LIBRARIES = ("torch", "torchax", "jax", "jaxlib", "transformers", "peft", "optax", "tokenizers")
DIGEST_LENGTH = 20


def module_file(module: str, root: Path = PACKAGE_ROOT) -> Path | None:
    """The source file of `module` ('jaxtune.runtime.compiled.steps') below the package folder `root`."""
    parts = module.split(".")
    if parts[0] != PACKAGE:
        return None
    base = root.joinpath(*parts[1:])
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _package_of(module: str, path: Path) -> str:
    return module if path.name == "__init__.py" else module.rpartition(".")[0]


def imported_modules(module: str, tree: ast.Module, path: Path, root: Path = PACKAGE_ROOT) -> set[str]:
    """The jaxtune modules that `tree` (the source of `module`) imports anywhere in its body."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = _package_of(module, path).split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            found.add(base)
            # `from jaxtune.runtime.compiled import steps` imports the module steps, not just a name.
            found.update(f"{base}.{alias.name}" for alias in node.names if module_file(f"{base}.{alias.name}", root))
    return {name for name in found if module_file(name, root) is not None}


def _without_docstrings(tree: ast.Module) -> ast.Module:
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if (
                body
                and isinstance(body[0], ast.Expr)
                and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)
            ):
                node.body = body[1:] or [ast.Pass()]
    return tree


def source_digest(tree: ast.Module) -> str:
    """sha256 of a module's syntax tree, docstrings removed (comments and layout never reach the tree)."""
    return hashlib.sha256(ast.dump(_without_docstrings(tree)).encode("utf-8")).hexdigest()


def _parse(path: Path, source: str | None = None, attempts: int = 3) -> ast.Module:
    """`ast.parse` of a source file, again if CPython 3.11 raises its spurious "AST constructor
    recursion depth mismatch" (python/cpython#106905): its AST builder keeps the depth in shared
    state, so another thread building an AST at the same moment (Prefect's, during a flow run)
    can trip the check. The source is unchanged, so a second parse gives the true tree."""
    source = path.read_text(encoding="utf-8") if source is None else source
    for attempt in range(attempts):
        try:
            return ast.parse(source, filename=str(path))
        except SystemError as e:
            if "recursion depth mismatch" not in str(e) or attempt == attempts - 1:
                raise
    raise AssertionError("unreachable")


def module_digests(module: str, root: Path = PACKAGE_ROOT) -> dict[str, str]:
    """{name: source digest} for `module`, every jaxtune module it imports transitively, and their packages."""
    digests: dict[str, str] = {}
    pending = [module]
    while pending:
        name = pending.pop()
        if name in digests:
            continue
        path = module_file(name, root)
        if path is None:
            raise ModuleNotFoundError(f"no source for {name} below {root}")
        digest, imports = _read_module(name, path, root, path.read_text(encoding="utf-8"))
        parents = [".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)]  # their __init__ runs first
        pending += [*imports, *parents]
        digests[name] = digest
    return dict(sorted(digests.items()))


@functools.lru_cache(maxsize=1024)
def _read_module(name: str, path: Path, root: Path, source: str) -> tuple[str, frozenset[str]]:
    """(source digest, jaxtune modules imported) of one module's `source`. Each stage module's
    digest walks the same few dozen files, and parsing them is most of its time (13 stages: 262
    parses, 0.9 s of a run's process, before this cache); keyed by the source itself, an edited
    file is read afresh."""
    tree = _parse(path, source)
    return source_digest(tree), frozenset(imported_modules(name, tree, path, root))


def library_versions(names: tuple[str, ...] = LIBRARIES) -> dict[str, str]:
    versions = {}
    for name in names:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = "absent"
    return versions


def code_digest(modules: dict[str, str], libraries: dict[str, str]) -> str:
    payload = json.dumps({"modules": modules, "libraries": libraries}, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(payload.encode("utf-8")).hexdigest()[:DIGEST_LENGTH]


@functools.cache
def code_identity(module: str) -> dict:
    """{"digest", "modules", "libraries"} of the code a stage in `module` runs. Read once per
    process: a long-lived worker keeps keying by the code it first saw, which is the code it runs."""
    modules = module_digests(module)
    libraries = library_versions()
    return {"digest": code_digest(modules, libraries), "modules": modules, "libraries": libraries}
