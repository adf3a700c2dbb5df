"""Stage `build_tokenizer` (offline default only): a BPE tokenizer trained on the bundled data."""

from __future__ import annotations

import json
from pathlib import Path

from prefect import task

from jaxtune.artifacts import ArtifactRef
from jaxtune.offline.tokenizer import texts_for_tokenizer, train_tokenizer
from jaxtune.tasks.stage import build_artifact

STAGE = "build_tokenizer"


def section_for(vocab_size: int) -> dict:
    return {"vocab_size": vocab_size}


@task(name=STAGE, result_serializer="json")
def build_tokenizer(section: dict, inputs: dict[str, ArtifactRef], store_root: str) -> ArtifactRef:
    """inputs: `data`, the bundled Dolly-schema jsonl."""

    def build(folder: Path) -> None:
        lines = inputs["data"].folder.read_text(encoding="utf-8").splitlines()
        rows = [json.loads(line) for line in lines if line.strip()]
        train_tokenizer(texts_for_tokenizer(rows), section["vocab_size"], folder)

    return build_artifact(store_root, STAGE, __name__, section, inputs, build)
