"""Flow tests share one temporary Prefect server, started and stopped inside the session."""

import pytest


@pytest.fixture(scope="session", autouse=True)
def prefect_server():
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield
