"""Fused, segment-aware attention for the models' own attention layers, as one JAX call.

transformers lets a model's attention layers dispatch to a registered function
(`AttentionInterface`). jaxtune registers `ATTENTION` there and switches a model to it only
while a train or eval step is traced, so PyTorch eager (the parity reference) and the decoder's
KV-cache path keep transformers' own eager attention.

The function builds its mask from `segment_ids` (which the step passes as a model keyword, and
transformers hands on to every attention layer): a token sees the earlier tokens of its own
segment, within the layer's sliding window if it has one. Padding is a segment of its own, so no
row is ever fully masked (no NaN) and a padded row computes what it computes alone; packed rows
are segments too. transformers builds no (b, 1, t, t) mask for it: `ATTENTION` is absent from
its mask registry on purpose.

The scores never outlive one layer. On accelerators the core is a Pallas kernel that never
forms them: splash attention on a TPU mesh (`splash`), flash attention on NVIDIA GPUs
(`gpu_flash`). Elsewhere, and where the kernel does not apply (attention dropout; a sequence not
a whole number of its tiles; on GPUs a head size that is not a power of two), the core runs under
`tied_checkpoint`, so the backward pass recomputes the scores from q, k and v instead of keeping
(b, heads, t, t) per layer: `jax.nn.dot_product_attention` (XLA's on every backend: given no
`implementation`, JAX 0.10 never picks cuDNN's), or, for soft-capped scores (Gemma 2) and
attention dropout, which that function cannot express, the same math written out in JAX, still
checkpointed. A kernel passed over says why, once per reason, as a warning of the
`jaxtune.attention` logger.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import logging
from collections.abc import Iterator
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import torch

from jaxtune.runtime.modeling import gpu_flash, splash
from jaxtune.runtime.modeling.remat import next_key, tied_checkpoint

ATTENTION = "jaxtune_fused"
KERNELS = {"splash": splash, "gpu-flash": gpu_flash}  # each has `refusal(length, head, dropout)` and `attention`
DEFAULT_KERNEL = {"tpu": "splash", "gpu": "gpu-flash"}  # by the mesh's platform; XLA's attention elsewhere
logger = logging.getLogger("jaxtune.attention")
_REPORTED: set[tuple[str, str]] = set()


@dataclass(frozen=True)
class Kernel:
    """Which core a traced step's attention runs: "xla", "splash" or "gpu-flash", on what mesh."""

    name: str = "xla"
    mesh: object = None
    interpret: bool = False  # a Pallas kernel in Pallas's interpreter: its exact arithmetic on any backend (tests)


_KERNEL: contextvars.ContextVar[Kernel] = contextvars.ContextVar("jaxtune_attention_kernel", default=Kernel())
_CHOSEN: contextvars.ContextVar[str | None] = contextvars.ContextVar("jaxtune_attention_choice", default=None)


def kernel_for(mesh) -> Kernel:
    """Splash attention for a mesh of TPUs, flash attention for one of NVIDIA GPUs (real or
    compile-only), XLA's attention otherwise; `choose` overrides it."""
    chosen = _CHOSEN.get()
    if chosen and chosen.endswith("-interpret"):
        return Kernel(chosen.removesuffix("-interpret"), mesh, interpret=True)
    platform = mesh.devices.flat[0].platform if mesh is not None else None
    return Kernel(chosen or DEFAULT_KERNEL.get(platform, "xla"), mesh)


def length_multiple(module: torch.nn.Module, mesh) -> int:
    """What a sequence's length must be a multiple of for the mesh's kernel to take it (splash's
    128-token tiles, the GPU kernel's smallest tile; 1 for XLA's attention, or where `module`'s
    attention is not the fused one): batches are padded to it."""
    if not supported(module):
        return 1
    return {"splash": splash.BLOCKS[-1], "gpu-flash": gpu_flash.SMALLEST_TILE}.get(kernel_for(mesh).name, 1)


@contextlib.contextmanager
def choose(name: str) -> Iterator[None]:
    """Steps traced inside run `name` ("xla", "splash", "gpu-flash", or a kernel's name with
    "-interpret": that kernel on the CPU, interpreted) whatever their devices: to compare cores
    on one target."""
    token = _CHOSEN.set(name)
    try:
        yield
    finally:
        _CHOSEN.reset(token)


def segment_mask(segment_ids: jax.Array, window: int | None) -> jax.Array:
    """(b, 1, t, t) bool: query i sees key j when both are in one segment, j <= i, and i - j < window."""
    t = segment_ids.shape[-1]
    index = jnp.arange(t)
    allowed = segment_ids[:, :, None] == segment_ids[:, None, :]  # (b, t, t)
    allowed &= index[:, None] >= index[None, :]
    if window is not None:
        allowed &= index[:, None] - index[None, :] < window  # transformers' sliding_window_overlay
    return allowed[:, None]


def _core(query, key, value, segment_ids, *, scale, window, softcap, dropout, dropout_key):
    """q (b, t, n, h), k/v (b, t, kv, h) -> (b, t, n, h), in XLA's ops."""
    mask = segment_mask(segment_ids, window)
    if softcap is None and dropout == 0.0:
        return jax.nn.dot_product_attention(query, key, value, mask=mask, scale=scale)
    groups = query.shape[2] // key.shape[2]
    key, value = (jnp.repeat(x, groups, axis=2) for x in (key, value))
    scores = jnp.einsum("btnh,bsnh->bnts", query, key).astype(jnp.float32) * scale  # (b, n, t, t)
    if softcap is not None:
        scores = softcap * jnp.tanh(scores / softcap)
    scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1)
    if dropout:
        keep = jax.random.bernoulli(dropout_key, 1.0 - dropout, probs.shape)
        probs = jnp.where(keep, probs / (1.0 - dropout), 0.0)
    return jnp.einsum("bnts,bsnh->btnh", probs.astype(value.dtype), value)


def fused_attention(
    module,
    query,
    key,
    value,
    attention_mask,
    dropout=0.0,
    scaling=None,
    sliding_window=None,
    softcap=None,
    segment_ids=None,
    **kwargs,
):
    """transformers' attention signature: q (b, n, t, h), k/v (b, kv, t, h) -> ((b, t, n, h), None)."""
    from torchax import interop

    if segment_ids is None:
        raise ValueError(f"{ATTENTION} attention needs the segment_ids keyword; it runs only inside jaxtune's steps")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    kernel = _KERNEL.get()
    pallas = KERNELS.get(kernel.name)
    if pallas is not None and _applies(kernel.name, pallas.refusal(query.shape[2], query.shape[3], float(dropout))):

        def run_kernel(q, k, v, segments):
            q, k, v = (jnp.swapaxes(x, 1, 2) for x in (q, k, v))  # (b, t, heads, h)
            return pallas.attention(
                q,
                k,
                v,
                segments,
                scale=float(scale),
                window=sliding_window,
                softcap=softcap,
                mesh=kernel.mesh,
                interpret=kernel.interpret,
            )

        return interop.call_jax(run_kernel, query, key, value, segment_ids), None
    dropout_key = next_key() if dropout else jnp.zeros((2,), jnp.uint32)
    core = functools.partial(_core, scale=float(scale), window=sliding_window, softcap=softcap, dropout=float(dropout))

    def run(q, k, v, segments, key_data):
        q, k, v = (jnp.swapaxes(x, 1, 2) for x in (q, k, v))  # (b, t, heads, h)
        return tied_checkpoint(lambda *a: core(*a[:4], dropout_key=a[4]))(q, k, v, segments, key_data)

    out = interop.call_jax(run, query, key, value, segment_ids, interop.torch_view(dropout_key))
    return out, None


def _applies(name: str, refusal: str | None) -> bool:
    """Whether the kernel runs; where it does not, say why (once per reason)."""
    if refusal is not None and (name, refusal) not in _REPORTED:
        _REPORTED.add((name, refusal))
        logger.warning("attention: %s does not take %s; XLA's attention runs instead", name, refusal)
    return refusal is None


def register() -> None:
    """Make `ATTENTION` a name transformers' attention layers can dispatch to (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION, fused_attention)


def _base(module: torch.nn.Module) -> torch.nn.Module:
    return module.get_base_model() if hasattr(module, "get_base_model") else module


def supported(module: torch.nn.Module) -> bool:
    """Whether the model's attention layers dispatch through transformers' AttentionInterface (and so
    can run `fused_attention`). Models that do not (older remote code) keep eager attention and padded batches."""
    return bool(getattr(_base(module), "_supports_attention_backend", False))


def _configs(module: torch.nn.Module) -> list:
    base = _base(module)
    return list({id(c): c for c in (base.config, base.config.get_text_config())}.values())


@contextlib.contextmanager
def fused(module: torch.nn.Module, enabled: bool = True, mesh=None) -> Iterator[None]:
    """While active (while a step is traced), the model's attention layers run `fused_attention`,
    with the core `kernel_for(mesh)` picks."""
    if not enabled:
        yield
        return
    register()
    configs = _configs(module)
    before = [c._attn_implementation for c in configs]
    for config in configs:
        config._attn_implementation = ATTENTION
    token = _KERNEL.set(kernel_for(mesh))
    try:
        yield
    finally:
        _KERNEL.reset(token)
        for config, name in zip(configs, before):
            config._attn_implementation = name
