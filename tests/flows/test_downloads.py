"""Stages that download retry a passing network failure (a dropped connection, a timeout, a 429 or
5xx answer) three times, 10, 20 and 40 s apart, through Prefect's task retries; errors that would
fail again (offline mode, a missing repo, bad data) fail at once, and training is never retried
(it resumes from its checkpoint when the flow runs again)."""

from __future__ import annotations

import httpx
import pytest
from huggingface_hub import errors

from jaxtune.artifacts import ArtifactRef
from jaxtune.errors import DataError
from jaxtune.tasks import downloads

HUB = ArtifactRef(stage="hub", key="k", path="acme/tiny@main")
LOCAL = ArtifactRef(stage="source", key="k", path="/models/tiny")


def hub_error(status: int, kind: type[errors.HfHubHTTPError] = errors.HfHubHTTPError) -> errors.HfHubHTTPError:
    """What huggingface_hub raises when the hub answers `status`."""
    request = httpx.Request("GET", "https://huggingface.co/acme/tiny/resolve/main/tokenizer.json")
    return kind(f"{status} Client Error for url: {request.url}", response=httpx.Response(status, request=request))


def raised_from(cause: BaseException, outer: BaseException) -> BaseException:
    try:
        try:
            raise cause
        except BaseException as inner:
            raise outer from inner
    except BaseException as error:
        return error


def test_only_stages_reading_from_the_hub_retry_and_train_never_does():
    assert downloads.retry_options("tokenize", {"model": HUB})["retries"] == 3
    assert downloads.retry_options("baseline_eval", {"model": HUB, "data": LOCAL})["retries"] == 3
    assert downloads.retry_options("tokenize", {"model": LOCAL}) == {"retries": 0}
    assert downloads.retry_options("train", {"model": HUB, "data": LOCAL}) == {"retries": 0}
    assert downloads.retry_options("tokenize", {"model": HUB})["retry_delay_seconds"](3) == [10.0, 20.0, 40.0]


@pytest.mark.parametrize(
    ("error", "transient"),
    [
        (httpx.ConnectError("connection reset"), True),
        (TimeoutError("read timed out"), True),
        (raised_from(httpx.ReadTimeout("slow"), OSError("We couldn't connect to 'https://huggingface.co'")), True),
        (raised_from(httpx.ConnectError("reset"), DataError("acme/rows: could not load hub dataset")), True),
        (hub_error(429), True),
        (hub_error(500), True),
        (hub_error(503), True),
        (
            raised_from(hub_error(502), OSError("There was a specific connection error when trying to load acme/tiny")),
            True,
        ),
        (hub_error(404), False),
        (hub_error(401), False),
        (hub_error(404, errors.RepositoryNotFoundError), False),
        (
            raised_from(
                hub_error(404, errors.RepositoryNotFoundError), OSError("acme/tiny is not a valid model identifier")
            ),
            False,
        ),
        (hub_error(404, errors.RevisionNotFoundError), False),
        (errors.OfflineModeIsEnabled("HF_HUB_OFFLINE=1"), False),
        (raised_from(errors.OfflineModeIsEnabled("offline"), OSError("We couldn't connect")), False),
        (DataError("rows.jsonl line 3: not valid JSON"), False),
        (FileNotFoundError("no such file"), False),
    ],
)
def test_network_failures_are_transient_and_everything_else_is_not(error, transient):
    assert downloads.is_transient(error) is transient


def _tokenizer_failing(first: list[BaseException], folder):
    """`open_tokenizer` whose first calls raise `first`, then opens the tokenizer in `folder`."""
    from transformers import AutoTokenizer

    from jaxtune.data.templates import apply_chat_template_setting

    calls = []

    def open_tokenizer(ref, cfg):
        calls.append(ref.path)
        if len(calls) <= len(first):
            raise first[len(calls) - 1]
        return apply_chat_template_setting(AutoTokenizer.from_pretrained(folder), cfg.chat_template)

    return open_tokenizer, calls


@pytest.fixture(scope="module")
def tokenizer_folder(tmp_path_factory):
    from jaxtune.config import DataConfig
    from jaxtune.data.rows import read_rows
    from jaxtune.offline.tokenizer import texts_for_tokenizer, train_tokenizer

    folder = tmp_path_factory.mktemp("tokenizer")
    train_tokenizer(texts_for_tokenizer(read_rows(DataConfig())[:200]), 300, folder)
    return folder


def _tokenize_run(store, monkeypatch, opener, backoff: float = 0.0):
    from jaxtune.flows.finetune import finetune
    from jaxtune.tasks import tokenize

    monkeypatch.setattr(tokenize, "open_tokenizer", opener)
    monkeypatch.setattr(downloads, "BACKOFF_SECONDS", backoff)
    return finetune(
        overrides=["model.name=acme/tiny", "data.max_train_rows=32", "data.max_eval_rows=8", f"store.root={store}"],
        until="tokenize",
        return_state=True,
    )


def _run_counts(state, settle_seconds: float = 30.0) -> dict[str, int]:
    """How many times Prefect recorded each task of the run as run. The server records task runs
    from the events the engine sends, a moment after the flow returns: read until every task run's
    recorded state is final (each event carries its run count, the final one the last)."""
    import time

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    deadline = time.monotonic() + settle_seconds
    with get_client(sync_client=True) as client:
        while True:
            runs = client.read_task_runs(
                flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[state.state_details.flow_run_id]))
            )
            if (
                runs and all(run.state is not None and run.state.is_final() for run in runs)
            ) or time.monotonic() > deadline:
                return {run.task_key.split("-")[0]: run.run_count for run in runs}
            time.sleep(0.1)


def test_a_dropped_connection_is_retried_and_the_stage_completes(tmp_path, monkeypatch, tokenizer_folder):
    opener, calls = _tokenizer_failing([httpx.ConnectError("connection reset by peer")], tokenizer_folder)
    state = _tokenize_run(tmp_path / "store", monkeypatch, opener)
    assert state.is_completed()
    assert state.result()["stages"] == {"tokenize": "Completed"}
    assert len(calls) == 2 and _run_counts(state)["tokenize"] == 2


def test_offline_mode_is_not_retried(tmp_path, monkeypatch, tokenizer_folder):
    opener, calls = _tokenizer_failing([errors.OfflineModeIsEnabled("HF_HUB_OFFLINE is set")], tokenizer_folder)
    state = _tokenize_run(tmp_path / "store", monkeypatch, opener)
    assert state.is_failed()
    assert len(calls) == 1 and _run_counts(state)["tokenize"] == 1
    assert not list((tmp_path / "store").glob("tokenize/*"))


@pytest.fixture
def sleeps(monkeypatch) -> list[float]:
    """The seconds Prefect's task engine waits before each retry, recorded instead of slept, with
    the jitter off (each delay as the schedule gives it)."""
    import time
    import types

    from prefect import task_engine

    slept: list[float] = []
    clock = types.SimpleNamespace(**{name: getattr(time, name) for name in dir(time) if not name.startswith("_")})
    clock.sleep = slept.append
    monkeypatch.setattr(task_engine, "time", clock)
    monkeypatch.setattr(
        task_engine, "clamped_poisson_interval", lambda average_interval, clamping_factor: average_interval
    )
    return slept


def test_429_and_5xx_answers_are_retried_three_times_10_20_and_40_s_apart(
    tmp_path, monkeypatch, tokenizer_folder, sleeps
):
    opener, calls = _tokenizer_failing([hub_error(429), hub_error(500), hub_error(503)], tokenizer_folder)
    state = _tokenize_run(tmp_path / "store", monkeypatch, opener, backoff=downloads.BACKOFF_SECONDS)
    assert state.is_completed() and state.result()["stages"] == {"tokenize": "Completed"}
    assert len(calls) == 4 and _run_counts(state)["tokenize"] == 4
    assert [round(s) for s in sleeps] == [10, 20, 40], sleeps


def test_a_fourth_failure_is_not_retried(tmp_path, monkeypatch, tokenizer_folder):
    opener, calls = _tokenizer_failing([hub_error(503)] * 5, tokenizer_folder)
    state = _tokenize_run(tmp_path / "store", monkeypatch, opener)
    assert state.is_failed()
    assert len(calls) == 4 and _run_counts(state)["tokenize"] == 4
    assert not list((tmp_path / "store").glob("tokenize/*"))


def test_a_missing_repo_fails_at_once(tmp_path, monkeypatch, tokenizer_folder, sleeps):
    missing = raised_from(
        hub_error(404, errors.RepositoryNotFoundError), OSError("acme/tiny is not a valid model identifier")
    )
    opener, calls = _tokenizer_failing([missing], tokenizer_folder)
    state = _tokenize_run(tmp_path / "store", monkeypatch, opener, backoff=downloads.BACKOFF_SECONDS)
    assert state.is_failed()
    assert len(calls) == 1 and _run_counts(state)["tokenize"] == 1
    assert sleeps == []
    assert not list((tmp_path / "store").glob("tokenize/*"))
