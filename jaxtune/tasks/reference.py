"""Stage `reference`: the reference model's summed log-probability of every chosen and rejected answer, for DPO.

A pure function of the base model and the pairs, so it is computed once, before training, and
the train step holds one model rather than two (TRL's `precompute_ref_log_probs`). With LoRA the
reference is the base model with the adapters off; with full fine-tuning, the frozen starting
weights: both are the base model, as this stage opens it. Written as train.arrow and eval.arrow,
one row per pair, in the token tables' order.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
from prefect import get_run_logger, task

from jaxtune.artifacts import ArtifactRef
from jaxtune.config import EvalConfig, MeshConfig, ModelConfig, Section
from jaxtune.tasks.stage import build_artifact

STAGE = "reference"
SCHEMA = pa.schema(
    [
        ("chosen_logp", pa.float64()),
        ("rejected_logp", pa.float64()),
        ("chosen_tokens", pa.int32()),
        ("rejected_tokens", pa.int32()),
    ]
)


class ReferenceSection(Section):
    model: ModelConfig
    eval: EvalConfig  # its batch size: how many rows one forward pass scores


@task(name=STAGE, result_serializer="json")
def reference(
    section: ReferenceSection, inputs: dict[str, ArtifactRef], store_root: str, mesh: MeshConfig
) -> ArtifactRef:
    """inputs: `model` (the reference: the base model) and `data` (the tokenize artifact of pairs)."""

    def build(folder: Path) -> None:
        from jaxtune.data.token_table import TokenTable
        from jaxtune.runtime.decoding.inference import row_nll
        from jaxtune.tasks.trained import open_trained_model

        pad_id = inputs["data"].read_json("stats.json")["pad_id"]
        model = open_trained_model({**inputs, "train": None}, section.model, mesh)
        logger = get_run_logger()
        for split in ("train", "eval"):
            table = TokenTable(inputs["data"].file(f"{split}.arrow"))
            nll, tokens = row_nll(model, table.input_ids, table.labels, section.eval.batch_size, pad_id)
            write_reference(-nll, tokens, folder / f"{split}.arrow")
            logger.info(
                "reference %s: %d pairs, mean log-probability chosen %.3f, rejected %.3f",
                split,
                len(nll) // 2,
                -nll[0::2].mean(),
                -nll[1::2].mean(),
            )

    return build_artifact(store_root, STAGE, __name__, section, inputs, build)


def write_reference(logp: np.ndarray, tokens: np.ndarray, path: Path) -> None:
    """Per-row values (rows 2p chosen, 2p+1 rejected) as one Arrow row per pair."""
    table = pa.table(
        [
            pa.array(logp[0::2], pa.float64()),
            pa.array(logp[1::2], pa.float64()),
            pa.array(tokens[0::2].astype(np.int32)),
            pa.array(tokens[1::2].astype(np.int32)),
        ],
        schema=SCHEMA,
    )
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, SCHEMA) as writer:
        writer.write_table(table)


def read_reference(ref: ArtifactRef | None, split: str) -> np.ndarray | None:
    """A split's reference log-probabilities per token-table row (2p chosen, 2p+1 rejected); None without a reference stage."""
    if ref is None:
        return None
    table = pa.ipc.open_file(pa.memory_map(str(ref.file(f"{split}.arrow")))).read_all()
    chosen, rejected = table.column("chosen_logp").to_numpy(), table.column("rejected_logp").to_numpy()
    return np.stack([chosen, rejected], axis=1).reshape(-1)
