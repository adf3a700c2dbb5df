"""Choosing the next token from logits: greedy, or sampled with temperature, top-k and top-p.

The settings are static (one compiled program per setting, as a chat session keeps one);
the random key is traced, so a new seed or step reuses the program.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp


@dataclass(frozen=True)
class Sampling:
    """temperature 0 is greedy (top_k and top_p are then unused); top_k 0 and top_p 1 keep every token."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self):
        if self.temperature < 0 or self.top_k < 0 or not 0 < self.top_p <= 1:
            raise ValueError(f"need temperature >= 0, top_k >= 0 and 0 < top_p <= 1, got {self}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def next_token(logits: jax.Array, key: jax.Array, sampling: Sampling) -> jax.Array:
    """(b, vocab) logits -> (b,) int32 token ids."""
    if sampling.greedy:
        return jnp.argmax(logits, -1).astype(jnp.int32)
    logits = logits.astype(jnp.float32) / sampling.temperature
    if sampling.top_k:
        kth = jax.lax.top_k(logits, min(sampling.top_k, logits.shape[-1]))[0][..., -1:]  # (b, 1)
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if sampling.top_p < 1:
        logits = _nucleus(logits, sampling.top_p)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


def _nucleus(logits: jax.Array, top_p: float) -> jax.Array:
    """Keep the most likely tokens whose probabilities first reach `top_p` together (at least one)."""
    ordered = jnp.sort(logits, axis=-1)[..., ::-1]  # (b, vocab), descending
    probs = jax.nn.softmax(ordered, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # mass of the strictly more likely tokens
    kept = jnp.sum(before < top_p, axis=-1, keepdims=True)  # (b, 1), >= 1 since before[0] = 0
    threshold = jnp.take_along_axis(ordered, kept - 1, axis=-1)
    return jnp.where(logits < threshold, -jnp.inf, logits)
