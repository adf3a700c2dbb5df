"""Shared fixtures: tiny random models built from configs (nothing is downloaded)."""

from __future__ import annotations

import os
import tempfile

# Before Prefect loads: no telemetry, and its home (database, logs) in a throwaway folder.
os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
os.environ["PREFECT_HOME"] = tempfile.mkdtemp(prefix="jaxtune-prefect-")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest


def tiny_gemma3(vocab_size: int = 256, layers: int = 2, sliding_window: int = 16, seed: int = 0):
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    config = Gemma3TextConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        sliding_window=sliding_window,
        max_position_embeddings=512,
        layer_types=(["sliding_attention", "full_attention"] * layers)[:layers],
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
    )
    torch.manual_seed(seed)
    return Gemma3ForCausalLM(config).eval()


@pytest.fixture(scope="session")
def tiny_gemma3_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-gemma3")
    tiny_gemma3().save_pretrained(path)
    return str(path)
