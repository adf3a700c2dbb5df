"""A tiny Gemma 3 (sliding and global layers, grouped-query attention) and a padded batch, run
through one attention core or another: what the Pallas kernels' whole-path tests compare."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np


def tiny_gemma_and_batch():
    """(model, batch, labels): two rows of 128 tokens, the second padded from token 90."""
    from jaxtune.config import MeshConfig
    from jaxtune.runtime.devices.mesh import make_placement
    from jaxtune.runtime.modeling.model import to_jax
    from tests.conftest import tiny_model

    model = to_jax(tiny_model("gemma3", layers=2, sliding_window=16), make_placement(MeshConfig()))
    rng = np.random.default_rng(1)
    ids = rng.integers(3, 256, (2, 128)).astype(np.int32)
    mask = np.ones_like(ids)
    mask[1, 90:] = 0
    labels = np.where(mask == 1, ids, -100).astype(np.int32)
    return model, {"input_ids": ids, "attention_mask": mask}, labels


def loss_and_gradients(model, batch, labels, core: str):
    """The loss and every weight's gradient with attention's core `core` ("xla", "splash-interpret", …)."""
    from jaxtune.runtime.compiled import steps
    from jaxtune.runtime.modeling import attention

    with attention.choose(core):
        return steps.make_loss_and_grad(model)(model.weights, model.buffers, batch, labels)


def worst_gradient_gap(grads: dict, reference: dict) -> float:
    """The largest relative difference, in norm, of one weight's gradient from the reference's."""
    return max(float(jnp.linalg.norm(grads[key] - want) / jnp.linalg.norm(want)) for key, want in reference.items())
