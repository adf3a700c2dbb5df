"""A frozen base held quantized on the device: LoRA's base linear layers as int8 or int4 blocks.

Under LoRA the base weights never change, so they can live on the device in fewer bits and be
dequantized where they are used. Each frozen linear layer's weight (out, in) is cut along `in`
into blocks of `BLOCK` consecutive values; each block keeps one scale, its largest magnitude
over the largest code (127 for int8, 7 for int4), and its values rounded to the nearest code:
symmetric absmax quantization, as bitsandbytes' and qwix's blockwise schemes. int4 codes
(-7..7, stored plus 8) are packed two to a byte, the first of each pair in the low nibble.

`QuantizedLinear` replaces the layer's `nn.Linear`: its codes and scales are buffers, so
`to_jax` places them like any frozen tensor (the sharding rules do not name them yet, so on a
mesh they take the rule for other matrices: fsdp over their largest dimension), and its forward
dequantizes them with torch ops that torchax traces into the compiled step. Dequantizing
happens inside each layer's forward, so remat recomputes it with the layer and no whole
dequantized base is ever held. Per weight, the base then takes 1 + 2/64 bytes (int8) or
0.5 + 2/64 bytes (int4) against bfloat16's 2: 0.52x and 0.27x.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

SCHEMES = {"int8": 127, "int4": 7}  # scheme -> largest code
BLOCK = 64  # values per scale, along the layer's input dimension
SCALE_DTYPE = torch.bfloat16  # as bitsandbytes' and qwix's scales: the base's bytes, not its precision, matter


def quantize(weight: torch.Tensor, scheme: str, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, scales) of a (out, in) weight: int8 codes (out, in), or for int4 uint8 (out, in / 2)
    two codes a byte; scales (out, in / block) in SCALE_DTYPE. `in` must divide by `block`."""
    out_features, in_features = weight.shape
    if in_features % block:
        raise ValueError(f"a weight of {in_features} inputs does not split into blocks of {block}")
    top = SCHEMES[scheme]
    blocks = weight.detach().float().reshape(out_features, in_features // block, block)
    scales = (blocks.abs().amax(dim=-1) / top).to(SCALE_DTYPE)
    # Divide by the scale as stored, so the codes are those of the stored scale.
    divisor = scales.float().unsqueeze(-1)
    codes = torch.where(divisor > 0, blocks / torch.where(divisor > 0, divisor, 1.0), 0.0)
    codes = codes.round().clamp(-top, top).to(torch.int8).reshape(out_features, in_features)
    if scheme == "int8":
        return codes, scales
    nibbles = (codes + 8).to(torch.uint8).reshape(out_features, in_features // 2, 2)
    return nibbles[..., 0] | (nibbles[..., 1] << 4), scales


def dequantize(codes: torch.Tensor, scales: torch.Tensor, scheme: str, dtype: torch.dtype) -> torch.Tensor:
    """The (out, in) weight in `dtype` that `quantize`'s codes and scales stand for."""
    if scheme == "int4":
        low, high = codes & 0x0F, codes >> 4
        codes = torch.stack((low, high), dim=-1).reshape(codes.shape[0], -1).to(torch.int8) - 8
    out_features, in_features = codes.shape
    blocks = codes.to(dtype).reshape(out_features, scales.shape[1], in_features // scales.shape[1])
    return (blocks * scales.to(dtype).unsqueeze(-1)).reshape(out_features, in_features)


class QuantizedLinear(torch.nn.Module):
    """A frozen `nn.Linear` whose weight is held as blockwise codes and scales (buffers)."""

    def __init__(self, linear: torch.nn.Linear, scheme: str, block: int = BLOCK):
        super().__init__()
        self.in_features, self.out_features, self.scheme = linear.in_features, linear.out_features, scheme
        self.compute_dtype = linear.weight.dtype
        codes, scales = quantize(linear.weight, scheme, block)
        self.register_buffer("codes", codes)
        self.register_buffer("scales", scales)
        self.bias = None if linear.bias is None else torch.nn.Parameter(linear.bias.detach(), requires_grad=False)

    def weight_dequantized(self) -> torch.Tensor:
        return dequantize(self.codes, self.scales, self.scheme, self.compute_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight_dequantized().to(x.dtype), self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, scheme={self.scheme}"


def quantizable(module: torch.nn.Module, block: int = BLOCK) -> list[str]:
    """Names of the frozen `nn.Linear`s a quantized base holds quantized: every one but the output
    head (tied to the embedding in many models, and what the loss reads most precisely), whose
    input dimension splits into blocks."""
    names = []
    for name, sub in module.named_modules():
        if type(sub) is not torch.nn.Linear or name.rsplit(".", 1)[-1] in ("lm_head", "embed_out"):
            continue
        if not any(p.requires_grad for p in sub.parameters()) and sub.in_features % block == 0:
            names.append(name)
    return names


def quantize_base(module: torch.nn.Module, scheme: str, block: int = BLOCK) -> list[str]:
    """Replace, in place, every frozen linear layer of `module` (`quantizable`) by a
    `QuantizedLinear`; returns their names. LoRA's adapters and other trained tensors stay as they are."""
    names = quantizable(module, block)
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = module.get_submodule(parent_name) if parent_name else module
        setattr(parent, child, QuantizedLinear(getattr(parent, child), scheme, block))
    return names
