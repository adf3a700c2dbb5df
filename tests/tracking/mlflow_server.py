"""A real `mlflow server` on 127.0.0.1 for the tests: a SQLite backend and an artifact root in a
temporary folder, artifacts served by the server itself."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

STARTUP_SECONDS = 240  # an import-heavy server on a loaded 2-core machine: 20-40 s here


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextmanager
def mlflow_server(folder: Path) -> Iterator[str]:
    """The URI of an MLflow server keeping its runs and artifacts under `folder`, while inside."""
    import httpx

    port = free_port()
    folder.mkdir(parents=True, exist_ok=True)
    command = [
        str(Path(sys.executable).parent / "mlflow"),
        "server",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--backend-store-uri",
        f"sqlite:///{folder / 'mlflow.db'}",
        "--artifacts-destination",
        str(folder / "artifacts"),
        "--serve-artifacts",
        "--workers",
        "1",
    ]
    # No background job runners (nothing here queues jobs): fewer processes on a busy machine.
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    with (folder / "server.log").open("w") as log:
        server = subprocess.Popen(
            command, cwd=folder, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    uri = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + STARTUP_SECONDS
        while True:
            try:
                if httpx.get(f"{uri}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"mlflow server did not start: {(folder / 'server.log').read_text()[-3000:]}")
            time.sleep(1)
        yield uri
    finally:
        os.killpg(server.pid, signal.SIGTERM)  # its own session: the server and the workers it started
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
