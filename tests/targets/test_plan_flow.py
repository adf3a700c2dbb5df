"""The `plan` flow on the session's Prefect server: a recipe's steps compiled for its plan.target
here, published as an artifact, and only a plan that fits queues a run of the accelerator's
deployment, with the same recipe and overrides."""

from __future__ import annotations

import dataclasses

import pytest

from jaxtune.flows.plan import plan

pytestmark = pytest.mark.target

DEPLOYMENT = "planned-accelerator-run"
OVERRIDES = ["train.max_steps=3"]


@pytest.fixture(scope="module", autouse=True)
def _on_the_server(prefect_server):
    yield


@pytest.fixture(scope="module")
def recipe(tiny_folder, tmp_path_factory):
    """A recipe for the tiny model, written for one v5e chip: 4 rows of 64 tokens, as the doctor's tests plan it."""
    path = tmp_path_factory.mktemp("recipes") / "tiny-on-v5e.yaml"
    path.write_text(
        f"model:\n  name: {tiny_folder}\ndata:\n  max_length: 64\ntrain:\n  batch_size: 4\nplan:\n  target: v5e-1\n"
    )
    return path


@pytest.fixture(scope="module")
def deployment():
    """The accelerator's deployment of the finetune flow (no worker here: its runs wait, Scheduled)."""
    from jaxtune.flows.finetune import finetune

    return finetune.to_deployment(name=DEPLOYMENT).apply()


def _runs_of(deployment_id) -> list:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId

    with get_client(sync_client=True) as client:
        return client.read_flow_runs(deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[deployment_id])))


def _newest_artifact(key: str):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey
    from prefect.client.schemas.sorting import ArtifactSort

    with get_client(sync_client=True) as client:
        return client.read_artifacts(
            artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key])), sort=ArtifactSort.CREATED_DESC, limit=1
        )[0]


def test_a_plan_that_fits_queues_the_accelerators_run_with_the_same_recipe(recipe, deployment):
    before = len(_runs_of(deployment))
    result = plan(recipe=str(recipe), overrides=OVERRIDES, then=f"finetune/{DEPLOYMENT}")
    assert result["target"] == "v5e-1" and result["fits"] is True
    runs = _runs_of(deployment)
    assert len(runs) == before + 1
    [queued] = [run for run in runs if str(run.id) == result["queued"]]
    assert queued.parameters == {"recipe": str(recipe), "overrides": OVERRIDES}
    assert queued.state.is_scheduled()  # waiting for the accelerator pool's worker
    artifact = _newest_artifact("tiny-on-v5e-plan")
    assert "| train step memory, peak |" in artifact.data and "15.75 GiB HBM | ok |" in artifact.data
    assert artifact.data.rstrip().endswith(
        "**fits: the train, eval and decode steps' XLA peaks are within the "
        "target's memory (parity not checked: run doctor without --target)**"
    )


def test_a_plan_that_does_not_fit_fails_naming_the_figures_and_queues_nothing(recipe, deployment, monkeypatch):
    from jaxtune.checks import target_plan
    from jaxtune.runtime.devices import targets

    # One v5e chip with 64 KiB of HBM: the tiny model's steps, as they are, do not fit it.
    monkeypatch.setitem(targets.CHIPS, "v5e", dataclasses.replace(targets.CHIPS["v5e"], hbm=64 * 2**10))
    monkeypatch.setattr(
        target_plan, "MAX_SLICES_TRIED", 0
    )  # no larger slice compiled: shown by tests/targets/test_targets
    before = len(_runs_of(deployment))
    state = plan(recipe=str(recipe), overrides=OVERRIDES, then=f"finetune/{DEPLOYMENT}", return_state=True)
    assert state.is_failed()
    assert state.message.startswith(
        "v5e-1: MEMORY: a step does not fit the target as configured; train step memory, peak: "
    )
    # train.remat auto: every policy, then every split of the 4 rows; the most economical is shown
    assert "with its code (bfloat16, adamw, remat layer, 4 x 1 x 64), over 0.1 MiB HBM; " in state.message
    assert "; to fit: train.optimizer=adafactor " in state.message  # the knobs, as the doctor names them
    assert len(_runs_of(deployment)) == before
    artifact = _newest_artifact("tiny-on-v5e-plan")
    assert "| 0.1 MiB HBM | FAIL |" in artifact.data
    assert artifact.data.rstrip().endswith("**MEMORY: a step does not fit the target as configured**")


def test_a_recipe_without_a_target_is_refused_before_anything_compiles(tiny_folder, tmp_path):
    from jaxtune.errors import ConfigError

    path = tmp_path / "no-target.yaml"
    path.write_text(f"model:\n  name: {tiny_folder}\n")
    with pytest.raises(
        ConfigError,
        match=r"no-target.yaml: no plan.target to plan for; set one in the recipe, "
        r"or give the flow a target",
    ):
        plan(recipe=str(path))
