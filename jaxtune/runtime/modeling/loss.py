"""Next-token cross-entropy over chunks of tokens, so no (tokens, vocab) float32 logits ever exist.

Full logits for Gemma 3 (262k vocab) at 8x512 tokens are 4 GiB in float32, plus the log-softmax
copy autodiff keeps. Here the head runs on `chunk_tokens` tokens at a time and each chunk's logits
are recomputed in the backward pass (one extra chunk matmul), so only one chunk's logits live at once.
A frozen head (LoRA's usual case) needs no recompute: the hidden states' gradient is taken in the
forward pass, from logits it already has.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero

from jaxtune.data.tokenize import IGNORE_INDEX

F32 = jnp.float32


LOGITS_BUDGET = 64 * 2**20  # bytes of one chunk's float32 logits
ACCELERATOR_CHUNK_TOKENS = 512  # the fewest tokens per chunk on a TPU or GPU
# Bytes a chunk of c tokens holds at once per vocabulary entry and token in the backward pass: its
# float32 logits, their float32 softmax gradient and that gradient cast to the weights' 16 bits.
CHUNK_BYTES_PER_LOGIT = 4 + 4 + 2
# The name scope of the loss's ops (forward and backward) in the compiled program's op names, so a
# profile of the step can tell its time apart (benchmarks/analysis/profile_breakdown.py).
SCOPE = "chunked_loss"


def chunk_tokens_for(vocab_size: int, budget_bytes: int = LOGITS_BUDGET) -> int:
    """Tokens per chunk so one chunk's float32 logits fit `budget_bytes` (a multiple of 8, at least 8)."""
    return max(8, budget_bytes // (4 * vocab_size) // 8 * 8)


def chunk_tokens_on(platform: str | None, vocab_size: int) -> int:
    """Tokens per chunk on `platform` (a mesh's: "cpu", "gpu", "tpu") when nothing larger was chosen
    for the devices' free memory (`grown_chunk_tokens`).

    Each chunk's matmul reads the whole head (vocab, d) from memory again, so a chunk of c tokens
    does about c flops per byte of it, and an accelerator's matmul waits on memory below a few
    hundred (an H200: 989 TFLOP/s over 4.8 TB/s; a TPU v5e: 197 TFLOP/s over 0.82 TB/s). On a TPU
    or GPU chunks are at least `ACCELERATOR_CHUNK_TOKENS`: for Gemma 3 (262k vocabulary) 512 tokens,
    512 MiB of float32 logits, where 64 MiB would give 64 tokens and read Gemma 3 1B's 604 MB head
    128 times in a LoRA step of 8 x 512 tokens (82 GB: on a v5e, Gemma 3 1B's LoRA step at 8 x 512
    took 210 ms with 64-token chunks and 140 ms with 512). The CPU keeps the 64 MiB chunks."""
    chunk = chunk_tokens_for(vocab_size)
    return max(chunk, ACCELERATOR_CHUNK_TOKENS) if platform in ("gpu", "tpu") else chunk


def grown_chunk_tokens(base: int, vocab_size: int, spare_bytes: int, tokens: int) -> int:
    """The most tokens per chunk, `base` doubled while the larger chunk's extra backward-pass bytes
    (`CHUNK_BYTES_PER_LOGIT` per logit) fit `spare_bytes` and the chunk stays below `tokens` (a
    micro-batch's: a larger chunk than that is the same single chunk)."""
    chunk = base
    while chunk * 2 <= tokens and (chunk * 2 - base) * vocab_size * CHUNK_BYTES_PER_LOGIT <= spare_bytes:
        chunk *= 2
    return chunk


def _chunked(hidden, labels, chunk_tokens: int):
    """Shifted, flattened and padded: hidden (c, k, d) predicting targets (c, k); padding is ignored."""
    b, t, d = hidden.shape
    n = b * (t - 1)
    chunks = -(-n // max(1, chunk_tokens))
    k = -(-n // chunks)  # equal chunks of at most chunk_tokens: padding under one token per chunk
    pad = -n % k
    h = jnp.pad(hidden[:, :-1].reshape(n, d), ((0, pad), (0, 0)))  # (n + pad, d)
    targets = jnp.pad(labels[:, 1:].reshape(n), (0, pad), constant_values=IGNORE_INDEX)  # (n + pad,)
    return h.reshape(-1, k, d), targets.reshape(-1, k)


def _unchunked(nll, b: int, t: int):
    """(c, k) per-token NLL back to (b, t-1), dropping the padding."""
    return nll.reshape(-1)[: b * (t - 1)].reshape(b, t - 1)


def _cap(logits, softcap):
    """Gemma's final-logit soft-capping, applied in float32 like the full-logits path."""
    return logits if softcap is None else softcap * jnp.tanh(logits / softcap)


def _nll_and_lse(logits, targets):
    """Per-token NLL and logsumexp of float32 logits (k, vocab); 0 NLL where the target is ignored."""
    lse = jax.nn.logsumexp(logits, axis=-1)  # (k,)
    picked = jnp.take_along_axis(logits, jnp.maximum(targets, 0)[:, None], axis=-1)[:, 0]  # (k,)
    return jnp.where(targets != IGNORE_INDEX, lse - picked, 0.0), lse


def _linear_logits(h, weight, bias, softcap):
    """h @ weight.T + bias in the compute dtype (as the model's head does), then float32, then capped."""
    z = jax.lax.dot_general(h, weight, (((1,), (1,)), ((), ())))  # (k, vocab)
    if bias is not None:
        z = z + bias
    return _cap(z.astype(F32), softcap)


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class _Wanted:
    """Which inputs the backward pass must produce gradients for (static: no leaves)."""

    hidden: bool
    weight: bool
    bias: bool


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _fused_nll(h, weight, bias, targets, softcap):
    """(c, k, d) hidden -> (c, k) NLL, one chunk's logits at a time."""
    return _fused_fwd_scan(h, weight, bias, targets, softcap)[0]


def _fused_fwd_scan(h, weight, bias, targets, softcap):
    def chunk(_, xs):
        return None, _nll_and_lse(_linear_logits(xs[0], weight, bias, softcap), xs[1])

    return jax.lax.scan(chunk, None, (h, targets))[1]  # nll (c, k), lse (c, k)


def _fused_fwd(h, weight, bias, targets, softcap):
    wanted = _Wanted(h.perturbed, weight.perturbed, bias is not None and bias.perturbed)
    h, weight, targets = h.value, weight.value, targets.value
    bias = None if bias is None else bias.value
    if wanted.hidden and not (wanted.weight or wanted.bias):
        # A frozen head (LoRA): the gradient of token j's NLL w.r.t. its hidden state is
        # g_j · (softmax_j − onehot_j) @ W for any cotangent g_j, so it is taken here, from the
        # logits the forward already has, at g = 1, and scaled in the backward: the head costs
        # two matmuls per chunk (logits, d_hidden) like an unchunked loss, not three.
        nll, unit = _frozen_head_scan(h, weight, bias, targets, softcap)
        return nll, (unit, None, None, None, None, wanted)
    nll, lse = _fused_fwd_scan(h, weight, bias, targets, softcap)
    # Only inputs and the per-token logsumexp are kept: never a chunk's logits.
    return nll, (h, weight, bias, targets, lse, wanted)


def _logit_grad(logits, lse, targets, scale, softcap, dtype):
    """d (scale · nll) / d logits before the float32 cast, (k, vocab) in `dtype`."""
    onehot = jax.nn.one_hot(jnp.maximum(targets, 0), logits.shape[-1], dtype=F32)  # (k, vocab)
    scale = jnp.where(targets != IGNORE_INDEX, scale, 0.0).astype(F32)  # (k,) the cotangent of each token
    dz = (jnp.exp(logits - lse[:, None]) - onehot) * scale[:, None]  # d nll / d capped logits
    if softcap is not None:
        dz = dz * (1.0 - jnp.square(logits / softcap))  # d tanh = 1 - tanh^2
    return dz.astype(dtype)  # back through `.float()`, as autodiff of the full path does


def _frozen_head_scan(h, weight, bias, targets, softcap):
    """(c, k) NLL and (c, k, d) d NLL / d hidden at unit cotangent."""

    def chunk(_, xs):
        hc, tc = xs
        logits = _linear_logits(hc, weight, bias, softcap)  # (k, vocab)
        nll, lse = _nll_and_lse(logits, tc)
        return None, (nll, _logit_grad(logits, lse, tc, 1.0, softcap, hc.dtype) @ weight)

    return jax.lax.scan(chunk, None, (h, targets))[1]


def _fused_bwd(softcap, res, g):
    h, weight, bias, targets, lse, wanted = res
    if isinstance(g, SymbolicZero):
        return None, None, None, None
    if weight is None:  # the frozen-head residual: d NLL / d hidden at unit cotangent
        return h * g[..., None].astype(h.dtype), None, None, None
    vocab, d = weight.shape

    def chunk(acc, xs):
        hc, tc, lc, gc = xs
        logits = _linear_logits(hc, weight, bias, softcap)  # (k, vocab) recomputed: the extra matmul
        dz = _logit_grad(logits, lc, tc, gc, softcap, h.dtype)
        dw, db = acc
        if wanted.weight:  # (vocab, d), accumulated in float32 across chunks
            dw = dw + jax.lax.dot_general(dz, hc, (((0,), (0,)), ((), ())), preferred_element_type=F32)
        if wanted.bias:
            db = db + dz.astype(F32).sum(0)  # (vocab,)
        dh = dz @ weight if wanted.hidden else None  # (k, d)
        return (dw, db), dh

    acc0 = (jnp.zeros((vocab, d), F32) if wanted.weight else None, jnp.zeros((vocab,), F32) if wanted.bias else None)
    (dw, db), dh = jax.lax.scan(chunk, acc0, (h, targets, lse, g))
    dw = None if dw is None else dw.astype(weight.dtype)
    db = None if db is None else db.astype(bias.dtype)
    return dh, dw, db, None


_fused_nll.defvjp(_fused_fwd, _fused_bwd, symbolic_zeros=True)


def linear_token_nll(hidden, weight, labels, bias=None, softcap=None, chunk_tokens=None) -> jax.Array:
    """Per-token next-token NLL, float32, (b, t-1): entry [r, i] scores labels[r, i+1] from hidden[r, i].

    0 where labels[r, i+1] == IGNORE_INDEX. hidden (b, t, d) and weight (vocab, d) in the compute
    dtype, bias (vocab,) or None, softcap a float or None. Same math as full logits -> float32 ->
    softcap -> log_softmax -> gather, with a custom VJP that recomputes each chunk's logits and skips
    the weight (and bias) gradient matmul when those are not differentiated (a frozen head).
    """
    b, t, _ = hidden.shape
    chunk_tokens = chunk_tokens or chunk_tokens_for(weight.shape[0])
    h, targets = _chunked(hidden, labels, chunk_tokens)
    softcap = None if softcap is None else float(softcap)
    with jax.named_scope(SCOPE):
        return _unchunked(_fused_nll(h, weight, bias, targets, softcap), b, t)


def head_token_nll(hidden, head: Callable, labels, chunk_tokens=None, softcap=None) -> jax.Array:
    """`linear_token_nll` for any head `head(h (n, d)) -> logits (n, vocab)` with closed-over weights.

    For heads that are not a plain matmul (LoRA-wrapped, PEFT modules_to_save, called through
    torchax). Each chunk is checkpointed inside the scan body, so its logits are recomputed per
    iteration in the backward pass rather than stacked; the closed-over weights get gradients.
    """
    b, t, d = hidden.shape
    if chunk_tokens is None:
        chunk_tokens = chunk_tokens_for(jax.eval_shape(head, jax.ShapeDtypeStruct((1, d), hidden.dtype)).shape[-1])
    h, targets = _chunked(hidden, labels, chunk_tokens)

    @jax.checkpoint
    def chunk_nll(hc, tc):
        return _nll_and_lse(_cap(head(hc).astype(F32), softcap), tc)[0]  # (k,)

    with jax.named_scope(SCOPE):
        nll = jax.lax.map(lambda xs: chunk_nll(*xs), (h, targets))  # (c, k)
    return _unchunked(nll, b, t)
