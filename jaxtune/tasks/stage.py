"""What every stage shares: its cache key and writing its artifact exactly once."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from jaxtune.artifacts import ArtifactRef, ArtifactStore, artifact_key


def input_keys(inputs: Mapping[str, ArtifactRef | None]) -> dict[str, str]:
    """Absent optional inputs (e.g. no trained weights for a baseline) still change the key."""
    return {name: (ref.key if ref is not None else "none") for name, ref in inputs.items()}


def stage_key(stage: str, version: str, section: BaseModel | Mapping[str, Any], inputs: Mapping[str, ArtifactRef | None]) -> str:
    return artifact_key(stage, version, section, input_keys(inputs))


def build_artifact(
    store_root: str | Path,
    stage: str,
    version: str,
    section: BaseModel | Mapping[str, Any],
    inputs: Mapping[str, ArtifactRef | None],
    build: Callable[[Path], None],
) -> ArtifactRef:
    """Return the verified artifact for these arguments, calling `build(folder)` only if it is missing.

    `build` writes into a temporary folder that becomes the artifact only when it returns.
    """
    store = ArtifactStore(store_root)
    key = stage_key(stage, version, section, inputs)
    if not store.verify(stage, key):
        with store.writing(stage, key, inputs=input_keys(inputs), config=section, code_version=version) as folder:
            build(folder)
    return store.ref(stage, key)
