"""Stages `baseline_eval` and `final_eval`: eval-split loss and perplexity, overall and per category."""

from __future__ import annotations

import json
from pathlib import Path

from prefect import get_run_logger, task

from jaxtune.artifacts import ArtifactRef
from jaxtune.config import EvalConfig, MeshConfig, ModelConfig, Section
from jaxtune.tasks.stage import build_artifact
from jaxtune.tasks.trained import open_trained_model

PARITY_ROWS = 4  # eval rows whose logits are also computed in PyTorch, to certify the numerics


class EvalSection(Section):
    model: ModelConfig
    eval: EvalConfig


def _evaluate(stage: str, section: EvalSection, inputs: dict, store_root: str, mesh: MeshConfig) -> ArtifactRef:
    def build(folder: Path) -> None:
        from jaxtune.data.token_table import TokenTable
        from jaxtune.runtime.inference import evaluate
        from jaxtune.runtime.parity import logits_parity

        pad_id = inputs["data"].read_json("stats.json")["pad_id"]
        model = open_trained_model(inputs, section.model, mesh)
        table = TokenTable(inputs["data"].file("eval.arrow"))  # memory-mapped: rows are read as batches take them
        metrics = evaluate(model, table.input_ids, table.labels, table.column("category"), section.eval.batch_size, pad_id)
        metrics["parity"] = logits_parity(model, table.input_ids[:PARITY_ROWS], pad_id)
        (folder / "metrics.json").write_text(json.dumps(metrics, indent=2, sort_keys=True))
        logger = get_run_logger()
        logger.info("%s: loss %.4f perplexity %.2f over %d tokens", stage, metrics["loss"], metrics["perplexity"], metrics["tokens"])
        logger.info("%s: JAX vs PyTorch logits max |diff| %.2e (%s)", stage, metrics["parity"]["max_abs_diff"], metrics["parity"]["dtype"])

    return build_artifact(store_root, stage, __name__, section, inputs, build)


@task(name="baseline_eval", result_serializer="json")
def baseline_eval(section: EvalSection, inputs: dict[str, ArtifactRef], store_root: str, mesh: MeshConfig) -> ArtifactRef:
    """inputs: `model`, `data`."""
    return _evaluate("baseline_eval", section, inputs, store_root, mesh)


@task(name="final_eval", result_serializer="json")
def final_eval(section: EvalSection, inputs: dict[str, ArtifactRef], store_root: str, mesh: MeshConfig) -> ArtifactRef:
    """inputs: `model`, `data`, `train`."""
    return _evaluate("final_eval", section, inputs, store_root, mesh)
