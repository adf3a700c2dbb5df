"""Compiled train and eval steps. Both are pure: arrays in, arrays out; logging happens outside."""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax
import torch

from jaxtune.config import TrainConfig
from jaxtune.data.tokenize import IGNORE_INDEX
from jaxtune.runtime.model import JaxModel


def token_nll(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row summed next-token NLL and count of scored tokens; labels of -100 are not scored."""
    logits = logits[:, :-1].float()  # (b, t-1, v): fp32 log-softmax whatever the weights' dtype
    target = labels[:, 1:]  # (b, t-1)
    scored = target != IGNORE_INDEX
    logp = torch.log_softmax(logits, dim=-1)
    picked = torch.gather(logp, -1, target.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return -(picked * scored).sum(-1), scored.sum(-1)


def forward_logits(model: JaxModel) -> Callable:
    """(weights, buffers, batch) -> logits, the model run as a pure function of its tensors."""
    module = model.module

    def forward(weights, buffers, batch):
        out = torch.func.functional_call(
            module,
            (weights, buffers),
            args=(),
            kwargs={"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"], "use_cache": False},
        )
        return out.logits

    return forward


class GradNormState(NamedTuple):
    grad_norm: jax.Array


def record_grad_norm() -> optax.GradientTransformation:
    """Keep the global gradient norm (before clipping) in the optimizer state, for the log."""

    def init(params):
        return GradNormState(jnp.zeros((), jnp.float32))

    def update(updates, state, params=None):
        return updates, GradNormState(optax.tree.norm(updates))

    return optax.GradientTransformation(init, update)


def learning_rate_schedule(cfg: TrainConfig) -> optax.Schedule:
    warmup = min(cfg.warmup_steps, cfg.max_steps - 1)
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=cfg.learning_rate,
        warmup_steps=warmup,
        decay_steps=cfg.max_steps,
        end_value=cfg.learning_rate * 0.1,
    )


def make_optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
    return optax.chain(
        record_grad_norm(),
        optax.clip_by_global_norm(cfg.max_grad_norm),
        optax.adamw(learning_rate_schedule(cfg), weight_decay=cfg.weight_decay),
    )


def grad_norm_of(opt_state: Any) -> jax.Array:
    return opt_state[0].grad_norm


def make_train_step(model: JaxModel, optimizer: optax.GradientTransformation) -> Callable:
    """torchax's train step, jitted, donating weights and optimizer state so they update in place.

    Returns step(weights, buffers, opt_state, batch, labels) -> (loss, weights, opt_state),
    all JAX pytrees.
    """
    import torchax.train
    from torchax import interop

    forward = forward_logits(model)

    def mean_loss(logits, labels):
        nll, count = token_nll(logits, labels)
        return nll.sum() / torch.clamp(count.sum(), min=1)

    step = torchax.train.make_train_step(forward, mean_loss, optimizer)
    jitted = interop.jax_jit(step, kwargs_for_jax_jit={"donate_argnums": (0, 2)})

    def run(weights, buffers, opt_state, batch, labels):
        with model.env:
            loss, weights, opt_state = jitted(*interop.torch_view((weights, buffers, opt_state, batch, labels)))
        return interop.jax_view((loss, weights, opt_state))

    return run


def make_eval_step(model: JaxModel) -> Callable:
    """eval(weights, buffers, batch, labels) -> (per-row NLL sum, per-row scored tokens)."""
    from torchax import interop

    forward = forward_logits(model)

    def evaluate(weights, buffers, batch, labels):
        return token_nll(forward(weights, buffers, batch), labels)

    jitted = interop.jax_jit(evaluate)

    def run(weights, buffers, batch, labels):
        with model.env:
            out = jitted(*interop.torch_view((weights, buffers, batch, labels)))
        return interop.jax_view(out)

    return run
