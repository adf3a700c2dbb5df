"""Stage `train`: LoRA or full fine-tuning -> params.safetensors, optimizer state, per-step log."""

from __future__ import annotations

import json
from pathlib import Path

from prefect import get_run_logger, task

from jaxtune.artifacts import ArtifactRef
from jaxtune.config import LoraConfig, MeshConfig, ModelConfig, Section, TrainConfig
from jaxtune.tasks.sources import pretrained_location
from jaxtune.tasks.stage import build_artifact

STAGE = "train"
VERSION = "1"


class TrainSection(Section):
    model: ModelConfig
    train: TrainConfig
    lora: LoraConfig | None  # None for full fine-tuning, so LoRA settings do not touch its key


def method_of(train_ref: ArtifactRef | None) -> tuple[str, LoraConfig | None]:
    """How to rebuild the trained model: ('base'|'lora'|'full', LoRA settings)."""
    if train_ref is None:
        return "base", None
    meta = train_ref.read_json("method.json")
    return meta["method"], LoraConfig(**meta["lora"]) if meta["lora"] else None


@task(name=STAGE, result_serializer="json")
def train(section: TrainSection, inputs: dict[str, ArtifactRef], store_root: str, mesh: MeshConfig) -> ArtifactRef:
    """inputs: `model` (base weights and tokenizer) and `data` (the tokenize artifact)."""

    def build(folder: Path) -> None:
        from transformers import AutoTokenizer

        from jaxtune.data.tokenize import pad_id_of, read_arrow
        from jaxtune.runtime import model as rt_model
        from jaxtune.runtime import training
        from jaxtune.runtime.mesh import make_placement

        logger = get_run_logger()
        name, revision = pretrained_location(inputs["model"])
        tokenizer = AutoTokenizer.from_pretrained(name, revision=revision)
        model = rt_model.open_model(name, revision, section.model, make_placement(mesh), lora=section.lora,
                                    train_all=section.lora is None)
        table = read_arrow(inputs["data"].file("train.arrow")).to_pydict()
        log_file = (folder / "log.jsonl").open("w")

        def on_log(record: dict) -> None:
            log_file.write(json.dumps(record) + "\n")
            log_file.flush()  # a crash keeps the log up to the last window
            logger.info("step %(step)d loss %(loss).4f lr %(lr).2e grad_norm %(grad_norm).3f tok/s %(tokens_per_second).0f", record)

        result = training.train(model, table["input_ids"], table["labels"], section.train, pad_id_of(tokenizer),
                                max(table["length"]), on_log)
        log_file.close()
        rt_model.save_weights(result.weights, folder / "params.safetensors")
        rt_model.save_weights(result.opt_state, folder / "optimizer.safetensors")
        (folder / "summary.json").write_text(json.dumps(result.summary, indent=2))
        method = {"method": section.train.method, "lora": section.lora.model_dump(mode="json") if section.lora else None}
        (folder / "method.json").write_text(json.dumps(method, indent=2))

    return build_artifact(store_root, STAGE, VERSION, section, inputs, build)
