"""Cache keys and content digests: what makes two artifacts the same."""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

from pydantic import BaseModel

KEY_LENGTH = 20
CHUNK_BYTES = 1 << 20


def _json_default(value: Any) -> Any:
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json")
    if isinstance(value, Mapping):
        return dict(value)
    raise TypeError(f"{type(value).__name__} is not allowed in a cache key: {value!r}")


def plain_config(config: Mapping[str, Any] | BaseModel | None) -> Any:
    """The JSON form of a config section, as stored in manifests and hashed into keys."""
    if config is None:
        return None
    if isinstance(config, BaseModel):
        return config.model_dump(mode="json")
    if isinstance(config, Mapping):
        return json.loads(canonical_json(config))
    raise TypeError(f"config must be a mapping, a pydantic model or None, not {type(config).__name__}")


def canonical_json(value: Any) -> str:
    """One fixed text per value: sorted keys, no whitespace, so equal values hash equally."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True, default=_json_default)


def artifact_key(
    stage: str,
    code: str,
    config: Mapping[str, Any] | BaseModel | None,
    inputs: Mapping[str, str],
) -> str:
    """Key of a stage output: sha256 of the stage, the digest of its code, its config section and its input keys."""
    payload = {
        "stage": stage,
        "code": code,
        "config": plain_config(config),
        "inputs": {str(name): str(key) for name, key in inputs.items()},
    }
    return hashlib.sha256(canonical_json(payload).encode("utf-8")).hexdigest()[:KEY_LENGTH]


# Digests of large files this process has read, by what stat says of the file when it was read.
# A run verifies the same weights once for every stage that takes them as input (a 1 GB model:
# about a second each time); a file rewritten since, in place or anew, has another modification
# and change time (or inode, or size), and is read again. Small files are always read, and so is
# a file changed in the last seconds: the kernel's clock for file times moves in steps of a few
# milliseconds, so a write just after a read could leave the times as they were (git's "racy
# clean" entries, handled the same way).
_REMEMBERED_FROM_BYTES = 1 << 24
_SETTLED_AFTER_NS = 2_000_000_000
_DIGESTS: dict[tuple[int, ...], str] = {}


def file_digest(path: str | Path) -> str:
    """sha256 hex of a file's bytes, read in 1 MiB chunks so large weights never sit in memory."""
    with open(path, "rb") as handle:
        stat = os.fstat(handle.fileno())
        identity = (stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns)
        settled = time.time_ns() - max(stat.st_mtime_ns, stat.st_ctime_ns) > _SETTLED_AFTER_NS
        remembered = stat.st_size >= _REMEMBERED_FROM_BYTES and settled
        if remembered and identity in _DIGESTS:
            return _DIGESTS[identity]
        digest = hashlib.sha256()
        while chunk := handle.read(CHUNK_BYTES):
            digest.update(chunk)
    if remembered:
        _DIGESTS[identity] = digest.hexdigest()
    return digest.hexdigest()


def tree_files(folder: str | Path, exclude: Collection[str] = frozenset()) -> list[str]:
    """Sorted relative posix paths of the files under `folder`, skipping any path with a part in `exclude`."""
    root = Path(folder)
    if not root.is_dir():
        raise NotADirectoryError(f"{root} is not a directory")
    found = []
    for current, dirs, files in os.walk(root):
        dirs[:] = [name for name in dirs if name not in exclude]
        for name in files:
            path = Path(current, name)
            if name not in exclude and path.is_file():
                found.append(path.relative_to(root).as_posix())
    return sorted(found)


def tree_digest(folder: str | Path, exclude: Collection[str] = frozenset()) -> str:
    """sha256 over the sorted relative paths and contents of a folder; mtimes and permissions do not count."""
    root = Path(folder)
    digest = hashlib.sha256()
    for relative in tree_files(root, exclude):
        digest.update(f"{relative}\0{file_digest(root / relative)}\n".encode("utf-8"))
    return digest.hexdigest()
