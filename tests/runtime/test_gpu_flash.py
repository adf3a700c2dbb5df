"""Flash attention for NVIDIA GPUs (`gpu_flash`, a Pallas kernel in Triton's lowering) against
XLA's attention: the same numbers, checked on this CPU in Pallas's interpreter, which runs the
kernel's own tiles, loops and online softmax. `tests/targets/test_gpu_flash_plan.py` compiles it
for compile-only H100s and H200s."""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxtune.runtime.modeling import attention, gpu_flash
from tests.runtime.attention_cores import loss_and_gradients, tiny_gemma_and_batch, worst_gradient_gap

# float32 on this CPU, measured: forward max |Δ| 3.9e-7 (outputs of size ~1), gradients 2.3e-7
# relative. The kernel sums each row's softmax over 64-token tiles, rescaling as it goes, where
# XLA's softmax sums it at once: rounding of that order, nothing more. A wrong mask, scale,
# window, cap or head group moves them by 1e-2 or more (dropping the window: 1.23 forward;
# dropping the cap: 8.4e-2 in the gradients: `test_a_kernel_without_the_window_or_the_cap_would_fail_these_checks`).
FORWARD_TOLERANCE = 5e-6
GRADIENT_TOLERANCE = 5e-6
HEAD = 16


def _inputs(b=2, t=256, n=4, kv=2, h=HEAD):
    rng = np.random.default_rng(0)
    q, k, v = (
        jnp.asarray(rng.standard_normal(shape), jnp.float32) for shape in [(b, t, n, h), (b, t, kv, h), (b, t, kv, h)]
    )
    segments = np.zeros((b, t), np.int32)
    segments[0, int(0.35 * t) :] = 1  # two packed rows, the second starting inside a tile
    segments[1, int(0.78 * t) :] = 7  # a row, then its padding (a segment of its own)
    return q, k, v, jnp.asarray(segments)


def _cores(segments, window, softcap):
    settings = dict(scale=HEAD**-0.5, window=window, softcap=softcap)
    xla = lambda q, k, v: attention._core(q, k, v, segments, dropout=0.0, dropout_key=None, **settings)  # noqa: E731
    kernel = lambda q, k, v: gpu_flash.attention(q, k, v, segments, interpret=True, **settings)  # noqa: E731
    return xla, kernel


def _gradients(core, q, k, v):
    weights = jnp.cos(jnp.arange(HEAD))  # a loss that weighs every output differently
    return jax.grad(lambda q, k, v: (core(q, k, v) * weights).sum(), argnums=(0, 1, 2))(q, k, v)


def _gap(got, want) -> float:
    return float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want))


# A 16-token window skips key tiles (the query tile at 128 sees keys from 113 on), and a cap of
# 2 bends logits of size ~1; a window of 100 skips none for the first query tile but masks within
# tiles; 8 query heads on one key/value head is multi-query attention; 80 tokens take tiles of 16.
@pytest.mark.parametrize(
    "window, softcap, heads, length",
    [(None, None, (4, 2), 256), (16, 2.0, (4, 2), 256), (100, None, (8, 1), 256), (24, None, (4, 2), 80)],
    ids=["causal-grouped", "sliding-window-soft-capped", "window-multi-query", "16-token-tiles"],
)
def test_flash_attention_computes_xlas_attention_and_its_gradients(window, softcap, heads, length):
    q, k, v, segments = _inputs(t=length, n=heads[0], kv=heads[1])
    xla, kernel = _cores(segments, window, softcap)
    assert float(jnp.abs(kernel(q, k, v) - xla(q, k, v)).max()) <= FORWARD_TOLERANCE
    for got, want in zip(_gradients(kernel, q, k, v), _gradients(xla, q, k, v)):
        assert _gap(got, want) <= GRADIENT_TOLERANCE


def test_a_kernel_without_the_window_or_the_cap_would_fail_these_checks():
    """The checks above can fail: the inputs are ones where the window and the cap matter."""
    q, k, v, segments = _inputs()
    xla, _ = _cores(segments, 16, 2.0)
    _, no_window = _cores(segments, None, 2.0)
    _, no_cap = _cores(segments, 16, None)
    assert float(jnp.abs(no_window(q, k, v) - xla(q, k, v)).max()) > 1e-2
    assert min(_gap(got, want) for got, want in zip(_gradients(no_cap, q, k, v), _gradients(xla, q, k, v))) > 1e-2


def test_the_kernel_names_what_it_does_not_take():
    assert gpu_flash.refusal(2048, 256, 0.0) is None and gpu_flash.refusal(512, 64, 0.0) is None
    assert gpu_flash.refusal(512, 64, 0.1) == "attention dropout"
    assert gpu_flash.refusal(512, 96, 0.0) == "head size 96 (the kernel takes 16, 32, 64, 128, 256)"
    assert (
        gpu_flash.refusal(1000, 64, 0.0)
        == "sequence length 1000, not a multiple of the kernel's smallest tile, 16 tokens"
    )
    assert gpu_flash.tiles_for(256, 2048) == gpu_flash.Tiles(forward=(64, 64), dkdv=(32, 64), dq=(64, 32), warps=8)
    assert gpu_flash.tiles_for(64, 80) == gpu_flash.Tiles(forward=(16, 16), dkdv=(16, 16), dq=(16, 16), warps=4)
    assert gpu_flash.tiles_for(64, 96).forward == (32, 32)
    assert gpu_flash.tiles_for(256, 128, itemsize=4) == gpu_flash.Tiles(
        forward=(64, 32), dkdv=(32, 32), dq=(32, 32), warps=8
    )


def test_on_a_gpu_mesh_the_kernel_is_flash_and_the_choice_can_be_overridden():
    gpu = type("Device", (), {"platform": "gpu"})()
    mesh = type("Mesh", (), {"devices": np.array([gpu])})()
    assert attention.kernel_for(mesh) == attention.Kernel("gpu-flash", mesh)
    with attention.choose("xla"):
        assert attention.kernel_for(mesh).name == "xla"
    with attention.choose("gpu-flash-interpret"):
        assert attention.kernel_for(None) == attention.Kernel("gpu-flash", None, interpret=True)


def test_a_models_loss_and_gradients_are_the_same_through_the_kernel(caplog):
    """The whole path: transformers' Gemma 3 layers (sliding and global, grouped-query) dispatching
    to `fused_attention`, which transposes and scales for the kernel. Measured: loss 8.6e-8
    relative, the worst weight's gradient 7.3e-7 relative. A sequence the tiles do not divide
    falls back to XLA's attention, and says so once."""
    model, batch, labels = tiny_gemma_and_batch()
    xla_loss, xla_grads = loss_and_gradients(model, batch, labels, "xla")
    loss, grads = loss_and_gradients(model, batch, labels, "gpu-flash-interpret")
    assert abs(float(loss) / float(xla_loss) - 1) <= FORWARD_TOLERANCE
    assert worst_gradient_gap(grads, xla_grads) <= GRADIENT_TOLERANCE

    short = {name: value[:, :100] for name, value in batch.items()}
    attention._REPORTED.clear()
    with caplog.at_level(logging.WARNING, logger="jaxtune.attention"):
        fallback, _ = loss_and_gradients(model, short, labels[:, :100], "gpu-flash-interpret")
    assert float(fallback) == pytest.approx(
        float(loss_and_gradients(model, short, labels[:, :100], "xla")[0]), rel=1e-6
    )
    warnings = [r.getMessage() for r in caplog.records if r.name == "jaxtune.attention"]
    assert warnings == [
        "attention: gpu-flash does not take sequence length 100, not a multiple of the kernel's "
        "smallest tile, 16 tokens; XLA's attention runs instead"
    ]


def test_in_bfloat16_the_kernel_is_as_near_float32_as_xlas_attention_in_bfloat16():
    """Training runs bf16: the kernel's error against float32 attention is bf16 rounding, of XLA's
    own size. Measured: forward max |Δ| 0.0117 (XLA's bf16: 0.0133), gradients 0.0039, 0.0039 and
    0.0023 relative (XLA's: 0.0040, 0.0039, 0.0023)."""
    q, k, v, segments = _inputs()
    xla, kernel = _cores(segments, 16, None)
    low = [x.astype(jnp.bfloat16) for x in (q, k, v)]
    exact = xla(q, k, v)
    got, xla_low = kernel(*low), xla(*low)
    assert got.dtype == jnp.bfloat16
    assert float(jnp.abs(got.astype(jnp.float32) - exact).max()) <= 1.5 * float(
        jnp.abs(xla_low.astype(jnp.float32) - exact).max()
    )
    for got, want, xla_got in zip(_gradients(kernel, *low), _gradients(xla, q, k, v), _gradients(xla, *low)):
        assert got.dtype == jnp.bfloat16
        assert _gap(got.astype(jnp.float32), want) <= 1.5 * _gap(xla_got.astype(jnp.float32), want)
