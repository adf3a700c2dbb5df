"""The test session's one Prefect server, shared by every xdist worker.

The controller starts it on a background thread as the session begins (`SessionServer`), so it
comes up while the workers start and collect; when it answers, its API URL and database are
written to a file whose path each worker is given, and a worker's first flow test waits for that
file (`wait_for_server`). Its SQLite database lies in a folder of its own.
"""

from __future__ import annotations

import inspect
import json
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path

STARTUP_SECONDS = 600  # the suite's two workers import and collect beside it on 2 cores, maybe under other load


class SessionServer:
    def __init__(self, folder: Path):
        self.folder = folder
        self.url_file = folder / "server.json"
        self.database = f"sqlite+aiosqlite:///{folder / 'prefect.db'}"
        self._server = None
        self._thread = threading.Thread(target=self._start, name="session-prefect-server", daemon=True)

    @classmethod
    def start_in_background(cls) -> SessionServer:
        server = cls(Path(tempfile.mkdtemp(prefix="jaxtune-session-server-")))
        server._thread.start()
        return server

    def _start(self) -> None:
        from prefect.server.api.server import SubprocessASGIServer
        from prefect.settings import PREFECT_SERVER_DATABASE_CONNECTION_URL, temporary_settings

        try:
            with temporary_settings({PREFECT_SERVER_DATABASE_CONNECTION_URL: self.database}):  # passed to the server
                self._server = SubprocessASGIServer()
                self._server.start(timeout=STARTUP_SECONDS)
            found = {"api": self._server.api_url, "database": self.database}
        except Exception as e:  # the workers' first flow test shows it
            found = {"error": f"the session's Prefect server did not start: {e!r}"}
        partial = self.url_file.with_suffix(".partial")
        partial.write_text(json.dumps(found))
        os.replace(partial, self.url_file)  # a worker never reads half a URL

    def stop(self) -> None:
        self._thread.join(timeout=STARTUP_SECONDS)
        if self._server is not None:
            self._server.stop()
        shutil.rmtree(self.folder, ignore_errors=True)


def wait_for_server(url_file: Path) -> dict[str, str]:
    """{"api": the server's API URL, "database": its database URL}, once it answers."""
    deadline = time.monotonic() + STARTUP_SECONDS
    while not url_file.exists():
        if time.monotonic() > deadline:
            raise RuntimeError(f"the session's Prefect server wrote no URL to {url_file} in {STARTUP_SECONDS} s")
        time.sleep(0.1)
    found = json.loads(url_file.read_text())
    if "error" in found:
        raise RuntimeError(found["error"])
    return found


def drain_to_server() -> None:
    """Send the logs and events this process still holds, before the server can stop."""
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker
    from prefect.utilities.asyncutils import run_coro_as_sync

    async def drain() -> None:
        try:
            pending = APILogWorker.instance().drain()
            if inspect.isawaitable(pending):
                await pending
        except RuntimeError:  # no log was sent
            pass
        pending = EventsWorker.drain_all()
        if inspect.isawaitable(pending):
            await pending

    run_coro_as_sync(drain())
