"""The memory plan of a training run, read from XLA's compiled train step, and whether it fits."""

from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np

from jaxtune.config import MESH_AXES, TrainConfig


def tree_bytes(tree) -> int:
    """Bytes of every array (or shape) in `tree`, whole."""
    return int(sum(np.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree)))


def device_bytes(tree) -> int:
    """Bytes one device holds of `tree`: each leaf's shard (its whole size where it is replicated)."""
    return int(
        sum(np.prod(x.sharding.shard_shape(x.shape)) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))
    )


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """Bytes per device of one compiled train step, by part, for the mesh it was compiled on (`memory_plan`)."""

    parameters: int  # weights and buffers as placed, the frozen base's included
    gradients: int
    optimizer_state: int
    # XLA's temporaries less the gradient accumulator and one micro-batch's gradients
    activations_per_micro_batch: int
    peak: int  # XLA's peak of the whole step
    code: int = 0  # the program, which lies in the same memory
    device_limit: int | None = None  # the device's memory, where known
    mesh: dict[str, int] = dataclasses.field(default_factory=lambda: dict.fromkeys(MESH_AXES, 1))
    devices: int = 1
    shape: dict[str, int] = dataclasses.field(default_factory=dict)  # micro_batches, rows_per_device, length
    cost: dict[str, float] = dataclasses.field(default_factory=dict)  # the compiler's flops and bytes_accessed
    base: dict = dataclasses.field(default_factory=dict)  # the frozen base's linear layers (`base_bytes`)
    platform: str | None = None  # whose compiler made the plan: cpu, tpu, gpu

    @property
    def needed(self) -> int:
        """Bytes the step needs on a device: its peak, and its code."""
        return self.peak + self.code

    def record(self) -> dict:
        """As the train artifact's memory.json and the logged plan keep it."""
        return dataclasses.asdict(self)

    @classmethod
    def from_record(cls, record: dict) -> MemoryPlan:
        return cls(**record)


def memory_plan(
    model,
    optimizer,
    cfg: TrainConfig,
    length: int,
    rows: int | None = None,
    fused: bool = True,
    limit: int | None = None,
    objective=None,
    segments: int = 0,
    chunk_tokens: int | None = None,
) -> MemoryPlan:
    """Bytes per device for parameters, gradients, optimizer state and one micro-batch's
    activations at `rows` (default `train.batch_size`) sequences of `length`, XLA's peak for the
    whole step, and the device's memory: `limit`, else what JAX reports (accelerators do, the CPU
    and compile-only devices do not). The step is the one that will train (see `steps.train_step_memory`):
    `objective` and `segments` those of a preference run's steps (default: train.objective's, padded pairs);
    `chunk_tokens` the loss's (default: the platform's, `loss.chunk_tokens_on`). `cfg.remat` is a policy, not auto
    (see `fit`)."""
    from jaxtune.runtime.compiled import preference, steps

    objective = objective or preference.objective_of(cfg.objective, None)
    if objective.pairs and not rows:
        rows, segments = 2 * cfg.batch_size, segments or 1
    rows = rows or cfg.batch_size
    if cfg.remat == "auto":
        raise ValueError("memory_plan compiles one remat policy: resolve train.remat=auto with fit.choose first")
    spec = steps.StepSpec(cfg.remat, fused=fused, objective=objective, chunk_tokens=chunk_tokens)
    xla = steps.train_step_memory(model, optimizer, cfg.grad_accumulation, rows, length, spec, segments=segments)
    gradients = device_bytes(model.weights)
    opt_state = steps.optimizer_state_shapes(optimizer, model.weights, model.placement.replicated)
    return MemoryPlan(
        parameters=device_bytes(model.weights) + device_bytes(model.buffers),
        gradients=gradients,
        optimizer_state=device_bytes(opt_state),
        activations_per_micro_batch=max(xla["temp_bytes"] - 2 * gradients, 0),
        peak=xla["peak_bytes"],
        code=xla["code_bytes"],
        cost={key: xla[key] for key in ("flops", "bytes_accessed") if key in xla},
        device_limit=limit or device_limit(),
        base=base_bytes(model),
        mesh=model.placement.sizes,
        devices=model.placement.mesh.size,
        platform=model.placement.mesh.devices.flat[0].platform,
        shape={
            "micro_batches": cfg.grad_accumulation,
            "rows_per_device": rows // model.placement.batch_shards,
            "length": length,
        },
    )


def base_bytes(model) -> dict:
    """What one device holds of the frozen base's linear layers (those `model.base_quantization`
    quantizes): `held`, their codes and scales or their weights as placed; `unquantized`, the same
    layers as weights in the compute dtype, split alike; `by_scheme`, what int8 and int4 blocks of
    them would hold (from their shapes); and the `scheme` they are held in."""
    from jaxtune.runtime.modeling.quantize import BLOCK, base_layers, scheme_of

    held = weights = 0
    for names, elements in base_layers(model.module):
        arrays = [model.buffers[name] for name in names if name in model.buffers]
        if not arrays:  # trained rather than frozen (a full fine-tune): not a frozen base
            continue
        held += device_bytes(arrays)
        first = arrays[0]
        weights += elements // (np.prod(first.shape) // np.prod(first.sharding.shard_shape(first.shape)))
    scale = 2 / BLOCK  # a bfloat16 scale per block
    return {
        "held": held,
        "unquantized": int(weights * np.dtype(model.dtype).itemsize),
        "scheme": scheme_of(model.module),
        "compute_dtype": str(np.dtype(model.dtype)),
        "by_scheme": {"int8": int(weights * (1 + scale)), "int4": int(weights * (0.5 + scale))},
    }


def device_limit() -> int | None:
    """Bytes of memory on the first device, where JAX reports it (accelerators do, the CPU does not)."""
    try:
        stats = jax.local_devices()[0].memory_stats()
    except Exception:  # a compile-only device raises rather than say it has none
        return None
    return (stats or {}).get("bytes_limit")


def mesh_text(sizes: dict[str, int], devices: int) -> str:
    """'data=2, fsdp=2, tensor=2 on 8 devices'."""
    return ", ".join(f"{axis}={size}" for axis, size in sizes.items()) + f" on {devices} device{'s' * (devices != 1)}"


def _plan_mesh(plan: MemoryPlan) -> tuple[dict[str, int], int]:
    """The plan's mesh sizes and device count."""
    return plan.mesh, plan.devices or math.prod(plan.mesh.values())


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"


def describe(plan: MemoryPlan) -> str:
    limit = _mib(plan.device_limit) if plan.device_limit else "not reported by this device"
    shape = plan.shape
    return (
        f"memory plan per device on mesh {mesh_text(*_plan_mesh(plan))}: parameters {_mib(plan.parameters)}, "
        f"gradients {_mib(plan.gradients)}, optimizer state {_mib(plan.optimizer_state)}, activations "
        f"{_mib(plan.activations_per_micro_batch)} per micro-batch of {shape['rows_per_device']} x "
        f"{shape['length']}; XLA peak {_mib(plan.peak)}; device memory {limit}"
    )


def estimate_peak(plan: MemoryPlan, sizes: dict[str, int]) -> int:
    """Bytes per device the plan's step would peak at on a mesh of `sizes` (same device count), by scaling its parts.

    The plan was compiled for the mesh in `plan.mesh`. Its peak is split in two:

    - activations (`activations_per_micro_batch`): proportional to the rows each device holds,
      so they scale with 1 / (data x fsdp). Tensor parallelism splits some of them too (heads,
      MLP hidden units) but not the residual stream a layer keeps: it is left out, so the
      estimate for a larger tensor axis errs high;
    - everything else (parameters, frozen weights, gradients and their accumulator, optimizer
      state; the batch's token ids are negligible): split over the fsdp and tensor axes, so it
      scales with 1 / (fsdp x tensor). Replicated tensors (norms, biases) and dimensions that do
      not divide are ignored: the estimate errs low by their few bytes.

    Both relative to the plan's own mesh: a plan on (data=8, fsdp=1, tensor=1) moved to
    (data=2, fsdp=4, tensor=1) is estimated at state / 4 + activations (8 / 8 = same rows per device).
    """
    now, _ = _plan_mesh(plan)
    activations = min(plan.activations_per_micro_batch, plan.peak)
    state = plan.peak - activations
    state_ratio = (now["fsdp"] * now["tensor"]) / (sizes["fsdp"] * sizes["tensor"])
    rows_ratio = (now["data"] * now["fsdp"]) / (sizes["data"] * sizes["fsdp"])
    return int(state * state_ratio + activations * rows_ratio)


def mesh_candidates(plan: MemoryPlan, cfg: TrainConfig, devices: int | None = None) -> list[dict]:
    """Every mesh (data, fsdp, tensor) of `devices` (default: the plan's) other than the plan's own
    whose data x fsdp divides train.batch_size, each as {"mesh": sizes, "peak": estimate_peak},
    preferred first: the largest data axis (least communication), then the smallest tensor axis."""
    now, planned = _plan_mesh(plan)
    devices = devices or planned
    found = []
    for data in _divisors(devices):
        for fsdp in _divisors(devices // data):
            sizes = {"data": data, "fsdp": fsdp, "tensor": devices // (data * fsdp)}
            if sizes == dict(now) or cfg.batch_size % (data * fsdp):
                continue
            found.append({"mesh": sizes, "peak": estimate_peak(plan, sizes)})
    return sorted(found, key=lambda c: (-c["mesh"]["data"], c["mesh"]["tensor"]))


def suggest_mesh(plan: MemoryPlan, cfg: TrainConfig, devices: int | None = None) -> dict | None:
    """The preferred mesh of `mesh_candidates` whose estimated peak fits the plan's device limit,
    as {"mesh": {"data", "fsdp", "tensor"}, "peak": bytes}; None when none does (or no limit is known)."""
    limit = plan.device_limit
    if not limit:
        return None
    return next((c for c in mesh_candidates(plan, cfg, devices) if c["peak"] <= limit), None)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def mesh_setting(sizes: dict[str, int]) -> str:
    """'mesh.data=2, mesh.fsdp=4, mesh.tensor=1'."""
    return ", ".join(f"mesh.{axis}={size}" for axis, size in sizes.items())


def knobs(cfg: TrainConfig) -> str:
    """The train settings that would shrink the plan, '; '-separated."""
    found = []
    if cfg.method == "full":
        found.append("train.method=lora (gradients and optimizer state for adapters only)")
    if cfg.optimizer == "adamw":
        found.append("train.optimizer=adafactor (factored second moments, no first moment)")
    if cfg.remat not in ("layer", "auto"):
        found.append("train.remat=layer (recompute each layer's activations in the backward pass)")
    if cfg.batch_size > 1 and cfg.remat != "auto":  # auto splits the batch itself
        found.append(
            f"a smaller train.batch_size with a larger train.grad_accumulation "
            f"(e.g. batch_size={max(cfg.batch_size // 2, 1)}, "
            f"grad_accumulation={cfg.grad_accumulation * 2}: same rows per step)"
        )
    return "; ".join(found) or "a shorter data.max_length or a device with more memory"


def advice(plan: MemoryPlan, cfg: TrainConfig) -> str:
    """What to change when the plan does not fit: a mesh of the same devices that fits by
    `estimate_peak`, or that none does; then the train settings that shrink the plan."""
    now, devices = _plan_mesh(plan)
    suggestion = suggest_mesh(plan, cfg)
    if suggestion is not None:
        sizes = suggestion["mesh"]
        return (
            f"Try {mesh_setting(sizes)}: about {suggestion['peak'] / 2**30:.2f} GiB per device by estimate "
            f"(parameters, gradients and optimizer state split {sizes['fsdp'] * sizes['tensor']} ways instead of "
            f"{now['fsdp'] * now['tensor']}, each batch split {sizes['data'] * sizes['fsdp']} ways instead of "
            f"{now['data'] * now['fsdp']}). Or try: {knobs(cfg)}"
        )
    candidates = mesh_candidates(plan, cfg)
    smallest = min(candidates, key=lambda c: c["peak"], default=None)
    closest = (
        f" (the smallest estimate, {mesh_setting(smallest['mesh'])}, needs about {smallest['peak'] / 2**30:.2f} GiB)"
        if smallest
        else ""
    )
    return f"No mesh of {devices} device{'s' * (devices != 1)} fits by estimate{closest}. Try: {knobs(cfg)}"


def check_fits(plan: MemoryPlan, cfg: TrainConfig) -> None:
    """Raise MemoryError, naming the mesh the plan was made for, a mesh of the same devices that
    would fit (`suggest_mesh`) and the settings that would shrink the plan, when the peak exceeds the device."""
    limit = plan.device_limit
    if not limit or plan.peak <= limit:
        return
    raise MemoryError(
        f"training needs {plan.peak / 2**30:.2f} GiB per device on mesh {mesh_text(*_plan_mesh(plan))} "
        f"but the device has {limit / 2**30:.2f} GiB. {describe(plan)}. {advice(plan, cfg)}"
    )
