"""A frozen base held quantized on the device: LoRA's base linear layers as int8, int4 or nf4 blocks.

Under LoRA the base weights never change, so they can live on the device in fewer bits and be
dequantized where they are used. Each frozen linear layer's weight (out, in) is cut along `in`
into blocks of `BLOCK` consecutive values; each block keeps one scale, its largest magnitude
over the largest code (127 for int8, 7 for int4), and its values rounded to the nearest code:
symmetric absmax quantization, as bitsandbytes' and qwix's blockwise schemes. int4 codes
(-7..7, stored plus 8) are packed two to a byte, the first of each pair in the low nibble. nf4
(QLoRA's NormalFloat4) packs alike the index of the nearest of 16 levels, spaced as a normal
distribution's quantiles (dense near zero, where most weights are), of the block scaled to its
largest magnitude.

`QuantizedLinear` replaces the layer's `nn.Linear`: its codes and scales are buffers, so
`to_jax` places them like any frozen tensor (split on a mesh as the weight they stand for would
be, `runtime.devices.sharding`), and its forward
dequantizes them with torch ops that torchax traces into the compiled step. Dequantizing
happens inside each layer's forward, so remat recomputes it with the layer and no whole
dequantized base is ever held. Per weight, the base then takes 1 + 2/64 bytes (int8) or
0.5 + 2/64 bytes (int4) against bfloat16's 2: 0.52x and 0.27x.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

SCHEMES = {"int8": 127, "int4": 7, "nf4": 1}  # scheme -> largest code (nf4: of the normalized levels)
BLOCK = 64  # values per scale, along the layer's input dimension
SCALE_DTYPE = torch.bfloat16  # as bitsandbytes' and qwix's scales: the base's bytes, not its precision, matter
# QLoRA's NormalFloat4: the 16 levels (of a block scaled by its largest magnitude) that split a
# normal distribution into equal shares, zero exact; bitsandbytes' table.
NF4_LEVELS = (
    -1.0,
    -0.6961928009986877,
    -0.5250730514526367,
    -0.39491748809814453,
    -0.28444138169288635,
    -0.18477343022823334,
    -0.09105003625154495,
    0.0,
    0.07958029955625534,
    0.16093020141124725,
    0.24611230194568634,
    0.33791524171829224,
    0.44070982933044434,
    0.5626170039176941,
    0.7229568362236023,
    1.0,
)


def quantize(weight: torch.Tensor, scheme: str, block: int = BLOCK) -> dict[str, torch.Tensor]:
    """The fields of a (out, in) weight's blocks: `codes`, int8 (out, in) for int8, or uint8
    (out, in / 2) two codes a byte for int4 and nf4; `scales` (out, in / block) in SCALE_DTYPE;
    for nf4 also `levels`, its 16 values. `in` must divide by `block`."""
    out_features, in_features = weight.shape
    if in_features % block:
        raise ValueError(f"a weight of {in_features} inputs does not split into blocks of {block}")
    top = SCHEMES[scheme]
    blocks = weight.detach().float().reshape(out_features, in_features // block, block)
    scales = (blocks.abs().amax(dim=-1) / top).to(SCALE_DTYPE)
    # Divide by the scale as stored, so the codes are those of the stored scale.
    divisor = scales.float().unsqueeze(-1)
    normalized = torch.where(divisor > 0, blocks / torch.where(divisor > 0, divisor, 1.0), 0.0)
    if scheme == "nf4":  # the nearest level: its index among the midpoints between levels
        levels = torch.tensor(NF4_LEVELS)
        nibbles = torch.bucketize(normalized.clamp(-1, 1), (levels[1:] + levels[:-1]) / 2).to(torch.uint8)
        nibbles = nibbles.reshape(out_features, in_features // 2, 2)
        return {"codes": nibbles[..., 0] | (nibbles[..., 1] << 4), "scales": scales, "levels": levels}
    codes = normalized.round().clamp(-top, top).to(torch.int8).reshape(out_features, in_features)
    if scheme == "int8":
        return {"codes": codes, "scales": scales}
    nibbles = (codes + 8).to(torch.uint8).reshape(out_features, in_features // 2, 2)
    return {"codes": nibbles[..., 0] | (nibbles[..., 1] << 4), "scales": scales}


def quantize_fast(weight: torch.Tensor, scheme: str, block: int = BLOCK) -> dict[str, torch.Tensor]:
    """`quantize(weight, scheme, block)`, bit for bit, as one XLA program on the host's CPU (compiled
    once per weight shape): its element-wise steps fused into a pass or two over the weight, where
    PyTorch makes a float32 temporary of the whole weight at each (nf4's `bucketize` alone took 60%).
    On the host whatever the default device: a TPU's float32 division is not correctly rounded, and
    the codes must be those `quantize` gives. XLA's CPU code reads and writes subnormal floats as
    zeros, so a weight with a block whose largest magnitude is that small, or not finite (a scale
    that `quantize` makes subnormal, infinite or NaN), goes to `quantize`, as does a weight of
    another dtype than bfloat16, float16 or float32."""
    import numpy as np

    if weight.dtype not in _HOST_DTYPES:
        return quantize(weight, scheme, block)
    out_features, in_features = weight.shape
    if in_features % block:
        raise ValueError(f"a weight of {in_features} inputs does not split into blocks of {block}")
    value = weight.detach().contiguous()
    host = value.view(torch.int16).numpy().view(_bfloat16()) if value.dtype == torch.bfloat16 else value.numpy()
    program = _host_program(scheme, block)
    if program is None:  # no CPU backend (JAX_PLATFORMS names only an accelerator)
        return quantize(weight, scheme, block)
    codes, scales, rare = program(host)
    if rare:
        return quantize(weight, scheme, block)
    fields = {
        "codes": torch.from_numpy(np.array(codes)),
        "scales": torch.from_numpy(np.array(scales).view(np.int16)).view(SCALE_DTYPE),
    }
    return {**fields, "levels": torch.tensor(NF4_LEVELS)} if scheme == "nf4" else fields


_HOST_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _bfloat16():
    import jax.numpy as jnp

    return jnp.bfloat16  # numpy's bfloat16 (ml_dtypes')


@functools.cache
def _host_program(scheme: str, block: int):
    """`quantize`'s steps in jnp, jitted, its input put on the host's CPU device (None where JAX has
    none): codes, scales (bfloat16) and whether a block is too small or not finite for it, of a
    weight as numpy gives it.
    A value whose magnitude is below the float32 normal range (2**-126) divided by a scale of at
    least 2**-120 stays below 2**-6, so reading it as zero changes no code: it lies inside the
    interval of zero's code (nf4's nearest midpoints are -0.0455 and 0.0398; int8's and int4's 0.5)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    top = SCHEMES[scheme]
    midpoints = ((torch.tensor(NF4_LEVELS)[1:] + torch.tensor(NF4_LEVELS)[:-1]) / 2).numpy()  # quantize's float32

    @jax.jit
    def program(weight):
        out_features, in_features = weight.shape
        blocks = weight.astype(jnp.float32).reshape(out_features, in_features // block, block)
        # Each block's largest magnitude from the floats' bits (a float's order is its bits'), exact
        # where the CPU's float arithmetic would flush a subnormal to zero.
        largest = jnp.max(jax.lax.bitcast_convert_type(blocks, jnp.int32) & 0x7FFFFFFF, axis=-1)
        rare = jnp.any((largest >= _bits(np.inf)) | ((largest > 0) & (largest < _bits(top * 2.0**-120))))
        largest = jax.lax.bitcast_convert_type(largest, jnp.float32)
        scales = (largest / np.float32(top)).astype(jnp.bfloat16)
        divisor = scales.astype(jnp.float32)[..., None]
        positive = divisor > 0
        # A division by a broadcast XLA would make a multiplication by the reciprocal (not always the
        # same float): the divisors, materialised behind a barrier, keep it a division.
        divisor = jax.lax.optimization_barrier(jnp.broadcast_to(jnp.where(positive, divisor, 1.0), blocks.shape))
        normalized = jnp.where(positive, blocks / divisor, 0.0)
        if scheme == "nf4":  # bucketize's index: how many midpoints lie below the value
            nibbles = jnp.searchsorted(midpoints, jnp.clip(normalized, -1, 1), side="left", method="compare_all")
            nibbles = nibbles.astype(jnp.uint8)
        else:  # jnp.round, as torch.round, rounds halves to even
            codes = jnp.clip(jnp.round(normalized), -top, top).astype(jnp.int8)
            if scheme == "int8":
                return codes.reshape(out_features, in_features), scales, rare
            nibbles = (codes + 8).astype(jnp.uint8)
        nibbles = nibbles.reshape(out_features, in_features // 2, 2)
        return nibbles[..., 0] | (nibbles[..., 1] << 4), scales, rare

    try:
        cpu = jax.devices("cpu")[0]
    except RuntimeError:  # JAX_PLATFORMS=tpu, say: quantize's own
        return None
    return lambda weight: program(jax.device_put(weight, cpu))


def _bits(value: float) -> int:
    """A positive float32's bits as an int32."""
    import numpy as np

    return int(np.float32(value).view(np.int32))


def quantize_by_rows(weight: torch.Tensor, scheme: str, rows: int = 1024) -> dict[str, torch.Tensor]:
    """`quantize(weight, scheme)` (by `quantize_fast`), `rows` rows at a time: the same codes and scales
    (each row's are its own), with temporaries of `rows` rows instead of the whole weight's."""
    parts = [quantize_fast(weight[start : start + rows], scheme) for start in range(0, weight.shape[0], rows)]
    return {
        field: torch.cat([part[field] for part in parts]) if field != "levels" else parts[0][field]
        for field in parts[0]
    }


# Quantizing's threads at most: on the TPU v5e machine's 13-core host, nf4 over Llama 3.1 8B's layers took 1.06 s
# a layer on 1 thread, 0.63 on 4, 0.68 on 8 and 0.67 on 13 (XLA's CPU programs use several cores each).
THREADS = 4


class Quantizing:
    """Weights quantized as they are handed in (`add`), on `threads` threads of their own (by default
    the host's cores, at most `THREADS`), while the caller reads the next: XLA's CPU programs and
    PyTorch's copies let go of the GIL. Host memory holds at most twice `threads` float weights beyond
    the caller's (each thread's, and one waiting for it): `add` waits while that many are. `fields()`
    waits for them all."""

    def __init__(self, scheme: str, threads: int | None = None):
        import os
        import threading
        from concurrent.futures import ThreadPoolExecutor

        if threads is None:
            cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
            threads = min(cores, THREADS)
        self.scheme, self.threads = scheme, max(threads, 1)
        self.pool = ThreadPoolExecutor(self.threads, thread_name_prefix="jaxtune-quantize")
        self.room = threading.Semaphore(2 * self.threads)  # weights handed in and not yet quantized
        self.pending: dict = {}
        self.seconds = 0.0  # the threads' seconds of quantizing, summed
        self.lock = threading.Lock()

    def add(self, name: str, weight: torch.Tensor) -> None:
        self.room.acquire()
        try:
            self.pending[name] = self.pool.submit(self._quantized, weight)
        except BaseException:
            self.room.release()
            raise

    def _quantized(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        import time

        started = time.perf_counter()
        try:
            return quantize_by_rows(weight, self.scheme)
        finally:
            with self.lock:
                self.seconds += time.perf_counter() - started
            self.room.release()

    def fields(self) -> dict[str, dict[str, torch.Tensor]]:
        """Each weight's fields, by the name it was added under, in the order they were added."""
        return {name: future.result() for name, future in self.pending.items()}

    def __enter__(self) -> Quantizing:
        return self

    def __exit__(self, *error) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)


# GGUF's own blocks of 32 values (ggml's layouts), kept as the file holds them, each block's bytes
# split into fields: `scales` (float16 d), `mins` (float16 m), `codes` (the low nibbles' bytes, or
# int8 values), `high` (Q5_0's fifth bits, 4 bytes a block). Q4: a block's 16 bytes hold values
# 0-15 in their low nibbles and 16-31 in their high ones.
GGUF_SCHEMES = ("q8_0", "q4_0", "q4_1", "q5_0")
GGUF_BLOCK = 32


def dequantize(tensors: dict[str, torch.Tensor], scheme: str, dtype: torch.dtype) -> torch.Tensor:
    """The (out, in) weight in `dtype` that a layer's `tensors` (codes, scales, and per scheme mins
    or high bits) stand for."""
    codes, scales = tensors["codes"], tensors["scales"].to(dtype)
    out_features, blocks = scales.shape
    if scheme in ("int8", "q8_0"):  # one int8 per value
        values = codes.to(dtype).reshape(out_features, blocks, -1)
    elif scheme == "int4":  # pairs packed low nibble first, stored plus 8
        values = torch.stack((codes & 0x0F, codes >> 4), dim=-1).to(dtype).reshape(out_features, blocks, -1) - 8
    elif scheme == "nf4":  # pairs packed low nibble first, each the index of its level
        index = torch.stack((codes & 0x0F, codes >> 4), dim=-1).reshape(out_features, blocks, -1)
        values = tensors["levels"].to(dtype)[index.long()]
    else:  # GGUF Q4_0, Q4_1, Q5_0: each block's 16 bytes, low nibbles then high
        packed = codes.reshape(out_features, blocks, GGUF_BLOCK // 2)
        values = torch.cat((packed & 0x0F, packed >> 4), dim=-1)
        if scheme == "q5_0":  # bit j of the block's 4 high bytes (little-endian) is value j's fifth bit
            high = tensors["high"].reshape(out_features, blocks, 4)
            bits = torch.stack([(high >> shift) & 1 for shift in range(8)], dim=-1)  # (.., byte, bit)
            values = values | (bits.reshape(out_features, blocks, GGUF_BLOCK) << 4)
        values = values.to(dtype) - {"q4_0": 8, "q4_1": 0, "q5_0": 16}[scheme]
    weight = values * scales.unsqueeze(-1)
    if scheme == "q4_1":
        weight = weight + tensors["mins"].to(dtype).unsqueeze(-1)
    return weight.reshape(out_features, -1)


class QuantizedLinear(torch.nn.Module):
    """A frozen `nn.Linear` whose weight is held as blockwise codes and scales (buffers): made from
    the layer's weight by `quantize` (int8, int4), or from tensors stored before (a GGUF file's blocks too)."""

    def __init__(
        self, linear: torch.nn.Linear, scheme: str, tensors: dict[str, torch.Tensor] | None = None, block: int = BLOCK
    ):
        super().__init__()
        self.in_features, self.out_features, self.scheme = linear.in_features, linear.out_features, scheme
        self.compute_dtype = linear.weight.dtype
        if tensors is None:
            tensors = quantize(linear.weight, scheme, block)
        for name, tensor in tensors.items():
            self.register_buffer(name, tensor)
        self.bias = None if linear.bias is None else torch.nn.Parameter(linear.bias.detach(), requires_grad=False)

    def tensors(self) -> dict[str, torch.Tensor]:
        return dict(self.named_buffers())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tensors = self.tensors()
        if _traced(x):
            x, tensors = _tied_to_input(x, tensors)
        return F.linear(x, dequantize(tensors, self.scheme, self.compute_dtype).to(x.dtype), self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, scheme={self.scheme}"


def _traced(x: torch.Tensor) -> bool:
    """Whether `x` is torchax's (a step being traced into JAX) rather than plain PyTorch's."""
    from torchax.tensor import Tensor

    return isinstance(x, Tensor)


def _tied_to_input(x: torch.Tensor, tensors: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict]:
    """`x` and the layer's codes and scales, unchanged, through one optimization barrier, and the
    codes and scales with no gradient. The barrier makes the dequantizing wait for the layer's
    input: a dequantized weight depends on no activation, so XLA would otherwise dequantize every
    layer's weights ahead of time, or keep the forward pass's for the backward pass, all live
    together (Gemma 3 4B's int4 LoRA step on v5e with remat=layer: 11.2 GiB of temporaries,
    against 1.4 GiB with its bfloat16 base). Without a gradient, autodiff keeps no unpacked
    codes for the scales' (which nothing asks for)."""
    import jax
    from torchax import interop

    def tie(x, tensors):
        return jax.lax.optimization_barrier((x, jax.tree.map(jax.lax.stop_gradient, tensors)))

    return interop.call_jax(tie, x, tensors)


def quantizable(module: torch.nn.Module, block: int = BLOCK) -> list[str]:
    """Names of the frozen `nn.Linear`s a quantized base holds quantized: every one but the output
    head (tied to the embedding in many models, and what the loss reads most precisely), whose
    input dimension splits into blocks."""
    return [
        name
        for name, sub in module.named_modules()
        if held_quantized(name, sub, block) and not any(p.requires_grad for p in sub.parameters())
    ]


def held_quantized(name: str, layer: torch.nn.Module, block: int = BLOCK) -> bool:
    """Whether a quantized base holds `layer` quantized, once frozen (`quantizable`)."""
    return (
        type(layer) is torch.nn.Linear
        and name.rsplit(".", 1)[-1] not in ("lm_head", "embed_out")
        and layer.in_features % block == 0
    )


def quantize_base(module: torch.nn.Module, scheme: str, block: int = BLOCK) -> list[str]:
    """Replace, in place, every frozen linear layer of `module` (`quantizable`) by a
    `QuantizedLinear`; returns their names. LoRA's adapters and other trained tensors stay as they are."""
    names = quantizable(module, block)
    for name in names:
        _replace(module, name, lambda linear: QuantizedLinear(linear, scheme, block=block))
    return names


def plain_name(name: str) -> str:
    """A layer's name in the plain model, without PEFT's wrappers: what a stored base is keyed by."""
    name = name.removeprefix("base_model.model.")
    return name.replace(".base_layer", "").replace(".original_module", "")


def load_base(module: torch.nn.Module, stored: dict[str, torch.Tensor], schemes: dict[str, str]) -> list[str]:
    """Replace, in place, every frozen linear layer of `module` that `schemes` names (by `plain_name`)
    by a `QuantizedLinear` of the `stored` tensors ('<name>.codes', '<name>.scales', ...) made
    before; returns their names. A layer the stored base does not name stays as it is (a GGUF
    tensor of a type held dequantized)."""
    names = _stored_layers(module, schemes)
    for name in names:
        key = plain_name(name)
        _replace(module, name, lambda linear: QuantizedLinear(linear, schemes[key], _fields(stored, key)))
    return names


def dequantize_base(module: torch.nn.Module, stored: dict[str, torch.Tensor], schemes: dict[str, str]) -> list[str]:
    """Set, in place, the weight of every frozen linear layer `schemes` names to what its stored
    codes stand for (computed in float32): the base a LoRA adapter was trained against, into which
    an export merges it. Returns their names."""
    names = _stored_layers(module, schemes)
    with torch.no_grad():
        for name in names:
            key, linear = plain_name(name), module.get_submodule(name)
            linear.weight.copy_(dequantize(_fields(stored, key), schemes[key], torch.float32))
    return names


def _stored_layers(module: torch.nn.Module, schemes: dict[str, str]) -> list[str]:
    """The frozen linear layers of `module` (PEFT's names) that a stored base holds (by `plain_name`)."""
    return [name for name in quantizable(module, block=1) if plain_name(name) in schemes]


def _fields(stored: dict[str, torch.Tensor], layer: str) -> dict[str, torch.Tensor]:
    """A layer's stored tensors by field: {'codes': ..., 'scales': ..., ...}."""
    return {name.rpartition(".")[2]: tensor for name, tensor in stored.items() if name.rpartition(".")[0] == layer}


def _replace(module: torch.nn.Module, name: str, make) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = module.get_submodule(parent_name) if parent_name else module
    setattr(parent, child, make(getattr(parent, child)))


def base_layers(module: torch.nn.Module) -> list[tuple[tuple[str, ...], int]]:
    """The frozen base's linear layers that a quantized base holds quantized, each as (the names of
    the tensors that hold it: `codes` and `scales` once quantized, else `weight`; its weight's
    element count): what the memory plans count as the base."""
    found = [
        ((f"{name}.codes", f"{name}.scales"), sub.in_features * sub.out_features)
        for name, sub in module.named_modules()
        if isinstance(sub, QuantizedLinear)
    ]
    found += [((f"{name}.weight",), module.get_submodule(name).weight.numel()) for name in quantizable(module)]
    return found


def scheme_of(module: torch.nn.Module) -> str:
    """The scheme of a module whose base `quantize_base` quantized (int8, int4, nf4), else 'none'."""
    return next((sub.scheme for sub in module.modules() if isinstance(sub, QuantizedLinear)), "none")
