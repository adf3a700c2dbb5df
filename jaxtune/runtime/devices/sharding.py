"""Which mesh axes split each parameter, chosen from its Hugging Face name.

The rules (Megatron-style tensor parallelism with FSDP on the other dimension, as in
torchprime's Llama table; a torch Linear weight is (out, in)):

- column-parallel q/k/v/gate/up: (tensor, fsdp): each device computes some heads / some of
  the MLP's hidden units;
- row-parallel o/down: (fsdp, tensor): the input is split like the column layer's output, so
  the pair needs one all-reduce;
- embeddings (vocab, hidden): hidden split over fsdp × tensor, vocabulary whole. Torchprime
  splits the vocabulary over fsdp and reports NaN gradients with it over tensor; here, with the
  vocabulary over fsdp, XLA (jax 0.10.2, CPU) computed the weight update of a fully fine-tuned
  embedding wrong by 0.01 (tests/mesh compares every mesh with one device). Split over hidden,
  each device looks tokens up in its own columns, and the update is exact;
- an untied LM head (vocab, hidden): (tensor, fsdp), so logits come out split over vocabulary;
- norms, and every other vector but a column layer's bias: replicated;
- any other matrix: fsdp over its largest dimension that divides evenly;
- a quantized base layer's codes (out, in or in / 2) and scales (out, in / block), which stand
  for its weight (`runtime.modeling.quantize`): split as that weight, so each device dequantizes its own
  shard of it.

LoRA follows its base layer: A (r, in) splits `in` like the base, B (out, r) splits `out`
like the base; PEFT's copies of modules_to_save follow the module they copy. A dimension that
does not divide by its axis size is left whole, so any model runs on any mesh.
`mesh.shardings` regexes, tried first, override all of this.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence

from jax.sharding import PartitionSpec

COLUMN = {
    "q_proj",
    "k_proj",
    "v_proj",
    "gate_proj",
    "up_proj",
    "qkv_proj",
    "gate_up_proj",
    "c_attn",
    "c_fc",
    "query_key_value",
    "dense_h_to_4h",
    "fc1",
    "fc_in",
    "Wqkv",
    "w1",
    "w3",
}
ROW = {"o_proj", "down_proj", "c_proj", "dense", "out_proj", "dense_4h_to_h", "fc2", "fc_out", "w2"}
EMBEDDING = {"embed_tokens", "wte", "wpe", "embed_in", "word_embeddings", "embed_positions"}
HEAD = {"lm_head", "embed_out"}
WEIGHT_LIKE = {"weight", "codes", "scales"}  # a layer's (out, in) matrix, or a quantized one's codes and scales

# Wrappers PEFT puts between a module and its tensors; dropped to find the layer a tensor belongs to.
_PEFT_PARTS = re.compile(r"\.(base_layer|original_module|modules_to_save\.[^.]+)(?=\.)")
_LORA = re.compile(r"\.lora_(A|B|embedding_A|embedding_B)\.[^.]+(\.weight)?$")


def layer_of(name: str) -> tuple[str, str | None]:
    """(the base layer's tensor name, 'A' / 'B' for a LoRA factor else None) of a parameter name."""
    name = name.removeprefix("base_model.model.")
    match = _LORA.search(name)
    lora = None
    if match:
        lora = match.group(1).removeprefix("embedding_")
        name = name[: match.start()] + ".weight"
    return _PEFT_PARTS.sub("", name), lora


def rule_spec(name: str, shape: Sequence[int], sizes: Mapping[str, int], transposed: bool = False) -> PartitionSpec:
    """The built-in rule's spec for the tensor `name` of `shape` on a mesh of axis `sizes`.

    `transposed`: the layer stores its weight as (in, out) (GPT-2's Conv1D), not (out, in).
    """
    base, lora = layer_of(name)
    parts = base.split(".")
    layer, kind = (parts[-2] if len(parts) > 1 else ""), parts[-1]
    out_in: tuple[str | None, str | None] | None = None
    if layer in COLUMN:
        out_in = ("tensor", "fsdp")
    elif layer in ROW:
        out_in = ("fsdp", "tensor")
    elif layer in HEAD:
        out_in = ("tensor", "fsdp")
    elif layer in EMBEDDING and kind == "weight" and len(shape) == 2 and lora is None:
        return _fit((None, ("fsdp", "tensor")), shape, sizes)
    if out_in is not None and kind in WEIGHT_LIKE and len(shape) == 2:
        out_axis, in_axis = out_in
        if lora == "A":  # (r, in)
            axes = (None, in_axis)
        elif lora == "B":  # (out, r)
            axes = (out_axis, None)
        else:
            axes = (in_axis, out_axis) if transposed else (out_axis, in_axis)
        return _fit(axes, shape, sizes)
    if out_in is not None and kind == "bias" and len(shape) == 1 and layer in COLUMN:
        return _fit((out_in[0],), shape, sizes)
    if len(shape) >= 2:
        return _fsdp_largest(shape, sizes)
    return PartitionSpec()


def spec_for(
    name: str,
    shape: Sequence[int],
    sizes: Mapping[str, int],
    overrides: Mapping[str, Sequence[str | None]] = {},
    transposed: bool = False,
) -> PartitionSpec:
    """`mesh.shardings`' first matching regex, else the built-in rule; ValueError naming the tensor
    and pattern when an override does not fit the tensor."""
    for pattern, axes in overrides.items():
        if re.search(pattern, name):
            if len(axes) != len(shape):
                raise ValueError(
                    f"mesh.shardings[{pattern!r}] gives {len(axes)} axes but {name} has "
                    f"{len(shape)} dimensions {tuple(shape)}"
                )
            for axis, dim in zip(axes, shape):
                if axis is not None and dim % sizes[axis]:
                    raise ValueError(
                        f"mesh.shardings[{pattern!r}]: {name} dimension {dim} does not divide over "
                        f"the {sizes[axis]} devices of the {axis} axis"
                    )
            return _trim(tuple(axes))
    return rule_spec(name, shape, sizes, transposed)


def _fit(axes: Sequence, shape: Sequence[int], sizes: Mapping[str, int]) -> PartitionSpec:
    """`axes` (each an axis, a tuple of axes, or None), leaving out each axis of size 1 and, of
    a tuple, trailing axes until the product divides the dimension."""
    fitted = []
    for axis, dim in zip(axes, shape):
        group = [a for a in ((axis,) if isinstance(axis, str) else axis or ()) if sizes[a] > 1]
        while group and dim % math.prod(sizes[a] for a in group):
            group.pop()
        fitted.append(None if not group else group[0] if len(group) == 1 else tuple(group))
    return _trim(tuple(fitted))


def _fsdp_largest(shape: Sequence[int], sizes: Mapping[str, int]) -> PartitionSpec:
    fsdp = sizes["fsdp"]
    if fsdp == 1:
        return PartitionSpec()
    for dim in sorted(range(len(shape)), key=lambda d: -shape[d]):
        if shape[dim] % fsdp == 0:
            return _trim(tuple("fsdp" if d == dim else None for d in range(len(shape))))
    return PartitionSpec()


def _trim(axes: tuple) -> PartitionSpec:
    """Trailing Nones dropped, so equal placements compare equal."""
    axes = list(axes)
    while axes and axes[-1] is None:
        axes.pop()
    return PartitionSpec(*axes)
