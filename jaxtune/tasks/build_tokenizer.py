"""Stage `build_tokenizer` (offline model only): a BPE tokenizer trained on the run's data,
the bundled rows by default or a user's own file."""

from __future__ import annotations

from pathlib import Path

from prefect import task

from jaxtune.artifacts import ArtifactRef
from jaxtune.config import DataConfig, SourceConfig
from jaxtune.offline.tokenizer import train_tokenizer
from jaxtune.tasks.sources import data_input
from jaxtune.tasks.stage import build_artifact

STAGE = "build_tokenizer"
_READING = {"format", "columns", "hub_split", "revision", "max_rows"}  # the settings that decide which texts are read


def section_for(vocab_size: int, data: DataConfig) -> dict:
    return {
        "vocab_size": vocab_size,
        "sources": [src.model_dump(mode="json", include=_READING) for src in data.mixture()],
    }


@task(name=STAGE, result_serializer="json")
def build_tokenizer(section: dict, inputs: dict[str, ArtifactRef], store_root: str) -> ArtifactRef:
    """inputs: `data` (and `data_2`, ... for a mixture), the rows' sources."""

    def build(folder: Path) -> None:
        from jaxtune.data.rows import source_texts

        texts = []
        for i, reading in enumerate(section["sources"]):
            src = SourceConfig(source=inputs[data_input(i)].path, **reading)
            texts += source_texts(src, src.source)
        train_tokenizer(texts, section["vocab_size"], folder)

    return build_artifact(store_root, STAGE, __name__, section, inputs, build)
