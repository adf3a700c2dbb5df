"""MLflow against a real server: a toy run logs its resolved config, every step's figures, the
report and adapter, and its stage keys and Prefect flow run; a cached re-run logs nothing new and
says so; a server that cannot be reached is one warning line and leaves the run as it was."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from tests.flows.toy import artifact, run_toy, states, toy_config
from tests.prefect_runs import all_pages, flow_runs_of_store
from tests.tracking.mlflow_server import free_port, mlflow_server

pytestmark = [pytest.mark.tracking, pytest.mark.slow]

EXPERIMENT = "toy-tracking"


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> str:
    with mlflow_server(tmp_path_factory.mktemp("mlflow")) as uri:
        yield uri


@pytest.fixture(scope="module")
def logged(server, tmp_path_factory) -> tuple[Path, dict]:
    store = tmp_path_factory.mktemp("store")
    settings = (f"tracking.mlflow_uri={server}", f"tracking.mlflow_experiment={EXPERIMENT}", "train.eval_every=2")
    return store, run_toy(store, *settings), settings


def _runs(server: str) -> list:
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=server)
    experiment = client.get_experiment_by_name(EXPERIMENT)
    return client.search_runs([experiment.experiment_id]) if experiment else []


def _messages(store: Path) -> list[list[str]]:
    """The log messages of each flow run in `store`, oldest run first."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    from tests.session_server import drain_to_server

    drain_to_server()
    with get_client(sync_client=True) as client:
        runs = sorted(flow_runs_of_store(client, store), key=lambda r: r.created)
        return [
            [
                log.message
                for log in all_pages(
                    lambda limit, offset, run=run: client.read_logs(
                        log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run.id])), limit=limit, offset=offset
                    )
                )
            ]
            for run in runs
        ]


def test_the_run_is_logged_with_its_config_metrics_files_and_keys(server, logged):
    from mlflow import MlflowClient

    from jaxtune.flows.finetune import planned_keys

    store, result, settings = logged
    [run] = _runs(server)
    assert result["mlflow_run"] == run.info.run_id and run.info.status == "FINISHED"
    params = run.data.params
    assert params["train.max_steps"] == "4" and params["tracking.mlflow_experiment"] == EXPERIMENT
    assert params["store.root"] == str(store) and params["model.name"] == "offline"

    client = MlflowClient(tracking_uri=server)
    log = [json.loads(line) for line in (artifact(store, "train") / "log.jsonl").read_text().splitlines()]
    for field, name in (
        ("loss", "loss"),
        ("eval_loss", "eval_loss"),
        ("lr", "learning_rate"),
        ("grad_norm", "grad_norm"),
        ("tokens_per_second", "tokens_per_second"),
        ("mfu", "mfu"),
    ):
        history = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, name))
        assert history == [(r["step"], pytest.approx(r[field])) for r in log if r.get(field) is not None], name
    final = json.loads((artifact(store, "final_eval") / "metrics.json").read_text())
    assert run.data.metrics["final_eval_loss"] == pytest.approx(final["loss"])

    files = {f.path for f in client.list_artifacts(run.info.run_id, "report")}
    assert files == {"report/report.md", "report/report.json", "report/loss.png"}
    adapter = {f.path for f in client.list_artifacts(run.info.run_id, "adapter")}
    assert {"adapter/adapter_config.json", "adapter/adapter_model.safetensors"} <= adapter
    report = Path(client.download_artifacts(run.info.run_id, "report/report.md", str(store.parent / "downloaded")))
    assert report.read_text() == (artifact(store, "report") / "report.md").read_text()

    keys = planned_keys(toy_config(store, *settings))
    assert {stage: run.data.tags[f"jaxtune.key.{stage}"] for stage in keys} == keys
    assert run.data.tags["jaxtune.run_key"] == f"report/{keys['report']}"
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as prefect:
        [flow_run] = flow_runs_of_store(prefect, store)
    assert run.data.tags["prefect.flow_run_id"] == str(flow_run.id)
    if "prefect.flow_run_url" in run.data.tags:
        assert run.data.tags["prefect.flow_run_url"].endswith(f"/flow-runs/flow-run/{flow_run.id}")


def test_a_cached_rerun_logs_nothing_new_and_says_so(server, logged):
    store, first, settings = logged
    [before] = _runs(server)
    again = run_toy(store, *settings)
    assert set(states(again).values()) == {"Cached"}
    assert again["mlflow_run"] == first["mlflow_run"]
    [after] = _runs(server)
    assert after.info.run_id == before.info.run_id and after.data.metrics == before.data.metrics
    said = [m for m in _messages(store)[-1] if m.startswith("MLflow:")]
    assert len(said) == 1 and "nothing new logged" in said[0], said


def test_an_unreachable_server_is_one_warning_and_costs_seconds(tmp_path):
    down = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    store = tmp_path / "store"
    started = time.monotonic()
    result = run_toy(store, f"tracking.mlflow_uri={down}")
    seconds = time.monotonic() - started
    assert set(states(result).values()) == {"Completed"} and result["mlflow_run"] is None
    [said] = [m for m in _messages(store)[-1] if "MLflow" in m]
    assert said.startswith("MLflow: not logged: the tracking server") and down in said
    print(f"toy run with the MLflow server down: {seconds:.1f} s")
