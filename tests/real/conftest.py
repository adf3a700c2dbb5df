"""Real checkpoints: each test module imports its GGUF file once into a store of its own."""

import pytest


@pytest.fixture(scope="session", autouse=True)
def _flows_use_the_server(prefect_server):
    yield
