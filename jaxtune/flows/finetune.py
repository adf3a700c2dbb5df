"""The `finetune` flow: tokenize -> baseline eval -> train -> final eval -> export -> generate -> report.

Each stage's Prefect result record lives inside its artifact folder
(`STORE/<stage>/<key>/result.json`), so Prefect reports a stage Cached exactly when its
verified artifact exists, and deleting a folder makes exactly that stage run again.
"""

from __future__ import annotations

from pathlib import Path

from prefect import flow, get_run_logger

from jaxtune.artifacts import ArtifactRef, ArtifactStore
from jaxtune.config import OFFLINE, JaxtuneConfig, load_config
from jaxtune.tasks import STAGES, build_model, build_tokenizer, evaluate, export, generate, report, tokenize, train
from jaxtune.tasks.sources import dataset_ref, model_ref
from jaxtune.tasks.stage import stage_key

DEFAULT = load_config()  # the bundled offline demo


class StageRunner:
    """Calls a stage task with its cache location set from the artifact key."""

    def __init__(self, store_root: Path, refresh: set[str]):
        self.store = ArtifactStore(store_root)
        self.refresh = refresh
        self.states: dict[str, str] = {}  # stage -> Prefect state name (Completed, Cached)

    def __call__(self, task, stage: str, version: str, section, inputs: dict, *extra) -> ArtifactRef:
        key = stage_key(stage, version, section, inputs)
        if stage in self.refresh or not self.store.verify(stage, key):
            self.store.remove(stage, key)  # also drops a result record whose artifact is gone or damaged
        configured = task.with_options(
            result_storage=self.store.root,
            result_storage_key=f"{stage}/{key}/result.json",
            task_run_name=f"{stage}-{key[:8]}",
        )
        state = configured(section, inputs, str(self.store.root), *extra, return_state=True)
        ref = state.result()  # re-raises the stage's error
        self.states[stage] = state.name
        return self.store.ref(stage, ref.key)


def base_model(config: JaxtuneConfig, run: StageRunner) -> ArtifactRef:
    if config.model.name != OFFLINE:
        return model_ref(config.model)
    tokenizer = run(build_tokenizer.build_tokenizer, build_tokenizer.STAGE, build_tokenizer.VERSION,
                    build_tokenizer.section_for(config.model.tiny.vocab_size), {"data": dataset_ref(config.data)})
    return run(build_model.build_model, build_model.STAGE, build_model.VERSION, config.model.tiny, {"tokenizer": tokenizer})


@flow(name="finetune")
def finetune(config: JaxtuneConfig = DEFAULT, refresh: list[str] = [], until: str = "report") -> dict:  # noqa: B006
    """Run every stage up to `until`, recomputing the stages named in `refresh`.

    Returns {"path": the last stage's artifact folder, "stages": {stage: "Completed" | "Cached"}}.
    """
    unknown = set(refresh) - set(STAGES) - {build_tokenizer.STAGE, build_model.STAGE}
    if unknown or until not in STAGES:
        raise ValueError(f"unknown stage(s) {sorted(unknown | ({until} - set(STAGES)))}; stages are {', '.join(STAGES)}")
    run = StageRunner(Path(config.store.root).resolve(), set(refresh))
    last = STAGES.index(until)
    mesh = config.mesh
    model = base_model(config, run)
    done = {"tokenize": run(tokenize.tokenize, tokenize.STAGE, tokenize.VERSION, config.data,
                            {"data": dataset_ref(config.data), "model": model})}
    eval_section = evaluate.EvalSection(model=config.model, eval=config.eval)
    plan = [
        ("baseline_eval", lambda: run(evaluate.baseline_eval, "baseline_eval", evaluate.VERSION, eval_section,
                                      {"model": model, "data": done["tokenize"]}, mesh)),
        ("train", lambda: run(train.train, train.STAGE, train.VERSION, _train_section(config),
                              {"model": model, "data": done["tokenize"]}, mesh)),
        ("final_eval", lambda: run(evaluate.final_eval, "final_eval", evaluate.VERSION, eval_section,
                                   {"model": model, "data": done["tokenize"], "train": done["train"]}, mesh)),
        ("export", lambda: run(export.export, export.STAGE, export.VERSION,
                               export.ExportSection(model=config.model, export=config.export),
                               {"model": model, "train": done["train"]})),
        ("generate", lambda: run(generate.generate, generate.STAGE, generate.VERSION,
                                 generate.GenerateSection(model=config.model, generate=config.generate),
                                 {"model": model, "data": done["tokenize"], "train": done["train"]}, mesh)),
        ("report", lambda: run(report.report, report.STAGE, report.VERSION, {"examples": report.EXAMPLES},
                               {name: done[name] for name in STAGES[:-1]})),
    ]
    for stage, call in plan[:last]:
        done[stage] = call()
    if "report" in done:
        report.publish_report(done["report"])
    get_run_logger().info("stages: %s", ", ".join(f"{k}={v}" for k, v in run.states.items()))
    return {"path": done[until].path, "stages": run.states}


def _train_section(config: JaxtuneConfig) -> train.TrainSection:
    lora = config.lora if config.train.method == "lora" else None
    return train.TrainSection(model=config.model, train=config.train, lora=lora)
