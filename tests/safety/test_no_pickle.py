"""No pickle anywhere in jaxtune: nothing it writes or reads can run code when loaded.

Every .py file of the package is parsed with `ast` and checked for
- an import of a pickling module (pickle, cPickle, cloudpickle, dill, joblib, shelve, marshal),
  also through `__import__` / `importlib.import_module` with a literal name;
- a call of `torch.load` (pickle underneath), `pandas.read_pickle`, or `numpy.load` with
  `allow_pickle` anything but False; names are followed through import aliases
  (`import torch as T; T.load`, `from torch import load`);
- a Prefect `@task(...)` or `@flow(...)` in jaxtune/tasks or jaxtune/flows without
  `result_serializer="json"` or `persist_result=False` (Prefect's default result serializer is pickle);
- a `save_pretrained(...)` passing `safe_serialization` as anything but True (False writes
  pytorch_model.bin, a pickle).

The checks run on snippets first, so a scanner that finds nothing would fail here.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

pytestmark = pytest.mark.safety

PACKAGE = Path(__file__).resolve().parents[2] / "jaxtune"
PICKLING_MODULES = {"pickle", "_pickle", "cPickle", "cloudpickle", "dill", "joblib", "shelve", "marshal"}
PICKLE_CALLS = {
    "torch.load",
    "torch.serialization.load",
    "pandas.read_pickle",
    "pandas.io.pickle.read_pickle",
    "jax.experimental.serialize_executable.deserialize_and_load",
}
# The one module that reads a pickle: JAX's own format for a compiled executable, through an
# unpickler that builds only JAX's classes (tested below). Nothing else may import pickle.
RESTRICTED_READER = "runtime/devices/executable_files.py"
NUMPY_LOADS = {"numpy.load"}


@dataclass(frozen=True)
class Finding:
    where: str
    line: int
    what: str

    def __str__(self) -> str:
        return f"{self.where}:{self.line}: {self.what}"


def _aliases(tree: ast.Module) -> dict[str, str]:
    """{local name: dotted name it stands for} from every import in the module (any scope)."""
    names: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    names[alias.asname] = alias.name
                else:  # `import a.b` binds `a`
                    head = alias.name.split(".")[0]
                    names[head] = head
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for alias in node.names:
                names[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return names


def _dotted(node: ast.AST) -> str | None:
    """'a.b.c' for a Name/Attribute chain, else None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    parts.append(node.id)
    return ".".join(reversed(parts))


def _qualified(node: ast.AST, aliases: dict[str, str]) -> str | None:
    dotted = _dotted(node)
    if dotted is None:
        return None
    head, _, rest = dotted.partition(".")
    base = aliases.get(head, head)
    full = f"{base}.{rest}" if rest else base
    # numpy is `np`, pandas `pd`, by convention even without a visible import (e.g. a doctest-free stub).
    for short, long in (("np", "numpy"), ("pd", "pandas")):
        if full == short or full.startswith(short + "."):
            full = long + full[len(short) :]
    return full


def _keyword(call: ast.Call, name: str) -> ast.keyword | None:
    return next((k for k in call.keywords if k.arg == name), None)


def _is_constant(node: ast.AST, value) -> bool:
    """Whether `node` is the literal `value` (True is not 1, "json" is not a variable holding it)."""
    return isinstance(node, ast.Constant) and type(node.value) is type(value) and node.value == value


def _module_root(name: str) -> str:
    return name.split(".")[0]


def scan_source(source: str, where: str = "<snippet>", task_module: bool = False) -> list[Finding]:
    """Every pickle hazard in `source`; `task_module`: also require json result serializers on @task."""
    tree = ast.parse(source, filename=where)
    aliases = _aliases(tree)
    found: list[Finding] = []

    def flag(node: ast.AST, what: str) -> None:
        found.append(Finding(where, getattr(node, "lineno", 0), what))

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if _module_root(alias.name) in PICKLING_MODULES:
                    flag(node, f"imports {alias.name}")
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            if _module_root(node.module) in PICKLING_MODULES:
                flag(node, f"imports from {node.module}")
            for alias in node.names:
                if f"{node.module}.{alias.name}" in PICKLE_CALLS:
                    flag(node, f"imports {node.module}.{alias.name}")
        elif isinstance(node, ast.Call):
            name = _qualified(node.func, aliases)
            if (
                name in ("__import__", "importlib.import_module")
                and node.args
                and isinstance(node.args[0], ast.Constant)
                and isinstance(node.args[0].value, str)
                and _module_root(node.args[0].value) in PICKLING_MODULES
            ):
                flag(node, f"imports {node.args[0].value} dynamically")
            if name in PICKLE_CALLS:
                flag(node, f"calls {name} (unpickles)")
            if name in NUMPY_LOADS:
                allow = _keyword(node, "allow_pickle")
                if allow is not None and not _is_constant(allow.value, False):
                    flag(node, f"calls {name} with allow_pickle={ast.unparse(allow.value)}")
                if any(k.arg is None for k in node.keywords):
                    flag(node, f"calls {name} with **kwargs (allow_pickle could be among them)")
            if isinstance(node.func, ast.Attribute) and node.func.attr == "save_pretrained":
                safe = _keyword(node, "safe_serialization")
                if safe is not None and not _is_constant(safe.value, True):
                    flag(node, f"calls save_pretrained with safe_serialization={ast.unparse(safe.value)}")
        elif task_module and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for decorator in node.decorator_list:
                target = decorator.func if isinstance(decorator, ast.Call) else decorator
                if _qualified(target, aliases) not in (
                    "prefect.task",
                    "prefect.tasks.task",
                    "prefect.flow",
                    "prefect.flows.flow",
                ):
                    continue
                serializer = _keyword(decorator, "result_serializer") if isinstance(decorator, ast.Call) else None
                persist = _keyword(decorator, "persist_result") if isinstance(decorator, ast.Call) else None
                if persist is not None and _is_constant(persist.value, False):
                    continue  # a result never stored is never serialized
                if serializer is None or not _is_constant(serializer.value, "json"):
                    shown = "none" if serializer is None else ast.unparse(serializer.value)
                    flag(
                        decorator,
                        f"@{target.attr if isinstance(target, ast.Attribute) else target.id} on {node.name} "
                        f'has result_serializer={shown}, not "json", nor persist_result=False '
                        "(Prefect's default serializer is pickle)",
                    )
    return found


def _sources() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


def _is_task_module(path: Path) -> bool:
    return (PACKAGE / "tasks") in path.parents or (PACKAGE / "flows") in path.parents


# -- the scanner itself can fail ----------------------------------------------------------------


@pytest.mark.parametrize(
    "snippet, expected",
    [
        ("import pickle", "imports pickle"),
        ("import cloudpickle as cp", "imports cloudpickle"),
        ("from dill import dumps", "imports from dill"),
        ("import joblib.externals", "imports joblib.externals"),
        ("import shelve, marshal", "imports shelve"),
        ("__import__('pickle')", "imports pickle dynamically"),
        ("import importlib\nimportlib.import_module('cPickle')", "imports cPickle dynamically"),
        ("import torch\nstate = torch.load(f)", "calls torch.load"),
        ("import torch as T\nT.load(f, weights_only=True)", "calls torch.load"),
        ("from torch import load\nload(f)", "imports torch.load"),
        ("from torch import load\nload(f)", "calls torch.load"),
        ("import numpy as np\nnp.load(f, allow_pickle=True)", "allow_pickle=True"),
        ("import numpy\nflag = True\nnumpy.load(f, allow_pickle=flag)", "allow_pickle=flag"),
        ("import pandas as pd\npd.read_pickle(f)", "calls pandas.read_pickle"),
        ("model.save_pretrained(out, safe_serialization=False)", "safe_serialization=False"),
        (
            "from jax.experimental import serialize_executable as s\ns.deserialize_and_load(b, i, o)",
            "calls jax.experimental.serialize_executable.deserialize_and_load",
        ),
    ],
)
def test_the_scanner_flags_a_pickle_hazard(snippet, expected):
    findings = scan_source(snippet)
    assert any(expected in f.what for f in findings), f"{snippet!r} gave {[str(f) for f in findings]}"


@pytest.mark.parametrize(
    "decorator",
    [
        "@task",
        "@task(name='x')",
        "@task(name='x', result_serializer='pickle')",
        "@prefect.task(result_serializer=SERIALIZER)",
        "@prefect.flow(name='x')",
        "@task(persist_result=True)",
    ],
)
def test_the_scanner_flags_a_task_without_a_json_serializer(decorator):
    source = f"import prefect\nfrom prefect import task\n{decorator}\ndef stage(section):\n    return section\n"
    [finding] = scan_source(source, task_module=True)
    assert finding.line == 3 and "result_serializer" in finding.what


@pytest.mark.parametrize(
    "snippet",
    [
        "import numpy as np\nnp.load(f)",
        "import numpy as np\nnp.load(f, allow_pickle=False)",
        "model.save_pretrained(out)",
        "model.save_pretrained(out, safe_serialization=True)",
        "from safetensors.numpy import load_file\nload_file(f)",
        "import json\njson.load(f)",
        "from prefect import task\n@task(name='x', result_serializer='json')\ndef stage(section):\n    return section\n",
        "from prefect import flow\n@flow(name='x', persist_result=False)\ndef run(section):\n    return section\n",
    ],
)
def test_the_scanner_passes_safe_code(snippet):
    assert scan_source(snippet, task_module=True) == []


# -- the package ---------------------------------------------------------------------------------


def test_the_scan_covers_the_package():
    files = _sources()
    names = {p.relative_to(PACKAGE).as_posix() for p in files}
    assert {"cli/main.py", "artifacts/store.py", "tasks/train.py", "runtime/train/checkpoint.py"} <= names
    assert sum(_is_task_module(p) for p in files) >= 10


def test_no_module_of_jaxtune_pickles():
    findings = [
        f
        for path in _sources()
        for f in scan_source(path.read_text(encoding="utf-8"), str(path.relative_to(PACKAGE.parent)))
        if not (path.relative_to(PACKAGE).as_posix() == RESTRICTED_READER and f.what == "imports pickle")
    ]
    assert not findings, "pickle hazards:\n" + "\n".join(map(str, findings))


def test_the_one_pickle_reader_restricts_what_it_builds():
    """executable_files imports pickle only to subclass JAX's executable unpickler with a find_class
    that refuses all but JAX's classes: a planted file naming os.system, a dotted path into a jax
    module, a builtin or a numpy function is refused before anything is called."""
    import io
    import pickle

    import jax
    import jax.numpy as jnp

    from jaxtune.runtime.devices import executable_files

    tree = ast.parse((PACKAGE / RESTRICTED_READER).read_text(encoding="utf-8"))
    unpicklers = [node for node in ast.walk(tree) if isinstance(node, ast.ClassDef) and "Unpickler" in node.name]
    assert unpicklers and all(
        any(isinstance(item, ast.FunctionDef) and item.name == "find_class" for item in node.body)
        for node in unpicklers
    )
    assert not [
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.Attribute)
        and n.attr in ("loads", "load")
        and isinstance(n.value, ast.Name)
        and n.value.id == "pickle"
    ]

    backend = jax.devices()[0].client

    class Planted:
        def __init__(self, call, *args):
            self.call, self.args = call, args

        def __reduce__(self):
            return self.call, self.args

    import os

    for planted in (
        Planted(os.system, "echo planted"),
        Planted(eval, "1"),
        Planted(jax._src.config.os.getcwd),
        Planted(jnp.zeros, 3),
    ):
        data = pickle.dumps(planted, protocol=4)
        with pytest.raises(pickle.UnpicklingError, match="may not name"):
            executable_files.RestrictedUnpickler(io.BytesIO(data), backend).load()
    dotted = (
        b"\x80\x04\x95\x00\x00\x00\x00\x00\x00\x00\x00\x8c\x0fjax._src.config\x94\x8c\tos.getcwd\x94\x93\x94)R\x94."
    )
    with pytest.raises(pickle.UnpicklingError, match="may not name"):
        executable_files.RestrictedUnpickler(io.BytesIO(dotted), backend).load()

    # What JAX itself writes reads back and runs, bfloat16 (an ml_dtypes type in its description) included.
    weights = {"w": jnp.ones((3, 4), jnp.bfloat16)}
    compiled = jax.jit(lambda x, d: ({"a": x * 2}, d["w"] @ x)).lower(jnp.ones(4, jnp.bfloat16), weights).compile()
    data, trees = executable_files.dump(compiled)
    loaded = executable_files.load(data, trees)
    out, product = loaded(jnp.arange(4.0, dtype=jnp.bfloat16), weights)
    assert out["a"].tolist() == [0.0, 2.0, 4.0, 6.0] and product.tolist() == [6.0, 6.0, 6.0]
    assert product.dtype == jnp.bfloat16


def test_every_prefect_task_serializes_its_result_as_json():
    tasks = [path for path in _sources() if _is_task_module(path)]
    findings = [
        f
        for path in tasks
        for f in scan_source(path.read_text(encoding="utf-8"), str(path.relative_to(PACKAGE.parent)), task_module=True)
        if "result_serializer" in f.what
    ]
    assert not findings, "\n".join(map(str, findings))
    # The check is not vacuous: the stages' tasks are there and were looked at.
    decorated = sum(source.count("@task(") for source in (p.read_text(encoding="utf-8") for p in tasks))
    assert decorated >= 9
