"""Tracking tests run their flows on the session's temporary Prefect server."""

import pytest


@pytest.fixture(scope="session", autouse=True)
def _flows_use_the_server(prefect_server):
    yield
