"""Load a Hugging Face causal LM, attach LoRA or keep it whole, and move its tensors to JAX."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import torch
from safetensors.numpy import load_file, save_file
from transformers import AutoModelForCausalLM, PreTrainedModel

from jaxtune.config import LoraConfig, ModelConfig
from jaxtune.runtime.compat import torchax_env
from jaxtune.runtime.mesh import Placement

@dataclass
class JaxModel:
    """A torch module used only for its structure, plus its tensors as JAX arrays.

    `weights` are trained, `buffers` (frozen parameters and buffers) are not; together they
    replace every tensor of `module` in `functional_call`.
    """

    module: torch.nn.Module
    weights: dict[str, jax.Array]
    buffers: dict[str, jax.Array]
    placement: Placement

    @property
    def config(self):
        return self.module.config.get_text_config()

    @property
    def env(self):
        return torchax_env()


def load_torch_model(name: str, revision: str | None, trust_remote_code: bool) -> PreTrainedModel:
    """`from_pretrained` on CPU, torchax not involved; eager attention for exact parity across backends."""
    model = AutoModelForCausalLM.from_pretrained(
        name,
        revision=revision,
        dtype=torch.float32,
        attn_implementation="eager",
        trust_remote_code=trust_remote_code,
    )
    return model.eval()


def open_model(
    name: str,
    revision: str | None,
    cfg: ModelConfig,
    placement: Placement,
    lora: LoraConfig | None = None,
    trained: Path | None = None,
    train_all: bool = False,
) -> JaxModel:
    """The model a stage computes with: base weights, LoRA attached when given, trained weights loaded.

    Trainable tensors are the LoRA ones, or all of them for full fine-tuning (`train_all`, or
    trained weights without LoRA); a plain base model has none.
    """
    module = load_torch_model(name, revision, cfg.trust_remote_code)
    if lora is not None:
        module = attach_lora(module, lora)
    else:
        module.requires_grad_(train_all or trained is not None)
    weights = load_weights(trained) if trained is not None else None
    return to_jax(module, cfg, placement, weights)


def attach_lora(model: PreTrainedModel, cfg: LoraConfig) -> torch.nn.Module:
    """Wrap in PEFT LoRA; only adapter (and modules_to_save) parameters stay trainable."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    peft_cfg = PeftLoraConfig(
        r=cfg.r,
        lora_alpha=cfg.alpha,
        lora_dropout=cfg.dropout,
        target_modules=list(cfg.target_modules),
        modules_to_save=list(cfg.modules_to_save) or None,
        task_type="CAUSAL_LM",
    )
    torch.manual_seed(0)  # LoRA A is random: fix it so a config always starts from the same weights
    return get_peft_model(model, peft_cfg)


def to_jax(
    module: torch.nn.Module, cfg: ModelConfig, placement: Placement, trained: dict[str, np.ndarray] | None = None
) -> JaxModel:
    """Split trainable from frozen tensors and place both on the mesh; `trained` overrides weights."""
    _use_eager_attention(module)
    dtype = jnp.dtype(cfg.dtype)
    weights, buffers = {}, {}
    for name, param in module.named_parameters():
        target = weights if param.requires_grad else buffers
        target[name] = _to_array(param, dtype, placement)
    for name, buf in module.named_buffers():
        buffers[name] = _to_array(buf, None, placement)  # buffers (rotary tables) keep their own dtype
    if trained is not None:
        _check_names(trained, weights)
        weights = {name: placement.replicate(jnp.asarray(trained[name], dtype)) for name in weights}
    return JaxModel(module=module, weights=weights, buffers=buffers, placement=placement)


def _use_eager_attention(module: torch.nn.Module) -> None:
    """torchax's SDPA turns fully masked rows (left padding) into NaN that then leaks into real
    rows; eager attention adds a finite minimum instead, and matches PyTorch to 1e-6."""
    config = module.config if hasattr(module, "config") else module.base_model.config
    if config._attn_implementation != "eager":
        base = module.get_base_model() if hasattr(module, "get_base_model") else module
        base.set_attn_implementation("eager")


def _to_array(tensor: torch.Tensor, dtype, placement: Placement) -> jax.Array:
    value = tensor.detach()
    if value.dtype == torch.bfloat16:  # numpy has no bfloat16; go through float32
        value = value.float()
    array = jnp.asarray(value.numpy())
    if dtype is not None and jnp.issubdtype(array.dtype, jnp.floating):
        array = array.astype(dtype)
    return placement.replicate(array)


def _check_names(trained: dict[str, np.ndarray], expected: dict[str, jax.Array]) -> None:
    missing = sorted(set(expected) - set(trained))
    extra = sorted(set(trained) - set(expected))
    if missing or extra:
        raise ValueError(
            f"trained weights do not match the model: missing {missing[:5]}, unexpected {extra[:5]}"
        )


def save_weights(weights: dict[str, np.ndarray], path: Path) -> None:
    """safetensors, float32 on disk so any reader can open it."""
    save_file({name: np.ascontiguousarray(v, dtype=np.float32) for name, v in weights.items()}, str(path))


def load_weights(path: Path) -> dict[str, np.ndarray]:
    return load_file(str(path))
