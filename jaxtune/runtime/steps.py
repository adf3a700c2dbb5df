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
            (model.for_compute(weights), buffers),
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
    schedule = learning_rate_schedule(cfg)
    if cfg.optimizer == "adafactor":
        # Plain steps of size lr (HF's scale_parameter=False, relative_step=False), the fine-tuning setting.
        update = optax.adafactor(schedule, multiply_by_parameter_scale=False, weight_decay_rate=cfg.weight_decay or None)
    else:
        update = optax.adamw(schedule, weight_decay=cfg.weight_decay)
    return optax.chain(record_grad_norm(), optax.clip_by_global_norm(cfg.max_grad_norm), update)


def grad_norm_of(opt_state: Any) -> jax.Array:
    return opt_state[0].grad_norm


def mean_token_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean NLL over every scored token of the batch (the training objective)."""
    nll, count = token_nll(logits, labels)
    return nll.sum() / torch.clamp(count.sum(), min=1)


def _jitted_train_step(model: JaxModel, optimizer: optax.GradientTransformation):
    """jax.jit of torchax's train step over JAX arrays, donating weights and optimizer state."""
    import torchax.train
    from torchax import interop

    step = torchax.train.make_train_step(forward_logits(model), mean_token_loss, optimizer)
    return jax.jit(interop.jax_view(step), donate_argnums=(0, 2))


def make_train_step(model: JaxModel, optimizer: optax.GradientTransformation) -> Callable:
    """torchax's train step, jitted, donating weights and optimizer state so they update in place.

    Returns step(weights, buffers, opt_state, batch, labels) -> (loss, weights, opt_state),
    all JAX pytrees.
    """
    jitted = _jitted_train_step(model, optimizer)

    def run(weights, buffers, opt_state, batch, labels):
        with model.env:
            return jitted(weights, buffers, opt_state, batch, labels)

    return run


def train_step_memory(model: JaxModel, optimizer: optax.GradientTransformation, batch_size: int, length: int) -> dict:
    """XLA's memory plan for one train step at (batch_size, length), compiled from shapes alone.

    Bytes of arguments (weights, frozen tensors, optimizer state, batch), of outputs, of
    temporaries (activations kept for the backward pass, gradients), and their peak.
    """
    jitted = _jitted_train_step(model, optimizer)
    spec = lambda tree: jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), tree)  # noqa: E731
    opt_state = jax.eval_shape(optimizer.init, spec(model.weights))
    batch = {name: jax.ShapeDtypeStruct((batch_size, length), jnp.int32) for name in ("input_ids", "attention_mask")}
    labels = jax.ShapeDtypeStruct((batch_size, length), jnp.int32)
    with model.env:
        compiled = jitted.lower(spec(model.weights), spec(model.buffers), opt_state, batch, labels).compile()
    stats = compiled.memory_analysis()
    plan = {
        "argument_bytes": int(stats.argument_size_in_bytes),
        "output_bytes": int(stats.output_size_in_bytes),
        "temp_bytes": int(stats.temp_size_in_bytes),
        "alias_bytes": int(stats.alias_size_in_bytes),
    }
    # Donated outputs reuse their argument buffers (alias), so they count once.
    plan["peak_bytes"] = plan["argument_bytes"] + plan["output_bytes"] + plan["temp_bytes"] - plan["alias_bytes"]
    return plan


def make_loss_and_grad(model: JaxModel) -> Callable:
    """grad(weights, buffers, batch, labels) -> (mean token loss, gradients of the weights), jitted."""
    from torchax import interop

    forward = forward_logits(model)

    def loss(weights, buffers, batch, labels):
        with model.env:
            return mean_token_loss(forward(weights, buffers, batch), labels)

    jitted = jax.jit(jax.value_and_grad(interop.jax_view(loss)))

    def run(weights, buffers, batch, labels):
        with model.env:
            return jitted(weights, buffers, batch, labels)

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
