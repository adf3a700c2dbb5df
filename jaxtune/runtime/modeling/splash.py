"""Attention on TPU as Pallas's splash-attention kernel (`jax.experimental.pallas.ops.tpu.splash_attention`).

Splash attention computes causal (or sliding-window) attention in tiles, skipping the tiles its
mask leaves empty, and never holds a (t, t) score matrix, forward or backward: for the forward
and backward pass of 8 rows of 2048 tokens with 4 heads of 256 (bf16), XLA:TPU gives it 4.2 MiB
of temporaries on a v5e against 768.6 MiB for XLA's attention (checkpointed, as
`attention._core` runs). It takes
segment ids (packed rows and padding, as `attention.segment_mask`) and Gemma 2's soft-capped
logits; attention dropout it cannot express, and sequences that are not a whole number of its
128-token tiles it does not take: `refusal` says why it does not apply.

Grouped-query attention runs the kernel's multi-query form once per key/value head, over that
head's group of query heads. On a mesh of several devices the kernel runs per device
(`mesh.per_device`).
"""

from __future__ import annotations

import functools

import jax

BLOCKS = (512, 256, 128)  # tile lengths tried, largest first: a tile must divide the sequence


def block_for(length: int) -> int | None:
    return next((block for block in BLOCKS if length % block == 0), None)


def refusal(length: int, head: int, dropout: float) -> str | None:
    """Why the kernel does not apply (None when it does)."""
    if dropout:
        return "attention dropout"
    if block_for(length) is None:
        return f"sequence length {length}, not a multiple of the kernel's {BLOCKS[-1]}-token tiles"
    return None


def attention(
    query,
    key,
    value,
    segment_ids,
    *,
    scale: float,
    window: int | None,
    softcap: float | None,
    mesh=None,
    interpret: bool = False,
):
    """q (b, t, n, h), k/v (b, t, kv, h), segment ids (b, t) -> (b, t, n, h), as `attention._core` computes it."""
    from jaxtune.runtime.devices.mesh import per_device

    local = functools.partial(_local, scale=scale, window=window, softcap=softcap, interpret=interpret)
    return per_device(local, mesh, query, key, value, segment_ids)


def _local(query, key, value, segment_ids, *, scale, window, softcap, interpret):
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as kernels
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks

    b, t, n, h = query.shape
    kv = key.shape[2]
    groups = n // kv
    block = block_for(t)
    sizes = kernels.BlockSizes(
        block_q=block,
        block_kv=block,
        block_kv_compute=block,
        block_q_dkv=block,
        block_kv_dkv=block,
        block_kv_dkv_compute=block,
        block_q_dq=block,
        block_kv_dq=block,
    )
    # transformers' sliding window: query i sees keys i - window < j <= i.
    one = masks.CausalMask((t, t)) if window is None else masks.LocalMask((t, t), window_size=(window - 1, 0), offset=0)
    kernel = kernels.make_splash_mqa(
        masks.MultiHeadMask([one] * groups),
        block_sizes=sizes,
        head_shards=1,
        q_seq_shards=1,
        attn_logits_soft_cap=softcap,
        interpret=interpret,
    )
    # The kernel does not scale the logits: scaled queries give the same q·k * scale.
    queries = (query * scale).astype(query.dtype).transpose(0, 2, 1, 3).reshape(b, kv, groups, t, h)
    keys, values = (x.transpose(0, 2, 1, 3) for x in (key, value))  # (b, kv, t, h)
    segments = kernels.SegmentIds(q=segment_ids, kv=segment_ids)
    per_head = jax.vmap(lambda q, k, v, s: kernel(q, k, v, segment_ids=s), in_axes=(0, 0, 0, None))
    out = jax.vmap(per_head)(queries, keys, values, segments)  # (b, kv, groups, t, h)
    return out.reshape(b, n, t, h).transpose(0, 2, 1, 3)
