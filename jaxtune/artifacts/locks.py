"""`StoreLocks`: one lock per artifact, held while a stage builds it, released by the kernel if
its holder dies.

Two runs of one config (a nightly and a manual one) reach the same stage with the same key.
Prefect's transactions serialise them when the stage's cache policy asks for SERIALIZABLE
isolation and names a lock manager: the first run takes the lock and builds, the second waits,
then finds the committed result record and reports the stage Cached. This is that lock manager.

Prefect's own `FileSystemLockManager` marks a lock by a file's existence and, given no hold
timeout (the transactions give none), never expires it: a run killed while training (OOM,
preemption, Ctrl-C twice) would leave every later run of that stage waiting forever. These locks
are `flock`s on files under `<store>/.locks/`, which the kernel releases when the holding process
exits however it exits. They serialise processes on one machine or on a shared filesystem with
working `flock` (local disks; not every NFS); runs on separate machines with separate stores
need no lock, and runs on separate machines sharing one store need a networked lock manager
(prefect-redis's `RedisLockManager`) in its place.
"""

from __future__ import annotations

import fcntl
import os
import threading
import time
from pathlib import Path
from typing import Optional

import anyio

POLL_SECONDS = 0.2


class StoreLocks:
    """A Prefect `LockManager` whose locks are `flock`s on `<store root>/.locks/<key>.lock`."""

    def __init__(self, store_root: str | Path):
        self.folder = Path(store_root).expanduser().resolve() / ".locks"
        self._held: dict[str, tuple[str, int]] = {}  # key -> (holder, open file descriptor)
        self._guard = threading.Lock()

    def __eq__(self, other: object) -> bool:  # Prefect compares the lock managers of combined cache policies
        return isinstance(other, StoreLocks) and other.folder == self.folder

    def __hash__(self) -> int:
        return hash(self.folder)

    def path(self, key: str) -> Path:
        # Keys are record paths such as "train/<key>/result.json": one flat file per key.
        return self.folder / (key.replace("/", "~") + ".lock")

    def _try(self, key: str) -> int | None:
        """An open descriptor holding `key`'s lock, or None when another holds it."""
        self.folder.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path(key), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        except BaseException:
            os.close(fd)
            raise
        return fd

    def acquire_lock(
        self, key: str, holder: str, acquire_timeout: Optional[float] = None, hold_timeout: Optional[float] = None
    ) -> bool:
        """Wait up to `acquire_timeout` seconds (None: as long as it takes) for the lock.

        `hold_timeout` is not needed: a dead holder's lock is released by the kernel, and a live
        holder may train for hours.
        """
        with self._guard:
            if self._held.get(key, (None,))[0] == holder:
                return True
        deadline = None if acquire_timeout is None else time.monotonic() + acquire_timeout
        while True:
            with self._guard:
                if key not in self._held:  # another thread of this process may hold it: flock would not tell
                    fd = self._try(key)
                    if fd is not None:
                        os.ftruncate(fd, 0)
                        os.write(fd, f"{holder}\n".encode())  # who holds it, for a person looking
                        self._held[key] = (holder, fd)
                        return True
            if deadline is not None and time.monotonic() >= deadline:
                return False
            time.sleep(POLL_SECONDS)

    async def aacquire_lock(
        self, key: str, holder: str, acquire_timeout: Optional[float] = None, hold_timeout: Optional[float] = None
    ) -> bool:
        return await anyio.to_thread.run_sync(self.acquire_lock, key, holder, acquire_timeout, hold_timeout)

    def release_lock(self, key: str, holder: str) -> None:
        with self._guard:
            held = self._held.get(key)
            if held is None or held[0] != holder:
                raise ValueError(f"no lock on {key!r} held by {holder!r}")
            del self._held[key]
            fcntl.flock(held[1], fcntl.LOCK_UN)
            os.close(held[1])

    def is_locked(self, key: str) -> bool:
        with self._guard:
            if key in self._held:
                return True
            fd = self._try(key)
        if fd is None:
            return True
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)
        return False

    def is_lock_holder(self, key: str, holder: str) -> bool:
        with self._guard:
            return self._held.get(key, (None,))[0] == holder

    def wait_for_lock(self, key: str, timeout: Optional[float] = None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.is_locked(key):
            if deadline is not None and time.monotonic() >= deadline:
                return False
            time.sleep(POLL_SECONDS)
        return True

    async def await_for_lock(self, key: str, timeout: Optional[float] = None) -> bool:
        return await anyio.to_thread.run_sync(self.wait_for_lock, key, timeout)
