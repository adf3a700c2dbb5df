"""Every server jaxtune starts listens on 127.0.0.1 only, never on all interfaces.

`jaxtune run` without PREFECT_API_URL gets Prefect's temporary server: its first API client
(`get_client`) starts `SubprocessASGIServer`, a uvicorn process. The test starts one exactly that
way, in a child process with no PREFECT_API_URL, and reads the listening sockets of the server
process with psutil. `jaxtune serve`'s runner webserver (when enabled) and `prefect server start`
read their host from Prefect settings, which `jaxtune.cli.main._local_servers()` defaults to 127.0.0.1.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.safety

ROOT = Path(__file__).parents[2]
LOOPBACK = {"127.0.0.1", "::1"}

# The child: start the temporary server as `jaxtune run` does (its server settings first, then
# get_client), report the server process, wait for the test to look at its sockets, then exit
# (Prefect stops the server at exit).
START_TEMPORARY_SERVER = """
import json, sys
from jaxtune.cli import main as cli
cli._local_servers()
from prefect.client.orchestration import get_client
from prefect.server.api.server import SubprocessASGIServer
with get_client(sync_client=True) as client:
    client.hello().raise_for_status()
    api = str(client.api_url)
server = SubprocessASGIServer()
print(json.dumps({"pid": server.server_process.pid, "port": server.port, "api": api}), flush=True)
sys.stdin.readline()
"""


def _clean_env(home: Path) -> dict[str, str]:
    """This environment without any Prefect API URL, host or profile, with its own Prefect home."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k
        not in (
            "PREFECT_API_URL",
            "PREFECT_PROFILE",
            "PREFECT_SERVER_API_HOST",
            "PREFECT_RUNNER_SERVER_HOST",
            "PREFECT_SERVER_DATABASE_CONNECTION_URL",
            "PREFECT_API_DATABASE_CONNECTION_URL",
        )
    }
    return {**env, "PREFECT_HOME": str(home), "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PYTHONPATH": str(ROOT)}


def _listening(pid: int) -> list[tuple[str, int]]:
    """(address, port) of every TCP socket in LISTEN state of process `pid` and its children."""
    import psutil

    process = psutil.Process(pid)
    found = []
    for p in [process, *process.children(recursive=True)]:
        for conn in p.net_connections(kind="inet"):
            if conn.status == psutil.CONN_LISTEN:
                found.append((conn.laddr.ip, conn.laddr.port))
    return found


def _tcp_listeners_from_proc() -> dict[int, set[str]]:
    """{port: addresses} of every listening IPv4 TCP socket on this machine, from /proc/net/tcp."""
    listeners: dict[int, set[str]] = {}
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        local, state = fields[1], fields[3]
        if state != "0A":  # TCP_LISTEN
            continue
        address, port = local.split(":")
        ip = ".".join(str(int(address[i : i + 2], 16)) for i in (6, 4, 2, 0))  # little-endian
        listeners.setdefault(int(port, 16), set()).add(ip)
    return listeners


def test_the_socket_readers_see_a_wildcard_listener():
    """The checks below could fail: a socket bound to 0.0.0.0 is seen as such by both readers."""
    import socket

    with socket.socket() as s:
        s.bind(("0.0.0.0", 0))
        s.listen()
        port = s.getsockname()[1]
        assert ("0.0.0.0", port) in _listening(os.getpid())
        assert _tcp_listeners_from_proc()[port] == {"0.0.0.0"}


def test_the_temporary_prefect_server_of_jaxtune_run_listens_on_loopback_only(tmp_path):
    child = subprocess.Popen(
        [sys.executable, "-c", START_TEMPORARY_SERVER],
        cwd=ROOT,
        env=_clean_env(tmp_path / "home"),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = child.stdout.readline()
        assert line, f"the temporary server did not start:\n{child.stderr.read()[-4000:]}"
        server = json.loads(line)
        assert server["api"].rstrip("/") == f"http://127.0.0.1:{server['port']}/api"

        deadline = time.monotonic() + 10  # it answered /health, so it listens; allow for a slow /proc
        while not (listening := _listening(server["pid"])) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert listening, "the server process has no listening socket"
        assert {port for _, port in listening} == {server["port"]}
        assert {ip for ip, _ in listening} <= LOOPBACK, f"listens beyond loopback: {listening}"
        # The machine-wide view agrees: nothing on that port listens on 0.0.0.0.
        assert _tcp_listeners_from_proc().get(server["port"], set()) <= LOOPBACK
    finally:
        _stop(child)
    assert child.returncode == 0, child.stderr.read()[-4000:]


LOCAL_SERVERS = """
from jaxtune.cli import main as cli
cli._local_servers()
from prefect.settings import PREFECT_RUNNER_SERVER_HOST, PREFECT_SERVER_API_HOST
from prefect.settings import PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS as startup
print(PREFECT_RUNNER_SERVER_HOST.value(), PREFECT_SERVER_API_HOST.value(), startup.value())
"""


def test_jaxtune_points_the_servers_prefect_starts_at_loopback(tmp_path):
    """`jaxtune serve`'s runner webserver and a Prefect API server read their host from these settings."""
    env = _clean_env(tmp_path / "home")
    env.pop("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", None)  # the suite's own (tests/conftest.py)
    # Prefect's own default for the runner webserver is "localhost", which is not what we set.
    default = subprocess.run(
        [sys.executable, "-c", "from prefect.settings import PREFECT_RUNNER_SERVER_HOST as h; print(h.value())"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert default.returncode == 0, default.stderr[-4000:]
    assert default.stdout.split() != ["127.0.0.1"]

    done = subprocess.run(
        [sys.executable, "-c", LOCAL_SERVERS], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-4000:]
    # and the temporary server is given time to migrate a new database on a busy machine (Prefect's: 20 s)
    assert done.stdout.split() == ["127.0.0.1", "127.0.0.1", "120"]


# The child: the runner webserver `jaxtune serve` starts when PREFECT_RUNNER_SERVER_ENABLE is on,
# through Prefect's own `start_webserver` (host and port from its settings), after the CLI's
# defaults; only the runner's routes are replaced by a bare app, since they need a live Runner.
START_RUNNER_WEBSERVER = """
import sys, threading
from jaxtune.cli import main as cli
cli._local_servers()
import prefect.runner.server as runner_server

async def bare_app(runner):
    async def app(scope, receive, send):
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                else:
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})
    return app

runner_server.build_server = bare_app
threading.Thread(target=runner_server.start_webserver, args=(None,), daemon=True).start()
print("started", flush=True)
sys.stdin.readline()
"""


def test_the_runner_webserver_of_jaxtune_serve_listens_on_loopback_only(tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**_clean_env(tmp_path / "home"), "PREFECT_RUNNER_SERVER_PORT": str(port)}
    child = subprocess.Popen(
        [sys.executable, "-c", START_RUNNER_WEBSERVER],
        cwd=ROOT,
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout.readline() == "started\n", child.stderr.read()[-4000:]
        deadline = time.monotonic() + 300  # uvicorn imported and started in a thread, however busy the machine
        while not (listening := _listening(child.pid)) and time.monotonic() < deadline and child.poll() is None:
            time.sleep(0.2)
        assert listening, (
            f"the runner webserver did not start:\n{child.stderr.read()[-4000:] if child.poll() is not None else ''}"
        )
        assert {p for _, p in listening} == {port}
        assert {ip for ip, _ in listening} <= LOOPBACK, f"listens beyond loopback: {listening}"
    finally:
        _stop(child)


def _stop(child: subprocess.Popen) -> None:
    """Ask the child to stop (a line on its stdin), and kill it if it has not within 300 s."""
    if child.poll() is None:
        child.stdin.write("\n")
        child.stdin.flush()
    try:
        child.wait(timeout=300)
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait()
