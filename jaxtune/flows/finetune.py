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

A multi-process job (`jaxtune launch`, or mesh.coordinator / num_processes / process_id, or
JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID) runs this same flow in every
process, joined through `jax.distributed` before the first stage. Process 0 alone writes the
store and creates Prefect artifacts; for each stage it decides cached-or-not and the others
follow. A stage that computes on the mesh (its `Step.options` name the mesh) is run by
every process, as its collectives need them all: process 0 as above, the others by calling
the task's function, building into a temporary folder they discard (`build_artifact`). A
stage that does not use the mesh runs on process 0 alone. After each stage every process
meets at a barrier, and the others then read process 0's verified artifact from the store, so
the store (store.root) must be a folder every host sees at the same path (a shared
filesystem: NFS, Filestore, a mounted bucket with read-after-write consistency). Only process
0 takes the store's locks and runs Prefect tasks; the others' flow runs hold none, and with no
PREFECT_API_URL they are recorded in a throw-away database (see `jaxtune.cli`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from prefect import Task, flow, get_run_logger
from prefect.cache_policies import CachePolicy
from prefect.client.schemas.objects import StateType
from prefect.states import Cancelled, Crashed, State

from jaxtune.artifacts import ArtifactRef, ArtifactStore
from jaxtune.artifacts.locks import StoreLocks
from jaxtune.config import OFFLINE, JaxtuneConfig, load_config, names_recipe
from jaxtune.errors import ConfigError, TrainingStopped
from jaxtune.flows import browse
from jaxtune.host import launch, processes
from jaxtune.tasks import (
    BUILD_STAGES,
    STAGES,
    build_model,
    build_tokenizer,
    evaluate,
    export,
    generate,
    import_gguf,
    merge_adapter,
    quantize_base,
    reference,
    report,
    tokenize,
    train,
)
from jaxtune.tasks.downloads import retry_options
from jaxtune.tasks.sources import ADAPTER, GGUF, adapter_base, dataset_refs, keyed_model, model_ref
from jaxtune.tasks.stage import input_keys, stage_key
from jaxtune.tracking import mlflow_run, ui

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
    options: dict[str, Any] = field(default_factory=dict)  # keyword arguments outside the key (mesh, num_proc, ...)

    @property
    def module(self) -> str:
        return self.task.fn.__module__

    @property
    def on_mesh(self) -> bool:
        """Whether the stage computes on the device mesh (in a multi-process job: in every process)."""
        return "mesh" in self.options


def pipeline(config: JaxtuneConfig, restart: bool = False) -> list[Step]:
    """Every stage `config` asks for, each after the stages it reads (`restart`: the run is an
    automatic restart of a crashed one, which `train` may give up)."""
    data, mesh = dataset_refs(config.data), {"mesh": config.mesh}
    steps = []
    if config.model.name == OFFLINE:
        tokenizer_section = build_tokenizer.section_for(config.model.tiny.vocab_size, config.data)
        steps += [
            Step(build_tokenizer.STAGE, build_tokenizer.build_tokenizer, tokenizer_section, data),
            Step(build_model.STAGE, build_model.build_model, config.model.tiny, {"tokenizer": build_tokenizer.STAGE}),
        ]
        model: str | ArtifactRef = build_model.STAGE
    else:
        model = model_ref(config.model)
        if model.stage == GGUF:
            steps.append(Step(import_gguf.STAGE, import_gguf.import_gguf, import_gguf.SECTION, {"gguf": model}))
            model = import_gguf.STAGE
        elif model.stage == ADAPTER:
            base = model_ref(adapter_base(Path(model.path)))
            steps.append(
                Step(
                    merge_adapter.STAGE,
                    merge_adapter.merge_adapter,
                    merge_adapter.SECTION,
                    {"adapter": model, "base": base},
                    {"trust_remote_code": config.model.trust_remote_code},
                )
            )
            model = merge_adapter.STAGE
    # A quantized base: its frozen layers' codes, made once and read by every stage that opens the model.
    base = {}
    if config.model.base_quantization != "none":
        source = {"gguf": model_ref(config.model)} if config.model.base_quantization == "gguf" else {}
        section = quantize_base.QuantizeSection(
            scheme=config.model.base_quantization,
            dtype=config.model.compute_dtype,
            trust_remote_code=config.model.trust_remote_code,
        )
        steps.append(Step(quantize_base.STAGE, quantize_base.quantize_base, section, {"model": model, **source}))
        base = {"base": quantize_base.STAGE}
    model_section = keyed_model(config.model)
    objective = config.train.objective
    evaluation = evaluate.EvalSection(model=model_section, eval=config.eval)
    if objective in ("dpo", "simpo"):
        evaluation = evaluate.PairEvalSection(
            model=model_section, eval=config.eval, objective=objective, preference=config.preference
        )
    elif objective == "grpo":
        evaluation = evaluate.RewardEvalSection(
            model=model_section,
            eval=config.eval,
            rewards=config.rl.rewards,
            reward_weights=config.rl.reward_weights,
            reward_code=_reward_code(config),
            max_new_tokens=config.rl.max_completion_length,
        )
    # DPO's reference log-probabilities: a stage of their own, read by the evals and train.
    scored = {"model": model, "data": "tokenize", **base, **({"reference": "reference"} if objective == "dpo" else {})}
    trained = {**scored, "train": "train"}
    steps.append(
        Step(
            "tokenize",
            tokenize.tokenize,
            tokenize.TokenizeSection.of(config.data, config.model),
            {**data, "model": model},
            {"num_proc": config.data.num_proc},
        )
    )
    if objective == "dpo":
        steps.append(
            Step(
                reference.STAGE,
                reference.reference,
                reference.ReferenceSection(model=model_section, eval=config.eval),
                {"model": model, "data": "tokenize", **base},
                mesh,
            )
        )
    return steps + [
        Step("baseline_eval", evaluate.baseline_eval, evaluation, scored, mesh),
        Step(
            "train",
            train.train,
            _train_section(config),
            scored,
            {"mesh": config.mesh, "restart": restart, "tracking": config.tracking},
        ),
        Step("final_eval", evaluate.final_eval, evaluation, trained, mesh),
        Step(
            "export",
            export.export,
            export.ExportSection(model=model_section, export=config.export),
            {"model": model, "train": "train", **base},
        ),
        Step(
            "generate",
            generate.generate,
            generate.GenerateSection(model=model_section, generate=config.generate),
            {"model": model, "data": "tokenize", "train": "train", **base},
            mesh,
        ),
        Step(
            "report",
            report.report,
            {"examples": report.EXAMPLES, "hardest": report.HARDEST},
            {**{stage: stage for stage in STAGES[:-1] if stage != reference.STAGE}, **base},
        ),
    ]


def planned_keys(config: JaxtuneConfig) -> dict[str, str]:
    """{stage: artifact key} of every stage, derived without running any (a model.name naming an
    earlier recipe: from the model its run exported, which must exist)."""
    if names_recipe(config.model.name):
        config = _starting_from(config, _exported_model(load_recipe(config.model.name)))
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
        record = f"{step.stage}/{key}/result.json"
        if processes.count > 1:
            return self._in_job(step, inputs, key, record)
        if step.stage in self.refresh or not self.store.verify(step.stage, key):
            self.store.remove(step.stage, key)  # also drops a result record whose artifact is gone or damaged
        return self._run_task(step, inputs, record)

    def _run_task(
        self, step: Step, inputs: dict[str, ArtifactRef], record: str, overwrite: bool = False
    ) -> ArtifactRef:
        """The stage as a Prefect task whose result record is `record` (`overwrite`: run it even if recorded)."""
        policy = ArtifactRecord(record=record)
        name = ui.stage_run_name(step.stage, self.config)
        configured = step.task.with_options(
            result_storage=self.store.root,
            cache_policy=policy.configure(isolation_level="SERIALIZABLE", lock_manager=self.locks),
            task_run_name=lambda: name,
            **({"refresh_cache": True} if overwrite else {}),
            **retry_options(step.stage, inputs),
        )
        state = configured(step.section, inputs, str(self.store.root), **step.options, return_state=True)
        try:
            ref = state.result()  # re-raises the stage's error
        except Exception as error:
            _note_stage(error, step.stage)
            raise
        self.states[step.stage] = state.name
        # The record may come from a store since moved: the path is this store's, the key the record's.
        ref = self.store.ref(step.stage, ref.key)
        if processes.writes():
            browse.publish_stage(ref, state.name)
        return ref

    def _in_job(self, step: Step, inputs: dict[str, ArtifactRef], key: str, record: str) -> ArtifactRef:
        """The stage in a multi-process job: process 0 decides whether it is cached and the others
        follow; it runs in every process if it computes on the mesh, else on process 0 alone; then
        every process waits for the others, and reads the artifact process 0 wrote."""
        writer, cached = processes.writes(), False
        if writer:
            # Cached only with its result record, else Prefect would run the task, on process 0 alone.
            cached = (
                step.stage not in self.refresh
                and self.store.verify(step.stage, key)
                and (self.store.root / record).is_file()
            )
            if not cached:
                self.store.remove(step.stage, key)
        cached = processes.agree(cached)
        if writer:
            # Not cached: run even if another job records the stage meanwhile, as the others compute with this one.
            ref = self._run_task(step, inputs, record, overwrite=not cached)
        elif step.on_mesh and not cached:
            try:  # without Prefect's task run, caching or locks; build_artifact discards what this process builds
                step.task.fn(step.section, inputs, str(self.store.root), **step.options)
            except Exception as error:
                _note_stage(error, step.stage)
                raise
        processes.barrier(f"{step.stage}/{key}")
        if not writer:
            ref = self.store.ref(step.stage, key)
            self.states[step.stage] = "Cached" if cached else "Completed"
        return ref


def _exported_model(earlier: JaxtuneConfig, export_folder: Path | None = None) -> Path:
    """The whole model an earlier run exported: its merged LoRA, or its full fine-tune."""
    folder = export_folder or Path(earlier.store.root) / "export" / planned_keys(earlier)["export"]
    return folder / ("merged" if earlier.train.method == "lora" else "model")


def _starting_from(config: JaxtuneConfig, folder: Path) -> JaxtuneConfig:
    return config.model_copy(update={"model": config.model.model_copy(update={"name": str(folder)})})


def _after_earlier_run(config: JaxtuneConfig) -> JaxtuneConfig:
    """`config`, or where model.name names an earlier run's recipe, that run first (a subflow, its
    stages cached when done) up to its export, and `config` starting from the model it exported.
    Keyed by that model's content, so this run's keys include the earlier run's weights."""
    if not names_recipe(config.model.name):
        return config
    from jaxtune.tasks.sources import check_earlier_recipe

    check_earlier_recipe(config.model.name)
    get_run_logger().info("model.name is the recipe %s: running it up to its export first", config.model.name)
    done = finetune(recipe=config.model.name, until="export")
    if not isinstance(done, dict):  # a stopped or failed earlier run: this one cannot start
        raise ConfigError(f"model.name {config.model.name!r}: the earlier run did not reach its export")
    return _starting_from(config, _exported_model(load_recipe(config.model.name), Path(done["path"])))


def _run_name() -> str:
    from prefect.runtime import flow_run

    parameters = flow_run.parameters
    recipe = parameters.get("recipe") or OFFLINE
    try:
        config = parameters.get("config") or load_recipe(recipe, parameters.get("overrides") or [])
        config = JaxtuneConfig.model_validate(config)
    except ValueError:
        return f"{ui.recipe_label(recipe)}{ui.SEPARATOR}invalid config"
    name = ui.flow_run_name(recipe, config, list(parameters.get("refresh") or []), parameters.get("until") or "report")
    return f"{name}{ui.SEPARATOR}restart" if parameters.get("restart_of") else name


@flow(name="finetune", flow_run_name=_run_name, persist_result=False)  # its dict is read where it runs
def finetune(
    recipe: str = OFFLINE,
    overrides: list[str] = [],  # noqa: B006
    refresh: list[AnyStage] = [],  # noqa: B006
    until: Stage = "report",
    config: JaxtuneConfig | None = None,
    restart_of: str | None = None,
) -> dict:
    """Fine-tune a model as the recipe says: every stage up to `until`, cached stages skipped.

    Args:
        recipe: 'offline' (the bundled demo: a tiny model and data, runs on a CPU in minutes) or a
            recipe YAML file, relative to the folder the flow runs in, e.g. configs/gemma3-1b-dolly-lora.yaml.
        overrides: settings changed for this run, each section.key=value, e.g. train.max_steps=50.
        refresh: stages to recompute even if their artifact is cached.
        until: the last stage to run.
        config: a whole config instead of recipe and overrides (for Python callers).
        restart_of: the crashed flow run this one starts again (set by prefect.yaml's restart
            automation; `train` resumes from its checkpoint, and gives up if restarts are stuck).

    Returns {"path": the last stage's artifact folder, "stages": {stage: "Completed" | "Cached"}}, and
    with an MLflow server configured "mlflow_run": the MLflow run that holds it (None if not logged).
    A run that a stop signal ended during `train` (checkpointed) ends Crashed, as Prefect marks
    any run a termination signal ends, so the restart automation starts it again; or Cancelled,
    if it was being cancelled.
    """
    from prefect.runtime import flow_run
    from prefect.settings import PREFECT_API_URL

    launch.record_run(flow_run.id, PREFECT_API_URL.value())  # for the gang to end it, should it kill this process
    if config is None:
        config = load_recipe(recipe, overrides)
    elif recipe != OFFLINE or overrides:
        raise ValueError("give either config, or recipe and overrides, not both")
    # A multi-process job: join it before anything starts JAX (`jaxtune run` has joined already).
    # Not through jaxtune.runtime.devices.distributed: importing the runtime starts JAX's backend.
    processes.join(config.mesh)
    named = config  # run names keep the recipe's model.name
    config = _after_earlier_run(config)
    run = StageRunner(Path(config.store.root).resolve(), set(refresh), named)
    if config.store.compile_cache:
        from jaxtune.runtime.devices import compile_cache

        compile_cache.enable(compile_cache.folder_of(run.store.root))
    done: dict[str, ArtifactRef] = {}
    steps = pipeline(config, restart=restart_of is not None)
    if until not in {step.stage for step in steps}:
        raise ConfigError(f"until={until}: this run has no {until} stage (it runs for train.objective=dpo alone)")
    try:
        for step in steps:
            if step.stage in STAGES and STAGES.index(step.stage) > STAGES.index(until):
                break
            inputs = {name: done[v] if isinstance(v, str) else v for name, v in step.inputs.items()}
            if step.stage == "train" and config.export.gguf:
                export.check_gguf_export(inputs["model"], config.model)  # not after training for a file it cannot write
            done[step.stage] = run(step, inputs)
    except TrainingStopped as stopped:
        return _stopped_state(stopped)
    if processes.writes():  # in a multi-process job, process 0 alone shows the run in Prefect
        if "report" in done:
            report.publish_report(done["report"])
        browse.publish_stages(done, run.states)
    get_run_logger().info("stages: %s", ", ".join(f"{k}={v}" for k, v in run.states.items()))
    result = {"path": done[until].path, "stages": run.states}
    if processes.writes() and config.tracking.mlflow_target():
        result["mlflow_run"] = mlflow_run.log_run(config, done, run.states, get_run_logger())
    return result


def _stopped_state(stopped: TrainingStopped) -> State:
    """The final state of a run a stop signal ended: Crashed, or Cancelled if the run was being
    cancelled (a worker cancels a run by sending SIGTERM, which must not start it again). Its data
    is the error, so a caller of the flow (`jaxtune run`) gets it raised."""
    message = f"train: {stopped}"
    if _cancelling():
        return Cancelled(message=message, data=stopped)
    return Crashed(message=message, data=stopped)


def _cancelling() -> bool:
    import httpx
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound
    from prefect.runtime import flow_run

    try:
        with get_client(sync_client=True) as client:
            return client.read_flow_run(flow_run.id).state.type == StateType.CANCELLING
    except (httpx.HTTPError, ObjectNotFound):  # no server to ask, or it lost the run: nobody cancelled it
        return False


def _note_stage(error: Exception, stage: str) -> None:
    error.add_note(f"{STAGE_NOTE}{stage}")  # for the one line `jaxtune run` prints


def _train_section(config: JaxtuneConfig) -> train.TrainSection:
    lora = config.lora if config.train.method == "lora" else None
    objective = config.train.objective
    preference = config.preference if objective in ("dpo", "simpo") else None
    rl, code = (config.rl, _reward_code(config)) if objective == "grpo" else (None, None)
    return train.TrainSection(
        model=keyed_model(config.model),
        train=config.train,
        lora=lora,
        packing=config.data.packing,
        preference=preference,
        rl=rl,
        reward_code=code,
    )


def _reward_code(config: JaxtuneConfig) -> dict[str, str]:
    """Each reward's code (`Rewards.identity`): resolving them here also fails a bad reward before any stage runs."""
    from jaxtune.rewards import load_rewards

    return load_rewards(config.rl.rewards, config.rl.reward_weights).identity()
