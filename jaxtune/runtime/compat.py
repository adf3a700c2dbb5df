"""torchax 0.0.13 on torch 2.13: tolerate the named-tensor operator overloads torch removed.

torchax builds its op tables at import (and in `default_env()`) by naming overloads such as
`aten.prod.dim_Dimname`; torch 2.13 dropped them, so the lookups raise AttributeError.
While torchax loads, a missing overload resolves to an inert placeholder that no dispatch
ever matches; the original lookup is restored as soon as loading ends.

Delete this module once torchax releases a version that imports on torch >= 2.13.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

from torch._ops import OpOverloadPacket

_lock = threading.Lock()
_env = None
missing_overloads: list[str] = []


class MissingOverload:
    """Stands in for an overload torch no longer has; hashable, so torchax can key tables on it."""

    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return f"<missing overload {self.name}>"


@contextlib.contextmanager
def tolerate_missing_overloads() -> Iterator[list[str]]:
    """Within the block, `torch.ops.aten.X.Y` for a removed overload Y returns a placeholder."""
    original = OpOverloadPacket.__getattr__

    def lookup(packet: OpOverloadPacket, key: str):
        try:
            return original(packet, key)
        except AttributeError:
            if key.startswith("__"):
                raise
            placeholder = MissingOverload(f"{packet}.{key}")
            missing_overloads.append(placeholder.name)
            return placeholder

    OpOverloadPacket.__getattr__ = lookup
    try:
        yield missing_overloads
    finally:
        OpOverloadPacket.__getattr__ = original


def torchax_env():
    """Import torchax and return its default environment, created once under the shim."""
    global _env
    with _lock:
        if _env is None:
            with tolerate_missing_overloads():
                import torchax

                _env = torchax.default_env()
    return _env
