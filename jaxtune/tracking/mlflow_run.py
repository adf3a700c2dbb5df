"""The run in MLflow: params (the resolved config), metrics per step, the report and adapter as
artifacts, tags naming every stage's key and the Prefect flow run.

Logged once the flow's stages are done, from their artifacts, so the tracker can neither slow nor
fail training: a server that cannot be reached costs one check of a few seconds and one warning
line. A run is found again by the key of its last stage (`KEY_TAG`): a re-run whose stages an
MLflow run already holds logs nothing new and says so. Credentials in the tracking URI never
leave it: every message names the URI without them.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

from jaxtune.artifacts import ArtifactRef
from jaxtune.config import JaxtuneConfig, without_credentials
from jaxtune.errors import first_line
from jaxtune.host.environment import temporary_environment
from jaxtune.records import EvalMetrics, GenerateMetrics, TrainSummary

KEY_TAG = "jaxtune.run_key"
CHECK_SECONDS = 3.0  # the reachability check before anything is logged
# MLflow's client retries a failed request 7 times with backoff (minutes); the server has just
# answered the check, so a few quick tries are enough, unless the user set their own.
HTTP_DEFAULTS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_TIMEOUT": "30"}
# Whatever the user set: the client prints the run's address to stdout, credentials and all.
CLIENT_SETTINGS = {"MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT": "true"}
STEP_METRICS = {
    "loss": "loss",
    "eval_loss": "eval_loss",
    "lr": "learning_rate",
    "grad_norm": "grad_norm",
    "tokens_per_second": "tokens_per_second",
    "mfu": "mfu",
    # GRPO: the step's sampled answers (and each reward's mean, `reward/NAME`)
    "reward": "reward",
    "reward_std": "reward_std",
    "kl": "kl",
    "clip_fraction": "clip_fraction",
    "completion_length": "completion_length",
    "truncated": "truncated",
}
REPORT_FILES = ("report.md", "report.json", "loss.png")


def log_run(config: JaxtuneConfig, done: Mapping[str, ArtifactRef], states: Mapping[str, str], logger) -> str | None:
    """Log the finished stages `done` to the configured MLflow server; the MLflow run id, or None
    when there is no server to log to (no URI, mlflow not installed, unreachable, refused)."""
    uri = config.tracking.mlflow_target()
    if uri is None or not done:
        return None
    shown = without_credentials(uri)
    try:
        import mlflow  # noqa: F401 - the optional extra
    except ImportError:
        logger.warning("MLflow: not logged to %s: mlflow is not installed (pip install 'jaxtune[mlflow]')", shown)
        return None
    problem = unreachable(uri)
    if problem is not None:
        logger.warning(
            "MLflow: not logged: the tracking server %s cannot be reached (%s); the run is complete without it",
            shown,
            problem,
        )
        return None
    try:
        with _client_settings():
            return _log(uri, config, done, states, logger)
    except Exception as error:  # noqa: BLE001 - a tracker's failure is a warning: the run's artifacts are complete
        logger.warning("MLflow: logging to %s failed: %s", shown, without_credentials(first_line(error)))
        return None


def _client_settings():
    """MLflow's client settings while it logs: `HTTP_DEFAULTS` where the user set none, `CLIENT_SETTINGS` always."""
    return temporary_environment(
        {**HTTP_DEFAULTS, **{k: os.environ[k] for k in HTTP_DEFAULTS if k in os.environ}, **CLIENT_SETTINGS}
    )


def unreachable(uri: str) -> str | None:
    """Why an http(s) tracking server does not answer its health check, or None when it does (or
    the URI is no server: a local folder or database)."""
    if not uri.startswith(("http://", "https://")):
        return None
    import httpx

    try:
        httpx.get(f"{uri.rstrip('/')}/health", timeout=CHECK_SECONDS).raise_for_status()
    except httpx.HTTPError as error:
        return without_credentials(f"{type(error).__name__}: {first_line(error)}")
    return None


def _log(uri: str, config: JaxtuneConfig, done: Mapping[str, ArtifactRef], states: Mapping[str, str], logger) -> str:
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    name = config.tracking.mlflow_experiment
    experiment = client.get_experiment_by_name(name)
    experiment_id = experiment.experiment_id if experiment else client.create_experiment(name)
    run_key = f"{list(done)[-1]}/{list(done.values())[-1].key}"
    found = client.search_runs([experiment_id], filter_string=f"tags.`{KEY_TAG}` = '{run_key}'", max_results=1)
    if found:
        logger.info(
            "MLflow: run %s (experiment %s) already holds these stages (%s): nothing new logged",
            found[0].info.run_id,
            name,
            run_key,
        )
        return found[0].info.run_id
    run = client.create_run(experiment_id, run_name=_prefect_run_name(), tags=tags(done, states, run_key))
    run_id = run.info.run_id
    params, metrics = run_params(config), run_metrics(done)
    for chunk in _chunks(params, 100):  # MLflow's limits per batch
        client.log_batch(run_id, params=chunk)
    for chunk in _chunks(metrics, 1000):
        client.log_batch(run_id, metrics=chunk)
    logged = _log_files(client, run_id, done)
    client.set_terminated(run_id)
    logger.info(
        "MLflow: logged run %s (%s/#/experiments/%s/runs/%s): %d params, %d metric values, %s",
        run_id,
        without_credentials(uri).rstrip("/"),
        experiment_id,
        run_id,
        len(params),
        len(metrics),
        ", ".join(logged) or "no files",
    )
    return run_id


def tags(done: Mapping[str, ArtifactRef], states: Mapping[str, str], run_key: str) -> dict[str, str]:
    """Every stage's key and state, this run's key, and the Prefect flow run (id and page)."""
    from prefect.runtime import flow_run

    found = {
        KEY_TAG: run_key,
        **{f"jaxtune.key.{stage}": ref.key for stage, ref in done.items()},
        **{f"jaxtune.state.{stage}": state for stage, state in states.items()},
    }
    if flow_run.id is not None:
        found["prefect.flow_run_id"] = str(flow_run.id)
        url = flow_run.ui_url
        if url and not url.startswith("None/"):  # no UI address configured
            found["prefect.flow_run_url"] = url
    return found


def run_params(config: JaxtuneConfig) -> list:
    """The resolved config, flattened to `section.key` params (credentials in URIs masked)."""
    from mlflow.entities import Param

    return [Param(key, without_credentials(str(value))[:6000]) for key, value in _flat(config.model_dump(mode="json"))]


def _flat(value, prefix: str = "") -> Iterator[tuple[str, object]]:
    if isinstance(value, dict) and value:
        for key, item in value.items():
            yield from _flat(item, f"{prefix}{key}.")
    else:
        yield prefix.rstrip("."), value


def run_metrics(done: Mapping[str, ArtifactRef]) -> list:
    """The train log's figures at every step, the train summary's numbers, and the evals' and
    generations' results before and after."""
    from mlflow.entities import Metric

    now = int(time.time() * 1000)
    metrics = []
    if "train" in done:
        for record in (json.loads(line) for line in done["train"].file("log.jsonl").read_text().splitlines()):
            metrics += [
                Metric(name, float(record[field]), now, record["step"])
                for field, name in STEP_METRICS.items()
                if record.get(field) is not None
            ]
            metrics += [
                Metric(_metric_name(field), float(value), now, record["step"])
                for field, value in record.items()
                if field.startswith("reward/")
            ]
        summary = TrainSummary.read(done["train"].file("summary.json")).model_dump(exclude_none=True)
        metrics += [
            Metric(f"train_{k}", float(v), now, summary["steps"])
            for k, v in summary.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool)
        ]
    for stage in ("baseline_eval", "final_eval"):
        if stage in done:
            figures = EvalMetrics.read(done[stage].file("metrics.json"))  # a GRPO eval has rewards, no loss
            metrics += [
                Metric(f"{stage}_{k}", float(getattr(figures, k)), now, 0)
                for k in ("loss", "perplexity", "reward")
                if getattr(figures, k) is not None
            ]
            metrics += [
                Metric(_metric_name(f"{stage}_reward/{name}"), float(value), now, 0)
                for name, value in (figures.rewards or {}).items()
            ]
    if "generate" in done:
        exact = GenerateMetrics.read(done["generate"].file("metrics.json")).exact_match
        metrics += [Metric(f"exact_match_{when}", float(getattr(exact, when)), now, 0) for when in ("before", "after")]
    return metrics


def _metric_name(name: str) -> str:
    """`name` in the characters MLflow takes in a metric's name: a reward's spec may hold others
    (format:REGEX); each becomes '_'."""
    return re.sub(r"[^\w\-. /]", "_", name)[:250]


def _log_files(client, run_id: str, done: Mapping[str, ArtifactRef]) -> list[str]:
    """The report's files under report/, and a LoRA adapter under adapter/; what was logged."""
    logged = []
    if "report" in done:
        for name in REPORT_FILES:
            client.log_artifact(run_id, str(done["report"].file(name)), "report")
        logged.append("report")
    adapter = Path(done["export"].path) / "adapter" if "export" in done else None
    if adapter is not None and adapter.is_dir():
        client.log_artifacts(run_id, str(adapter), "adapter")
        logged.append("adapter")
    return logged


def _prefect_run_name() -> str | None:
    from prefect.runtime import flow_run

    return flow_run.name if flow_run.id is not None else None


def _chunks(items: list, size: int) -> Iterator[list]:
    for start in range(0, len(items), size):
        yield items[start : start + size]
