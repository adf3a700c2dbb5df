"""The memory plan of a training run, read from XLA's compiled train step, and whether it fits."""

from __future__ import annotations

import jax
import numpy as np

from jaxtune.config import TrainConfig


def tree_bytes(tree) -> int:
    return int(sum(np.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree)))


def memory_plan(model, optimizer, cfg: TrainConfig, length: int, rows: int | None = None, fused: bool = True) -> dict:
    """Bytes per device for parameters, gradients, optimizer state and one micro-batch's
    activations at `rows` (default `train.batch_size`) sequences of `length`, XLA's peak for the
    whole step, and the device's memory where JAX reports it (accelerators do, the CPU does not)."""
    from jaxtune.runtime import steps

    per_device_rows = (rows or cfg.batch_size) // model.placement.data_size
    xla = steps.train_step_memory(model, optimizer, cfg.grad_accumulation, per_device_rows, length,
                                  cfg.remat, fused=fused)
    gradients = tree_bytes(model.weights)
    return {
        "parameters": tree_bytes(model.weights) + tree_bytes(model.buffers),
        "gradients": gradients,
        "optimizer_state": tree_bytes(jax.eval_shape(optimizer.init, model.weights)),
        # XLA's temporaries hold the gradient accumulator and one micro-batch's gradients besides activations.
        "activations_per_micro_batch": max(xla["temp_bytes"] - 2 * gradients, 0),
        "peak": xla["peak_bytes"],
        "device_limit": device_limit(),
        "shape": {"micro_batches": cfg.grad_accumulation, "rows_per_device": per_device_rows, "length": length},
    }


def device_limit() -> int | None:
    """Bytes of memory on the first device, where JAX reports it (accelerators do, the CPU does not)."""
    return (jax.devices()[0].memory_stats() or {}).get("bytes_limit")


def describe(plan: dict) -> str:
    mib = lambda n: f"{n / 2**20:,.1f} MiB"  # noqa: E731
    limit = mib(plan["device_limit"]) if plan["device_limit"] else "not reported by this device"
    shape = plan["shape"]
    return (f"memory plan per device: parameters {mib(plan['parameters'])}, gradients {mib(plan['gradients'])}, "
            f"optimizer state {mib(plan['optimizer_state'])}, activations {mib(plan['activations_per_micro_batch'])} "
            f"per micro-batch of {shape['rows_per_device']} x {shape['length']}; XLA peak {mib(plan['peak'])}; "
            f"device memory {limit}")


def check_fits(plan: dict, cfg: TrainConfig) -> None:
    """Raise MemoryError, naming the settings that would shrink the plan, when the peak exceeds the device."""
    limit = plan["device_limit"]
    if not limit or plan["peak"] <= limit:
        return
    knobs = []
    if cfg.method == "full":
        knobs.append("train.method=lora (gradients and optimizer state for adapters only)")
    if cfg.optimizer == "adamw":
        knobs.append("train.optimizer=adafactor (factored second moments, no first moment)")
    if cfg.remat != "layer":
        knobs.append("train.remat=layer (recompute each layer's activations in the backward pass)")
    if cfg.batch_size > 1:
        knobs.append(f"a smaller train.batch_size with a larger train.grad_accumulation "
                     f"(e.g. batch_size={max(cfg.batch_size // 2, 1)}, grad_accumulation={cfg.grad_accumulation * 2}: same rows per step)")
    hint = "; ".join(knobs) or "a shorter data.max_length or a device with more memory"
    raise MemoryError(f"training needs {plan['peak'] / 2**30:.2f} GiB per device but the device has "
                      f"{limit / 2**30:.2f} GiB. {describe(plan)}. Try: {hint}")
