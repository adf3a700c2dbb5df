"""Fixtures the GRPO tests share with the preference tests (tests/preference/test_against_trl.py):
the tiny LoRA Llama (random B), its JAX copy and their word-level tokenizer."""

from tests.preference.test_against_trl import jax_model as jax_model
from tests.preference.test_against_trl import lora_module as lora_module
from tests.preference.test_against_trl import tokenizer as tokenizer
