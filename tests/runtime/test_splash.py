"""Splash attention (Pallas's TPU kernel) against XLA's attention: the same numbers, checked on
this CPU in Pallas's interpreter, which runs the kernel's own tiled arithmetic; and the kernel
chosen for, and compiled by, libtpu for compile-only TPU devices."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxtune.runtime.modeling import attention, splash
from tests.runtime.attention_cores import loss_and_gradients, tiny_gemma_and_batch, worst_gradient_gap

# float32 on this CPU, measured: forward max |Δ| 5.4e-7 (outputs of size ~1), gradients 3.2e-7
# relative. The kernel's online softmax sums each row in 128-token tiles where XLA's softmax sums
# it at once: rounding of that order, nothing more. A wrong mask, scale, window or cap moves them
# by 1e-2 or more.
FORWARD_TOLERANCE = 5e-6
GRADIENT_TOLERANCE = 5e-6


def _inputs(b=2, t=128, n=4, kv=2, h=64):
    rng = np.random.default_rng(0)
    q, k, v = (
        jnp.asarray(rng.standard_normal(shape), jnp.float32) for shape in [(b, t, n, h), (b, t, kv, h), (b, t, kv, h)]
    )
    segments = np.zeros((b, t), np.int32)
    segments[0, 50:] = 1  # two packed rows
    segments[1, 100:] = 7  # a row, then its padding (a segment of its own)
    return q, k, v, jnp.asarray(segments)


@pytest.mark.parametrize("window, softcap", [(None, None), (16, 50.0)], ids=["causal", "sliding-window-soft-capped"])
def test_splash_attention_computes_xlas_attention_and_its_gradients(window, softcap):
    q, k, v, segments = _inputs()
    settings = dict(scale=64**-0.5, window=window, softcap=softcap)
    xla = lambda q, k, v: attention._core(q, k, v, segments, dropout=0.0, dropout_key=None, **settings)  # noqa: E731
    kernel = lambda q, k, v: splash.attention(q, k, v, segments, interpret=True, **settings)  # noqa: E731
    assert float(jnp.abs(kernel(q, k, v) - xla(q, k, v)).max()) <= FORWARD_TOLERANCE
    weights = jnp.cos(jnp.arange(64))  # a loss that weighs every output differently

    def grads(core):
        return jax.grad(lambda q, k, v: (core(q, k, v) * weights).sum(), argnums=(0, 1, 2))(q, k, v)

    for got, want in zip(grads(kernel), grads(xla)):
        assert float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want)) <= GRADIENT_TOLERANCE


def test_splash_takes_whole_tiles_and_no_dropout():
    assert [splash.block_for(t) for t in (2048, 768, 384, 128, 96, 1000)] == [512, 256, 128, 128, None, None]
    assert splash.refusal(512, 256, 0.0) is None
    assert splash.refusal(512, 256, 0.1) == "attention dropout"
    assert splash.refusal(100, 256, 0.0) == "sequence length 100, not a multiple of the kernel's 128-token tiles"


def test_a_models_loss_and_gradients_are_the_same_through_splash(tmp_path):
    """The whole path: transformers' Gemma 3 layers (sliding and global, grouped-query) dispatching
    to `fused_attention`, which transposes, scales and groups for the kernel. Measured: loss 9e-8
    relative, the worst weight's gradient 9.3e-7 relative; bounded as the core is. Splash with
    the window dropped fails this and the sliding-window case above."""
    model, batch, labels = tiny_gemma_and_batch()
    xla_loss, xla_grads = loss_and_gradients(model, batch, labels, "xla")
    loss, grads = loss_and_gradients(model, batch, labels, "splash-interpret")
    assert abs(float(loss) / float(xla_loss) - 1) <= FORWARD_TOLERANCE
    assert worst_gradient_gap(grads, xla_grads) <= GRADIENT_TOLERANCE
