"""Decoding one prompt a token at a time, so a chat can print each token as it is made.

Two compiled programs over a static KV cache (the same cache and forward pass as
`decode.make_generate`): a prefill that fills the cache and picks the first token, and a
one-token step. The host drives the loop, reading back each token; the step for token i+1
is dispatched before token i is read, so the device computes while the host prints.
The cache length is a bucket of prompt + answer length, so a growing conversation compiles
few programs; they are compiled ahead of time and kept, and compile time is counted apart.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from jaxtune.runtime.compiled.batches import bucket_length
from jaxtune.runtime.decoding.decode import _cached_forward, kv_shape, left_pad
from jaxtune.runtime.decoding.sampling import Sampling, next_token
from jaxtune.runtime.modeling.model import JaxModel


@dataclass
class Stats:
    """Of one `stream` call: tokens yielded, seconds spent producing them, and seconds compiling."""

    tokens: int = 0
    seconds: float = 0.0
    compile_seconds: float = 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


class StreamDecoder:
    """`stream(prompt_ids, max_new_tokens, seed)` yields answer token ids; a stop id ends it unyielded."""

    def __init__(self, model: JaxModel, stop_ids: Sequence[int], pad_id: int, sampling: Sampling = Sampling()):
        self.model = model
        self.stop_ids = frozenset(stop_ids)
        self.pad_id = pad_id
        self.sampling = sampling
        self.last = Stats()
        self._prefill, self._step = _programs(model, sampling)
        self._compiled: dict[tuple[int, int], tuple] = {}  # (prompt bucket, cache length) -> (prefill, step)

    def stream(self, prompt_ids: Sequence[int], max_new_tokens: int, seed: int = 0) -> Iterator[int]:
        ids, prompt_mask = left_pad([list(prompt_ids)], self.pad_id)  # (1, p)
        p = ids.shape[1]
        total = bucket_length(p + max_new_tokens)
        # Future slots are marked valid: the causal mask hides each until it is written. On the
        # device once, not with every step.
        mask = jnp.asarray(np.concatenate([prompt_mask, np.ones((1, total - p), np.int32)], axis=1))  # (1, total)
        key = jax.random.key(seed)
        self.last = stats = Stats()
        prefill, step = self._programs_for(p, total, ids, mask, key, stats)
        weights, buffers = self.model.weights, self.model.buffers
        start = time.perf_counter()
        token, kv = prefill(weights, buffers, ids, mask, key)
        for i in range(max_new_tokens):
            if i + 1 < max_new_tokens:  # token i sits in cache slot p + i, at position len(prompt) + i
                upcoming, kv = step(
                    weights,
                    buffers,
                    kv,
                    token,
                    mask,
                    np.int32(p + i),
                    np.int32(len(prompt_ids) + i),
                    key,
                    np.int32(i + 1),
                )
            value = int(token[0])
            stats.seconds = time.perf_counter() - start
            if value in self.stop_ids:
                break
            stats.tokens = i + 1
            yield value
            token = upcoming

    def _programs_for(self, p: int, total: int, ids, mask, key, stats: Stats) -> tuple:
        if (p, total) not in self._compiled:
            started = time.perf_counter()
            weights, buffers = self.model.weights, self.model.buffers
            prefill = self._prefill.lower(weights, buffers, ids, mask, key).compile()
            token, kv = prefill.out_info
            slot = position = index = np.int32(0)
            step = self._step.lower(weights, buffers, kv, token, mask, slot, position, key, index).compile()
            self._compiled[(p, total)] = (prefill, step)
            stats.compile_seconds = time.perf_counter() - started
        return self._compiled[(p, total)]


def _programs(model: JaxModel, sampling: Sampling) -> tuple:
    """(prefill, step) as jitted functions, not yet compiled."""
    from torchax import interop

    forward = _cached_forward(model)
    n_layers = model.config.num_hidden_layers

    def cached_forward(*args):
        with model.env:
            return interop.jax_view(forward(*interop.torch_view(args)))

    def prefill(weights, buffers, ids, mask, key):
        b, p = ids.shape
        kv = [(jnp.zeros(kv_shape(model, b, mask.shape[1]), model.dtype),) * 2 for _ in range(n_layers)]
        positions = jnp.maximum(jnp.cumsum(mask[:, :p], axis=1) - 1, 0)  # (b, p): left padding shifts positions
        logits, kv = cached_forward(weights, buffers, kv, ids, mask, jnp.arange(p), positions)
        return next_token(logits, jax.random.fold_in(key, 0), sampling), kv

    def step(weights, buffers, kv, token, mask, slot, position, key, index):
        positions = jnp.broadcast_to(position, token.shape)[:, None]  # (b, 1)
        logits, kv = cached_forward(weights, buffers, kv, token[:, None], mask, slot[None], positions)
        return next_token(logits, jax.random.fold_in(key, index), sampling), kv

    return jax.jit(prefill), jax.jit(step, donate_argnums=(2,))
