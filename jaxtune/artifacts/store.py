"""`ArtifactStore`: content-addressed stage outputs under `root/<stage>/<key>/`, each with a manifest."""

from __future__ import annotations

import errno
import json
import os
import re
import secrets
import shutil
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path, PurePosixPath
from typing import Any

from pydantic import BaseModel

from jaxtune.errors import ArtifactMissing

from .keys import file_digest, plain_config, tree_files
from .ref import ArtifactRef

MANIFEST = "manifest.json"
TEMP_PREFIX = ".tmp-"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")


def _check_name(kind: str, value: str) -> str:
    # Names become folder names; a leading dot or a slash could collide with temp folders or escape the root.
    if not isinstance(value, str) or not _NAME.fullmatch(value):
        raise ValueError(f"invalid artifact {kind} {value!r}: use letters, digits, '_', '.', '-'")
    return value


def _temp_name(key: str) -> str:
    return f"{TEMP_PREFIX}{key}-{os.getpid()}-{secrets.token_hex(4)}"


def _temp_owner(name: str) -> int | None:
    """Pid encoded in a temp folder name (`.tmp-<key>-<pid>-<random>`), or None if it has none."""
    parts = name.rsplit("-", 2)
    if len(parts) != 3 or not parts[1].isdigit():
        return None
    return int(parts[1])


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _fsync_dir(folder: Path) -> None:
    # Makes a rename durable; not every platform can open a directory, and then there is nothing to do.
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _write_json_synced(path: Path, value: Any) -> None:
    with open(path, "w", encoding="utf-8") as handle:
        handle.write(json.dumps(value, indent=2, sort_keys=True) + "\n")
        handle.flush()
        # The manifest must be on disk before the rename publishes the folder as complete.
        os.fsync(handle.fileno())


def _outside(path: Path, folder: Path) -> bool:
    """Whether `path`, its symlinks followed, lies outside `folder` (its symlinks followed too).
    A symlink loop counts as outside: it leads nowhere inside."""
    try:
        return not path.resolve().is_relative_to(folder.resolve())
    except (OSError, RuntimeError):  # RuntimeError: Python 3.11's "Symlink loop"
        return True


def _refuse_links_out(folder: Path, what: str) -> None:
    """Raise ValueError naming the first symlink under `folder` that leads out of it, or that
    names its target by an absolute path (the target would move away when the folder is renamed)."""
    for current, dirs, files in os.walk(folder):
        for name in sorted([*dirs, *files]):
            path = Path(current, name)
            if not path.is_symlink():
                continue
            relative = path.relative_to(folder).as_posix()
            target = os.readlink(path)
            if _outside(path, folder):
                raise ValueError(
                    f"{what}: {relative} is a symlink out of the artifact folder (to {target}); "
                    "an artifact must hold its files, not point at others"
                )
            if os.path.isabs(target):
                raise ValueError(
                    f"{what}: {relative} is a symlink by absolute path ({target}); "
                    "use a relative link inside the artifact folder, or a copy"
                )


def _file_problem(folder: Path, name: Any, entry: Any) -> str | None:
    """Why a manifest file entry does not match the folder, or None when it does."""
    relative = PurePosixPath(str(name))
    if relative.is_absolute() or ".." in relative.parts or not isinstance(entry, dict):
        return f"manifest entry {name!r} is malformed"
    path = folder.joinpath(*relative.parts)
    if _outside(path, folder):
        # A listed file swapped for a symlink out of the folder would verify against whatever it
        # points at; the artifact is only what lies inside its folder.
        return f"listed file {name} is a link out of the artifact folder, or a symlink loop"
    if not path.is_file():
        return f"listed file {name} is missing"
    if path.stat().st_size != entry.get("bytes"):
        return f"listed file {name} has the wrong size"
    if file_digest(path) != entry.get("sha256"):
        return f"listed file {name} has the wrong sha256"
    return None


class ArtifactStore:
    """Reads, verifies and atomically writes artifact folders below one root directory."""

    def __init__(self, root: str | Path):
        self.root = Path(root).expanduser().resolve()
        # A root (or a folder above it) that is a file would fail later, in the middle of a
        # stage, naming some path below it; say so now, naming the file.
        for folder in (self.root, *self.root.parents):
            if folder.exists():
                if not folder.is_dir():
                    where = "" if folder == self.root else f" (so store root {self.root} cannot be one)"
                    raise NotADirectoryError(
                        errno.ENOTDIR, f"the artifact store needs a folder, not a file{where}", str(folder)
                    )
                break

    def __repr__(self) -> str:
        return f"ArtifactStore({str(self.root)!r})"

    def folder(self, stage: str, key: str) -> Path:
        """Where the artifact of `stage` with `key` lives (whether or not it exists)."""
        return self.root / _check_name("stage", stage) / _check_name("key", key)

    def scratch(self, stage: str, key: str) -> Path:
        """A folder that outlives a crashed run of `stage` with `key` (its checkpoints), kept apart
        from the artifacts; the stage removes it once its artifact is complete."""
        return self.root / ".scratch" / _check_name("stage", stage) / _check_name("key", key)

    def manifest(self, stage: str, key: str) -> dict[str, Any]:
        """The parsed manifest of an artifact, without checking its files."""
        path = self.folder(stage, key) / MANIFEST
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise ArtifactMissing(errno.ENOENT, f"no manifest for artifact {stage}/{key}", str(path)) from None
        manifest = json.loads(text)
        if not isinstance(manifest, dict):
            raise ValueError(f"{path}: manifest is not a JSON object")
        return manifest

    def problem(self, stage: str, key: str) -> str | None:
        """Why the artifact is not complete and intact, or None when it is."""
        folder = self.folder(stage, key)
        try:
            manifest = self.manifest(stage, key)
        except ArtifactMissing:
            return f"{MANIFEST} is missing"
        except (OSError, ValueError) as error:
            return f"{MANIFEST} is unreadable ({error})"
        if manifest.get("stage") != stage or manifest.get("key") != key:
            return f"{MANIFEST} names {manifest.get('stage')!r}/{manifest.get('key')!r}"
        if _outside(folder / MANIFEST, folder):
            return f"{MANIFEST} is a link out of the artifact folder"
        files = manifest.get("files")
        if not isinstance(files, dict):
            return f"{MANIFEST} has no file list"
        for name, entry in sorted(files.items()):
            try:
                reason = _file_problem(folder, name, entry)
            except OSError as error:
                reason = f"listed file {name} is unreadable ({error})"
            if reason is not None:
                return reason
        return None

    def verify(self, stage: str, key: str) -> bool:
        """True when the manifest matches this stage/key and every listed file has its size and sha256."""
        return self.problem(stage, key) is None

    def ref(self, stage: str, key: str) -> ArtifactRef:
        """A ref to a verified artifact; raises ArtifactMissing (naming the folder) otherwise."""
        reason = self.problem(stage, key)
        folder = self.folder(stage, key)
        if reason is not None:
            raise ArtifactMissing(errno.ENOENT, f"no verified artifact {stage}/{key}: {reason}", str(folder))
        return ArtifactRef(stage=stage, key=key, path=str(folder))

    @contextmanager
    def writing(
        self,
        stage: str,
        key: str,
        *,
        inputs: Mapping[str, str],
        config: Mapping[str, Any] | BaseModel | None,
        code: Mapping[str, Any],
    ) -> Iterator[Path]:
        """Yield an empty temp folder to fill; on clean exit publish it as `stage/key`, on error delete it."""
        target = self.folder(stage, key)
        target.parent.mkdir(parents=True, exist_ok=True)
        self._clean_dead_temps(target.parent, key)
        temp = target.parent / _temp_name(key)
        temp.mkdir()
        try:
            yield temp
            manifest = self._build_manifest(temp, stage, key, inputs, config, code)
            _write_json_synced(temp / MANIFEST, manifest)
            self._publish(temp, target, stage, key)
        except BaseException:
            shutil.rmtree(temp, ignore_errors=True)
            raise

    def _build_manifest(
        self,
        temp: Path,
        stage: str,
        key: str,
        inputs: Mapping[str, str],
        config: Mapping[str, Any] | BaseModel | None,
        code: Mapping[str, Any],
    ) -> dict[str, Any]:
        """Describe what the writer left in `temp`: every file with its sha256 and size."""
        _refuse_links_out(temp, f"{stage}/{key}")
        names = tree_files(temp)
        if MANIFEST in names:
            raise ValueError(f"{stage}/{key}: {MANIFEST} is reserved for the store")
        files = {name: {"sha256": file_digest(temp / name), "bytes": (temp / name).stat().st_size} for name in names}
        return {
            "stage": stage,
            "key": key,
            "inputs": {str(name): str(value) for name, value in inputs.items()},
            "config": plain_config(config),
            "code": dict(code),
            "created_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "files": files,
        }

    def _publish(self, temp: Path, target: Path, stage: str, key: str) -> None:
        """Move a finished temp folder to `target`, replacing any folder already there."""
        # A directory rename is atomic but cannot overwrite a non-empty directory, so the old
        # folder is first renamed aside (under a temp name clean_temp recognises) and deleted last.
        aside = None
        if target.exists():
            aside = target.parent / _temp_name(key)
            os.rename(target, aside)
        try:
            os.rename(temp, target)
        except OSError as error:
            # Another writer published the same key first; equal keys mean equal content, so keep theirs.
            if error.errno in (errno.EEXIST, errno.ENOTEMPTY) and self.verify(stage, key):
                shutil.rmtree(temp, ignore_errors=True)
            else:
                if aside is not None and not target.exists():
                    os.rename(aside, target)
                raise
        _fsync_dir(target.parent)
        if aside is not None:
            shutil.rmtree(aside, ignore_errors=True)

    def remove(self, stage: str, key: str) -> bool:
        """Delete an artifact folder; returns whether there was one."""
        target = self.folder(stage, key)
        if not target.exists():
            return False
        # Renamed away first so a half-deleted folder is never seen under the real key.
        aside = target.parent / _temp_name(key)
        os.rename(target, aside)
        shutil.rmtree(aside, ignore_errors=True)
        return True

    @staticmethod
    def _clean_dead_temps(folder: Path, key: str) -> None:
        """Remove the temp folders of `key` whose writers are dead (a killed run's half-built
        artifact, up to its whole size). The caller writes `key` under the stage's lock, so no
        other live writer of it can be mid-write; one whose pid is alive is kept all the same."""
        for temp in folder.glob(f"{TEMP_PREFIX}{key}-*"):
            owner = _temp_owner(temp.name)
            if temp.is_dir() and owner is not None and not _pid_alive(owner):
                shutil.rmtree(temp, ignore_errors=True)

    def clean_temp(self, *, include_live: bool = False) -> list[Path]:
        """Delete leftover temp folders of dead writers (or all of them with include_live); returns them."""
        removed = []
        for temp in sorted(self.root.glob(f"*/{TEMP_PREFIX}*")):
            if not temp.is_dir():
                continue
            owner = _temp_owner(temp.name)
            if not include_live and owner is not None and _pid_alive(owner):
                continue
            shutil.rmtree(temp, ignore_errors=True)
            removed.append(temp)
        return removed
