"""A user's reward module, written to a folder put on sys.path and forgotten after the test."""

from __future__ import annotations

import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest


@pytest.fixture
def user_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Callable[[str, str], Path]:
    """user_module('pkg.rw', source): writes tmp_path/pkg/rw.py (and pkg/__init__.py), importable
    until the test ends; its name must be new to the test."""
    monkeypatch.syspath_prepend(str(tmp_path))
    written: list[str] = []

    def write(name: str, source: str) -> Path:
        *packages, module = name.split(".")
        folder = tmp_path.joinpath(*packages)
        folder.mkdir(parents=True, exist_ok=True)
        for depth in range(1, len(packages) + 1):
            (tmp_path.joinpath(*packages[:depth]) / "__init__.py").touch()
        path = folder / f"{module}.py"
        path.write_text(textwrap.dedent(source))
        written.extend(".".join(packages[:depth]) for depth in range(1, len(packages) + 1))
        written.append(name)
        return path

    yield write
    for name in written:
        sys.modules.pop(name, None)
