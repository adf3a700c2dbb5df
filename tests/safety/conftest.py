"""The hub-token test runs the CLI against a temporary Prefect server started for the session,
as the flow tests do. Only the tests that ask for it start it (the static checks need none)."""

import pytest


@pytest.fixture(scope="session")
def prefect_server():
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield
