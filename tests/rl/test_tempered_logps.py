"""Token log-probabilities of softmax(logits / T), as GRPO scores the answers it sampled at T: from
the hidden states divided by T where the head is linear, from full logits where it is not."""

from __future__ import annotations

import numpy as np
import pytest

from jaxtune.config import MeshConfig
from jaxtune.runtime.devices.mesh import make_placement
from jaxtune.runtime.modeling import model as rt_model
from jaxtune.runtime.modeling.forward import _Parts, forward_logits, forward_token_nll
from tests.conftest import VOCAB, tiny_model

pytestmark = pytest.mark.rl
T = 0.7


@pytest.mark.parametrize("family, linear", [("llama", True), ("gemma2", False)])  # Gemma 2's logits are softcapped
def test_tempered_token_nll_is_the_log_softmax_of_logits_over_t(family, linear):
    import jax
    import jax.numpy as jnp
    from torchax import interop

    module = tiny_model(family, layers=2)
    assert _Parts(module).linear_in_hidden == linear
    model = rt_model.to_jax(module, make_placement(MeshConfig()))
    ids = np.random.default_rng(0).integers(3, VOCAB, (2, 16)).astype(np.int32)
    batch = {"input_ids": jnp.asarray(ids), "attention_mask": jnp.ones_like(jnp.asarray(ids))}
    labels = jnp.asarray(ids)
    with model.env:
        nll, _ = interop.jax_view(forward_token_nll(model, temperature=T))(model.weights, model.buffers, batch, labels)
        logits = interop.jax_view(forward_logits(model))(model.weights, model.buffers, batch)
        plain, _ = interop.jax_view(forward_token_nll(model))(model.weights, model.buffers, batch, labels)
    tempered = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32) / T, axis=-1)
    logp = np.asarray(jnp.take_along_axis(tempered, labels[:, 1:, None], -1)[..., 0])
    np.testing.assert_allclose(-np.asarray(nll), logp, rtol=0, atol=2e-5)
    assert np.abs(np.asarray(nll) - np.asarray(plain)).max() > 1e-3  # the temperature changes them
