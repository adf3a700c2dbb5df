"""Environment variables set for the length of a block, then put back as they were."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping


@contextlib.contextmanager
def temporary_environment(values: Mapping[str, str]) -> Iterator[None]:
    """`values` in os.environ inside the block; after it each of those variables as it was (unset if
    it was unset), the rest of the environment untouched."""
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
