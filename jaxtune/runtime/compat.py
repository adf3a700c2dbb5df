"""torchax 0.0.13 on torch 2.13 and later: tolerate the operators and overloads torch removed.

torchax builds its op tables at import (and in `default_env()`) by naming overloads such as
`aten.prod.dim_Dimname`, which torch 2.13 dropped (22 of them), and operators such as
`aten.cholesky`, which torch 2.14 dropped, so the lookups raise AttributeError. While torchax
loads, a missing overload (or any overload of a missing operator) resolves to an inert
placeholder that no dispatch ever matches; the original lookups are restored as soon as
loading ends. On torch 2.11 and 2.12 nothing is missing.

Delete this module once torchax releases a version that imports on torch >= 2.13.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

from torch._ops import OpOverloadPacket, _OpNamespace

_lock = threading.Lock()
_env = None
missing_overloads: list[str] = []


class MissingOverload:
    """Stands in for an overload torch no longer has; hashable, so torchax can key tables on it."""

    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return f"<missing overload {self.name}>"


class MissingOperator:
    """Stands in for an operator torch no longer has: each of its overloads is a `MissingOverload`."""

    def __init__(self, name: str):
        self.name = name

    def __getattr__(self, key: str) -> MissingOverload:
        if key.startswith("__"):
            raise AttributeError(key)
        return _missing_overload(f"{self.name}.{key}")


def _missing_overload(name: str) -> MissingOverload:
    missing_overloads.append(name)
    return MissingOverload(name)


def _or_placeholder(lookup, placeholder):
    """`lookup`, returning `placeholder(owner, key)` where it raises AttributeError (but for dunders)."""

    def tolerant(owner, key: str):
        try:
            return lookup(owner, key)
        except AttributeError:
            if key.startswith("__"):
                raise
            return placeholder(owner, key)

    return tolerant


@contextlib.contextmanager
def tolerate_missing_overloads() -> Iterator[list[str]]:
    """Within the block, `torch.ops.aten.X.Y` for a removed overload Y, or a removed operator X,
    returns a placeholder."""
    original_overload, original_operator = OpOverloadPacket.__getattr__, _OpNamespace.__getattr__
    OpOverloadPacket.__getattr__ = _or_placeholder(
        original_overload, lambda packet, key: _missing_overload(f"{packet}.{key}")
    )
    _OpNamespace.__getattr__ = _or_placeholder(
        original_operator, lambda namespace, key: MissingOperator(f"{namespace.name.removeprefix('torch.ops.')}.{key}")
    )
    try:
        yield missing_overloads
    finally:
        OpOverloadPacket.__getattr__, _OpNamespace.__getattr__ = original_overload, original_operator


def torchax_env():
    """Import torchax and return its default environment, created once under the shim."""
    global _env
    with _lock:
        if _env is None:
            with tolerate_missing_overloads():
                import torchax

                _env = torchax.default_env()
    return _env
