"""prefect.yaml's deployments on a real Prefect server, run by a real worker, as the README says:
create the pool, deploy from the clone, `prefect deployment run`, `prefect worker start`; then
the same run refreshing one stage; then `jaxtune serve` in place of the pool and worker.

Last, on the same server, two runs of one config at once (a nightly and a manual run) build each
stage once: the second waits on the stage's lock in the store, then finds it Cached
(jaxtune.artifacts.locks). One module, so one server for all (starting one takes 10-20 s)."""

from __future__ import annotations

import base64
import json
import time
from pathlib import Path

import pytest
import yaml

from jaxtune.artifacts import ArtifactStore
from tests.deployment.server import BIN, ROOT
from tests.flows.toy import ALL_STAGES, TOY
from tests.prefect_runs import flow_runs_of_store

pytestmark = [pytest.mark.deployment, pytest.mark.slow]

NAME = "offline · tiny gemma3 · lora r64"  # what the toy run of the demo calls itself
DECLARED = {d["name"]: d for d in yaml.safe_load((ROOT / "prefect.yaml").read_text())["deployments"]}


def flow_run(server, run_id):
    from prefect.client.orchestration import get_client

    with server.client_settings(), get_client(sync_client=True) as client:
        return client.read_flow_run(run_id)


def task_states(server, run_id) -> dict[str, str]:
    """{task run name: state name} of a flow run."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with server.client_settings(), get_client(sync_client=True) as client:
        runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[run_id])))
    return {run.name: run.state.name for run in runs}


def artifacts(server, key: str) -> list:
    """Every artifact ever published under `key`, newest first."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey
    from prefect.client.schemas.sorting import ArtifactSort

    with server.client_settings(), get_client(sync_client=True) as client:
        return client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key])),
                                     sort=ArtifactSort.CREATED_DESC)


@pytest.fixture(scope="module")
def deployed(server):
    server.deploy()
    return server


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("deployed-store")


@pytest.fixture(scope="module")
def first(deployed, store):
    run_id = deployed.run_deployment("offline-nightly", overrides=[*TOY, f"store.root={store}"])
    deployed.work_once()
    return run_id


def test_every_declared_deployment_is_deployed_with_its_recipe_and_schedule(deployed):
    from prefect.client.orchestration import get_client

    with deployed.client_settings(), get_client(sync_client=True) as client:
        found = {d.name: d for d in client.read_deployments()}
    assert set(found) == set(DECLARED)
    for name, declared in DECLARED.items():
        deployment = found[name]
        assert deployment.parameters == declared["parameters"] and deployment.work_pool_name == "jaxtune"
        assert [s.schedule.cron for s in deployment.schedules] == [s["cron"] for s in declared.get("schedules", [])]
        assert deployment.job_variables["env"] == {"PYTHONHASHSEED": "0"}
        assert deployment.pull_steps == [{"prefect.deployments.steps.set_working_directory": {"directory": str(ROOT)}}]
        # The UI's run form: typed fields with the flow's defaults, the stages as choices.
        form = deployment.parameter_openapi_schema["properties"]
        assert form["until"]["enum"][-1] == "report" and "final_eval" in form["refresh"]["items"]["enum"]
        assert form["recipe"]["default"] == "offline" and form["overrides"]["type"] == "array"


def test_a_deployment_run_executed_by_a_worker_runs_every_stage(deployed, first):
    run = flow_run(deployed, first)
    assert run.state.is_completed(), run.state.message
    assert run.name == NAME
    assert task_states(deployed, first) == {**{f"{stage} · tiny gemma3 · lora r64": "Completed" for stage in ALL_STAGES},
                                            "publish report": "Completed"}


def test_the_run_publishes_its_artifacts_under_the_deployments_keys(deployed, first):
    [report] = artifacts(deployed, "offline-nightly-report")
    assert report.flow_run_id == first and report.type == "markdown"
    assert report.data.startswith("# jaxtune report") and "| eval loss |" in report.data
    image = report.data.split("![loss curve](data:image/png;base64,")[1].split(")")[0]
    assert base64.b64decode(image).startswith(b"\x89PNG") and len(image) > 10_000  # inline, no URL to fetch
    [metrics] = artifacts(deployed, "offline-nightly-metrics")
    assert metrics.type == "table" and [row["metric"] for row in json.loads(metrics.data)] == ["eval loss", "perplexity", "exact match"]
    [progress] = artifacts(deployed, "offline-nightly-train-progress")
    assert progress.type == "progress" and float(progress.data) == 100.0
    [stages] = artifacts(deployed, "offline-nightly-stages")
    assert [row["stage"] for row in json.loads(stages.data)] == list(ALL_STAGES)
    for row in json.loads(stages.data):
        [stage] = artifacts(deployed, f"offline-nightly-stage-{row['stage'].replace('_', '-')}")
        assert row["folder"] in stage.data and row["key"] in stage.data and Path(row["folder"], "manifest.json").is_file()


def test_refreshing_one_stage_reruns_it_and_takes_everything_else_from_the_cache(deployed, first, store):
    again = deployed.run_deployment("offline-nightly", overrides=[*TOY, f"store.root={store}"], refresh=["final_eval"])
    deployed.work_once()
    run = flow_run(deployed, again)
    assert run.state.is_completed() and run.name == f"{NAME} · refresh final_eval"
    ran = {name.split(" · ")[0] for name, state in task_states(deployed, again).items() if state != "Cached"}
    # The report's key hashes final_eval's key, which a refresh leaves as it was: the report is Cached too.
    assert ran == {"final_eval", "publish report"}
    # The UI keeps one history per key: both runs' reports, newest first.
    assert [a.flow_run_id for a in artifacts(deployed, "offline-nightly-report")] == [again, first]


def test_jaxtune_serve_serves_the_deployments_with_their_schedules(deployed, first, store):
    """`jaxtune serve` registers the deployments from prefect.yaml and runs what is triggered."""
    from prefect.client.orchestration import get_client

    serve = deployed.start("serve", str(BIN / "jaxtune"), "serve", "--only", "offline-nightly",
                           env={"PREFECT_RUNNER_POLL_FREQUENCY": "2"})
    try:
        deadline = time.monotonic() + 120
        while "being served" not in deployed.log("serve"):
            assert serve.poll() is None and time.monotonic() < deadline, deployed.log("serve")[-3000:]
            time.sleep(1)
        with deployed.client_settings(), get_client(sync_client=True) as client:
            d = client.read_deployment_by_name("finetune/offline-nightly")
        assert [s.schedule.cron for s in d.schedules] == ["0 3 * * *"] and all(s.active for s in d.schedules)
        assert d.work_pool_name is None and "finetune/offline-nightly was a work-pool deployment" in deployed.log("serve")
        run_id = deployed.run_deployment("offline-nightly", overrides=[*TOY, f"store.root={store}"], until="tokenize")
        while not (run := flow_run(deployed, run_id)).state.is_final():
            assert serve.poll() is None and time.monotonic() < deadline + 120, deployed.log("serve")[-3000:]
            time.sleep(1)
        assert run.state.is_completed(), deployed.log("serve")[-3000:]
        assert set(task_states(deployed, run_id).values()) == {"Cached"}  # the store the worker's run filled
    finally:
        deployed.stop(serve)
    with deployed.client_settings(), get_client(sync_client=True) as client:
        paused = client.read_deployment_by_name("finetune/offline-nightly")
    assert paused.paused, "serve pauses what it served when it stops: no schedule fires with nothing to run it"


def stage_states(output: str) -> dict[str, str]:
    """{stage: state} from `jaxtune run`'s closing lines (`<stage>  <state>`)."""
    lines = [line.split() for line in output.splitlines()]
    return {words[0]: words[1] for words in lines if len(words) == 2 and words[0] in ALL_STAGES}


def task_runs_of_store(server, store: Path, stage: str) -> list:
    """The task runs of `stage` in the flow runs given `store` (the module's other runs share the server)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId, TaskRunFilter, TaskRunFilterName

    with server.client_settings(), get_client(sync_client=True) as client:
        of_store = FlowRunFilter(id=FlowRunFilterId(any_=[r.id for r in flow_runs_of_store(client, store)]))
        return client.read_task_runs(flow_run_filter=of_store, task_run_filter=TaskRunFilter(name=TaskRunFilterName(like_=f"{stage} · ")))


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
        found = task_runs_of_store(server, store, stage)
        assert len(found) == 2, (stage, [run.name for run in found])
        by_state = {run.state.name: run for run in found}
        if by_state["Cached"].start_time < by_state["Completed"].end_time:
            waited.append(stage)
    assert waited, "the two runs never overlapped, so nothing here tested the lock"

    built = ArtifactStore(store)
    for stage in ALL_STAGES:
        folders = list((store / stage).iterdir())
        assert len(folders) == 1 and built.verify(stage, folders[0].name), folders  # no temp folder left either
    assert not list(store.glob(".scratch/*/*"))
