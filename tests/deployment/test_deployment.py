"""prefect.yaml's deployments on a real Prefect server, run by a real worker, as docs/deployments.md says:
create the pool, deploy from the clone, `prefect deployment run`, `prefect worker start`; then
the same run refreshing one stage; a run killed mid-train, which prefect.yaml's automation
starts again, and a run cancelled mid-train, which it leaves; then `jaxtune serve` in place of
the pool and worker (it takes the deployments over, so it comes after every pool test).

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
from tests.flows.test_train_resume import newest_checkpoint, newest_logged
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
        return client.read_artifacts(
            artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key])), sort=ArtifactSort.CREATED_DESC
        )


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
        flows = {flow.id: flow.name for flow in client.read_flows()}
    assert set(found) == set(DECLARED)
    for name, declared in DECLARED.items():
        deployment = found[name]
        assert deployment.parameters == declared["parameters"] and deployment.work_pool_name == "jaxtune"
        assert [s.schedule.cron for s in deployment.schedules] == [s["cron"] for s in declared.get("schedules", [])]
        assert deployment.pull_steps == [{"prefect.deployments.steps.set_working_directory": {"directory": str(ROOT)}}]
        form = deployment.parameter_openapi_schema["properties"]
        if flows[deployment.flow_id] == "plan":  # compiles for the recipe's chip, then queues the run it names
            assert set(form) == {"recipe", "overrides", "target", "then"} and declared["parameters"]["then"] in {
                f"finetune/{other}" for other in DECLARED
            }
            continue
        if flows[deployment.flow_id] == "ray-job":  # the driver of a job of several processes on Ray
            assert {"recipe", "overrides", "processes", "tpu", "address", "restarts"} <= set(form)
            assert form["restarts"]["default"] == 2 and deployment.parameters["processes"] == 2
            continue
        assert flows[deployment.flow_id] == "finetune" and deployment.job_variables["env"] == {"PYTHONHASHSEED": "0"}
        # The UI's run form: typed fields with the flow's defaults, the stages as choices.
        assert form["until"]["enum"][-1] == "report" and "final_eval" in form["refresh"]["items"]["enum"]
        assert form["recipe"]["default"] == "offline" and form["overrides"]["type"] == "array"
    # One restart automation for each finetune deployment, running it on a crash of its runs only.
    finetunes = {name: d for name, d in found.items() if flows[d.flow_id] == "finetune"}
    # The three hub recipes' plans restart nothing (they queue runs), nor does ray-offline, which
    # restarts its job itself.
    assert len(finetunes) == len(found) - 4
    with deployed.client_settings(), get_client(sync_client=True) as client:
        automations = {a.name: a for a in client.read_automations()}
    for name, deployment in finetunes.items():
        automation = automations[f"restart {name} after a crash"]
        [action] = automation.actions
        assert (action.type, action.deployment_id) == ("run-deployment", deployment.id)
        assert automation.trigger.expect == {"prefect.flow-run.Crashed"}
        assert {"prefect.resource.role": "deployment", "prefect.resource.name": name} in [
            spec.root for spec in automation.trigger.match_related
        ]
    assert len(automations) == len(finetunes)


def test_a_deployment_run_executed_by_a_worker_runs_every_stage(deployed, first):
    run = flow_run(deployed, first)
    assert run.state.is_completed(), run.state.message
    assert run.name == NAME
    assert task_states(deployed, first) == {
        **{f"{stage} · tiny gemma3 · lora r64": "Completed" for stage in ALL_STAGES},
        "publish report": "Completed",
    }


def test_the_run_publishes_its_artifacts_under_the_deployments_keys(deployed, first):
    [report] = artifacts(deployed, "offline-nightly-report")
    assert report.flow_run_id == first and report.type == "markdown"
    assert report.data.startswith("# jaxtune report") and "| eval loss |" in report.data
    image = report.data.split("![loss curve](data:image/png;base64,")[1].split(")")[0]
    assert base64.b64decode(image).startswith(b"\x89PNG") and len(image) > 10_000  # inline, no URL to fetch
    [metrics] = artifacts(deployed, "offline-nightly-metrics")
    assert metrics.type == "table" and [row["metric"] for row in json.loads(metrics.data)] == [
        "eval loss",
        "perplexity",
        "exact match",
    ]
    [progress] = artifacts(deployed, "offline-nightly-train-progress")
    assert progress.type == "progress" and float(progress.data) == 100.0
    [stages] = artifacts(deployed, "offline-nightly-stages")
    assert [row["stage"] for row in json.loads(stages.data)] == list(ALL_STAGES)
    for row in json.loads(stages.data):
        [stage] = artifacts(deployed, f"offline-nightly-stage-{row['stage'].replace('_', '-')}")
        assert (
            row["folder"] in stage.data and row["key"] in stage.data and Path(row["folder"], "manifest.json").is_file()
        )


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


RESUMED = [*TOY, "train.max_steps=150", "train.checkpoint_every=10", "train.log_every=1"]


def flow_run_process(run_id, deadline: float):
    """The process a worker started for flow run `run_id` (it carries the run's id in its environment)."""
    import psutil

    while time.monotonic() < deadline:
        for process in psutil.process_iter():
            try:
                if process.environ().get("PREFECT__FLOW_RUN_ID") == str(run_id):
                    return process
            except (psutil.AccessDenied, psutil.NoSuchProcess, psutil.ZombieProcess):
                continue
        time.sleep(0.2)
    pytest.fail(f"no process for flow run {run_id}")


def restarts_of(server, run_id) -> list:
    from prefect.client.orchestration import get_client

    with server.client_settings(), get_client(sync_client=True) as client:
        return [r for r in client.read_flow_runs(limit=200) if r.parameters.get("restart_of") == str(run_id)]


def test_a_run_killed_mid_train_is_started_again_by_prefect_and_resumes_to_the_uninterrupted_weights(
    deployed, tmp_path
):
    """SIGKILL of a deployment run's process mid-train, the worker alive: the run ends Crashed, and
    the automation prefect.yaml declares (no person) starts it again with its parameters. The new
    run resumes from the checkpoint and ends with the weights and metrics of a run never killed."""
    whole_store, killed_store = tmp_path / "whole", tmp_path / "killed"
    whole = deployed.run_deployment(
        "offline-nightly", overrides=[*RESUMED, f"store.root={whole_store}"], until="final_eval"
    )
    killed = deployed.run_deployment(
        "offline-nightly", overrides=[*RESUMED, f"store.root={killed_store}"], until="final_eval"
    )
    worker = deployed.start(
        "worker-restart", str(BIN / "prefect"), "worker", "start", "--pool", "jaxtune", "--run-once"
    )
    deadline = time.monotonic() + 1200  # a ceiling: two runs at once on a busy 2-core machine
    process = flow_run_process(killed, deadline)
    while not (newest_checkpoint(killed_store) >= 20 and newest_logged(killed_store) > newest_checkpoint(killed_store)):
        assert process.is_running() and time.monotonic() < deadline, deployed.log("worker-restart")[-3000:]
        time.sleep(0.005)
    process.kill()
    killed_at = time.time()
    process.wait(30)
    saved, reached = newest_checkpoint(killed_store), newest_logged(killed_store)
    worker.wait(max(deadline - time.monotonic(), 1))  # it ends once the uninterrupted run has finished
    crashed = flow_run(deployed, killed)
    assert crashed.state.is_crashed(), (crashed.state, deployed.log("worker-restart")[-3000:])
    assert flow_run(deployed, whole).state.is_completed()

    while not (restarted := restarts_of(deployed, killed)):
        assert time.monotonic() < deadline, "no run was started after the crash"
        time.sleep(0.5)
    [restart] = restarted
    assert restart.deployment_id == crashed.deployment_id
    assert {k: restart.parameters[k] for k in ("recipe", "overrides", "until", "refresh")} == {
        "recipe": "offline",
        "overrides": crashed.parameters["overrides"],
        "until": "final_eval",
        "refresh": [],
    }
    deployed.work_once()
    restart = flow_run(deployed, restart.id)
    assert restart.state.is_completed() and restart.name == f"{crashed.name} · restart", restart.state
    assert not restarts_of(deployed, restart.id), "a run that completed is not started again"

    [resumed] = killed_store.glob("train/*/summary.json")
    summary = json.loads(resumed.read_text())
    assert summary["resumed_from"] == saved
    [interruption] = summary["interruptions"]
    assert interruption["reached"] >= reached and interruption["resumed_from"] == saved
    assert (interruption["stopped_by"], interruption["restart"]) == ("killed", True)
    for stage, name in (("train", "params.safetensors"), ("final_eval", "metrics.json")):
        [got], [expected] = (list(store.glob(f"{stage}/*/{name}")) for store in (killed_store, whole_store))
        assert got.read_bytes() == expected.read_bytes(), f"{stage}/{name}"
    print(
        f"killed after step {reached} (checkpoint {saved}); the restart was created "
        f"{restart.created.timestamp() - killed_at:.1f} s after the kill; it resumed from {saved}"
    )


def test_a_run_cancelled_mid_train_ends_cancelled_and_is_not_started_again(deployed, tmp_path):
    """A worker cancels a run by sending its process SIGTERM: train checkpoints and stops as on a
    spot VM's notice, but the run ends Cancelled, not Crashed, so the restart automation leaves it."""
    store = tmp_path / "cancelled"
    run_id = deployed.run_deployment("offline-nightly", overrides=[*RESUMED, f"store.root={store}"], until="train")
    worker = deployed.start("worker-cancel", str(BIN / "prefect"), "worker", "start", "--pool", "jaxtune", "--run-once")
    deadline = time.monotonic() + 900  # the worker, its flow run process and the first steps, on a busy machine
    while newest_logged(store) < 5:
        assert worker.poll() is None and time.monotonic() < deadline, deployed.log("worker-cancel")[-3000:]
        time.sleep(0.01)
    logged = newest_logged(store)
    deployed.prefect("flow-run", "cancel", str(run_id))
    worker.wait(max(deadline - time.monotonic(), 1))
    run = flow_run(deployed, run_id)
    assert run.state.is_cancelled(), (run.state, deployed.log("worker-cancel")[-3000:])
    step = newest_checkpoint(store)
    from prefect.client.orchestration import get_client

    with deployed.client_settings(), get_client(sync_client=True) as client:
        history = [(state.name, state.message or "") for state in client.read_flow_run_states(run_id)]
    # The run's own final state says where it stopped; the worker then records the cancel as done.
    [(name, message)] = [(name, message) for name, message in history if message.startswith("train: ")]
    assert name == "Cancelled" and message.startswith(f"train: stopped by SIGTERM at step {step}; checkpoint saved")
    assert "Crashed" not in [name for name, _ in history]
    assert step >= logged, "the step it reached is saved, not the last periodic checkpoint"
    time.sleep(5)  # what an automation would take to start a run
    assert not restarts_of(deployed, run_id)


def test_jaxtune_serve_serves_the_deployments_with_their_schedules(deployed, first, store):
    """`jaxtune serve` registers the deployments from prefect.yaml and runs what is triggered."""
    from prefect.client.orchestration import get_client

    serve = deployed.start(
        "serve", str(BIN / "jaxtune"), "serve", "--only", "offline-nightly", env={"PREFECT_RUNNER_POLL_FREQUENCY": "2"}
    )
    try:
        deadline = time.monotonic() + 600
        while "being served" not in deployed.log("serve"):
            assert serve.poll() is None and time.monotonic() < deadline, deployed.log("serve")[-3000:]
            time.sleep(1)
        with deployed.client_settings(), get_client(sync_client=True) as client:
            d = client.read_deployment_by_name("finetune/offline-nightly")
        assert [s.schedule.cron for s in d.schedules] == ["0 3 * * *"] and all(s.active for s in d.schedules)
        assert d.work_pool_name is None and "finetune/offline-nightly was a work-pool deployment" in deployed.log(
            "serve"
        )
        run_id = deployed.run_deployment("offline-nightly", overrides=[*TOY, f"store.root={store}"], until="tokenize")
        while not (run := flow_run(deployed, run_id)).state.is_final():
            assert serve.poll() is None and time.monotonic() < deadline + 600, deployed.log("serve")[-3000:]
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
        return client.read_task_runs(
            flow_run_filter=of_store, task_run_filter=TaskRunFilter(name=TaskRunFilterName(like_=f"{stage} · "))
        )


def test_two_runs_started_together_build_each_stage_once(server, tmp_path):
    store = tmp_path / "store"
    command = [str(BIN / "jaxtune"), "run", *[arg for o in (*TOY, f"store.root={store}") for arg in ("--set", o)]]
    runs = [server.start(f"run-{i}", *command) for i in (1, 2)]
    deadline = time.monotonic() + 1200
    while any(run.poll() is None for run in runs):
        assert time.monotonic() < deadline, "runs did not finish in 20 minutes"
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
