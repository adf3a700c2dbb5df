"""`jaxtune serve`: the deployments of `prefect.yaml`, with their schedules and parameters, served
from one process (Prefect's `serve`), for people without a work pool and worker.

The same file is the one source for both ways of running: `prefect deploy --all` reads it for a
work pool, and this reads it for `serve`. The process runs each due flow run in a subprocess
and pauses its deployments when it stops.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import yaml

from jaxtune.errors import ServeError

PREFECT_YAML = Path("prefect.yaml")


def read_deployments(path: Path = PREFECT_YAML, only: list[str] = ()) -> list[dict[str, Any]]:
    """The deployments declared in `path` (those named in `only`, if given), as written there."""
    try:
        declared = yaml.safe_load(Path(path).read_text())["deployments"]
    except (OSError, yaml.YAMLError, KeyError, TypeError) as e:
        raise ServeError(f"{path}: no deployments to serve ({e})") from e
    names = [d["name"] for d in declared]
    unknown = sorted(set(only) - set(names))
    if unknown:
        raise ServeError(f"{path} declares no deployment {', '.join(unknown)}; it declares {', '.join(names)}")
    return [d for d in declared if not only or d["name"] in only]


def _flows() -> dict[str, Any]:
    """The flows a deployment's entrypoint may name."""
    from jaxtune.flows.finetune import finetune
    from jaxtune.flows.plan import plan
    from jaxtune.flows.ray_job import ray_job

    return {
        "jaxtune/flows/finetune.py:finetune": finetune,
        "jaxtune/flows/plan.py:plan": plan,
        "jaxtune/flows/ray_job.py:ray_job": ray_job,
    }


def runner_deployments(declared: list[dict[str, Any]]) -> list:
    """Prefect `RunnerDeployment`s of the flow each declared deployment's entrypoint names, with its triggers."""
    from prefect.schedules import Cron

    flows = _flows()
    unknown = sorted({d["entrypoint"] for d in declared} - set(flows))
    if unknown:
        raise ServeError(f"no flow {', '.join(unknown)}; deployments run one of {', '.join(flows)}")
    return [
        flows[d["entrypoint"]].to_deployment(
            name=d["name"],
            description=d.get("description"),
            parameters=d.get("parameters") or {},
            schedules=[Cron(s["cron"], timezone=s.get("timezone")) for s in d.get("schedules") or []],
            tags=d.get("tags") or [],
            triggers=d.get("triggers") or [],  # the restart automation, as `prefect deploy` creates it
        )
        for d in declared
    ]


def take_over(names: list[str]) -> list[str]:
    """Delete the work-pool deployments named `names` ('flow/deployment'), returning those deleted.

    A served deployment cannot share its name with a pool one: serving upserts the same record,
    which keeps the pool but loses the pull step, and its runs then crash loading the flow. Run
    `prefect deploy --all` again to go back to the pool.
    """
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    deleted = []
    with get_client(sync_client=True) as client:
        for name in names:
            try:
                existing = client.read_deployment_by_name(name)
            except ObjectNotFound:
                continue
            if existing.work_pool_name is not None:
                client.delete_deployment(existing.id)
                deleted.append(name)
    return deleted


def serve(path: Path = PREFECT_YAML, only: list[str] = (), limit: int | None = 1) -> None:
    """Serve until interrupted. `limit` runs at once: one by default, since a run uses every core."""
    from prefect import serve as prefect_serve

    deployments = runner_deployments(read_deployments(path, only))
    for name in take_over([f"{d.flow_name}/{d.name}" for d in deployments]):
        print(f"jaxtune serve: {name} was a work-pool deployment; it is served from here now", file=sys.stderr)
    prefect_serve(*deployments, limit=limit)
