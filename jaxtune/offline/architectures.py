"""Tiny random configs of the model families jaxtune is tested on.

Each entry turns one shape (`TinyModelConfig`) into that family's own transformers config,
keeping what makes the family itself: Gemma's sliding-window layers and logit soft-capping,
Llama 3's rope scaling, Qwen 3's q/k norms, Mistral's sliding window, GPT-2's learned
positions and fused Conv1D projections, Phi-3's fused qkv and gate/up projections. Nothing
here downloads anything; the offline default and the tests build models from these.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from jaxtune.config import ARCHITECTURES

MAX_POSITIONS = 2048


def _alternating(layers: int) -> list[str]:
    return ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]


def _decoder(shape, **extra) -> dict[str, Any]:
    """Settings every rotary decoder family names the same way."""
    return {
        "hidden_size": shape.hidden_size,
        "intermediate_size": shape.intermediate_size,
        "num_hidden_layers": shape.num_hidden_layers,
        "num_attention_heads": shape.num_attention_heads,
        "num_key_value_heads": shape.num_key_value_heads,
        "head_dim": shape.head_dim,
        "max_position_embeddings": MAX_POSITIONS,
        **extra,
    }


def _gemma3(shape) -> dict[str, Any]:
    return _decoder(shape, sliding_window=shape.sliding_window, layer_types=_alternating(shape.num_hidden_layers))


def _gemma2(shape) -> dict[str, Any]:
    # Gemma 2 soft-caps attention scores and final logits; both run through torchax's tanh.
    return _decoder(
        shape,
        sliding_window=shape.sliding_window,
        layer_types=_alternating(shape.num_hidden_layers),
        query_pre_attn_scalar=shape.head_dim,
        attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0,
    )


def _llama(shape) -> dict[str, Any]:
    llama3_rope = {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 256,
    }
    return _decoder(shape, rope_parameters=llama3_rope)


def _qwen3(shape) -> dict[str, Any]:
    return _decoder(shape)


def _mistral(shape) -> dict[str, Any]:
    return _decoder(shape, sliding_window=shape.sliding_window)


def _phi3(shape) -> dict[str, Any]:
    return _decoder(shape, sliding_window=shape.sliding_window)


def _gpt2(shape) -> dict[str, Any]:
    return {
        "n_embd": shape.hidden_size,
        "n_inner": shape.intermediate_size,
        "n_layer": shape.num_hidden_layers,
        "n_head": shape.num_attention_heads,
        "n_positions": MAX_POSITIONS,
    }


# family name -> (transformers model_type, settings for a shape)
FAMILIES: dict[str, tuple[str, Callable[[Any], dict[str, Any]]]] = {
    "gemma3": ("gemma3_text", _gemma3),
    "gemma2": ("gemma2", _gemma2),
    "llama": ("llama", _llama),
    "qwen3": ("qwen3", _qwen3),
    "mistral": ("mistral", _mistral),
    "phi3": ("phi3", _phi3),
    "gpt2": ("gpt2", _gpt2),
}


assert tuple(FAMILIES) == ARCHITECTURES, "config.ARCHITECTURES lists the families defined here"


def tiny_config(family: str, shape, vocab_size: int, pad_id: int, bos_id: int, eos_id: int):
    """A random-init transformers config of `family` with `shape`'s sizes and the tokenizer's special ids."""
    from transformers import AutoConfig

    if family not in FAMILIES:
        raise ValueError(f"unknown architecture {family!r}; known: {', '.join(FAMILIES)}")
    model_type, settings = FAMILIES[family]
    return AutoConfig.for_model(
        model_type,
        vocab_size=vocab_size,
        pad_token_id=pad_id,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        tie_word_embeddings=shape.tie_word_embeddings,
        **settings(shape),
    )
