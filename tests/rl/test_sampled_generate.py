"""Batched decoding with sampling, as GRPO draws its answers: reproducible from its key, and drawing
each token from the model's own tempered distribution."""

from __future__ import annotations

import numpy as np
import pytest

from jaxtune.config import MeshConfig
from jaxtune.runtime.decoding import decode
from jaxtune.runtime.decoding.sampling import Sampling
from jaxtune.runtime.devices.mesh import make_placement
from jaxtune.runtime.modeling import model as rt_model
from tests.conftest import PAD, tiny_model

pytestmark = pytest.mark.rl
PROMPT = [5, 9, 14, 3]


@pytest.fixture(scope="module")
def model():
    """A tiny Llama whose output head is scaled up, so its logits are nats apart (a random model's
    are within a few hundredths): distributions of different temperatures then differ clearly."""
    import torch

    module = tiny_model("llama", layers=2)
    with torch.no_grad():
        module.lm_head.weight.mul_(40.0)
    return rt_model.to_jax(module, make_placement(MeshConfig()))


def generate(model, rows: int, new: int, sampling: Sampling, seed: int | None):
    import jax

    ids, mask = decode.left_pad([PROMPT] * rows, PAD)
    key = None if seed is None else jax.random.key(seed)
    program = decode.make_generate(model, new, (), sampling)
    return np.asarray(program(model, model.weights, model.buffers, ids, mask, key))


def test_a_key_gives_the_same_answers_and_another_key_others(model):
    sampling = Sampling(temperature=2.0)
    first, again, other = (generate(model, 8, 6, sampling, seed) for seed in (3, 3, 4))
    np.testing.assert_array_equal(first, again)
    assert (first != other).any()
    assert len({tuple(row) for row in first}) > 4  # each row draws its own tokens
    greedy = generate(model, 8, 6, Sampling(), None)
    assert (greedy == greedy[0]).all()  # the same prompt greedily: one answer


def test_the_first_token_follows_the_tempered_top_k_distribution(model):
    """2,048 draws of the first token, against softmax(logits / T) over the top 4 logits of the
    model's own forward pass. The total variation distance of an empirical distribution of 2,048
    draws over 4 outcomes is about 0.02 by chance; a wrong temperature or top-k moves it past 0.1."""
    import jax.numpy as jnp
    from torchax import interop

    from jaxtune.runtime.modeling.forward import forward_logits

    sampling = Sampling(temperature=0.7, top_k=4)
    drawn = generate(model, 2048, 1, sampling, seed=0)[:, 0]
    logits_fn = forward_logits(model)
    batch = {"input_ids": jnp.asarray([PROMPT]), "attention_mask": jnp.ones((1, len(PROMPT)), jnp.int32)}
    with model.env:
        logits = np.asarray(interop.jax_view(logits_fn)(model.weights, model.buffers, batch))[0, -1].astype(np.float64)
    top = np.argsort(logits)[-4:]
    expected = np.exp((logits[top] - logits[top].max()) / 0.7)
    expected /= expected.sum()
    assert set(np.unique(drawn)) <= set(top.tolist())
    seen = np.asarray([(drawn == t).mean() for t in top])
    assert 0.5 * np.abs(seen - expected).sum() < 0.05, (seen, expected)  # measured: 0.006
    untempered = np.exp(logits[top] - logits[top].max())
    assert (
        0.5 * np.abs(seen - untempered / untempered.sum()).sum() > 0.1
    )  # temperature 1 would not pass (measured: 0.13)
