"""The `finetune` flow: tokenize -> baseline eval -> train -> final eval -> export -> generate -> report.

`pipeline(config)` lists the stages as data (task, config section, inputs); the flow runs
them in order, and `planned_keys` derives every artifact key from the same list without
running anything. Each stage's Prefect result record lives inside its artifact folder
(`STORE/<stage>/<key>/result.json`), so Prefect reports a stage Cached exactly when its
verified artifact exists, and deleting a folder makes exactly that stage run again.

Two runs of one config at once (a nightly and a manual run) build each stage once: a stage's
record path is its Prefect transaction key, taken with SERIALIZABLE isolation under a lock in
the store (`jaxtune.artifacts.locks`), so the second run waits for the first and then finds
the stage Cached.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from prefect import Task, flow, get_run_logger
from prefect.cache_policies import CachePolicy

from jaxtune import ui
from jaxtune.artifacts import ArtifactRef, ArtifactStore
from jaxtune.artifacts.locks import StoreLocks
from jaxtune.config import OFFLINE, JaxtuneConfig, load_config
from jaxtune.flows import browse
from jaxtune.tasks import BUILD_STAGES, STAGES, build_model, build_tokenizer, evaluate, export, generate, import_gguf, report, tokenize, train
from jaxtune.tasks.downloads import retry_options
from jaxtune.tasks.sources import GGUF, dataset_refs, keyed_model, model_ref
from jaxtune.tasks.stage import input_keys, stage_key

Stage = Literal[STAGES]
STAGE_NOTE = "in stage "  # the note a stage's error carries out of the flow
AnyStage = Literal[BUILD_STAGES + STAGES]


def load_recipe(recipe: str = OFFLINE, overrides: list[str] = ()) -> JaxtuneConfig:
    """The config of `recipe` ('offline' or a YAML file) with `section.key=value` overrides applied."""
    return load_config(None if recipe == OFFLINE else recipe, list(overrides))


@dataclass(frozen=True)
class Step:
    """One stage to run: its task, the config section its key hashes, and its inputs, each an
    earlier step's stage name or a ref to something outside the store (data file, hub model)."""

    stage: str
    task: Task
    section: Any
    inputs: dict[str, str | ArtifactRef]
    extra: tuple = ()  # further task arguments that do not change what it computes (the mesh, data.num_proc)

    @property
    def module(self) -> str:
        return self.task.fn.__module__


def pipeline(config: JaxtuneConfig) -> list[Step]:
    """Every stage `config` asks for, each after the stages it reads."""
    data, mesh = dataset_refs(config.data), (config.mesh,)
    steps = []
    if config.model.name == OFFLINE:
        tokenizer_section = build_tokenizer.section_for(config.model.tiny.vocab_size, config.data)
        steps += [Step(build_tokenizer.STAGE, build_tokenizer.build_tokenizer, tokenizer_section, data),
                  Step(build_model.STAGE, build_model.build_model, config.model.tiny, {"tokenizer": build_tokenizer.STAGE})]
        model: str | ArtifactRef = build_model.STAGE
    else:
        model = model_ref(config.model)
        if model.stage == GGUF:
            steps.append(Step(import_gguf.STAGE, import_gguf.import_gguf, import_gguf.SECTION, {"gguf": model}))
            model = import_gguf.STAGE
    model_section = keyed_model(config.model)
    evaluation = evaluate.EvalSection(model=model_section, eval=config.eval)
    trained = {"model": model, "data": "tokenize", "train": "train"}
    return steps + [
        Step("tokenize", tokenize.tokenize, tokenize.TokenizeSection.of(config.data, config.model), {**data, "model": model},
             (config.data.num_proc,)),
        Step("baseline_eval", evaluate.baseline_eval, evaluation, {"model": model, "data": "tokenize"}, mesh),
        Step("train", train.train, _train_section(config), {"model": model, "data": "tokenize"}, mesh),
        Step("final_eval", evaluate.final_eval, evaluation, trained, mesh),
        Step("export", export.export, export.ExportSection(model=model_section, export=config.export),
             {"model": model, "train": "train"}),
        Step("generate", generate.generate, generate.GenerateSection(model=model_section, generate=config.generate),
             trained, mesh),
        Step("report", report.report, {"examples": report.EXAMPLES}, {stage: stage for stage in STAGES[:-1]}),
    ]


def planned_keys(config: JaxtuneConfig) -> dict[str, str]:
    """{stage: artifact key} of every stage, derived without running any."""
    keys: dict[str, str] = {}
    for step in pipeline(config):
        inputs = {name: keys[v] if isinstance(v, str) else v.key for name, v in step.inputs.items()}
        keys[step.stage] = stage_key(step.stage, step.module, step.section, inputs)
    return keys


@dataclass
class ArtifactRecord(CachePolicy):
    """Prefect's cache key of a stage: the path of its result record, inside its artifact folder."""

    record: str = ""

    def compute_key(self, task_ctx, inputs, flow_parameters, **kwargs) -> str:
        return self.record


class StageRunner:
    """Calls a stage task with its cache location set from the artifact key."""

    def __init__(self, store_root: Path, refresh: set[str], config: JaxtuneConfig):
        self.store = ArtifactStore(store_root)
        self.locks = StoreLocks(self.store.root)
        self.refresh = refresh
        self.config = config
        self.states: dict[str, str] = {}  # stage -> Prefect state name (Completed, Cached)

    def __call__(self, step: Step, inputs: dict[str, ArtifactRef]) -> ArtifactRef:
        key = stage_key(step.stage, step.module, step.section, input_keys(inputs))
        if step.stage in self.refresh or not self.store.verify(step.stage, key):
            self.store.remove(step.stage, key)  # also drops a result record whose artifact is gone or damaged
        policy = ArtifactRecord(record=f"{step.stage}/{key}/result.json")
        name = ui.stage_run_name(step.stage, self.config)
        configured = step.task.with_options(
            result_storage=self.store.root,
            cache_policy=policy.configure(isolation_level="SERIALIZABLE", lock_manager=self.locks),
            task_run_name=lambda: name,
            **retry_options(step.stage, inputs),
        )
        state = configured(step.section, inputs, str(self.store.root), *step.extra, return_state=True)
        try:
            ref = state.result()  # re-raises the stage's error
        except Exception as error:
            error.add_note(f"{STAGE_NOTE}{step.stage}")  # for the one line `jaxtune run` prints
            raise
        self.states[step.stage] = state.name
        # The record may come from a store since moved: the path is this store's, the key the record's.
        ref = self.store.ref(step.stage, ref.key)
        browse.publish_stage(ref, state.name)
        return ref


def _run_name() -> str:
    from prefect.runtime import flow_run

    parameters = flow_run.parameters
    recipe = parameters.get("recipe") or OFFLINE
    try:
        config = parameters.get("config") or load_recipe(recipe, parameters.get("overrides") or [])
        config = JaxtuneConfig.model_validate(config)
    except ValueError:
        return f"{ui.recipe_label(recipe)}{ui.SEPARATOR}invalid config"
    return ui.flow_run_name(recipe, config, list(parameters.get("refresh") or []), parameters.get("until") or "report")


@flow(name="finetune", flow_run_name=_run_name, persist_result=False)  # its dict is read where it runs
def finetune(
    recipe: str = OFFLINE,
    overrides: list[str] = [],  # noqa: B006
    refresh: list[AnyStage] = [],  # noqa: B006
    until: Stage = "report",
    config: JaxtuneConfig | None = None,
) -> dict:
    """Fine-tune a model as the recipe says: every stage up to `until`, cached stages skipped.

    Args:
        recipe: 'offline' (the bundled demo: a tiny model and data, runs on a CPU in minutes) or a
            recipe YAML file, relative to the folder the flow runs in, e.g. configs/gemma3-1b-dolly-lora.yaml.
        overrides: settings changed for this run, each section.key=value, e.g. train.max_steps=50.
        refresh: stages to recompute even if their artifact is cached.
        until: the last stage to run.
        config: a whole config instead of recipe and overrides (for Python callers).

    Returns {"path": the last stage's artifact folder, "stages": {stage: "Completed" | "Cached"}}.
    """
    if config is None:
        config = load_recipe(recipe, overrides)
    elif recipe != OFFLINE or overrides:
        raise ValueError("give either config, or recipe and overrides, not both")
    run = StageRunner(Path(config.store.root).resolve(), set(refresh), config)
    if config.store.compile_cache:
        from jaxtune.runtime import compile_cache

        compile_cache.enable(compile_cache.folder_of(run.store.root))
    done: dict[str, ArtifactRef] = {}
    for step in pipeline(config):
        if step.stage in STAGES and STAGES.index(step.stage) > STAGES.index(until):
            break
        done[step.stage] = run(step, {name: done[v] if isinstance(v, str) else v for name, v in step.inputs.items()})
    if "report" in done:
        report.publish_report(done["report"])
    browse.publish_stages(done, run.states)
    get_run_logger().info("stages: %s", ", ".join(f"{k}={v}" for k, v in run.states.items()))
    return {"path": done[until].path, "stages": run.states}


def _train_section(config: JaxtuneConfig) -> train.TrainSection:
    lora = config.lora if config.train.method == "lora" else None
    return train.TrainSection(model=keyed_model(config.model), train=config.train, lora=lora, packing=config.data.packing)
