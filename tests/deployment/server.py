"""A real, throwaway Prefect server and the `prefect` commands run against it.

`PrefectServer` starts `prefect server start` on 127.0.0.1 at a free port with its own
PREFECT_HOME (database, logs) and the scheduler service off (prefect.yaml's schedules must not
start runs of their own), and stops it, and every process started through it, on exit, failed
or not. Used by the deployment tests and by `make ui-check`.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).parents[2]
BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PrefectServer:
    def __init__(self, home: Path | None = None, port: int | None = None):
        self._own_home = home is None  # a folder of its own is removed when the server stops
        self.home = Path(home or tempfile.mkdtemp(prefix="jaxtune-server-"))
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api = f"{self.url}/api"
        self.logs = self.home / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.env = {
            **os.environ,
            "PREFECT_HOME": str(self.home),
            "PREFECT_API_URL": self.api,
            "PREFECT_UI_API_URL": self.api,  # the UI's own requests go to this server, not the default port
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "PREFECT_SERVER_SERVICES_SCHEDULER_ENABLED": "false",
            "PREFECT_SERVER_API_HOST": "127.0.0.1",
            "PREFECT_SERVER_API_PORT": str(self.port),
            "PREFECT_LOGGING_LEVEL": "INFO",
            "HF_HUB_OFFLINE": "1",
            "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
        }
        self.env.pop("PREFECT_PROFILE", None)
        self._processes: list[subprocess.Popen] = []

    # -- processes ---------------------------------------------------------------------------
    def start(self, name: str, *args: str, cwd: Path = ROOT, env: dict | None = None) -> subprocess.Popen:
        """Start a process in its own process group (so stopping it stops its children too)."""
        log = open(self.logs / f"{name}.log", "ab")
        process = subprocess.Popen(
            args, cwd=cwd, env={**self.env, **(env or {})}, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        self._processes.append(process)
        return process

    def run(self, *args: str, cwd: Path = ROOT, timeout: float = 600, env: dict | None = None) -> str:
        """Run a command to completion; its output, or an error that shows it. On timeout its whole
        process group goes (a worker's flow run process with it)."""
        process = subprocess.Popen(
            args,
            cwd=cwd,
            env={**self.env, **(env or {})},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        try:
            out, _ = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            out, _ = process.communicate()
            raise RuntimeError(f"{' '.join(args)} ran past {timeout:.0f} s:\n{out[-4000:]}") from None
        if process.returncode != 0:
            raise RuntimeError(f"{' '.join(args)} exited {process.returncode}:\n{out[-8000:]}")
        return out

    def prefect(self, *args: str, timeout: float = 600) -> str:
        return self.run(str(BIN / "prefect"), *args, timeout=timeout)

    def stop(self, process: subprocess.Popen, timeout: float = 20) -> None:
        if process.poll() is None:
            for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGKILL):
                try:
                    os.killpg(process.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    process.wait(timeout)
                    break
                except subprocess.TimeoutExpired:
                    continue

    def log(self, name: str) -> str:
        path = self.logs / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    # -- the server --------------------------------------------------------------------------
    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.api}/health", timeout=2) as response:
                return json.loads(response.read()) is True
        except OSError:
            return False

    def __enter__(self) -> PrefectServer:
        server = self.start(
            "server", str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(self.port)
        )
        deadline = time.monotonic() + 300  # its first start creates and migrates the database
        while not self.healthy():
            if server.poll() is not None or time.monotonic() > deadline:
                self.__exit__(None, None, None)
                raise RuntimeError(f"prefect server did not start:\n{self.log('server')[-4000:]}")
            time.sleep(0.5)
        return self

    def __exit__(self, *exc) -> None:
        for process in reversed(self._processes):
            self.stop(process)
        if self._own_home:
            shutil.rmtree(self.home, ignore_errors=True)

    # -- deployments -------------------------------------------------------------------------
    def deploy(self, pool: str = "jaxtune") -> None:
        """Create the process work pool and deploy everything prefect.yaml declares, as docs/deployments.md says."""
        self.prefect("work-pool", "create", pool, "--type", "process")
        self.prefect("--no-prompt", "deploy", "--all")

    def run_deployment(self, name: str, **parameters) -> uuid.UUID:
        """`prefect deployment run 'finetune/<name>' --param k=<json>...`; the new flow run's id."""
        args = [arg for k, v in parameters.items() for arg in ("--param", f"{k}={json.dumps(v)}")]
        out = self.prefect("deployment", "run", f"finetune/{name}", *args)
        return uuid.UUID(re.search(r"UUID: ([0-9a-f-]{36})", out).group(1))

    def work_once(self, pool: str = "jaxtune", timeout: float = 1200) -> str:
        """`prefect worker start --run-once`: executes the runs already due, then exits."""
        return self.prefect("worker", "start", "--pool", pool, "--run-once", timeout=timeout)

    @contextmanager
    def client_settings(self):
        """Prefect settings of this process pointed at the server, for `get_client`."""
        from prefect.settings import PREFECT_API_URL, temporary_settings

        with temporary_settings({PREFECT_API_URL: self.api}):
            yield
