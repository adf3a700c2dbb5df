"""What the Prefect UI shows: run names that say what runs, and artifact keys that stay put.

A flow run is named `<recipe> · <model> · <method>` (`gemma3-1b-dolly-lora · gemma-3-1b-it ·
lora r8`), and each stage's task run `<stage> · <model> · <method>`. Artifacts are keyed
`<label>-<what>`, where the label is the deployment's name when a deployment started the run
(else the recipe's): the UI then lists every run's report, metrics and progress under one key,
with its history.
"""

from __future__ import annotations

import re
from pathlib import PurePath

from jaxtune.config import OFFLINE, JaxtuneConfig, ModelConfig

SEPARATOR = " · "


def model_label(model: ModelConfig) -> str:
    """`gemma-3-1b-it` for google/gemma-3-1b-it, a folder's or GGUF file's name, `tiny gemma3` offline."""
    if model.name == OFFLINE:
        return f"tiny {model.tiny.architecture}"
    path = PurePath(model.name.rstrip("/"))
    return path.stem if path.suffix.lower() in (".gguf", ".yaml", ".yml") else path.name


def method_label(config: JaxtuneConfig) -> str:
    """`lora r8` or `full adafactor`; a preference objective first: `dpo lora r16`, `simpo full adamw`."""
    objective = f"{config.train.objective} " if config.train.objective != "sft" else ""
    if config.train.method == "lora":
        return f"{objective}lora r{config.lora.r}"
    return f"{objective}full {config.train.optimizer}"


def recipe_label(recipe: str) -> str:
    """The name a recipe goes by: its file's stem, or `offline` for the bundled demo."""
    return PurePath(recipe).stem if recipe != OFFLINE else OFFLINE


def stage_run_name(stage: str, config: JaxtuneConfig) -> str:
    return SEPARATOR.join((stage, model_label(config.model), method_label(config)))


def flow_run_name(recipe: str, config: JaxtuneConfig, refresh: list[str], until: str) -> str:
    parts = [recipe_label(recipe), model_label(config.model), method_label(config)]
    if refresh:
        parts.append("refresh " + ", ".join(refresh))
    if until != "report":
        parts.append(f"until {until}")
    return SEPARATOR.join(parts)


def slug(text: str) -> str:
    """`text` as Prefect allows in an artifact key: lowercase letters, digits and dashes."""
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "jaxtune"


# Asked from inside a task, Prefect finds the run's deployment by reading the flow run (and then
# the deployment) from the API: two requests for each of a run's dozen artifacts. The label is the
# same all run long, so each flow run asks once.
_RUN_LABELS: dict[str, str] = {}


def run_label() -> str:
    """The deployment that started this run, else the recipe the flow was given, as a key prefix."""
    from prefect.runtime import flow_run

    run_id = flow_run.id
    if run_id is None:
        return _asked_run_label()
    if run_id not in _RUN_LABELS:
        _RUN_LABELS[run_id] = _asked_run_label()
    return _RUN_LABELS[run_id]


def _asked_run_label() -> str:
    from prefect.runtime import deployment, flow_run

    if deployment.name:
        return slug(deployment.name)
    parameters = flow_run.parameters or {}
    if parameters.get("config") is not None:
        return "jaxtune"
    return slug(recipe_label(parameters.get("recipe") or OFFLINE))


def artifact_key(what: str) -> str:
    """The key of this run's artifact `what` (report, metrics, train-progress, stage-train, ...)."""
    return f"{run_label()}-{slug(what)}"
