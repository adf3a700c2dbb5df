"""`jaxtune serve` runs one flow run at a time unless `--limit` says otherwise: the Prefect runner
it builds holds that many slots. Registering with the API and polling it are recorded, not done,
so no server is needed (tests/deployment serves against a real one)."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import pytest

from jaxtune.cli.main import main

PREFECT_YAML = str(Path(__file__).parents[1] / "prefect.yaml")


@pytest.fixture
def runners(monkeypatch) -> list:
    """The Prefect runners `jaxtune serve` starts, each with `served`: the deployments added to it."""
    from prefect.runner import Runner

    from jaxtune.flows import serve as serve_module

    started = []

    def add_deployment(self, deployment):
        self.__dict__.setdefault("served", []).append(deployment.name)

    async def start(self, *args, **kwargs):
        started.append(self)

    monkeypatch.setattr(serve_module, "take_over", lambda names: [])  # it reads the API's deployments
    monkeypatch.setattr(Runner, "add_deployment", add_deployment)
    monkeypatch.setattr(Runner, "start", start)
    return started


def flow_runs_taken(runner, offered: int) -> list[bool]:
    """Which of `offered` flow runs, arriving while none has finished, the runner takes."""

    async def offer():
        async with runner._limit_manager as slots:
            return [slots.acquire_for_flow_run(uuid.uuid4()) for _ in range(offered)]

    return asyncio.run(offer())


def test_serve_runs_one_flow_run_at_a_time_and_limit_sets_how_many(runners, capsys):
    serve = ["serve", "--prefect-yaml", PREFECT_YAML, "--only", "offline-nightly"]
    assert main(serve) == 0
    assert main([*serve, "--limit", "3"]) == 0
    default, three = runners
    assert default.served == three.served == ["offline-nightly"]
    assert default.pause_on_shutdown and three.pause_on_shutdown  # no schedule fires with nothing to run it
    assert (default.limit, three.limit) == (1, 3)
    assert flow_runs_taken(default, 2) == [True, False]
    assert flow_runs_taken(three, 4) == [True, True, True, False]
