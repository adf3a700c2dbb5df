"""`jaxtune run` killed by SIGKILL leaves no process behind: the temporary Prefect server it
started (uvicorn) and the guard watching it end within 5 s. Before the guard, the server ran on,
reparented to PID 1, one per killed run."""

from __future__ import annotations

import subprocess
import sys
import time
import urllib.request

import pytest

from tests.flows.toy import TOY
from tests.safety.test_localhost import ROOT, _clean_env

pytestmark = pytest.mark.safety


def command(process) -> list[str]:
    import psutil

    try:
        return process.cmdline()
    except psutil.Error:  # gone since it was listed
        return []


def answering_server(pid: int):
    """The Prefect server process among `pid`'s children, once it answers its health check."""
    import psutil

    for child in psutil.Process(pid).children(recursive=True):
        argv = command(child)
        if "prefect.server.api.server:create_app" in argv:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{argv[argv.index('--port') + 1]}/api/health", timeout=1):
                    return child
            except OSError:
                return None
    return None


def watching_guard(pid: int):
    """The guard among `pid`'s children, once it watches: it has imported psutil, its last step
    before its loop (a guard still starting up would add its interpreter's start to the 5 s)."""
    import psutil

    for child in psutil.Process(pid).children(recursive=True):
        if "jaxtune.host.temporary_server" in command(child):
            try:
                if any("_psutil_linux" in m.path for m in child.memory_maps()):
                    return child
            except psutil.Error:
                return None
    return None


def test_a_killed_jaxtune_run_leaves_no_process_within_5_seconds(tmp_path):
    import psutil

    sets = [a for s in [*TOY, f"store.root={tmp_path / 'store'}"] for a in ("--set", s)]
    run = subprocess.Popen(
        [sys.executable, "-m", "jaxtune.cli", "run", *sets],
        cwd=ROOT,
        env=_clean_env(tmp_path / "home"),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 900  # its temporary server may take 600 s (tests/conftest.py)
    while True:
        assert run.poll() is None and time.monotonic() < deadline, (
            run.stderr.read()[-3000:] if run.poll() is not None else "no server"
        )
        if server := answering_server(run.pid):
            break
        time.sleep(0.05)
    # jaxtune starts the guard once its server answers; killed before that, it could leave the server.
    while not (guard := watching_guard(run.pid)):
        assert run.poll() is None and time.monotonic() < deadline, "no guard watches the temporary server"
        time.sleep(0.05)
    children = psutil.Process(run.pid).children(recursive=True)
    assert server in children and guard in children
    run.kill()
    run.wait()
    _, alive = psutil.wait_procs(children, timeout=5)
    assert not alive, [" ".join(command(p)) for p in alive]
