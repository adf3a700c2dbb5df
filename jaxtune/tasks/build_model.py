"""Stage `build_model` (offline default only): a tiny random Gemma 3 saved as a normal HF
model folder, tokenizer included, so it loads through the same `from_pretrained` path as a
hub model."""

from __future__ import annotations

from pathlib import Path

from prefect import task

from jaxtune.artifacts import ArtifactRef
from jaxtune.config import TinyModelConfig
from jaxtune.tasks.stage import build_artifact

STAGE = "build_model"
VERSION = "1"


def tiny_gemma3_config(cfg: TinyModelConfig, tokenizer):
    from transformers import Gemma3TextConfig

    layer_types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(cfg.num_hidden_layers)]
    return Gemma3TextConfig(
        vocab_size=len(tokenizer),
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim,
        sliding_window=cfg.sliding_window,
        layer_types=layer_types,
        max_position_embeddings=2048,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=cfg.tie_word_embeddings,
    )


@task(name=STAGE, result_serializer="json")
def build_model(section: TinyModelConfig, inputs: dict[str, ArtifactRef], store_root: str) -> ArtifactRef:
    """inputs: `tokenizer`, whose vocabulary sizes the embedding."""

    def build(folder: Path) -> None:
        import torch
        from transformers import AutoTokenizer, Gemma3ForCausalLM

        tokenizer = AutoTokenizer.from_pretrained(inputs["tokenizer"].path)
        torch.manual_seed(section.seed)
        model = Gemma3ForCausalLM(tiny_gemma3_config(section, tokenizer))
        model.generation_config.eos_token_id = tokenizer.eos_token_id
        model.generation_config.pad_token_id = tokenizer.pad_token_id
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)

    return build_artifact(store_root, STAGE, VERSION, section, inputs, build)
