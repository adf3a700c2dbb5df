"""A Hugging Face token in the environment stays there: a `jaxtune run` with HF_TOKEN set leaves
it nowhere it could be read later: not on its console, not in the store, not in the Prefect
run (logs, parameters, task runs, artifacts), not in Prefect's database or home folder."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.flows.toy import TOY
from tests.prefect_runs import all_pages, flow_runs_of_store

pytestmark = [pytest.mark.safety, pytest.mark.slow]

ROOT = Path(__file__).parents[2]
TOKEN = "hf_jaxtuneFAKEtoken0123456789abcdef"
# Any recognisable piece of it counts, with or without its prefix.
NEEDLES = (TOKEN, TOKEN[len("hf_") :])


def run_cli(env_extra: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    """`python -m jaxtune.cli run ...` against the session's Prefect server, as test_failure_message runs it."""
    from prefect.settings import PREFECT_API_URL

    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value(), "PYTHONPATH": str(ROOT), **env_extra}
    return subprocess.run(
        [sys.executable, "-m", "jaxtune.cli", "run", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def leaks(text: str | bytes) -> list[str]:
    """The pieces of the token found in `text`."""
    if isinstance(text, bytes):
        return [n for n in NEEDLES if n.encode() in text]
    return [n for n in NEEDLES if n in text]


def files_with_token(folder: Path) -> list[str]:
    """Every file under `folder` (hidden ones too, symlinks not followed) whose bytes hold the token."""
    found = []
    for current, _, files in os.walk(folder):
        for name in files:
            path = Path(current, name)
            if path.is_symlink() or not path.is_file():
                continue
            try:
                data = path.read_bytes()
            except OSError:
                continue
            if leaks(data):
                found.append(str(path.relative_to(folder)))
    return found


def _database_folder() -> Path | None:
    """The folder of the session server's SQLite database."""
    from prefect.settings import PREFECT_SERVER_DATABASE_CONNECTION_URL

    url = PREFECT_SERVER_DATABASE_CONNECTION_URL.value() or ""
    prefix = "sqlite+aiosqlite:///"
    return Path(url[len(prefix) :]).parent if url.startswith(prefix) else None


def test_the_search_finds_a_planted_token(tmp_path):
    """Each search below would report the token if it were there."""
    (tmp_path / ".hidden").mkdir()
    (tmp_path / ".hidden" / "result.json").write_bytes(b'{"env": "' + TOKEN.encode() + b'"}')
    (tmp_path / "clean.txt").write_text("nothing here")
    assert files_with_token(tmp_path) == [".hidden/result.json"]
    assert leaks(f"token={TOKEN[3:]}") and leaks(TOKEN.encode()) and not leaks("hf_***")


@pytest.mark.usefixtures("prefect_server")
def test_a_run_with_a_hub_token_in_its_environment_keeps_it_out_of_logs_and_artifacts(tmp_path):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        ArtifactFilter,
        ArtifactFilterFlowRunId,
        FlowRunFilter,
        FlowRunFilterId,
        LogFilter,
        LogFilterFlowRunId,
    )
    from prefect.settings import PREFECT_HOME

    env = {"HF_TOKEN": TOKEN, "HUGGING_FACE_HUB_TOKEN": TOKEN}
    # The token really is where Hugging Face code looks: a leak would be this very string.
    probe = subprocess.run(
        [sys.executable, "-c", "from huggingface_hub import get_token; print(get_token())"],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert probe.stdout.strip() == TOKEN, probe.stderr[-2000:]

    store = tmp_path / "store"
    started = time.monotonic()
    done = run_cli(
        env, *[arg for o in TOY for arg in ("--set", o)], "--set", f"store.root={store}", "--until", "report"
    )
    assert done.returncode == 0, done.stderr[-4000:]
    print(f"toy run: {time.monotonic() - started:.0f} s")

    # The console.
    assert done.stdout.strip().splitlines()[-1].startswith(str(store.resolve()))
    assert not leaks(done.stdout) and not leaks(done.stderr)

    # The store: every file, manifests, Prefect result records and lock files included.
    assert len(list(store.glob("*/*/manifest.json"))) == 9, "every stage wrote its artifact"
    assert files_with_token(store) == []

    with get_client(sync_client=True) as client:
        [run] = flow_runs_of_store(client, store)
        logs = all_pages(
            lambda limit, offset: client.read_logs(
                log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run.id])), limit=limit, offset=offset
            )
        )
        task_runs = all_pages(
            lambda limit, offset: client.read_task_runs(
                flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[run.id])), limit=limit, offset=offset
            )
        )
        artifacts = all_pages(
            lambda limit, offset: client.read_artifacts(
                artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[run.id])),
                limit=limit,
                offset=offset,
            )
        )

    assert run.state.is_completed()
    # The flow run: its parameters, and all else it records (context, job variables, labels, ...).
    assert any(f"store.root={store}" in o for o in run.parameters["overrides"])
    assert not leaks(repr(run.parameters)) and not leaks(run.model_dump_json())
    # Its logs, its task runs' logs with them.
    assert len(logs) >= 5 and any("stages:" in log.message for log in logs)
    # The runtime's compile progress is in the run's log and on the console, not only in Python's logging.
    assert any(log.message.startswith("compiling train_step (") and log.task_run_id for log in logs)
    assert any(log.message.startswith("compiled train_step (") for log in logs)
    assert "compiling train_step (" in done.stdout + done.stderr
    assert [log.message for log in logs if leaks(log.message) or leaks(log.model_dump_json())] == []
    # Its task runs.
    assert len(task_runs) >= 9
    assert [t.name for t in task_runs if leaks(t.model_dump_json())] == []
    # Its artifacts: the report, the metrics table, one per stage and the stages table.
    assert len(artifacts) >= 12 and any(a.type == "markdown" and "report" in (a.key or "") for a in artifacts)
    assert [a.key for a in artifacts if leaks(a.model_dump_json())] == []

    # Whatever else Prefect keeps: the server's database (events included) and the Prefect home.
    database = _database_folder()
    assert database is not None and any(database.glob("*.db")), "the session server's database was found"
    assert files_with_token(database) == []
    assert files_with_token(Path(PREFECT_HOME.value())) == []
