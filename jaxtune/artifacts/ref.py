"""`ArtifactRef`: the small, JSON-serializable handle that stages pass to each other."""

from __future__ import annotations

import json
from pathlib import Path, PurePosixPath
from typing import Any

from pydantic import BaseModel, ConfigDict


class ArtifactRef(BaseModel):
    """Points at one verified artifact folder; carries no tensors, so Prefect can persist it as JSON."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    stage: str
    key: str
    path: str

    @property
    def folder(self) -> Path:
        return Path(self.path)

    def file(self, name: str) -> Path:
        """Path of file `name` (relative, posix) inside the artifact folder."""
        relative = PurePosixPath(name)
        if relative.is_absolute() or ".." in relative.parts or not relative.parts:
            raise ValueError(f"{name!r} is not a relative path inside artifact {self.stage}/{self.key}")
        return self.folder.joinpath(*relative.parts)

    def read_json(self, name: str) -> Any:
        """Parse JSON file `name` from the artifact folder."""
        return json.loads(self.file(name).read_text(encoding="utf-8"))
