"""The session's shared Prefect server as the workers see it: the file naming it appears whole,
and a server that cannot start fails the first flow test with why, instead of a wait."""

import json

import pytest

from tests import session_server
from tests.session_server import SessionServer, wait_for_server


def test_a_server_that_cannot_start_fails_the_workers_with_its_error(tmp_path, monkeypatch):
    import prefect.server.api.server as server_module

    class Refusing:
        def start(self, timeout):
            raise OSError("port refused")

    monkeypatch.setattr(server_module, "SubprocessASGIServer", Refusing)
    server = SessionServer(tmp_path)
    server._start()
    assert not server.url_file.with_suffix(".partial").exists()
    with pytest.raises(RuntimeError, match=r"^the session's Prefect server did not start: OSError\('port refused'\)$"):
        wait_for_server(server.url_file)


def test_the_workers_read_the_api_and_database_the_server_wrote(tmp_path, monkeypatch):
    import prefect.server.api.server as server_module
    from prefect.settings import PREFECT_SERVER_DATABASE_CONNECTION_URL

    seen = {}

    class Answering:
        api_url = "http://127.0.0.1:4321/api"

        def start(self, timeout):
            seen["database"] = PREFECT_SERVER_DATABASE_CONNECTION_URL.value()  # what the server process is given

    monkeypatch.setattr(server_module, "SubprocessASGIServer", Answering)
    monkeypatch.setattr(session_server, "STARTUP_SECONDS", 1)
    server = SessionServer(tmp_path)
    with pytest.raises(RuntimeError, match="wrote no URL"):
        wait_for_server(server.url_file)  # nothing yet
    server._start()
    found = wait_for_server(server.url_file)
    assert found == {"api": "http://127.0.0.1:4321/api", "database": f"sqlite+aiosqlite:///{tmp_path / 'prefect.db'}"}
    assert seen["database"] == found["database"]
    assert json.loads(server.url_file.read_text()) == found
