"""Two runs of one config at once (a nightly and a manual run) build each stage once: the second
waits on the stage's lock in the store, then finds it Cached (jaxtune.artifacts.locks)."""

from __future__ import annotations

import time

import pytest

from jaxtune.artifacts import ArtifactStore
from tests.deployment.server import BIN
from tests.flows.toy import ALL_STAGES, TOY

pytestmark = [pytest.mark.deployment, pytest.mark.slow]


def stage_states(output: str) -> dict[str, str]:
    """{stage: state} from `jaxtune run`'s closing lines (`<stage>  <state>`)."""
    lines = [line.split() for line in output.splitlines()]
    return {words[0]: words[1] for words in lines if len(words) == 2 and words[0] in ALL_STAGES}


def task_runs(server, stage: str) -> list:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import TaskRunFilter, TaskRunFilterName

    with server.client_settings(), get_client(sync_client=True) as client:
        return client.read_task_runs(task_run_filter=TaskRunFilter(name=TaskRunFilterName(like_=f"{stage} · ")))


def test_two_runs_started_together_build_each_stage_once(server, tmp_path):
    store = tmp_path / "store"
    command = [str(BIN / "jaxtune"), "run", *[arg for o in (*TOY, f"store.root={store}") for arg in ("--set", o)]]
    runs = [server.start(f"run-{i}", *command) for i in (1, 2)]
    deadline = time.monotonic() + 600
    while any(run.poll() is None for run in runs):
        assert time.monotonic() < deadline, "runs did not finish in 10 minutes"
        time.sleep(1)
    logs = [server.log(f"run-{i}") for i in (1, 2)]
    assert [run.returncode for run in runs] == [0, 0], "\n\n".join(log[-3000:] for log in logs)

    states = [stage_states(log) for log in logs]
    for stage in ALL_STAGES:
        assert sorted((states[0][stage], states[1][stage])) == ["Cached", "Completed"], stage
    # The runs did overlap: at least one Cached task run began before its Completed twin ended (it waited).
    waited = []
    for stage in ALL_STAGES:
        by_state = {run.state.name: run for run in task_runs(server, stage)}
        if by_state["Cached"].start_time < by_state["Completed"].end_time:
            waited.append(stage)
    assert waited, "the two runs never overlapped, so nothing here tested the lock"

    artifacts = ArtifactStore(store)
    for stage in ALL_STAGES:
        folders = list((store / stage).iterdir())
        assert len(folders) == 1 and artifacts.verify(stage, folders[0].name), folders  # no temp folder left either
    assert not list(store.glob(".scratch/*/*"))
