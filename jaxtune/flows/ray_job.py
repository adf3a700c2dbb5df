"""The `ray-job` flow: a recipe's run as a job of several hosts on a Ray cluster, from a deployment.

Its flow run is the job's driver: it connects to the cluster (`address`, else RAY_ADDRESS, else
the cluster of the host it runs on), reserves the processes as one gang and starts `jaxtune run`
in each (`jaxtune.host.ray_job`, as `jaxtune launch --ray` does), logs every process's lines into
this run's logs as they come, `[i] ` before each, restarts the whole job after a failure that may
not repeat, and ends with the job's status: Completed, or Failed naming the status. Process 0's
own `jaxtune run` is a finetune flow run on the same Prefect server (where the Ray nodes have
PREFECT_API_URL), with the stages, artifacts and report of any run.

Why the flow run drives the job itself, rather than Ray's job API or `prefect-ray`: the job API
would run the same driver as one more process on the head node, behind Ray's dashboard server,
and this run would only tail its logs; `prefect-ray`'s task runner sends Prefect tasks to Ray
workers one by one, with no gang to reserve, fail and restart as a whole.
"""

from __future__ import annotations

import os

from prefect import flow, get_run_logger

from jaxtune.config import OFFLINE
from jaxtune.errors import ConfigError
from jaxtune.tracking import ui


def _run_name() -> str:
    from prefect.runtime import flow_run

    parameters = flow_run.parameters
    hosts = f"{parameters.get('processes') or 'slice'} processes"
    return ui.SEPARATOR.join(("ray", ui.recipe_label(parameters.get("recipe") or OFFLINE), hosts))


@flow(name="ray-job", flow_run_name=_run_name, persist_result=False)
def ray_job(
    recipe: str = OFFLINE,
    overrides: list[str] = [],  # noqa: B006
    processes: int | None = None,
    tpu: list[str] | None = None,
    cpu_devices: int | None = None,
    restarts: int = 2,
    address: str | None = None,
    until: str = "report",
) -> int:
    """Run `jaxtune run RECIPE` as one job of several processes on a Ray cluster.

    Args:
        recipe: a recipe YAML file, relative to the folder the processes run in, or offline.
        overrides: settings changed for this run, each section.key=value (store.root: a folder
            every host sees).
        processes: processes in the job, each on a node of its own; with `tpu`, its hosts'.
        tpu: [version, topology] of a TPU slice, e.g. ["v5e", "4x4"]: one process on each host.
        cpu_devices: for testing on CPUs: each process runs on this many fake CPU devices.
        restarts: how many times the whole job starts again after a failure that may not repeat.
        address: the Ray cluster's address; default RAY_ADDRESS, else this host's cluster.
        until: the last stage to run.

    Returns 0 when every process ended well; a job that failed ends the run Failed.
    """
    from jaxtune.errors import LaunchError
    from jaxtune.host import ray_job as job

    logger = get_run_logger()
    arguments = ["run", *([] if recipe == OFFLINE else [recipe]), "--until", until]
    arguments += [a for setting in overrides for a in ("--set", setting)]
    try:
        gang = job.gang(processes, tuple(tpu) if tpu else None)
    except LaunchError as error:
        raise ConfigError(str(error)) from None
    status = job.run(
        arguments, gang, address or os.environ.get("RAY_ADDRESS") or "auto", cpu_devices, restarts, sink=logger.info
    )
    if status != 0:
        raise RuntimeError(f"the job on Ray ended with status {status} (its processes' last lines are above)")
    return status
