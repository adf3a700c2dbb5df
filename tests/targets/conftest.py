"""What the target tests plan: a model's config.json alone."""

import pytest


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    """A folder holding nothing but a Llama's config.json: all a plan reads."""
    from transformers import AutoConfig

    folder = tmp_path_factory.mktemp("tiny-config")
    AutoConfig.for_model(
        "llama",
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        tie_word_embeddings=False,
    ).save_pretrained(folder)
    return folder
