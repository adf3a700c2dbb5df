"""Compiled train and eval steps. All are pure: arrays in, arrays out; logging happens outside.

The train step is written here rather than taken from `torchax.train.make_train_step`, which
computes one batch and ignores its remat policy: this one sums the gradients of k
micro-batches in a `lax.scan` inside one XLA program, can recompute each decoder layer in the
backward pass, and draws dropout from a key the caller derives from (seed, step).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import torch

from jaxtune.config import REMAT_POLICIES, TrainConfig
from jaxtune.runtime.compiled import programs
from jaxtune.runtime.compiled.preference import OBJECTIVE_INPUTS, SFT, Objective, summed_objective
from jaxtune.runtime.modeling import stacked
from jaxtune.runtime.modeling.forward import forward_logits, forward_token_nll, token_nll  # noqa: F401  (re-exported)
from jaxtune.runtime.modeling.model import JaxModel

OPTIMIZER_SCOPE = "optimizer"  # the name scope of the step's update in its compiled op names


class GradNormState(NamedTuple):
    grad_norm: jax.Array


def record_grad_norm() -> optax.GradientTransformation:
    """Keep the global gradient norm (before clipping) in the optimizer state, for the log."""

    def init(params):
        return GradNormState(jnp.zeros((), jnp.float32))

    def update(updates, state, params=None):
        return updates, GradNormState(optax.tree.norm(updates))

    return optax.GradientTransformation(init, update)


def learning_rate_schedule(cfg: TrainConfig, total_steps: int) -> Callable[[int], float]:
    """Linear warmup to `cfg.learning_rate`, then cosine decay to 10%, linear decay to 0, or constant:
    step -> rate, a lookup in rates computed once (held after `total_steps`).

    Called per step, optax's schedule would run a dozen one-op programs on the device and wait for
    them (about 10 ms a step on a TPU v5e, while the chip idles); the lookup runs none.
    """
    rates = np.asarray(jax.vmap(optax_schedule(cfg, total_steps))(np.arange(total_steps + 1)), np.float32)
    return lambda step: float(rates[min(step, total_steps)])


def optax_schedule(cfg: TrainConfig, total_steps: int) -> optax.Schedule:
    """The schedule `learning_rate_schedule` looks up, as an optax schedule."""
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


def make_optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
    """Clipping and the update rule, with the learning rate a hyperparameter held in the state.

    The train step writes each step's rate into the state (`with_learning_rate`), so the
    schedule is evaluated on the host and a new rate or schedule never recompiles the step.
    Settings equal but for the rate give the very same optimizer, so that runs with them share
    one train step (`programs.shared` keys it by `optimizer_settings`).
    """
    return _optimizer(cfg.optimizer, cfg.weight_decay, cfg.max_grad_norm)


_MADE: dict[tuple, optax.GradientTransformation] = {}  # every optimizer `make_optimizer` made, by its settings


def optimizer_settings(optimizer: optax.GradientTransformation) -> tuple | None:
    """(rule, weight decay, clipping norm) of an optimizer `make_optimizer` made: all its update compiles
    in besides the rate; None for any other optimizer. `_MADE` holds each optimizer it made, so no other
    object can be taken for one."""
    return next((settings for settings, made in _MADE.items() if made is optimizer), None)


def _optimizer(name: str, weight_decay: float, max_grad_norm: float) -> optax.GradientTransformation:
    """The optimizer of these settings, made once."""
    settings = (name, weight_decay, max_grad_norm)
    if settings in _MADE:
        return _MADE[settings]

    def chain(learning_rate):
        if name == "adafactor":
            # Plain steps of size lr (HF's scale_parameter=False, relative_step=False), the fine-tuning setting:
            # optax.adafactor's chain (so its state), its update clipped a layer at a time where layers are stacked.
            update = optax.chain(
                optax.scale_by_factored_rms(),
                clip_by_layer_rms(1.0),
                optax.scale_by_learning_rate(learning_rate, flip_sign=False),
                *([optax.add_decayed_weights(weight_decay)] if weight_decay else []),
                optax.scale(-1),
            )
        elif name == "sgd":
            update = optax.chain(optax.add_decayed_weights(weight_decay), optax.sgd(learning_rate, momentum=0.9))
        else:
            update = optax.adamw(learning_rate, weight_decay=weight_decay)
        return optax.chain(record_grad_norm(), optax.clip_by_global_norm(max_grad_norm), update)

    # A strongly typed float32: a weak-typed Python float here would make the state the step
    # returns (strong float32) differ in type from the one it was first called with: a recompile.
    # Its value is a placeholder: every step writes its own rate (`with_learning_rate`).
    _MADE[settings] = optax.inject_hyperparams(chain)(learning_rate=jnp.asarray(0.0, jnp.float32))
    return _MADE[settings]


def clip_by_layer_rms(threshold: float) -> optax.GradientTransformation:
    """optax.clip_by_block_rms (each update scaled to a root mean square of at most `threshold`), with each
    layer's row of a stacked tensor (`stacked.leading_axes`) a block of its own, as the unrolled model's is."""

    def clip(path, update):
        name = getattr(path[-1], "key", None) if path else None
        axes = tuple(range(stacked.leading_axes(name), update.ndim))
        rms = jnp.sqrt(jnp.mean(jnp.square(update), axis=axes, keepdims=True))
        return update / jnp.maximum(1.0, rms / threshold)

    def update_fn(updates, state, params=None):
        del params
        return jax.tree_util.tree_map_with_path(clip, updates), state

    return optax.GradientTransformation(optax.init_empty_state, update_fn)


def with_learning_rate(opt_state: Any, lr: jax.Array) -> Any:
    """`opt_state` with this step's learning rate."""
    return opt_state._replace(hyperparams={**opt_state.hyperparams, "learning_rate": jnp.asarray(lr, jnp.float32)})


def grad_norm_of(opt_state: Any) -> jax.Array:
    return opt_state.inner_state[0].grad_norm


@dataclasses.dataclass(frozen=True)
class StepSpec:
    """What a compiled train step depends on beyond the model's structure and the optimizer: with the
    optimizer's settings, the key of its program (`shared_train_step`).

    `remat`: the recomputation policy, one of `REMAT_POLICIES` (auto is resolved by `fit` before a
    step is built); `fused`: fused attention and the chunked loss, else transformers' eager attention
    and full logits; `objective`: what the step minimises; `chunk_tokens`: the loss's tokens per chunk
    (None: `loss.chunk_tokens_on` the platform)."""

    remat: str = "none"
    fused: bool = True
    objective: Objective = SFT
    chunk_tokens: int | None = None

    def __post_init__(self):
        if self.remat not in REMAT_POLICIES:
            raise ValueError(
                f"remat {self.remat!r} is not a policy a step compiles ({', '.join(REMAT_POLICIES)}): "
                "resolve train.remat=auto with fit.choose first"
            )


def _summed_loss(model: JaxModel, training: bool, spec: StepSpec = StepSpec()) -> Callable:
    """JAX function (weights, buffers, batch, labels, key) -> (summed loss, count) of `spec.objective`
    (`preference.summed_objective`: token NLL and scored tokens for sft); dropout, if any, draws from `key`."""
    from torchax import interop

    objective = spec.objective
    temperature = objective.rl.temperature if objective.sampled else 1.0  # GRPO scores its tempered samples
    forward = forward_token_nll(
        model,
        training=training,
        remat=spec.remat,
        fused=spec.fused,
        chunk_tokens=spec.chunk_tokens,
        temperature=temperature,
    )

    def per_token(weights, buffers, batch, labels):
        with model.env:
            return forward(weights, buffers, batch, labels)

    as_jax = interop.jax_view(per_token)

    def run(weights, buffers, batch, labels, key):
        with model.env.override_property(prng=key):
            nll, scored = as_jax(
                weights, buffers, {k: v for k, v in batch.items() if k not in OBJECTIVE_INPUTS}, labels
            )
        return summed_objective(objective, nll, scored, batch)

    return run


def _train_step_fn(model: JaxModel, optimizer: optax.GradientTransformation, spec: StepSpec = StepSpec()) -> Callable:
    """step(weights, buffers, opt_state, batch, labels, key, lr) -> (loss, weights, opt_state).

    `batch` arrays and `labels` are (k, b, t): k micro-batches whose summed gradients, divided
    by all k micro-batches' count (scored tokens, or pairs), equal one big batch's mean-loss gradient.
    """
    grad = jax.value_and_grad(_summed_loss(model, training=True, spec=spec), has_aux=True)

    def train_step(weights, buffers, opt_state, batch, labels, key, lr):
        def micro(carry, xs):
            grads, nll, count = carry
            micro_batch, micro_labels, index = xs
            (n, c), g = grad(weights, buffers, micro_batch, micro_labels, jax.random.fold_in(key, index))
            return (jax.tree.map(jnp.add, grads, g), nll + n, count + c), None

        zeros = (jax.tree.map(jnp.zeros_like, weights), jnp.zeros((), jnp.float32), jnp.zeros((), jnp.int32))
        k = labels.shape[0]
        (grads, nll, count), _ = jax.lax.scan(micro, zeros, (batch, labels, jnp.arange(k)))
        scale = 1.0 / jnp.maximum(count, 1).astype(jnp.float32)
        with jax.named_scope(OPTIMIZER_SCOPE):  # the update's ops, named for a profile to tell apart
            grads = jax.tree.map(lambda g: g * scale, grads)
            with stacked.layout_of_step(model.layout):  # a stacked weight's layers: blocks of their own
                updates, opt_state = optimizer.update(grads, with_learning_rate(opt_state, lr), weights)
            weights = optax.apply_updates(weights, updates)
        return nll * scale, weights, opt_state

    return train_step


def optimizer_shardings(optimizer: optax.GradientTransformation, weights: dict, replicated) -> Any:
    """Where each leaf of `optimizer.init(weights)` lives: a leaf of a parameter's shape under that
    parameter's name (Adam's moments) is split like it; the rest (counts, factored statistics,
    the learning rate) is replicated. `weights` may be arrays or shapes, with shardings."""
    shapes = jax.eval_shape(optimizer.init, weights)
    own = {name: (tuple(w.shape), w.sharding) for name, w in weights.items()}

    def follow(path, leaf):
        for key in path:
            name = getattr(key, "key", None)
            if name in own and own[name][0] == tuple(leaf.shape):
                return own[name][1]
        return replicated

    return jax.tree_util.tree_map_with_path(follow, shapes)


def optimizer_state_shapes(optimizer: optax.GradientTransformation, weights: dict, replicated) -> Any:
    """`optimizer.init(weights)` as shapes, each with its sharding (`optimizer_shardings`)."""
    return jax.tree.map(
        lambda a, sharding: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding),
        jax.eval_shape(optimizer.init, weights),
        optimizer_shardings(optimizer, weights, replicated),
    )


def init_optimizer(model: JaxModel, optimizer: optax.GradientTransformation, weights: dict | None = None) -> Any:
    """The optimizer state of `weights` (default the model's), each leaf placed as `optimizer_shardings` says."""
    weights = model.weights if weights is None else weights
    shardings = optimizer_shardings(optimizer, weights, model.placement.replicated)
    return jax.jit(optimizer.init, out_shardings=shardings)(weights)


def _jitted_train_step(model: JaxModel, optimizer: optax.GradientTransformation, spec: StepSpec = StepSpec()):
    """The train step jitted with every input and output's sharding pinned (so the second call
    finds the first's program), donating weights and optimizer state so they update in place."""
    placement = model.placement
    weights = jax.tree.map(lambda a: a.sharding, model.weights)
    buffers = jax.tree.map(lambda a: a.sharding, model.buffers)
    opt_state = optimizer_shardings(optimizer, model.weights, placement.replicated)
    batch, one = placement.micro_batch_sharding, placement.replicated
    return jax.jit(
        _train_step_fn(model, optimizer, spec),
        donate_argnums=(0, 2),
        in_shardings=(weights, buffers, opt_state, batch, batch, one, one),
        out_shardings=(one, weights, opt_state),
    )


def shared_train_step(
    model: JaxModel, optimizer: optax.GradientTransformation, spec: StepSpec = StepSpec()
) -> programs.Program:
    """The jitted train step (`_jitted_train_step`) every model of this structure shares (see `programs`).

    Keyed by the optimizer's settings where `make_optimizer` made it, else by the optimizer itself
    (a tuple of functions, equal only to itself), which the key then holds: no other optimizer can
    come to share it."""
    described = optimizer_settings(optimizer)
    return programs.shared(
        "train_step",
        model,
        (described or optimizer, spec),
        lambda ref: _jitted_train_step(ref, optimizer, spec),
        keep=described is not None,
    )


def make_train_step(model: JaxModel, optimizer: optax.GradientTransformation, spec: StepSpec = StepSpec()) -> Callable:
    """step(weights, buffers, opt_state, batch, labels, key, lr), jitted; weights and optimizer state are donated.

    `spec.fused=False` runs transformers' eager attention and full logits (what PyTorch eager
    computes); it cannot isolate packed rows, so it takes unpacked batches only. A preference
    objective's batches carry `reference` (see `preference.summed_objective`). `spec.chunk_tokens`: the
    loss's tokens per chunk (default `loss.chunk_tokens_on` the platform; `fit` may choose more).
    """
    program = shared_train_step(model, optimizer, spec)
    put = model.placement.put

    def run(weights, buffers, opt_state, batch, labels, key, lr):
        with model.env:
            return program(model, weights, buffers, opt_state, batch, labels, put(key), put(np.asarray(lr, np.float32)))

    run.program = program  # for counting compilations (`program.compiled`)
    return run


def step_key(seed: int, step: int) -> np.ndarray:
    """The dropout and sampling key of one optimizer step, `fold_in(PRNGKey(seed), step)`: a function of
    (seed, step) alone, so a resumed run draws what an uninterrupted one would.

    A host array from a block of `KEY_BLOCK` keys computed at once, so a step runs no key program
    on the device and waits for none (see `learning_rate_schedule`)."""
    block, index = divmod(step, KEY_BLOCK)
    return _key_block(seed, block)[index]


KEY_BLOCK = 1024


@functools.lru_cache(maxsize=4)
def _key_block(seed: int, block: int) -> np.ndarray:
    base = jax.random.PRNGKey(seed)
    return np.asarray(
        jax.vmap(lambda s: jax.random.fold_in(base, s))(np.arange(block * KEY_BLOCK, (block + 1) * KEY_BLOCK))
    )


BATCH_KEYS = ("input_ids", "attention_mask", "segment_ids", "position_ids")


def train_step_memory(
    model: JaxModel,
    optimizer: optax.GradientTransformation,
    micro_batches: int,
    batch_size: int,
    length: int,
    spec: StepSpec = StepSpec(),
    segments: int = 0,
) -> dict:
    """XLA's memory plan for one train step of (micro_batches, batch_size, length), compiled from shapes alone.

    `batch_size` is the whole micro-batch's rows, split over the mesh as training splits it; the
    bytes are one device's: of arguments (weights, frozen tensors, optimizer state, batch), of
    outputs, of temporaries (activations kept for the backward pass, gradients), and their peak.
    """
    return compiled_memory(
        compiled_train_step(model, optimizer, micro_batches, batch_size, length, spec, segments, plan_only=True)
    )


def compiled_train_step(
    model: JaxModel,
    optimizer: optax.GradientTransformation,
    micro_batches: int,
    batch_size: int,
    length: int,
    spec: StepSpec = StepSpec(),
    segments: int = 0,
    plan_only: bool = False,
):
    """The train step XLA compiles for (micro_batches, batch_size, length) on the model's devices, from
    shapes alone. The step is the one training calls (`shared_train_step`), so that its first call at
    these shapes reuses this trace instead of tracing the model again. `segments`: the reference
    log-probabilities per sequence of a pairwise objective's batch. `plan_only`: only its memory analysis
    and costs are read (on a target's compile-only devices, they may be a remembered plan's)."""
    program = shared_train_step(model, optimizer, spec)
    arguments = train_step_arguments(model, optimizer, micro_batches, batch_size, length, spec, segments)
    with model.env:
        return program.compiled_for(model, *arguments, planning=True, plan_only=plan_only)


def train_step_arguments(
    model: JaxModel,
    optimizer: optax.GradientTransformation,
    micro_batches: int,
    batch_size: int,
    length: int,
    spec: StepSpec = StepSpec(),
    segments: int = 0,
) -> tuple:
    """The train step's arguments (weights, buffers, optimizer state, batch, labels, key, rate) as shapes
    with their shardings, for a batch of (micro_batches, batch_size, length) (see `compiled_train_step`)."""
    objective = spec.objective
    weights = shapes_of(model.weights)
    opt_state = optimizer_state_shapes(optimizer, weights, model.placement.replicated)
    shape = (micro_batches, batch_size, length)
    rows = model.placement.micro_batch_sharding
    batch = {name: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=rows) for name in BATCH_KEYS}
    if objective.pairs:  # `segments` reference log-probabilities per sequence (see `preference.summed_objective`)
        batch["reference"] = jax.ShapeDtypeStruct((micro_batches, batch_size, segments), jnp.float32, sharding=rows)
    if objective.sampled:  # an advantage per answer; per-token log-probabilities where the loss needs them
        batch["advantages"] = jax.ShapeDtypeStruct((micro_batches, batch_size), jnp.float32, sharding=rows)
        per_token = jax.ShapeDtypeStruct((micro_batches, batch_size, length - 1), jnp.float32, sharding=rows)
        batch |= {"reference": per_token} if objective.rl.beta else {}
        batch |= {"old": per_token} if objective.rl.num_iterations > 1 else {}
    labels = jax.ShapeDtypeStruct(shape, jnp.int32, sharding=rows)
    key = jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=model.placement.replicated)
    lr = jax.ShapeDtypeStruct((), jnp.float32, sharding=model.placement.replicated)
    return weights, shapes_of(model.buffers), opt_state, batch, labels, key, lr


def shapes_of(tree) -> Any:
    """Every array (or shape) of `tree` as a shape with its sharding: what `jit(...).lower` compiles for."""
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), tree)


def compiled_memory(compiled) -> dict:
    """One device's bytes of a compiled program, from XLA's memory analysis (see `train_step_memory`), and its costs."""
    stats = compiled.memory_analysis()
    plan = {
        "argument_bytes": int(stats.argument_size_in_bytes),
        "output_bytes": int(stats.output_size_in_bytes),
        "temp_bytes": int(stats.temp_size_in_bytes),
        "alias_bytes": int(stats.alias_size_in_bytes),
        "code_bytes": int(stats.generated_code_size_in_bytes),
    }
    # Donated outputs reuse their argument buffers (alias), so they count once.
    plan["peak_bytes"] = plan["argument_bytes"] + plan["output_bytes"] + plan["temp_bytes"] - plan["alias_bytes"]
    return {**plan, **_costs(compiled)}


def _costs(compiled) -> dict:
    """XLA's count of one device's flops and bytes accessed for the step, where its backend gives them
    (XLA:CPU and XLA:TPU do; a compile-only GPU gives none)."""
    cost = compiled.cost_analysis()
    if isinstance(cost, list):  # one dict per program in older JAX
        cost = cost[0] if cost else None
    if not cost or "flops" not in cost:
        return {}
    return {"flops": float(cost["flops"]), "bytes_accessed": float(cost.get("bytes accessed", 0.0))}


def mean_token_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean NLL over every scored token of the batch (the training objective), from full logits."""
    nll, scored = token_nll(logits, labels)
    return nll.sum() / torch.clamp(scored.sum(), min=1)


def make_loss_and_grad(model: JaxModel, remat: str = "none", fused: bool = True) -> Callable:
    """grad(weights, buffers, batch, labels) -> (mean token loss, gradients of the weights), jitted."""

    def build(ref):
        summed = _summed_loss(ref, training=False, spec=StepSpec(remat, fused))

        def loss(weights, buffers, batch, labels):
            nll, count = summed(weights, buffers, batch, labels, jnp.zeros((2,), jnp.uint32))
            return nll / jnp.maximum(count, 1)

        return jax.jit(jax.value_and_grad(loss))

    program = programs.shared("loss_and_grad", model, (remat, fused), build)

    def run(weights, buffers, batch, labels):
        with model.env:
            return program(model, weights, buffers, batch, labels)

    return run


def make_eval_step(model: JaxModel, fused: bool = True) -> Callable:
    """eval(weights, buffers, batch, labels) -> (per-row NLL sum, per-row scored tokens)."""
    program = shared_eval_step(model, fused)

    def run(weights, buffers, batch, labels):
        with model.env:
            return program(model, weights, buffers, batch, labels)

    run.program = program
    return run


def shared_eval_step(model: JaxModel, fused: bool = True) -> programs.Program:
    """The jitted eval step every model of this structure shares (see `programs`)."""
    from torchax import interop

    def build(ref):
        forward = forward_token_nll(ref, fused=fused)

        def evaluate(weights, buffers, batch, labels):
            nll, scored = forward(weights, buffers, batch, labels)
            return nll.sum(-1), scored.sum(-1)

        return jax.jit(interop.jax_view(evaluate))  # on JAX arrays in and out, as torchax's jax_jit

    return programs.shared("eval_step", model, (fused,), build)


def make_token_logp_step(model: JaxModel, fused: bool = True, temperature: float = 1.0) -> Callable:
    """logp(weights, buffers, batch, labels) -> each scored token's log-probability (b, t-1), 0 elsewhere,
    under softmax(logits / temperature): entry i scores token i+1. GRPO's reference and sampling-policy
    log-probabilities."""
    from torchax import interop

    def build(ref):
        forward = forward_token_nll(ref, fused=fused, temperature=temperature)

        def logp(weights, buffers, batch, labels):
            nll, _ = forward(weights, buffers, batch, labels)
            return -nll

        return jax.jit(interop.jax_view(logp))

    program = programs.shared("token_logp_step", model, (fused, temperature), build)

    def run(weights, buffers, batch, labels):
        with model.env:
            return program(model, weights, buffers, batch, labels)

    run.program = program
    return run


def eval_step_memory(model: JaxModel, rows: int, length: int, fused: bool = True) -> dict:
    """XLA's memory plan (as `train_step_memory`) of one eval batch
    of (rows, length), the rows split as `evaluate` splits them."""
    sharding = model.placement.batch_sharding
    batch = {name: jax.ShapeDtypeStruct((rows, length), jnp.int32, sharding=sharding) for name in BATCH_KEYS}
    labels = jax.ShapeDtypeStruct((rows, length), jnp.int32, sharding=sharding)
    with model.env:
        compiled = shared_eval_step(model, fused).compiled_for(
            model, shapes_of(model.weights), shapes_of(model.buffers), batch, labels
        )
    return compiled_memory(compiled)
