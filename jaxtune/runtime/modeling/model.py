"""Load a Hugging Face causal LM, attach LoRA or keep it whole, and move its tensors to JAX."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import torch
from safetensors.numpy import load_file, save_file
from transformers import AutoModelForCausalLM, PreTrainedModel

from jaxtune.config import LoraConfig, ModelConfig
from jaxtune.errors import ModelError
from jaxtune.runtime.compat import torchax_env
from jaxtune.runtime.devices.mesh import Placement, place
from jaxtune.runtime.modeling.quantize import (
    SCHEMES,
    held_quantized,
    load_base,
    quantize_base,
)
from jaxtune.runtime.modeling.stacked import Layout, layout_of
from jaxtune.runtime.modeling.streaming import is_placeholder, load_model


@dataclass
class JaxModel:
    """A torch module used only for its structure, plus its tensors as JAX arrays.

    `weights` are trained, `buffers` (frozen parameters and buffers) are not; together they
    replace every tensor of `module` in `functional_call`. Weights are kept in float32 (the
    master copy the optimizer updates); `casts` names those the module computes in another
    dtype (bfloat16 for a bf16 model), and `for_compute` applies it inside the forward, so
    gradients flow back to the float32 copy.
    """

    module: torch.nn.Module
    weights: dict[str, jax.Array]
    buffers: dict[str, jax.Array]
    placement: Placement
    dtype: jnp.dtype  # what the model computes in; the KV cache holds this
    casts: dict[str, torch.dtype] = field(default_factory=dict)
    layout: Layout | None = None  # where the decoder layers' tensors are held stacked (`stacked`), else None

    @property
    def scan_layers(self) -> bool:
        """Whether the decoder layers are held stacked and traced once, as a scan over groups."""
        return self.layout is not None

    def flat(self, tensors: dict) -> dict:
        """`tensors` in this model's layout (weights, gradients) with per-layer names, as files hold them."""
        return tensors if self.layout is None else self.layout.flat(tensors)

    @property
    def config(self):
        return self.module.config.get_text_config()

    @property
    def env(self):
        return torchax_env()

    def for_compute(self, weights: dict) -> dict:
        """torch-view `weights` with each one in the dtype the module computes it in."""
        return {name: value.to(self.casts[name]) if name in self.casts else value for name, value in weights.items()}


def load_torch_model(
    name: str, revision: str | None, trust_remote_code: bool, dtype: str = "float32"
) -> PreTrainedModel:
    """`from_pretrained` on CPU, torchax not involved; eager attention for exact parity across backends.

    `dtype` goes to `from_pretrained` alone: the process-wide torch default dtype is untouched.
    """
    model = AutoModelForCausalLM.from_pretrained(
        name,
        revision=revision,
        dtype=getattr(torch, dtype),
        attn_implementation="eager",
        trust_remote_code=trust_remote_code,
    )
    return model.eval()


def load_quantized(
    name: str, revision: str | None, trust_remote_code: bool, dtype: str, scheme: str, whole: tuple[str, ...] = ()
) -> tuple[PreTrainedModel, tuple[dict[str, torch.Tensor], dict[str, str]]]:
    """`load_torch_model`'s model read a decoder layer at a time (`streaming`), each linear layer
    that a quantized base holds quantized (`held_quantized`) quantized as `scheme` as soon as its
    weight arrives, its float weight then dropped: host memory holds the quantized base, never the
    float one. The layers are quantized on threads of their own while the next are read
    (`Quantizing`). Returns the model (those layers' weights placeholders) and, as `load_base` takes
    them, their tensors ('<layer>.codes', '<layer>.scales', ...) and each layer's scheme. Layers
    whose names end with one of `whole` are loaded as they are (LoRA trains copies of them)."""
    import logging
    import time

    from jaxtune.runtime.modeling.quantize import Quantizing

    schemes: dict[str, str] = {}
    started = time.perf_counter()
    with Quantizing(scheme) as quantizing:

        def take(layer: str, linear: torch.nn.Linear) -> bool:
            if not held_quantized(layer, linear) or layer.endswith(whole):
                return False
            quantizing.add(layer, linear.weight)
            schemes[layer] = scheme
            return True

        module = load_model(name, revision, trust_remote_code, dtype, take)
        read = time.perf_counter() - started
        fields = quantizing.fields()
    seconds = time.perf_counter() - started
    logging.getLogger("jaxtune.load").info(
        "quantized %d layers as %s in %.1f s (%.1f s of quantizing on %d threads while reading, %.1f s after)",
        len(fields),
        scheme,
        seconds,
        quantizing.seconds,
        quantizing.threads,
        seconds - read,
        extra={"phase": "quantized", "seconds": seconds, "quantizing_seconds": quantizing.seconds},
    )
    order = [layer for layer, _ in module.named_modules() if layer in schemes]  # the model's, as quantize_base's
    return module, (
        {f"{layer}.{field}": tensor for layer in order for field, tensor in fields[layer].items()},
        {layer: schemes[layer] for layer in order},
    )


def open_model(
    name: str,
    revision: str | None,
    cfg: ModelConfig,
    placement: Placement,
    lora: LoraConfig | None = None,
    trained: Path | None = None,
    train_all: bool = False,
    base: tuple[dict, dict[str, str]] | None = None,
) -> JaxModel:
    """The model a stage computes with: base weights, LoRA attached when given, trained weights loaded.

    Trainable tensors are the LoRA ones, or all of them for full fine-tuning (`train_all`, or
    trained weights without LoRA); a plain base model has none. With `model.base_quantization`,
    the frozen linear layers are held quantized: as `base` holds them (the quantize_base stage's
    tensors and each layer's scheme), else quantized here (int8, int4, nf4) as each layer is read
    (`load_quantized`). Either way their float weights are dropped as they arrive (`streaming`).
    """
    if base is None and cfg.base_quantization not in SCHEMES and cfg.base_quantization != "none":
        raise ModelError(
            f"model.base_quantization={cfg.base_quantization}: the quantize_base stage's tensors are needed"
        )
    whole = tuple(lora.modules_to_save) if lora is not None else ()  # LoRA trains copies of these: read their weights
    frozen = lora is not None or not (train_all or trained is not None)
    if base is None and cfg.base_quantization in SCHEMES and frozen:  # quantized as the weights arrive
        module, base = load_quantized(
            name, revision, cfg.trust_remote_code, cfg.compute_dtype, cfg.base_quantization, whole
        )
    elif base is not None:  # the stored base replaces these layers: their weights are not kept
        layers = base[1]
        module = load_model(
            name,
            revision,
            cfg.trust_remote_code,
            cfg.compute_dtype,
            take=lambda layer, linear: layer in layers and not layer.endswith(whole),
        )
    else:
        module = load_torch_model(name, revision, cfg.trust_remote_code, cfg.compute_dtype)
    if lora is not None:
        module = attach_lora(module, lora)
    else:
        module.requires_grad_(train_all or trained is not None)
    if base is not None:  # the frozen linear layers; LoRA's adapters stay as they are
        load_base(module, *base)
    if cfg.base_quantization in SCHEMES:  # those not quantized while loading (LoRA's modules_to_save originals)
        quantize_base(module, cfg.base_quantization)
    if left := [name for name, tensor in module.named_parameters() if is_placeholder(tensor)]:
        raise ModelError(f"layers left without weights after loading: {', '.join(left[:5])}")
    weights = load_weights(trained) if trained is not None else None
    return to_jax(module, placement, weights, scan_layers=cfg.layers_stacked)


def attach_lora(model: PreTrainedModel, cfg: LoraConfig) -> torch.nn.Module:
    """Wrap in PEFT LoRA; only adapter (and modules_to_save) parameters stay trainable."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import NoMatchingPeftModuleError, get_peft_model

    peft_cfg = PeftLoraConfig(
        r=cfg.r,
        lora_alpha=cfg.alpha,
        lora_dropout=cfg.dropout,
        target_modules=cfg.target_modules if isinstance(cfg.target_modules, str) else list(cfg.target_modules),
        modules_to_save=list(cfg.modules_to_save) or None,
        task_type="CAUSAL_LM",
    )
    torch.manual_seed(0)  # LoRA A is random: fix it so a config always starts from the same weights
    try:
        return get_peft_model(model, peft_cfg)
    except NoMatchingPeftModuleError:  # no target matched, or only modules_to_save did
        targets = cfg.target_modules if isinstance(cfg.target_modules, str) else f"[{', '.join(cfg.target_modules)}]"
        raise ModelError(
            f"lora.target_modules {targets} matches no layer of this model; its linear layers are: "
            f"{', '.join(linear_layer_names(model))} (or all-linear)"
        ) from None


def adapters_off(weights: dict) -> dict:
    """LoRA `weights` with every adapter's B zeroed: the base model's function, as PEFT's
    `disable_adapter` gives (each adapted layer adds B(A(x)) * scale = 0), without a second copy of the base."""
    return {name: value * 0 if ".lora_B." in name else value for name, value in weights.items()}


def linear_layer_names(module: torch.nn.Module) -> list[str]:
    """Names LoRA can target, in model order: the last part of each linear layer's name (GPT-2's
    Conv1D counts, as PEFT's all-linear does), the output head left out as all-linear leaves it."""
    from transformers.pytorch_utils import Conv1D

    names = (name.rsplit(".", 1)[-1] for name, m in module.named_modules() if isinstance(m, (torch.nn.Linear, Conv1D)))
    return [name for name in dict.fromkeys(names) if name != "lm_head"]


def to_jax(
    module: torch.nn.Module,
    placement: Placement,
    trained: dict[str, np.ndarray] | None = None,
    shapes_only: bool = False,
    scan_layers: bool = False,
) -> JaxModel:
    """Split trainable from frozen tensors and place both on the mesh, each split as its name
    says (`jaxtune.runtime.devices.sharding`); `trained` overrides weights (per-layer names).

    Frozen tensors keep the module's dtype; trainable ones become float32 master weights. With
    `shapes_only` the tensors are `jax.ShapeDtypeStruct`s (a module on the meta device will do):
    enough to compile a step and read XLA's memory plan for a model too big to build here. With
    `scan_layers` the decoder layers' tensors are stacked on the host as `stacked.Layout` says and
    placed once, each stack split as its layers' tensors are, its layer axis whole.
    """
    from jaxtune.runtime.modeling.remat import decoder_layers

    _use_eager_attention(module)
    base = module.get_base_model() if hasattr(module, "get_base_model") else module
    transposed = _transposed_weights(module)
    layout = layout_of(module, decoder_layers(module)) if scan_layers else None
    if trained is not None:
        _check_names(trained, {name for name, p in module.named_parameters() if p.requires_grad})
    # name -> (tensor, sharding, dtype it is held in or None for its own); weights trained, buffers frozen
    weights, buffers, casts = {}, {}, {}
    for name, param in module.named_parameters():
        sharding = placement.parameter_sharding(name, tuple(param.shape), name in transposed)
        if param.requires_grad:
            value = torch.from_numpy(np.asarray(trained[name])) if trained is not None else param
            weights[name] = (value, sharding, jnp.float32)
            if param.dtype != torch.float32:
                casts[name] = param.dtype
        else:
            buffers[name] = (param, sharding, None)
    for name, buf in module.named_buffers():
        buffers[name] = (buf, placement.parameter_sharding(name, tuple(buf.shape)), None)
    if layout is not None:  # each stack made as it is placed, so that the host holds one at a time
        weights, buffers = (
            layout.stacked(tree, lambda rows, lead: lambda: _stacked_entry(rows, lead)) for tree in (weights, buffers)
        )
        # both names: the stacked one for steps, the per-layer one for PyTorch's own forward (`parity`)
        casts |= {layout.member(name)[0]: dtype for name, dtype in casts.items() if layout.member(name)}
    convert = _to_shape if shapes_only else _to_array
    dtype = jnp.dtype(str(base.dtype).removeprefix("torch."))
    return JaxModel(
        module=module,
        weights={name: convert(*(entry() if callable(entry) else entry)) for name, entry in weights.items()},
        buffers={name: convert(*(entry() if callable(entry) else entry)) for name, entry in buffers.items()},
        placement=placement,
        dtype=dtype,
        casts=casts,
        layout=layout,
    )


def _stacked_entry(entries: list[tuple], lead: tuple[int, ...]) -> tuple:
    """Layers' (tensor, sharding, dtype) entries as one: their tensors stacked with the leading axes `lead`
    (meta ones stay meta), their sharding with the layer axes whole in front."""
    from jax.sharding import NamedSharding, PartitionSpec

    tensors = [tensor.detach() for tensor, _, _ in entries]
    _, sharding, dtype = entries[0]
    if any(t.is_meta for t in tensors):
        stacked = torch.empty((*lead, *tensors[0].shape), dtype=tensors[0].dtype, device="meta")
    else:
        stacked = torch.stack(tensors).reshape(*lead, *tensors[0].shape)
    return stacked, NamedSharding(sharding.mesh, PartitionSpec(*[None] * len(lead), *sharding.spec)), dtype


def _transposed_weights(module: torch.nn.Module) -> set[str]:
    """Names of weights stored (in, out) rather than torch Linear's (out, in): GPT-2's Conv1D."""
    from transformers.pytorch_utils import Conv1D

    return {f"{name}.weight" for name, m in module.named_modules() if isinstance(m, Conv1D)}


def _use_eager_attention(module: torch.nn.Module) -> None:
    """torchax's SDPA turns fully masked rows (left padding) into NaN that then leaks into real
    rows; eager attention adds a finite minimum instead, and matches PyTorch to 1e-6."""
    config = module.config if hasattr(module, "config") else module.base_model.config
    if config._attn_implementation != "eager":
        base = module.get_base_model() if hasattr(module, "get_base_model") else module
        base.set_attn_implementation("eager")


def _to_array(tensor: torch.Tensor, sharding, dtype=None) -> jax.Array:
    """The tensor as a JAX array placed by `sharding`, in its own dtype unless `dtype` is given."""
    value = tensor.detach()
    own = jnp.dtype(str(value.dtype).removeprefix("torch."))
    if value.dtype == torch.bfloat16:  # numpy has no bfloat16: the same bits, read as ml_dtypes' bfloat16
        host = value.contiguous().view(torch.int16).numpy().view(jnp.bfloat16)
    else:
        host = value.numpy()
    return place(host.astype(dtype if dtype is not None and jnp.issubdtype(own, jnp.floating) else own), sharding)


def _to_shape(tensor: torch.Tensor, sharding, dtype=None) -> jax.ShapeDtypeStruct:
    own = jnp.dtype(str(tensor.dtype).removeprefix("torch."))
    dtype = dtype if dtype is not None and jnp.issubdtype(own, jnp.floating) else own
    return jax.ShapeDtypeStruct(tuple(tensor.shape), dtype, sharding=sharding)


def _check_names(trained: dict[str, np.ndarray], expected) -> None:
    missing = sorted(set(expected) - set(trained))
    extra = sorted(set(trained) - set(expected))
    if missing or extra:
        raise ValueError(f"trained weights do not match the model: missing {missing[:5]}, unexpected {extra[:5]}")


def save_weights(weights: dict[str, np.ndarray], path: Path) -> None:
    """safetensors, float32 on disk so any reader can open it."""
    save_file({name: np.ascontiguousarray(v, dtype=np.float32) for name, v in weights.items()}, str(path))


def load_weights(path: Path) -> dict[str, np.ndarray]:
    return load_file(str(path))
