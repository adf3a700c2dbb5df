"""The `plan` flow: a run checked against the chip it is written for before it is queued there.

On a CPU work pool, it compiles the recipe's train, eval and decode steps for `plan.target` (as
`jaxtune doctor MODEL --config RECIPE --target` does: from the model's config alone, no weight
read, no accelerator needed), publishes the plan as a markdown artifact beside the recipe's other
artifacts (`<recipe>-plan`), and ends Failed when a step does not fit, naming the figures and
what would fit. When every step fits and `then` names a deployment (the recipe's run on the
accelerator pool), it queues a run of it with the same recipe and overrides: a config that cannot
fit never waits for the chips, nor holds them while it finds out.
"""

from __future__ import annotations

import os

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact
from prefect.states import Failed

from jaxtune.config import OFFLINE
from jaxtune.errors import ConfigError
from jaxtune.flows.finetune import load_recipe
from jaxtune.tracking import ui


def _run_name() -> str:
    from prefect.runtime import flow_run

    parameters = flow_run.parameters
    recipe = parameters.get("recipe") or OFFLINE
    target = parameters.get("target")
    if not target:
        try:
            target = load_recipe(recipe, parameters.get("overrides") or []).plan.target
        except (ValueError, OSError):  # the flow itself says what is wrong with the recipe
            target = None
    return ui.SEPARATOR.join(("plan", ui.recipe_label(recipe), target or "no target"))


@flow(name="plan", flow_run_name=_run_name, persist_result=False)
def plan(recipe: str, overrides: list[str] = [], target: str | None = None, then: str | None = None) -> dict:  # noqa: B006
    """Plan the recipe's run for its chip here, then queue it there if it fits.

    Args:
        recipe: a recipe YAML file, relative to the folder the flow runs in, e.g.
            configs/gemma3-1b-dolly-lora.yaml.
        overrides: settings changed for this run, each section.key=value; the queued run gets them too.
        target: the accelerator to plan for (v5e-1, v5e-8, v6e-1, v5p-8, h100, ...), if not the
            recipe's plan.target.
        then: the deployment to queue a run of when every step fits, e.g. finetune/gemma3-1b-dolly-lora.

    Returns {"target", "fits": True, "queued": the queued flow run's id or None}; a plan that does
    not fit ends the run Failed, with the plan's verdict as its message.
    """
    config = load_recipe(recipe, overrides)
    name = target or config.plan.target
    if not name:
        raise ConfigError(f"{recipe}: no plan.target to plan for; set one in the recipe, or give the flow a target")
    # Planning compiles for the target's devices alone: no local accelerator is looked for.
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from jaxtune.checks.doctor import render_markdown, verdict
    from jaxtune.checks.target_plan import plan_for_target

    diagnosis = plan_for_target(config.model.name, config, name, revision=config.model.revision)
    create_markdown_artifact(
        key=f"{ui.slug(ui.recipe_label(recipe))}-plan",
        markdown=render_markdown(diagnosis),
        description=f"{name}: {verdict(diagnosis)}",
    )
    if not diagnosis.ok:
        shown = [row for row in diagnosis.rows if row.ok is False or row.check.strip() == "to fit"]
        return Failed(
            message=f"{name}: {verdict(diagnosis)}; "
            + "; ".join(
                f"{row.check.strip()}: {row.value}" + (f", over {row.limit}" if row.ok is False else "")
                for row in shown
            )
        )
    queued = None
    if then:
        from prefect.deployments import run_deployment

        # The accelerator's run stands alone (it starts when a chip is free, long after this run ends).
        run = run_deployment(
            then, parameters={"recipe": recipe, "overrides": list(overrides)}, timeout=0, as_subflow=False
        )
        queued = str(run.id)
        get_run_logger().info("%s fits %s: queued %s (flow run %s)", recipe, name, then, run.name)
    return {"target": name, "fits": True, "queued": queued}
