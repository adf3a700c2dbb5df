"""`jaxtune doctor MODEL --target v5e-1`: XLA's plan of the train, eval and decode steps on an
accelerator this machine does not have, from the model's config alone.

The model is built on the meta device from its `config.json` (a hub id's, a local folder's) or a
GGUF file's header, so no weight is read or downloaded; the steps the config runs (training as
configured: LoRA or full, accumulation, remat, optimizer; an eval batch; greedy decoding) are
compiled for the target's compile-only devices on the config's mesh, and the target's own
compiler (XLA:TPU, or XLA:GPU for an NVIDIA GPU) says what one device holds. The XLA:CPU plan of
a plain `jaxtune doctor` overstates an accelerator's: XLA:CPU computes bf16 matmuls in float32
and keeps float32 copies of the weights for them.

The roofline figures are the compiler's estimate, not a measurement: the train step's flops and
bytes as XLA:TPU counts them, over the chip's published peak FLOP/s and HBM bandwidth.
"""

from __future__ import annotations

import copy
import functools
from pathlib import Path
from typing import TYPE_CHECKING

from jaxtune.checks.doctor import (
    DECODE_CHECK,
    EVAL_CHECK,
    MEMORY_CHECK,
    Diagnosis,
    Row,
    as_trained,
    fit_row,
    part_rows,
    size_text,
    train_length,
    train_objective,
)
from jaxtune.config import JaxtuneConfig
from jaxtune.errors import DoctorError

if TYPE_CHECKING:  # the runtime is imported where a plan compiles, not with the CLI
    from jaxtune.runtime.measures.fit import Fit
    from jaxtune.runtime.measures.memory import MemoryPlan

MAX_SLICES_TRIED = 3  # each is a compile of the whole step: minutes for a real model


def plan_for_target(
    name: str, config: JaxtuneConfig, target_name: str, revision: str | None = None, train_only: bool = False
) -> Diagnosis:
    """Rows of the target's plan for `name` trained as `config` says; TargetError when the target is
    unknown or cannot be compiled for here (both found before the model is read). When the train
    step does not fit, the larger slices of the same chip are compiled in turn, the smallest that
    fits named. `train_only`: leave out the eval and decode steps (each another compile)."""
    from jaxtune.runtime.devices import targets
    from jaxtune.runtime.measures import memory

    target = targets.resolve(target_name)
    devices = targets.devices(target)
    train, length = config.train, train_length(config)
    dtype = config.model.model_copy(update={"name": name}).compute_dtype
    module = as_trained(meta_model(name, revision, config.model.trust_remote_code, dtype), config, randomize_lora=False)
    method = f"LoRA r={config.lora.r}" if train.method == "lora" else "full fine-tuning"
    diagnosis = Diagnosis(
        model=name,
        summary=f"{module.config.model_type}, {method}; {target.chip.compiler} plan for "
        f"{target.describe(len(devices))}, compiled here without them",
        plan_only=True,
    )
    chosen, refused = _compile(module, config, target, devices, config.mesh)
    if refused:
        shape = (
            f"{dtype}, {train.optimizer}, remat {train.remat}, "
            f"{train.grad_accumulation} x {train.batch_size} x {length}"
        )
        diagnosis.rows += [
            Row("mesh", refused["mesh"]),
            Row(MEMORY_CHECK, f"does not compile ({shape}): {refused['message']}", size_text(target.chip.hbm), False),
        ]
    else:
        run = chosen.train_config(train)
        shape = f"{dtype}, {run.optimizer}, remat {run.remat}, {run.grad_accumulation} x {run.batch_size} x {length}"
        diagnosis.rows += [fit_row(chosen, train)]
        diagnosis.rows += _rows(chosen.plan, target, shape, tokens=train.grad_accumulation * train.batch_size * length)
        diagnosis.rows += [] if train_only else _other_steps(module, config, target, devices)
    if diagnosis.ok:
        return diagnosis
    larger = _smallest_fitting_slice(module, config, target, len(devices))
    diagnosis.rows.append(Row("  to fit", (larger + ". Or try: " if larger else "") + memory.knobs(train)))
    return diagnosis


def _compile(module, config: JaxtuneConfig, target, devices: list, mesh) -> tuple[Fit | None, dict | None]:
    """(`fit.Fit` of the step on `devices` with `mesh`, its memory plan under `.plan`, None), or
    (None, {"mesh", "message"}) when XLA:TPU refuses it for want of memory (with train.remat auto:
    every way `fit.choose` tries)."""
    from jaxtune.runtime.compiled import steps
    from jaxtune.runtime.devices.mesh import make_placement
    from jaxtune.runtime.measures import fit, memory
    from jaxtune.runtime.modeling.model import to_jax

    try:
        placement = make_placement(mesh, devices)
    except ValueError as e:
        raise DoctorError(f"{e} of {target.describe(len(devices))}") from None
    # the layers held as `open_model` holds them: the program the run would compile
    model = to_jax(module, placement, shapes_only=True, scan_layers=config.model.layers_stacked)
    try:
        chosen = fit.choose(
            model,
            steps.make_optimizer(config.train),
            config.train,
            lambda run: (None, train_length(config), 0),
            limit=target.chip.hbm,
            objective=train_objective(config),
        )
    except fit.NothingFits as e:  # XLA:TPU refuses a step that does not fit at compile time
        if e.fit is None:
            return None, {"mesh": memory.mesh_text(placement.sizes, placement.mesh.size), "message": str(e)}
        chosen = e.fit  # the most economical way, which compiled: its figures, marked as not fitting
    return chosen, None


def _smallest_fitting_slice(module, config: JaxtuneConfig, target, devices: int) -> str | None:
    """'v5e-8 fits: 9.10 GiB of 15.75 GiB per device with mesh.data=1, mesh.fsdp=8, mesh.tensor=1 (compiled)',
    from compiling the step on each larger slice of the chip in turn, its parameters split over every
    device (fsdp where the batch divides, else tensor); None when none of the first few does."""
    from jaxtune.config import MeshConfig
    from jaxtune.runtime.devices import targets
    from jaxtune.runtime.measures import memory

    for name in targets.larger_slices(target, devices)[:MAX_SLICES_TRIED]:
        candidate = targets.resolve(name)
        found = targets.devices(candidate)
        axis = "fsdp" if config.train.batch_size % len(found) == 0 else "tensor"
        mesh = MeshConfig(data=1, **{axis: len(found)})
        chosen, refused = _compile(module, config, candidate, found, mesh)
        if chosen and chosen.plan.needed <= candidate.chip.hbm:
            return (
                f"{candidate.name} fits: {size_text(chosen.plan.needed)} of {size_text(candidate.chip.hbm)} "
                f"per device with {memory.mesh_setting(chosen.plan.mesh)} (compiled)"
            )
    return None


def _rows(plan: MemoryPlan, target, shape: str, tokens: int) -> list[Row]:
    from jaxtune.runtime.measures import memory

    # The program itself lies in HBM beside its buffers: hundreds of MiB for a 1B model's step.
    needed = plan.needed
    fits = needed <= target.chip.hbm
    rows = [
        Row("mesh", memory.mesh_text(plan.mesh, plan.devices)),
        Row(MEMORY_CHECK, f"{size_text(needed)} with its code ({shape})", f"{size_text(target.chip.hbm)} HBM", fits),
        *part_rows(plan),
        Row("  generated code", size_text(plan.code)),
    ]
    cost = plan.cost
    if cost.get("flops"):
        seconds = max(cost["flops"] / target.chip.peak_flops, cost["bytes_accessed"] / target.chip.hbm_bandwidth)
        per_chip = tokens / plan.devices * target.chip.devices_per_chip / seconds
        rows += [
            Row(
                "compiler's count per device", f"{cost['flops']:.3g} flops, {cost['bytes_accessed']:.3g} bytes accessed"
            ),
            Row("roofline (estimate)", f"step >= {seconds * 1e3:.1f} ms, <= {per_chip:,.0f} tokens/s per chip"),
        ]
    return rows


def _other_steps(module, config: JaxtuneConfig, target, devices: list) -> list[Row]:
    """The eval batch's and the decoder's peaks on the same mesh, each against the device's memory."""
    from jaxtune.runtime.compiled import steps
    from jaxtune.runtime.decoding import decode
    from jaxtune.runtime.devices import compile_cache
    from jaxtune.runtime.devices.mesh import make_placement
    from jaxtune.runtime.modeling.model import to_jax

    placement = make_placement(config.mesh, devices)
    model = to_jax(module, placement, shapes_only=True, scan_layers=config.model.layers_stacked)
    shards = model.placement.batch_shards
    rows = -(-config.eval.batch_size // shards) * shards  # as `inference.evaluate` rounds them
    length, prompts, new_tokens = config.data.max_length, config.generate.batch_size, config.generate.max_new_tokens
    if config.train.objective == "grpo":  # its largest decode: the answers a step samples
        prompts, new_tokens = config.train.batch_size * config.train.grad_accumulation, config.rl.max_completion_length
    found = []
    for check, shape, plan in (
        (EVAL_CHECK, f"{rows} x {length}", lambda: steps.eval_step_memory(model, rows, length)),
        (
            DECODE_CHECK,
            f"{prompts} prompts of {length} + {new_tokens} tokens",
            lambda: decode.generate_memory(model, prompts, length, new_tokens),
        ),
    ):
        try:
            bytes_ = plan()
        except Exception as e:
            refused = compile_cache.refusal(e)
            if not refused:
                raise
            found.append(Row(check, f"does not compile ({shape}): {refused}", size_text(target.chip.hbm), False))
            continue
        needed = bytes_["peak_bytes"] + bytes_["code_bytes"]
        found.append(
            Row(
                check,
                f"{size_text(needed)} with its code ({shape})",
                f"{size_text(target.chip.hbm)} HBM",
                needed <= target.chip.hbm,
            )
        )
    return found


def meta_model(name: str, revision: str | None, trust_remote_code: bool, dtype: str):
    """`name`'s architecture on the meta device in `dtype`: shapes, no storage; from a hub id's or
    folder's config.json, or the header of a .gguf file."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    path = Path(name)
    if name.lower().endswith(".gguf"):
        if not path.is_file():
            raise DoctorError(f"{name}: no such GGUF file")
        stat = path.stat()
        config = copy.deepcopy(_gguf_config(path.resolve(), stat.st_mtime_ns, stat.st_size))
    else:
        try:
            config = AutoConfig.from_pretrained(name, revision=revision, trust_remote_code=trust_remote_code)
        except OSError as e:
            raise DoctorError(f"{name}: no model config.json found ({str(e).splitlines()[0]})") from None
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(
            config, dtype=getattr(torch, dtype), attn_implementation="eager", trust_remote_code=trust_remote_code
        )


@functools.lru_cache(maxsize=8)
def _gguf_config(path: Path, mtime_ns: int, size: int):
    """A GGUF file's model config, read once a process per version of the file: transformers parses
    the whole header, tokenizer included, for it (7.5 s for SmolLM2-135M's on 2 cores), and a plan
    over several chips or recipes asks for the same file each time."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
