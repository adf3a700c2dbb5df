"""StoreLocks: the lock a stage holds while it builds, and its release when the holder dies."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from jaxtune.artifacts.locks import StoreLocks

KEY = "train/0123456789abcdef0123/result.json"


def test_a_second_holder_waits_until_the_first_releases(tmp_path):
    first, second = StoreLocks(tmp_path), StoreLocks(tmp_path)  # as two runs see the one store
    assert first.acquire_lock(KEY, "run-1")
    assert first.is_lock_holder(KEY, "run-1") and not first.is_lock_holder(KEY, "run-2")
    assert second.is_locked(KEY)
    assert not second.acquire_lock(KEY, "run-2", acquire_timeout=0.5)
    with pytest.raises(ValueError, match="no lock on"):
        second.release_lock(KEY, "run-2")
    first.release_lock(KEY, "run-1")
    assert not second.is_locked(KEY) and second.acquire_lock(KEY, "run-2", acquire_timeout=0.5)
    assert first.is_locked(KEY) and not first.wait_for_lock(KEY, timeout=0.3)
    second.release_lock(KEY, "run-2")
    assert first.wait_for_lock(KEY, timeout=0.3)
    assert [p.name for p in (tmp_path / ".locks").iterdir()] == ["train~0123456789abcdef0123~result.json.lock"]


def test_a_killed_holders_lock_is_free_at_once(tmp_path):
    """A run killed mid-stage (OOM, preemption) must not leave later runs waiting for ever."""
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(f"""
        import sys, time
        from jaxtune.artifacts.locks import StoreLocks
        StoreLocks({str(tmp_path)!r}).acquire_lock({KEY!r}, "doomed")
        print("held", flush=True)
        time.sleep(600)
    """),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        locks = StoreLocks(tmp_path)
        assert not locks.acquire_lock(KEY, "next", acquire_timeout=0.5)
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait(10)
        start = time.monotonic()
        assert locks.acquire_lock(KEY, "next", acquire_timeout=5)
        assert time.monotonic() - start < 1
    finally:
        holder.kill()
