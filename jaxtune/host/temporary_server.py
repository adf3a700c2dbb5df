"""Prefect's temporary server for a `jaxtune run` that has no PREFECT_API_URL: started before the
flow, and watched by a guard process so that it ends with jaxtune however jaxtune ends.

Prefect starts the server (a uvicorn child process) on its first API call and stops it at exit,
from an atexit hook: after a SIGKILL, or a SIGTERM outside training, no hook runs and the server
keeps running, reparented to PID 1, one per killed run. The guard is a second, small child in a
session of its own (a terminal's Ctrl-C does not reach it): it polls its parent every
POLL_SECONDS, and once the parent is gone it terminates the server, then exits; it also exits
when the server stops first, as at a normal exit. Linux's parent-death signal would need the
server's own start, which is Prefect's.

`python -m jaxtune.host.temporary_server PARENT SERVER` runs the guard.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

POLL_SECONDS = 0.2
STOP_SECONDS = 3.0  # for the server to stop after SIGTERM, before SIGKILL


def start_guarded() -> int | None:
    """Start Prefect's temporary server now if this process would use one, and its guard; the
    server's pid, or None when Prefect is pointed at a server of its own."""
    from prefect.settings import PREFECT_API_URL, PREFECT_SERVER_EPHEMERAL_ENABLED

    if PREFECT_API_URL.value() or not PREFECT_SERVER_EPHEMERAL_ENABLED.value():
        return None
    from prefect.server.api.server import SubprocessASGIServer

    server = SubprocessASGIServer()  # the instance every Prefect client of this process then uses
    server.start()
    pid = server.server_process.pid
    subprocess.Popen(
        [sys.executable, "-m", __name__, str(os.getpid()), str(pid)], stdin=subprocess.DEVNULL, start_new_session=True
    )
    return pid


def guard(parent: int, server_pid: int) -> None:
    """Wait while `parent` lives (this process's parent) and the server runs; if the parent went
    first, stop the server. psutil tells the server from a later process given its pid."""
    import psutil

    try:
        server = psutil.Process(server_pid)
    except psutil.NoSuchProcess:
        return
    while os.getppid() == parent:
        try:
            if not server.is_running() or server.status() == psutil.STATUS_ZOMBIE:
                return
        except psutil.NoSuchProcess:
            return
        time.sleep(POLL_SECONDS)
    try:
        server.terminate()
        server.wait(STOP_SECONDS)
    except psutil.TimeoutExpired:
        server.kill()
    except psutil.NoSuchProcess:
        pass


if __name__ == "__main__":
    guard(int(sys.argv[1]), int(sys.argv[2]))
