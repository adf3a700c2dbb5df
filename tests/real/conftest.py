"""Real checkpoints: each test module imports its GGUF file once into a store of its own."""

from tests.flows.conftest import prefect_server  # noqa: F401  (flow runs need the shared temporary server)
