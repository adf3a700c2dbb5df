"""Compiled train and eval steps. All are pure: arrays in, arrays out; logging happens outside.

The train step is written here rather than taken from `torchax.train.make_train_step`, which
computes one batch and ignores its remat policy: this one sums the gradients of k
micro-batches in a `lax.scan` inside one XLA program, can recompute each decoder layer in the
backward pass, and draws dropout from a key the caller derives from (seed, step).
"""

from __future__ import annotations

import contextlib
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


def forward_logits(model: JaxModel, training: bool = False, remat: bool = False) -> Callable:
    """(weights, buffers, batch) -> logits, the model run as a pure function of its tensors.

    `training` puts the module in train mode (dropout on) while it is traced; `remat` recomputes
    each decoder layer in the backward pass. Either way each layer draws its dropout from a key of
    its own (see `remat.keyed_layers`), so remat never changes the dropout masks.
    """
    from jaxtune.runtime.remat import keyed_layers

    module = model.module

    def forward(weights, buffers, batch):
        module.train(training)
        with keyed_layers(module, remat) if training or remat else contextlib.nullcontext():
            out = torch.func.functional_call(
                module,
                (model.for_compute(weights), buffers),
                args=(),
                kwargs={"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"], "use_cache": False},
            )
        module.eval()
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


def learning_rate_schedule(cfg: TrainConfig, total_steps: int) -> optax.Schedule:
    """Linear warmup to `cfg.learning_rate`, then cosine decay to 10%, linear decay to 0, or constant."""
    warmup = min(cfg.warmup_steps, max(total_steps - 1, 0))
    peak, rest = cfg.learning_rate, max(total_steps - warmup, 1)
    if cfg.lr_schedule == "warmup_cosine":
        after = optax.cosine_decay_schedule(peak, rest, alpha=0.1)
    elif cfg.lr_schedule == "linear":
        after = optax.linear_schedule(peak, 0.0, rest)
    else:
        after = optax.constant_schedule(peak)
    if warmup == 0:
        return after
    return optax.join_schedules([optax.linear_schedule(0.0, peak, warmup), after], [warmup])


def make_optimizer(cfg: TrainConfig, total_steps: int) -> optax.GradientTransformation:
    schedule = learning_rate_schedule(cfg, total_steps)
    if cfg.optimizer == "adafactor":
        # Plain steps of size lr (HF's scale_parameter=False, relative_step=False), the fine-tuning setting.
        update = optax.adafactor(schedule, multiply_by_parameter_scale=False, weight_decay_rate=cfg.weight_decay or None)
    elif cfg.optimizer == "sgd":
        update = optax.chain(optax.add_decayed_weights(cfg.weight_decay), optax.sgd(schedule, momentum=0.9))
    else:
        update = optax.adamw(schedule, weight_decay=cfg.weight_decay)
    return optax.chain(record_grad_norm(), optax.clip_by_global_norm(cfg.max_grad_norm), update)


def grad_norm_of(opt_state: Any) -> jax.Array:
    return opt_state[0].grad_norm


def _summed_nll(model: JaxModel, training: bool, remat: bool) -> Callable:
    """JAX function (weights, buffers, batch, labels, key) -> (summed token NLL, scored tokens);
    dropout, if any, draws from `key`."""
    from torchax import interop

    forward = forward_logits(model, training=training, remat=remat)

    def summed(weights, buffers, batch, labels):
        with model.env:
            nll, count = token_nll(forward(weights, buffers, batch), labels)
            return nll.sum(), count.sum()

    as_jax = interop.jax_view(summed)

    def run(weights, buffers, batch, labels, key):
        with model.env.override_property(prng=key):
            return as_jax(weights, buffers, batch, labels)

    return run


def _train_step_fn(model: JaxModel, optimizer: optax.GradientTransformation, remat: bool) -> Callable:
    """step(weights, buffers, opt_state, batch, labels, key) -> (loss, weights, opt_state).

    `batch` arrays and `labels` are (k, b, t): k micro-batches whose summed gradients, divided
    by all k·b rows' scored tokens, equal one (k·b)-row batch's mean-token-loss gradient.
    """
    grad = jax.value_and_grad(_summed_nll(model, training=True, remat=remat), has_aux=True)

    def step(weights, buffers, opt_state, batch, labels, key):
        def micro(carry, xs):
            grads, nll, count = carry
            micro_batch, micro_labels, index = xs
            (n, c), g = grad(weights, buffers, micro_batch, micro_labels, jax.random.fold_in(key, index))
            return (jax.tree.map(jnp.add, grads, g), nll + n, count + c), None

        zeros = (jax.tree.map(jnp.zeros_like, weights), jnp.zeros((), jnp.float32), jnp.zeros((), jnp.int32))
        k = labels.shape[0]
        (grads, nll, count), _ = jax.lax.scan(micro, zeros, (batch, labels, jnp.arange(k)))
        scale = 1.0 / jnp.maximum(count, 1).astype(jnp.float32)
        grads = jax.tree.map(lambda g: g * scale, grads)
        updates, opt_state = optimizer.update(grads, opt_state, weights)
        return nll * scale, optax.apply_updates(weights, updates), opt_state

    return step


def _jitted_train_step(model: JaxModel, optimizer: optax.GradientTransformation, remat: bool):
    """The train step jitted, donating weights and optimizer state so they update in place."""
    return jax.jit(_train_step_fn(model, optimizer, remat), donate_argnums=(0, 2))


def make_train_step(model: JaxModel, optimizer: optax.GradientTransformation, remat: bool = False) -> Callable:
    """The train step jitted, donating weights and optimizer state so they update in place."""
    jitted = _jitted_train_step(model, optimizer, remat)

    def run(weights, buffers, opt_state, batch, labels, key):
        with model.env:
            return jitted(weights, buffers, opt_state, batch, labels, key)

    return run


def step_key(seed: int, step: int) -> jax.Array:
    """The dropout key of one optimizer step: a function of (seed, step) alone, so a resumed run draws what an uninterrupted one would."""
    return jax.random.fold_in(jax.random.PRNGKey(seed), step)


def train_step_memory(model: JaxModel, optimizer: optax.GradientTransformation, micro_batches: int, batch_size: int,
                      length: int, remat: bool = False) -> dict:
    """XLA's memory plan for one train step of (micro_batches, batch_size, length), compiled from shapes alone.

    Bytes of arguments (weights, frozen tensors, optimizer state, batch), of outputs, of
    temporaries (activations kept for the backward pass, gradients), and their peak.
    """
    jitted = _jitted_train_step(model, optimizer, remat)
    spec = lambda tree: jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), tree)  # noqa: E731
    opt_state = jax.eval_shape(optimizer.init, spec(model.weights))
    shape = (micro_batches, batch_size, length)
    batch = {name: jax.ShapeDtypeStruct(shape, jnp.int32) for name in ("input_ids", "attention_mask")}
    labels = jax.ShapeDtypeStruct(shape, jnp.int32)
    key = jax.ShapeDtypeStruct((2,), jnp.uint32)
    with model.env:
        compiled = jitted.lower(spec(model.weights), spec(model.buffers), opt_state, batch, labels, key).compile()
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


def mean_token_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean NLL over every scored token of the batch (the training objective)."""
    nll, count = token_nll(logits, labels)
    return nll.sum() / torch.clamp(count.sum(), min=1)


def make_loss_and_grad(model: JaxModel, remat: bool = False) -> Callable:
    """grad(weights, buffers, batch, labels) -> (mean token loss, gradients of the weights), jitted."""
    from torchax import interop

    forward = forward_logits(model, remat=remat)

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
