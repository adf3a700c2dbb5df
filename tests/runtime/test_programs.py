"""Programs shared by models of one structure: a second model of the same shape is computed by the
program the first traced, with its own tensors; any change of structure gets a program of its own;
a kept program keeps no model alive."""

from __future__ import annotations

import gc
import logging
import weakref

import jax
import numpy as np
import pytest

from jaxtune.config import LoraConfig, MeshConfig
from jaxtune.runtime.compiled import programs, steps
from jaxtune.runtime.devices.mesh import make_placement
from jaxtune.runtime.modeling import attention
from jaxtune.runtime.modeling import model as rt_model
from tests.conftest import VOCAB, tiny_model


@pytest.fixture(autouse=True)
def fresh_programs():
    programs.clear()
    yield
    programs.clear()


def lora(seed: int = 0, r: int = 4, alpha: int = 8, family: str = "llama"):
    module = rt_model.attach_lora(tiny_model(family, seed=seed), LoraConfig(r=r, alpha=alpha))
    return rt_model.to_jax(module, make_placement(MeshConfig()))


def batch():
    ids = np.random.default_rng(1).integers(3, VOCAB, (2, 24)).astype(np.int32)
    return {"input_ids": ids, "attention_mask": np.ones_like(ids)}, ids


def nll(model) -> np.ndarray:
    inputs, labels = batch()
    return np.asarray(steps.make_eval_step(model)(model.weights, model.buffers, inputs, labels)[0])


def test_a_model_of_the_same_structure_is_computed_by_the_first_ones_program_with_its_own_weights(caplog):
    first, second = lora(seed=0), lora(seed=1)
    assert steps.shared_eval_step(first) is steps.shared_eval_step(second)
    with jax.log_compiles(), caplog.at_level(logging.WARNING, logger="jax._src.interpreters.pxla"):
        first_nll = nll(first)
        compiled_for_first = sum("Compiling" in r.getMessage() for r in caplog.records)
        caplog.clear()
        second_nll = nll(second)
        assert sum("Compiling" in r.getMessage() for r in caplog.records) == 0, "the second model traced again"
    assert compiled_for_first >= 1
    assert not np.allclose(first_nll, second_nll), "the second model was computed with the first one's weights"
    programs.clear()
    np.testing.assert_array_equal(nll(second), second_nll)  # what its own, freshly traced program computes


@pytest.mark.parametrize("other", ["lora scale", "lora rank", "family", "frozen base", "attention core"])
def test_a_change_of_structure_gets_a_program_of_its_own(other):
    model = lora()
    changed = {
        "lora scale": lambda: lora(alpha=16),  # lora_alpha / r multiplies the adapter's output inside the trace
        "lora rank": lambda: lora(r=8),
        "family": lambda: lora(family="mistral"),
        "frozen base": lambda: rt_model.to_jax(tiny_model("llama").requires_grad_(True), make_placement(MeshConfig())),
    }
    if other == "attention core":
        outside = steps.shared_eval_step(model)
        with attention.choose("splash-interpret"):  # a step traced here runs another core
            assert steps.shared_eval_step(model) is not outside
    else:
        assert steps.shared_eval_step(changed[other]()) is not steps.shared_eval_step(model)
    assert steps.shared_eval_step(lora(seed=5)) is steps.shared_eval_step(model)


def test_a_kept_program_keeps_no_model_alive():
    model = lora()
    nll(model)
    program, gone = steps.shared_eval_step(model), weakref.ref(model)
    del model
    gc.collect()
    assert gone() is None, "the kept program holds its model (and every tensor of it)"
    with pytest.raises(RuntimeError, match="no live model"):
        program.ref.module
    assert nll(lora(seed=2)).shape == (2,)  # the next model of that structure is served by it
    assert len(programs._kept) == 1


def test_at_most_max_kept_programs_are_kept_the_least_recently_used_first_out(monkeypatch):
    monkeypatch.setattr(programs, "MAX_KEPT", 2)
    a, b, c = lora(r=2), lora(r=4), lora(r=8)
    first = steps.shared_eval_step(a)
    steps.shared_eval_step(b)
    assert steps.shared_eval_step(a) is first  # used again: now the most recent
    steps.shared_eval_step(c)  # b goes
    assert steps.shared_eval_step(a) is first
    assert len(programs._kept) == 2
