"""The `finetune` flow: tokenize -> baseline eval -> train -> final eval -> export -> generate -> report.

`pipeline(config)` lists the stages as data (task, config section, inputs); the flow runs
them in order, and `planned_keys` derives every artifact key from the same list without
running anything. Each stage's Prefect result record lives inside its artifact folder
(`STORE/<stage>/<key>/result.json`), so Prefect reports a stage Cached exactly when its
verified artifact exists, and deleting a folder makes exactly that stage run again.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prefect import Task, flow, get_run_logger

from jaxtune.artifacts import ArtifactRef, ArtifactStore
from jaxtune.config import OFFLINE, JaxtuneConfig, load_config
from jaxtune.tasks import STAGES, build_model, build_tokenizer, evaluate, export, generate, import_gguf, report, tokenize, train
from jaxtune.tasks.sources import GGUF, dataset_ref, keyed_model, model_ref
from jaxtune.tasks.stage import input_keys, stage_key

DEFAULT = load_config()  # the bundled offline demo
# Before `tokenize`, making the base model: the offline model's two, or a GGUF file's import.
BUILD_STAGES = (build_tokenizer.STAGE, build_model.STAGE, import_gguf.STAGE)


@dataclass(frozen=True)
class Step:
    """One stage to run: its task, the config section its key hashes, and its inputs, each an
    earlier step's stage name or a ref to something outside the store (data file, hub model)."""

    stage: str
    task: Task
    section: Any
    inputs: dict[str, str | ArtifactRef]
    extra: tuple = ()  # further task arguments that do not change what it computes (the mesh)

    @property
    def module(self) -> str:
        return self.task.fn.__module__


def pipeline(config: JaxtuneConfig) -> list[Step]:
    """Every stage `config` asks for, each after the stages it reads."""
    data, mesh = dataset_ref(config.data), (config.mesh,)
    steps = []
    if config.model.name == OFFLINE:
        tokenizer_section = build_tokenizer.section_for(config.model.tiny.vocab_size, config.data)
        steps += [Step(build_tokenizer.STAGE, build_tokenizer.build_tokenizer, tokenizer_section, {"data": data}),
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
        Step("tokenize", tokenize.tokenize, tokenize.TokenizeSection.of(config.data, config.model), {"data": data, "model": model}),
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


class StageRunner:
    """Calls a stage task with its cache location set from the artifact key."""

    def __init__(self, store_root: Path, refresh: set[str]):
        self.store = ArtifactStore(store_root)
        self.refresh = refresh
        self.states: dict[str, str] = {}  # stage -> Prefect state name (Completed, Cached)

    def __call__(self, step: Step, inputs: dict[str, ArtifactRef]) -> ArtifactRef:
        key = stage_key(step.stage, step.module, step.section, input_keys(inputs))
        if step.stage in self.refresh or not self.store.verify(step.stage, key):
            self.store.remove(step.stage, key)  # also drops a result record whose artifact is gone or damaged
        configured = step.task.with_options(
            result_storage=self.store.root,
            result_storage_key=f"{step.stage}/{key}/result.json",
            task_run_name=f"{step.stage}-{key[:8]}",
        )
        state = configured(step.section, inputs, str(self.store.root), *step.extra, return_state=True)
        ref = state.result()  # re-raises the stage's error
        self.states[step.stage] = state.name
        # The record may come from a store since moved: the path is this store's, the key the record's.
        return self.store.ref(step.stage, ref.key)


@flow(name="finetune")
def finetune(config: JaxtuneConfig = DEFAULT, refresh: list[str] = [], until: str = "report") -> dict:  # noqa: B006
    """Run every stage up to `until`, recomputing the stages named in `refresh`.

    Returns {"path": the last stage's artifact folder, "stages": {stage: "Completed" | "Cached"}}.
    """
    unknown = set(refresh) - set(STAGES) - set(BUILD_STAGES)
    if unknown or until not in STAGES:
        raise ValueError(f"unknown stage(s) {sorted(unknown | ({until} - set(STAGES)))}; stages are {', '.join(STAGES)}")
    run = StageRunner(Path(config.store.root).resolve(), set(refresh))
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
    get_run_logger().info("stages: %s", ", ".join(f"{k}={v}" for k, v in run.states.items()))
    return {"path": done[until].path, "stages": run.states}


def _train_section(config: JaxtuneConfig) -> train.TrainSection:
    lora = config.lora if config.train.method == "lora" else None
    return train.TrainSection(model=keyed_model(config.model), train=config.train, lora=lora, packing=config.data.packing)
