"""Stage `train`: LoRA or full fine-tuning -> params.safetensors, optimizer state, per-step log,
memory plan; checkpoints while it runs, so a crashed run resumes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import yaml
from prefect import get_run_logger, task

from jaxtune.artifacts import ArtifactRef, ArtifactStore
from jaxtune.config import (
    LoraConfig,
    MeshConfig,
    ModelConfig,
    PreferenceConfig,
    RLConfig,
    Section,
    TrackingConfig,
    TrainConfig,
    without_credentials,
)
from jaxtune.errors import first_line
from jaxtune.host import processes
from jaxtune.records import TrainSummary
from jaxtune.tasks.sources import pretrained_location
from jaxtune.tasks.stage import build_artifact, input_keys, stage_key
from jaxtune.tracking import ui

STAGE = "train"


class TrainSection(Section):
    model: ModelConfig
    train: TrainConfig
    lora: LoraConfig | None  # None for full fine-tuning, so LoRA settings do not touch its key
    packing: bool  # data.packing
    preference: PreferenceConfig | None = None  # train.objective dpo or simpo: its settings
    rl: RLConfig | None = None  # train.objective grpo: its settings
    reward_code: dict[str, str] | None = None  # grpo: each reward's code (`Rewards.identity`), so an edit retrains


@task(name=STAGE, result_serializer="json")
def train(
    section: TrainSection,
    inputs: dict[str, ArtifactRef],
    store_root: str,
    mesh: MeshConfig,
    restart: bool = False,
    tracking: TrackingConfig = TrackingConfig(),
) -> ArtifactRef:
    """inputs: `model` (base weights and tokenizer), `data` (the tokenize artifact) and, for DPO,
    `reference` (the reference stage's log-probabilities). GRPO samples answers to the train
    split's prompts and scores them with `rl.rewards` (`_train_grpo`).

    Checkpoints go to the store's scratch folder for this key, so re-running the flow after a
    crash resumes from the newest one; they are removed once the artifact is complete.
    `restart`: the flow run is an automatic restart of a crashed one (it may give up, see
    `jaxtune.runtime.train.training.GIVE_UP_AFTER`).
    `tracking`: where the curves also go as training runs (the Prefect UI always; TensorBoard
    event files in the artifact's tensorboard/ with `tracking.tensorboard`); not in the key.
    """
    checkpoints = ArtifactStore(store_root).scratch(STAGE, stage_key(STAGE, __name__, section, input_keys(inputs)))

    def build(folder: Path) -> None:
        from jaxtune.data.token_table import TokenTable
        from jaxtune.runtime.compiled.preference import objective_of
        from jaxtune.runtime.devices.mesh import make_placement
        from jaxtune.runtime.modeling import model as rt_model
        from jaxtune.runtime.train import training
        from jaxtune.tasks.reference import read_reference
        from jaxtune.tasks.trained import held_base

        name, revision = pretrained_location(inputs["model"])
        pad_id = inputs["data"].read_json("stats.json")["pad_id"]
        model = rt_model.open_model(
            name,
            revision,
            section.model,
            make_placement(mesh),
            lora=section.lora,
            train_all=section.lora is None,
            base=held_base(inputs),
        )
        _require_space(model, section, checkpoints, folder)
        rows = TokenTable(inputs["data"].file("train.arrow"))  # memory-mapped: rows are read as batches take them
        if section.rl is not None:
            result = _train_grpo(model, rows, section, inputs, folder, checkpoints, pad_id, tracking, restart)
            _write(folder, result, section, name)
            return
        evals = TokenTable(inputs["data"].file("eval.arrow"))
        objective = objective_of(section.train.objective, section.preference)
        feed = training.feed_for(model, rows.lengths, section.train, rows.longest, section.packing, objective.pairs)
        log = TrainLog(folder / "log.jsonl", training.total_steps(section.train, feed), section, tracking)
        reference = None
        if inputs.get("reference") is not None:
            reference = (read_reference(inputs["reference"], "train"), read_reference(inputs["reference"], "eval"))
        try:
            result = training.train(
                model,
                rows.input_ids,
                rows.labels,
                section.train,
                pad_id,
                rows.longest,
                log,
                eval_data=(evals.input_ids, evals.labels),
                checkpoint_dir=checkpoints,
                packing=section.packing,
                feed=feed,
                restart=restart,
                objective=objective,
                reference=reference,
            )
            log.finish(result.summary)
        finally:
            log.close()
        _write(folder, result, section, name)

    ref = build_artifact(store_root, STAGE, __name__, section, inputs, build)
    if processes.writes():  # in a multi-process job the checkpoints are process 0's
        shutil.rmtree(checkpoints, ignore_errors=True)
    return ref


def _write(folder: Path, result, section: TrainSection, base_model: str) -> None:
    """The artifact's files: trained weights, optimizer state, summary, memory plan, method."""
    from safetensors.numpy import save_file

    from jaxtune.runtime.modeling import model as rt_model
    from jaxtune.runtime.train.checkpoint import tree_to_arrays

    rt_model.save_weights(result.weights, folder / "params.safetensors")
    save_file(tree_to_arrays(result.opt_state), str(folder / "optimizer.safetensors"))
    result.summary.write(folder / "summary.json")
    (folder / "memory.json").write_text(json.dumps(result.memory, indent=2))
    method = {
        "method": section.train.method,
        "objective": section.train.objective,
        "lora": section.lora.model_dump(mode="json") if section.lora else None,
        "base_model": base_model,
    }  # what `jaxtune chat` opens the weights on; the key hashes the model by content
    (folder / "method.json").write_text(json.dumps(method, indent=2))


def _train_grpo(
    model,
    rows,
    section: TrainSection,
    inputs: dict,
    folder: Path,
    checkpoints: Path,
    pad_id: int,
    tracking: TrackingConfig,
    restart: bool,
):
    """GRPO on the train split's prompts, scored by `rl.rewards` (`rollouts.train_grpo`)."""
    from jaxtune.data.templates import stop_ids
    from jaxtune.rewards import load_rewards
    from jaxtune.runtime.train import rollouts
    from jaxtune.tasks import scoring
    from jaxtune.tasks.sources import open_tokenizer

    rewards = load_rewards(section.rl.rewards, section.rl.reward_weights)
    tokenizer = open_tokenizer(inputs["model"], section.model)
    score = scoring.scorer(rewards, tokenizer, scoring.reward_rows(rows, "train"))
    eos = stop_ids(tokenizer, getattr(model.module, "generation_config", None))
    log = TrainLog(folder / "log.jsonl", section.train.max_steps, section, tracking)
    try:
        result = rollouts.train_grpo(
            model,
            rows.input_ids,
            score,
            rewards.names,
            section.train,
            section.rl,
            pad_id,
            eos,
            log,
            checkpoint_dir=checkpoints,
            restart=restart,
        )
        log.finish(result.summary)
    finally:
        log.close()
    return result


def _require_space(model, section: TrainSection, checkpoints: Path, folder: Path) -> None:
    """Fail before the first step when the store cannot hold what training writes: its weights and
    optimizer state in the artifact, and in up to `KEEP` + 1 checkpoints while a new one is written."""
    import jax

    from jaxtune.artifacts.space import require_free
    from jaxtune.runtime.compiled import steps
    from jaxtune.runtime.measures.memory import tree_bytes
    from jaxtune.runtime.train import checkpoint

    state = tree_bytes(model.weights) + tree_bytes(
        jax.eval_shape(steps.make_optimizer(section.train).init, model.weights)
    )
    copies = (
        1
        if section.train.max_steps is not None and section.train.checkpoint_every >= section.train.max_steps
        else checkpoint.KEEP + 1
    )
    what = f"its artifact{f' and {copies - 1} checkpoints' if copies > 1 else ''} ({state / 1e6:.1f} MB each)"
    require_free(checkpoints if copies > 1 else folder, copies * state, what)


class TrainLog:
    """Where training records go: log.jsonl (one JSON line each), the Prefect log, a Prefect progress
    artifact that the UI shows as a bar, the live curve and latest figures (at each periodic eval,
    or each host sync without one), and TensorBoard when asked (in a multi-process job, process 0's alone)."""

    def __init__(self, path: Path, total_steps: int, section: TrainSection, tracking: TrackingConfig):
        from prefect.artifacts import create_progress_artifact

        from jaxtune.tracking.live import LiveCurve
        from jaxtune.tracking.tensorboard import TensorBoardWriter

        self.file = path.open("w")
        self.total = total_steps
        self.logger = get_run_logger()
        self.progress = self.live = self.tensorboard = None
        self.live_at_evals = section.train.eval_every is not None
        if processes.writes():
            self.progress = create_progress_artifact(
                0.0, key=ui.artifact_key("train-progress"), description=f"training, {total_steps} steps"
            )
            self.live = LiveCurve(total_steps)
            if tracking.tensorboard:
                text = without_credentials(yaml.safe_dump(section.model_dump(mode="json"), sort_keys=False))
                self.tensorboard = TensorBoardWriter(path.parent / "tensorboard", text)

    def __call__(self, records: list[dict]) -> None:
        from prefect.artifacts import update_progress_artifact

        for record in records:
            if "message" in record:  # the memory plan, and the steps the run it chose takes
                self.logger.info(record["message"])
                self.total = record.get("total_steps", self.total)
                if self.live is not None:
                    self.live.total = self.total
                continue
            self.file.write(json.dumps(record) + "\n")
        self.file.flush()  # a crash keeps every record up to the last sync
        records = [r for r in records if "message" not in r]
        if self.tensorboard is not None:
            self.tensorboard.write(records)
        last = records[-1] if records else {}
        if "eval_loss" in last:
            self.logger.info("step %(step)d eval loss %(eval_loss).4f", last)
        elif "loss" in last:
            if "reward" in last:  # GRPO: what its sampled answers scored
                self.logger.info(
                    "step %(step)d reward %(reward).3f loss %(loss).4f lr %(lr).2e grad_norm %(grad_norm).3f "
                    "answer length %(completion_length).1f",
                    last,
                )
            else:
                self.logger.info(
                    "step %(step)d loss %(loss).4f lr %(lr).2e grad_norm %(grad_norm).3f tok/s %(tokens_per_second).0f",
                    last,
                )
            if self.progress is not None:
                update_progress_artifact(self.progress, 100.0 * last["step"] / self.total)
        if self.live is not None and last:
            self.live.add(records)
            if "eval_loss" in last or not self.live_at_evals:
                self._publish_live()

    def _publish_live(self) -> None:
        """The live curve and figures; a failure to show them is a warning, never the end of training."""
        try:
            self.live.publish()
        except Exception as error:  # noqa: BLE001 - the UI's copy must not stop the run
            self.logger.warning("the live training curve could not be published: %s", first_line(error))

    def finish(self, summary: TrainSummary) -> None:
        if self.tensorboard is not None:
            self.tensorboard.finish(summary.model_dump(exclude_unset=True), self.total)

    def close(self) -> None:
        self.file.close()
        if self.tensorboard is not None:
            self.tensorboard.close()
