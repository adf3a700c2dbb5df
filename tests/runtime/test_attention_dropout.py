"""Attention dropout in the fused attention: the probabilities written out in JAX, each dropped with
probability `dropout` and the rest scaled by 1 / (1 - dropout); drawn in training only."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxtune.config import MeshConfig
from jaxtune.runtime.compiled import steps
from jaxtune.runtime.devices.mesh import make_placement
from jaxtune.runtime.modeling import attention
from jaxtune.runtime.modeling import model as rt_model
from tests.conftest import VOCAB, tiny_model

pytestmark = pytest.mark.parity

B, T, HEADS, KV_HEADS = 2, 8, 16, 2
CORE = jax.jit(attention._core, static_argnames=("scale", "window", "softcap", "dropout"))


def probabilities(dropout: float, seed: int = 0) -> np.ndarray:
    """(b, heads, t, t) attention probabilities as `_core` applies them: with value[s] the one-hot
    vector of position s, each query's output is its row of probabilities."""
    rng = np.random.default_rng(123)
    query = rng.standard_normal((B, T, HEADS, T), np.float32)
    key = rng.standard_normal((B, T, KV_HEADS, T), np.float32)
    value = np.broadcast_to(np.eye(T, dtype=np.float32)[None, :, None, :], (B, T, KV_HEADS, T))
    segments = np.asarray([[1] * T, [1] * 5 + [2] * 3], np.int32)  # the second row: two packed rows
    out = CORE(
        query,
        key,
        value,
        segments,
        scale=T**-0.5,
        window=None,
        softcap=None,
        dropout=dropout,
        dropout_key=jax.random.PRNGKey(seed),
    )
    return np.asarray(jnp.swapaxes(out, 1, 2))  # (b, heads, t, t)


def test_dropout_zeroes_a_share_of_the_probabilities_and_scales_the_rest():
    kept = probabilities(0.0)  # jax.nn.dot_product_attention: the path without dropout
    allowed = kept > 0
    assert allowed.sum() == B * HEADS * (T * (T + 1) // 2) - HEADS * 15  # causal, the second row's segments apart
    np.testing.assert_allclose(kept.sum(-1), 1.0, rtol=1e-6)
    dropped = probabilities(0.25)
    assert np.all(dropped[~allowed] == 0), "a masked position got probability"
    zeroed = allowed & (dropped == 0)
    np.testing.assert_allclose(dropped[allowed & ~zeroed], kept[allowed & ~zeroed] / 0.75, rtol=1e-5)
    share = zeroed.sum() / allowed.sum()
    assert 0.2 < share < 0.3, f"{share:.3f} of 912 probabilities dropped at dropout 0.25"
    np.testing.assert_array_equal(probabilities(0.25), dropped)  # the key decides which
    assert not np.array_equal(probabilities(0.25, seed=1) == 0, dropped == 0)


def test_a_model_drops_attention_in_training_and_not_in_eval():
    """A tiny Gemma 3 with attention_dropout 0.5 through the fused step's loss: in eval, the loss
    without dropout; in training, another loss for each key (Gemma 3 has no other dropout)."""
    module = tiny_model("gemma3", layers=1, sliding_window=8)
    model = rt_model.to_jax(module, make_placement(MeshConfig()))
    assert attention.supported(module)
    ids = np.random.default_rng(0).integers(3, VOCAB, (2, 16)).astype(np.int32)
    batch = {"input_ids": ids, "attention_mask": np.ones_like(ids)}

    def losses(training: bool, dropout: float, seeds=(0,)) -> list[float]:
        for layer in module.model.layers:
            layer.self_attn.attention_dropout = dropout  # read when the step is traced
        summed = jax.jit(steps._summed_loss(model, training=training))
        return [float(summed(model.weights, model.buffers, batch, ids, jax.random.PRNGKey(s))[0]) for s in seeds]

    [plain] = losses(False, 0.0)
    assert losses(False, 0.5, seeds=(0, 1)) == [plain, plain], "attention dropout in eval"
    first, again, other = losses(True, 0.5, seeds=(0, 0, 1))
    assert first == again and first != other
    assert min(abs(first - plain), abs(other - plain)) > 1e-3 * plain, (plain, first, other)
