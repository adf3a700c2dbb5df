"""Credentials in an MLflow tracking URI, and a hub token, stay out of the trackers: a `jaxtune run`
with both in its environment, logging to TensorBoard and to a real MLflow server, leaves neither
on its console, in the store (TensorBoard's event files included), in MLflow's database and
artifacts, or in the Prefect run's logs and artifacts."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.flows.toy import TOY
from tests.prefect_runs import all_pages, flow_runs_of_store
from tests.safety.test_hub_token import TOKEN, _database_folder, run_cli
from tests.tracking.mlflow_server import mlflow_server

pytestmark = [pytest.mark.safety, pytest.mark.tracking, pytest.mark.slow]

PASSWORD = "trackerPASSWORD0123456789"
USER = "trackeruser"
# Any recognisable piece of either secret counts.
NEEDLES = (TOKEN, TOKEN[len("hf_") :], PASSWORD, f"{USER}:")


def leaks(text: str | bytes) -> list[str]:
    data = text if isinstance(text, bytes) else text.encode()
    return [n for n in NEEDLES if n.encode() in data]


def files_with_secrets(folder: Path) -> list[str]:
    """Every file under `folder` (hidden ones too, symlinks not followed) whose bytes hold a secret."""
    return sorted(
        str(p.relative_to(folder))
        for p in folder.rglob("*")
        if p.is_file() and not p.is_symlink() and leaks(p.read_bytes())
    )


def test_the_search_finds_planted_secrets(tmp_path):
    (tmp_path / "events.out.tfevents.1").write_bytes(b"\x00uri http://" + f"{USER}:{PASSWORD}".encode() + b"@h\x01")
    (tmp_path / "clean").write_text("http://***@127.0.0.1:5000")
    assert files_with_secrets(tmp_path) == ["events.out.tfevents.1"]


@pytest.mark.usefixtures("prefect_server")
def test_tracking_uri_credentials_and_a_hub_token_reach_no_tracker(tmp_path):
    from mlflow import MlflowClient
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, LogFilter, LogFilterFlowRunId

    store, mlflow_folder = tmp_path / "store", tmp_path / "mlflow"
    with mlflow_server(mlflow_folder) as uri:
        secret_uri = uri.replace("http://", f"http://{USER}:{PASSWORD}@")
        env = {"HF_TOKEN": TOKEN, "HUGGING_FACE_HUB_TOKEN": TOKEN, "MLFLOW_TRACKING_URI": secret_uri}
        done = run_cli(
            env,
            *[arg for o in TOY for arg in ("--set", o)],
            "--set",
            f"store.root={store}",
            "--set",
            "tracking.tensorboard=true",
            "--until",
            "report",
        )
        assert done.returncode == 0, done.stderr[-4000:]
        [run] = MlflowClient(tracking_uri=uri).search_runs(
            [MlflowClient(tracking_uri=uri).get_experiment_by_name("jaxtune").experiment_id]
        )
        assert run.info.status == "FINISHED", "the run was logged through the URI with credentials"

    assert not leaks(done.stdout) and not leaks(done.stderr)
    assert "http://***@127.0.0.1" in done.stderr + done.stdout, "the MLflow line names the URI, masked"
    # The store, TensorBoard's event files with it.
    assert list(store.glob("train/*/tensorboard/events.out.tfevents.*")), "event files were written"
    assert files_with_secrets(store) == []
    # MLflow's database, its artifact root (the report, the adapter) and the server's own log.
    assert list(mlflow_folder.glob("artifacts/**/report.md")) and (mlflow_folder / "mlflow.db").is_file()
    assert files_with_secrets(mlflow_folder) == []
    assert not leaks(repr(run.data.params)) and not leaks(repr(run.data.tags))
    # The Prefect run: its logs and artifacts, and the server's database.
    with get_client(sync_client=True) as client:
        [flow_run] = flow_runs_of_store(client, store)
        logs = all_pages(
            lambda limit, offset: client.read_logs(
                log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run.id])), limit=limit, offset=offset
            )
        )
        artifacts = all_pages(
            lambda limit, offset: client.read_artifacts(
                artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run.id])),
                limit=limit,
                offset=offset,
            )
        )
    assert any(log.message.startswith("MLflow: logged run") for log in logs)
    assert [log.message for log in logs if leaks(log.model_dump_json())] == []
    assert any((a.key or "").endswith("-train-curve") for a in artifacts)
    assert [a.key for a in artifacts if leaks(a.model_dump_json())] == []
    assert not leaks(flow_run.model_dump_json())
    database = _database_folder()
    assert database is not None and files_with_secrets(database) == []
