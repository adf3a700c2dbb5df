"""Retries for the stages that download: a hub model or dataset may fail to arrive for a reason
that passes (a dropped connection, a timeout, the hub answering 429 or 5xx). Those stages retry
with exponential backoff through Prefect's task retries, and only for such errors: a missing
repo, a gated one, offline mode or bad data fail at once. Training is never retried: a crashed
train stage resumes from its checkpoint when the flow runs again.
"""

from __future__ import annotations

from typing import Any

from jaxtune.errors import chain

RETRIES = 3
BACKOFF_SECONDS = 10.0  # first delay; then 20, 40
NEVER_RETRIED = ("train",)


def downloads(stage: str, inputs: dict[str, Any]) -> bool:
    """Whether `stage` reads an input from the hub (its ref's stage is 'hub')."""
    return stage not in NEVER_RETRIED and any(getattr(ref, "stage", None) == "hub" for ref in inputs.values())


def retry_options(stage: str, inputs: dict[str, Any]) -> dict[str, Any]:
    """Task options for `stage`: retries with backoff when it downloads, none otherwise."""
    if not downloads(stage, inputs):
        return {"retries": 0}
    from prefect.tasks import exponential_backoff

    return {
        "retries": RETRIES,
        "retry_delay_seconds": exponential_backoff(BACKOFF_SECONDS),
        "retry_jitter_factor": 0.5,
        "retry_condition_fn": _transient_failure,
    }


def is_transient(error: BaseException) -> bool:
    """True when `error`, or an error it was raised from, is a network failure worth another try."""
    for link in chain(error):
        if _permanent(link):
            return False
        if _network(link):
            return True
    return False


def _transient_failure(task, task_run, state) -> bool:
    error = state.data if isinstance(state.data, BaseException) else state.result(raise_on_failure=False)
    return isinstance(error, BaseException) and is_transient(error)


def _permanent(error: BaseException) -> bool:
    from huggingface_hub import errors

    return isinstance(
        error, (errors.OfflineModeIsEnabled, errors.RepositoryNotFoundError, errors.RevisionNotFoundError)
    )


def _network(error: BaseException) -> bool:
    import httpx
    import requests
    from huggingface_hub import errors

    if isinstance(error, errors.HfHubHTTPError):
        status = getattr(getattr(error, "response", None), "status_code", None)
        return status is None or status == 429 or status >= 500
    return isinstance(
        error, (ConnectionError, TimeoutError, httpx.TransportError, requests.ConnectionError, requests.Timeout)
    )
