"""Decoding compiled as one XLA program, greedy or sampled: a prefill, then a `while_loop` of one-token
steps (it stops early once every row has emitted end-of-sequence) over a static KV cache built from
transformers 5's `StaticLayer`s.

Every layer gets a full-length `StaticLayer` (sliding-window layers too): the sliding
window is then applied by the attention mask rather than by rolling the cache, which keeps
all shapes and control flow static, so prefill and decode compile once per shape.
"""

from __future__ import annotations

import inspect
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import torch
from transformers.cache_utils import Cache, StaticLayer

from jaxtune.runtime.compiled import programs
from jaxtune.runtime.decoding.sampling import Sampling, next_token
from jaxtune.runtime.modeling.model import JaxModel
from jaxtune.runtime.modeling.stacked import held


def kv_shape(model: JaxModel, batch: int, length: int) -> tuple[int, int, int, int]:
    cfg = model.config
    heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return (batch, heads, length, head_dim)


def _static_cache(kv: list[tuple[torch.Tensor, torch.Tensor]], start: torch.Tensor) -> Cache:
    """A transformers Cache over existing key/value tensors, writing from slot `start`."""
    layers = []
    for keys, values in kv:
        layer = StaticLayer(max_cache_len=keys.shape[2])
        layer.keys, layer.values = keys, values
        layer.device = keys.device
        layer.batch_size, layer.num_heads, _, layer.k_head_dim = keys.shape
        layer.v_head_dim = values.shape[-1]
        layer.cumulative_length = start.clone()  # StaticLayer writes at cumulative_length, not cache_position
        layer.is_initialized = True
        layers.append(layer)
    return Cache(layers=layers)


def _cache_argument(module: torch.nn.Module) -> str:
    """transformers 5.24 renamed `past_key_values` to `cache` (the old
    name goes in 5.40); models not yet migrated keep the old one."""
    base = module.get_base_model() if hasattr(module, "get_base_model") else module
    return "cache" if "cache" in inspect.signature(base.forward).parameters else "past_key_values"


def _cached_forward(model: JaxModel) -> Callable:
    """(weights, buffers, kv, ids, mask, cache_position, position_ids) -> (last logits, new kv)."""
    cache_argument = _cache_argument(model.module)

    def forward(weights, buffers, kv, ids, mask, cache_position, position_ids):
        cache = _static_cache(kv, cache_position[0])
        tensors = {**model.for_compute(weights), **buffers}
        with held(model.module, model.layout, tensors) as called_with:  # stacked layers: each on its row
            out = torch.func.functional_call(
                model.module,
                called_with,
                args=(),
                kwargs={
                    "input_ids": ids,
                    "attention_mask": mask,
                    cache_argument: cache,
                    "cache_position": cache_position,
                    "position_ids": position_ids,
                    "use_cache": True,
                    "logits_to_keep": 1,
                },
            )
        return out.logits[:, -1], [(layer.keys, layer.values) for layer in cache.layers]

    return forward


def make_generate(
    model: JaxModel, max_new_tokens: int, eos_ids: tuple[int, ...], sampling: Sampling = Sampling()
) -> programs.Program:
    """generate(model, weights, buffers, prompt_ids, prompt_mask, key=None) -> (b, max_new_tokens) token
    ids, one program every model of this structure shares (see `programs`).

    Prompts are left-padded (b, p); a row that emitted any of `eos_ids` keeps emitting the first.
    With no `eos_ids`, every row runs all `max_new_tokens`. Greedy by default; a `sampling` with a
    temperature draws token i from `fold_in(key, i)`, so a key gives the same answers on any run.
    """
    return programs.shared(
        "generate",
        model,
        (max_new_tokens, tuple(eos_ids), sampling),
        lambda ref: _jitted_generate(ref, max_new_tokens, eos_ids, sampling),
    )


def _jitted_generate(
    model: JaxModel, max_new_tokens: int, eos_ids: tuple[int, ...], sampling: Sampling = Sampling()
) -> Callable:
    from torchax import interop

    forward = _cached_forward(model)
    n_layers = model.config.num_hidden_layers
    env = model.env
    eos_id, stop_ids = (eos_ids[0], jnp.asarray(eos_ids)) if eos_ids else (0, jnp.asarray([-1]))

    def step(*args):
        with env:
            return interop.jax_view(forward(*interop.torch_view(args)))

    def pick(logits, key, i):
        return next_token(logits, None if sampling.greedy else jax.random.fold_in(key, i), sampling)

    def generate(weights, buffers, prompt_ids, prompt_mask, key=None):
        b, p = prompt_ids.shape
        total = p + max_new_tokens
        kv = [(jnp.zeros(kv_shape(model, b, total), model.dtype),) * 2 for _ in range(n_layers)]
        # Future slots are marked valid: the causal mask already hides them until they are written.
        mask = jnp.concatenate([prompt_mask, jnp.ones((b, max_new_tokens), prompt_mask.dtype)], axis=1)
        positions = jnp.maximum(jnp.cumsum(prompt_mask, axis=1) - 1, 0)  # (b, p): left padding shifts positions
        logits, kv = step(weights, buffers, kv, prompt_ids, mask, jnp.arange(p), positions)
        first = pick(logits, key, 0).astype(prompt_ids.dtype)

        def unfinished(state):
            i, _, _, _, done, _ = state
            return (i < max_new_tokens) & ~jnp.all(done)

        def one_token(state):
            i, tokens, kv, last, done, position = state
            logits, kv = step(weights, buffers, kv, last[:, None], mask, (p + i - 1)[None], position[:, None])
            nxt = jnp.where(done, eos_id, pick(logits, key, i).astype(last.dtype))
            return i + 1, tokens.at[:, i].set(nxt), kv, nxt, done | jnp.isin(nxt, stop_ids), position + 1

        tokens = jnp.full((b, max_new_tokens), eos_id, prompt_ids.dtype).at[:, 0].set(first)
        state = (jnp.int32(1), tokens, kv, first, jnp.isin(first, stop_ids), positions[:, -1] + 1)
        return jax.lax.while_loop(unfinished, one_token, state)[1]

    return jax.jit(generate)


def generate_memory(model: JaxModel, rows: int, prompt_length: int, max_new_tokens: int) -> dict:
    """XLA's memory plan (see `steps.train_step_memory`) of decoding `max_new_tokens` after `rows`
    prompts of `prompt_length`, the prompts split as `Placement.shard_prompts` splits them."""
    from jaxtune.runtime.compiled import steps

    prompts = jax.ShapeDtypeStruct((rows, prompt_length), jnp.int32, sharding=model.placement.prompt_sharding(rows))
    generate = make_generate(model, max_new_tokens, eos_ids=(0,))  # which ids stop decoding changes no buffer
    with model.env:
        compiled = generate.lower(
            model, steps.shapes_of(model.weights), steps.shapes_of(model.buffers), prompts, prompts
        ).compile()
    return steps.compiled_memory(compiled)


def left_pad(prompts: list[list[int]], pad_id: int, length: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(b, p) ids and mask; p is `length`, or else a bucket length (see `batches.bucket_length`) so
    few prompt shapes compile."""
    from jaxtune.runtime.compiled.batches import bucket_length

    p = length or bucket_length(max(len(x) for x in prompts))
    ids = np.full((len(prompts), p), pad_id, np.int32)
    mask = np.zeros((len(prompts), p), np.int32)
    for row, prompt in enumerate(prompts):
        ids[row, p - len(prompt) :] = prompt
        mask[row, p - len(prompt) :] = 1
    return ids, mask
