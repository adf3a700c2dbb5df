"""A compiled JAX executable to bytes and back, reading nothing but JAX's own objects.

JAX serialises a compiled executable (`jax.experimental.serialize_executable`) as XLA's own bytes
for the machine code, wrapped in a pickle of JAX's description of it (shardings, avals, layouts).
Its `deserialize_and_load` unpickles with no restriction, so a planted file could run any Python.
This module reads the same bytes with an unpickler that builds only classes of jax, jaxlib, NumPy
and ml_dtypes (bfloat16), and JAX's own `_unpickle_*` helpers: no other module, no dotted path
through a module's attributes (`jax._src.config.os.system`), no builtins. The argument and result
trees are written as JSON of their node types and keys, never pickled.

Loading an executable still runs its machine code when it is called: like JAX's persistent cache,
the folder it comes from is the user's own (`executables` keeps it beside that cache).
"""

from __future__ import annotations

import importlib
import io
import pickle  # JAX's executable format; read only through RestrictedUnpickler below
from collections.abc import Sequence

import jax
from jax.experimental import serialize_executable
from jax.tree_util import default_registry

ROOTS = ("jax", "jaxlib", "numpy", "ml_dtypes")  # all a kept executable's description may name
NUMPY_BUILDERS = {
    ("numpy", "dtype"),
    ("numpy", "ndarray"),
    ("numpy._core.multiarray", "_reconstruct"),
    ("numpy.core.multiarray", "_reconstruct"),
    ("numpy._core.multiarray", "scalar"),
    ("numpy.core.multiarray", "scalar"),
    ("numpy._core.numeric", "_frombuffer"),
    ("numpy.core.numeric", "_frombuffer"),
}


class RefusedClass(pickle.UnpicklingError):
    """A kept executable named something outside what JAX writes."""


class RestrictedUnpickler(serialize_executable._JaxPjrtUnpickler):
    """JAX's executable unpickler (devices and XLA bytes by persistent id) that builds only JAX's objects."""

    def find_class(self, module: str, name: str):
        if module.split(".")[0] not in ROOTS or "." in name or name.startswith("__"):
            raise RefusedClass(f"a kept executable may not name {module}.{name}")
        value = getattr(importlib.import_module(module), name, None)
        if (module, name) in NUMPY_BUILDERS or isinstance(value, type) and not module.startswith("numpy"):
            return value
        if callable(value) and name.startswith("_unpickle") and module.startswith("jax"):
            return value
        raise RefusedClass(f"a kept executable may not name {module}.{name} (not a class of jax or jaxlib)")


def dump(compiled) -> tuple[bytes, dict]:
    """(JAX's bytes for `compiled`, its argument and result trees as JSON-ready data)."""
    data, in_tree, out_tree = serialize_executable.serialize(compiled)
    return data, {"in": tree_to_json(in_tree), "out": tree_to_json(out_tree)}


def load(data: bytes, trees: dict, devices: Sequence | None = None) -> jax.stages.Compiled:
    """The executable `dump` wrote, loaded onto `devices` (default: the default backend's)."""
    backend = jax.devices()[0].client
    execution_devices = list(devices) if devices is not None else backend.devices()
    unloaded, args_info_flat, no_kwargs = RestrictedUnpickler(io.BytesIO(data), backend, execution_devices).load()
    in_tree, out_tree = tree_from_json(trees["in"]), tree_from_json(trees["out"])
    return jax.stages.Compiled(unloaded.load(), [], in_tree.unflatten(args_info_flat), out_tree, no_kwargs=no_kwargs)


# -- trees as JSON -------------------------------------------------------------------------------------


def tree_to_json(tree) -> dict:
    """{"type", "data", "children"} of a tree's nodes; a leaf is {"type": "*"}. A node that is not a builtin
    container or a namedtuple (a custom node, whose aux data JSON cannot hold) raises ValueError: such a
    program is not kept."""
    if tree.num_nodes == 1 and tree.num_leaves == 1:
        return {"type": "*"}
    kind, data = tree.node_data()
    _node_type(f"{kind.__module__}:{kind.__qualname__}")  # a tree that cannot be read back is refused here
    return {
        "type": f"{kind.__module__}:{kind.__qualname__}",
        "data": _data_to_json(kind, data),
        "children": [tree_to_json(child) for child in tree.children()],
    }


def tree_from_json(node: dict):
    if node["type"] == "*":
        return jax.tree.structure(0)
    kind = _node_type(node["type"])
    children = [tree_from_json(child) for child in node["children"]]
    return jax.tree_util.PyTreeDef.from_node_data_and_children(
        default_registry, (kind, _data_from_json(node["data"])), children
    )


def _data_to_json(kind: type, data):
    if data is None:
        return None
    if isinstance(data, (list, tuple)) and all(isinstance(item, (str, int)) for item in data):
        return {"items": [[type(item).__name__, item] for item in data]}
    raise ValueError(f"the tree node {kind.__qualname__} carries data JSON cannot hold: {data!r}")


def _data_from_json(data):
    if data is None:
        return None
    return tuple(int(value) if name == "int" else str(value) for name, value in data["items"])


def _node_type(name: str) -> type:
    """A node's type by name: a builtin container or a namedtuple class, looked up but never called."""
    module, _, qualname = name.partition(":")
    value = importlib.import_module(module)
    for part in qualname.split("."):
        value = getattr(value, part)
    if value in (tuple, list, dict, type(None)) or (
        isinstance(value, type) and issubclass(value, tuple) and hasattr(value, "_fields")
    ):
        return value
    raise ValueError(f"{name} is not a builtin container or a namedtuple")
