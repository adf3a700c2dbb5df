import pytest

from tests.deployment.server import PrefectServer


@pytest.fixture(scope="module")
def server():
    """A real Prefect server for the module's tests, stopped (with every process it started) afterwards."""
    with PrefectServer() as running:
        yield running
