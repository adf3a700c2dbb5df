"""`jaxtune run` killed by SIGKILL leaves no process behind: the temporary Prefect server it
started (uvicorn) and the guard watching it end within 5 s. Before the guard, the server ran on,
reparented to PID 1, one per killed run."""

from __future__ import annotations

import subprocess
import sys
import time

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


def test_a_killed_jaxtune_run_leaves_no_process_within_5_seconds(tmp_path):
    import psutil

    store = tmp_path / "store"
    sets = [a for s in [*TOY, f"store.root={store}"] for a in ("--set", s)]
    run = subprocess.Popen([sys.executable, "-m", "jaxtune.cli", "run", *sets], cwd=ROOT, env=_clean_env(tmp_path / "home"),
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while not (store / "build_tokenizer").exists():  # the flow runs its first stage: the server is up
        assert run.poll() is None and time.monotonic() < deadline, run.stderr.read()[-3000:] if run.poll() is not None else "no stage"
        time.sleep(0.05)
    children = psutil.Process(run.pid).children(recursive=True)
    commands = [" ".join(command(child)) for child in children]
    assert any("uvicorn" in c and "prefect.server.api.server:create_app" in c for c in commands), commands
    run.kill()
    run.wait()
    _, alive = psutil.wait_procs(children, timeout=5)
    assert not alive, [" ".join(command(p)) for p in alive]
