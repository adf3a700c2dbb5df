"""A tiny Llama the GGUF writer can write: unscaled RoPE (the tiny configs' Llama 3 scaling is
refused), 300 tokens, saved with an offline byte-level BPE tokenizer trained on given texts."""

from __future__ import annotations

from pathlib import Path


def save_tiny_llama(
    folder: Path, texts: list[str], hidden_size: int, num_attention_heads: int, num_key_value_heads: int, eos_id: int
) -> Path:
    import torch
    from transformers import AutoModelForCausalLM

    from jaxtune.config import TinyModelConfig
    from jaxtune.offline.architectures import tiny_config
    from jaxtune.offline.tokenizer import train_tokenizer

    train_tokenizer(texts, 300, folder)
    shape = TinyModelConfig(
        architecture="llama",
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=2,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        head_dim=16,
        vocab_size=300,
    )
    config = tiny_config("llama", shape, 300, 0, 2, eos_id)
    config.rope_parameters = {"rope_type": "default", "rope_theta": 10000.0}
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)
    return folder
