"""The llama.cpp check fine-tunes SmolLM2 with the flow: on the session's Prefect server."""

import pytest


@pytest.fixture(scope="session", autouse=True)
def _flows_use_the_server(prefect_server):
    yield
