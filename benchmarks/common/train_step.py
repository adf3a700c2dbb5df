"""Train-step adapter: the ONLY code that knows how jaxtune's train step is called (and the
PyTorch eager step it is compared with)."""

from __future__ import annotations

import inspect
from typing import Callable

import numpy as np

# None: detect. The new step is step(weights, buffers, opt_state, batch, labels, key, lr) with
# batch keys input_ids/attention_mask/segment_ids/position_ids; the pre-change step is
# step(weights, buffers, opt_state, batch, labels, key) with input_ids/attention_mask only.
# Once the new API has landed everywhere, set this to True (the one-line switch).
STEP_TAKES_LR: bool | None = None


def step_takes_lr(step: Callable) -> bool:
    if STEP_TAKES_LR is not None:
        return STEP_TAKES_LR
    try:
        return "lr" in inspect.signature(step).parameters or len(inspect.signature(step).parameters) >= 7
    except (TypeError, ValueError):
        return False


def call_train_step(step, weights, buffers, opt_state, batch: dict, labels, key, lr: float):
    """One jaxtune train step: (loss, weights, opt_state). `batch` has (k, b, t) arrays under
    input_ids, attention_mask, segment_ids, position_ids; the pre-change step gets only the first two
    (so a packed batch there costs the same compute but attends across its segments)."""
    import jax.numpy as jnp

    if step_takes_lr(step):
        return step(weights, buffers, opt_state, batch, labels, key, jnp.float32(lr))
    return step(weights, buffers, opt_state, {k: batch[k] for k in ("input_ids", "attention_mask")}, labels, key)


def api_state(step=None) -> str:
    from jaxtune.runtime.compiled import steps

    if step is None:
        step_new = STEP_TAKES_LR if STEP_TAKES_LR is not None else hasattr(steps, "with_learning_rate")
    else:
        step_new = step_takes_lr(step)
    fused = hasattr(steps, "StepSpec") or "fused" in inspect.signature(steps.train_step_memory).parameters
    kind = "new (lr input, segment ids)" if step_new else "pre-change (no lr input, input_ids/attention_mask only)"
    return f"train step: {kind}; train_step_memory fused flag: {'present' if fused else 'absent (TODO)'}"


def make_optimizer(cfg, total_steps: int):
    """`steps.make_optimizer`: (cfg) now that the rate is a step input, (cfg, total_steps) before."""
    from jaxtune.runtime.compiled import steps

    if len(inspect.signature(steps.make_optimizer).parameters) >= 2:
        return steps.make_optimizer(cfg, total_steps)
    return steps.make_optimizer(cfg)


def with_segments(padded: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A right-padded batch plus segment and position ids (`packing.unpacked_segments`)."""
    from jaxtune.runtime.train import packing

    return {**padded, **packing.unpacked_segments(padded["attention_mask"])}


def micro_batch(batch: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """(S, L) arrays -> ((1, S, L) batch without labels, (1, S, L) labels): one micro-batch per step."""
    arrays = {k: np.asarray(v, np.int32)[None] for k, v in batch.items() if k != "labels"}
    return arrays, np.asarray(batch["labels"], np.int32)[None]


class JaxtuneTrainer:
    """jaxtune's compiled train step on one model, fed micro-batches as the training loop feeds them."""

    def __init__(self, model, lr: float = 1e-4):
        from jaxtune.config import TrainConfig
        from jaxtune.runtime.compiled import steps
        from jaxtune.runtime.measures import fit

        self.model, self.lr = model, lr
        cfg = TrainConfig(
            learning_rate=lr,
            warmup_steps=0,
            lr_schedule="constant",
            max_steps=1000,
            max_grad_norm=1.0,
            weight_decay=0.01,
        )
        self.optimizer = make_optimizer(cfg, 1000)
        spec = steps.StepSpec(fit.WITHOUT_LIMIT)  # auto on the CPU
        self.step_fn = steps.make_train_step(model, self.optimizer, spec)
        self.weights = model.weights
        self.opt_state = steps.init_optimizer(model, self.optimizer)  # as training places it
        self.n = 0

    def step(self, batch: dict[str, np.ndarray], labels: np.ndarray):
        from jaxtune.runtime.compiled import steps

        self.n += 1
        placed = self.model.placement.shard_micro_batches({**batch, "labels": labels})
        placed_labels = placed.pop("labels")
        loss, self.weights, self.opt_state = call_train_step(
            self.step_fn,
            self.weights,
            self.model.buffers,
            self.opt_state,
            placed,
            placed_labels,
            steps.step_key(0, self.n),
            self.lr,
        )
        return loss


class TorchTrainer:
    """PyTorch eager (or a compiled module): model(**batch).loss, backward, clip, AdamW (`fused`: one
    kernel for all parameters, CUDA's fastest AdamW)."""

    def __init__(
        self, module, lr: float = 1e-4, weight_decay: float = 0.01, max_grad_norm: float = 1.0, fused: bool = False
    ):
        import torch

        self.module, self.max_grad_norm = module, max_grad_norm
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            self.params, lr=lr, weight_decay=weight_decay, **({"fused": True} if fused else {})
        )

    def step(self, batch: dict):
        import torch

        loss = self.module(**batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, self.max_grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(loss.detach())
