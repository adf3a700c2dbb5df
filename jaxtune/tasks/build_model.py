"""Stage `build_model` (offline default only): a tiny random model of the configured family,
saved as a normal HF model folder, tokenizer included, so it loads through the same
`from_pretrained` path as a hub model."""

from __future__ import annotations

from pathlib import Path

from prefect import task

from jaxtune.artifacts import ArtifactRef
from jaxtune.config import TinyModelConfig
from jaxtune.tasks.stage import build_artifact

STAGE = "build_model"


def build_tiny_model(section: TinyModelConfig, tokenizer):
    """A random `section.architecture` model sized by `section`, with `tokenizer`'s vocabulary and special ids."""
    import torch
    from transformers import AutoModelForCausalLM

    from jaxtune.offline.architectures import tiny_config

    config = tiny_config(
        section.architecture,
        section,
        len(tokenizer),
        tokenizer.pad_token_id,
        tokenizer.bos_token_id,
        tokenizer.eos_token_id,
    )
    torch.manual_seed(section.seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


@task(name=STAGE, result_serializer="json")
def build_model(section: TinyModelConfig, inputs: dict[str, ArtifactRef], store_root: str) -> ArtifactRef:
    """inputs: `tokenizer`, whose vocabulary sizes the embedding."""

    def build(folder: Path) -> None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(inputs["tokenizer"].path)
        build_tiny_model(section, tokenizer).save_pretrained(folder)
        tokenizer.save_pretrained(folder)

    return build_artifact(store_root, STAGE, __name__, section, inputs, build)
