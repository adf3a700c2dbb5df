"""The preference train step: packed and padded pairs score exactly as each row alone, and the losses' fixed points."""

from __future__ import annotations

import math

import jax
import numpy as np
import pytest

from jaxtune.config import LoraConfig, MeshConfig, PreferenceConfig, TrainConfig
from jaxtune.runtime.compiled import preference, steps
from jaxtune.runtime.decoding.inference import pair_summary, row_nll
from jaxtune.runtime.devices.mesh import make_placement
from jaxtune.runtime.modeling import model as rt_model
from jaxtune.runtime.train.feed import make_feed
from tests.conftest import PAD, VOCAB, tiny_model

pytestmark = pytest.mark.preference
IGNORE = -100


@pytest.fixture(scope="module")
def model():
    """LoRA on every linear layer, B drawn at random so that the policy is not the base model."""
    import torch

    module = rt_model.attach_lora(tiny_model("llama", layers=2), LoraConfig(r=4, target_modules="all-linear"))
    with torch.no_grad():
        for name, param in module.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.05)
    return rt_model.to_jax(module, make_placement(MeshConfig()))


def pair_rows(pairs: int, seed: int = 0) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Rows 2p (chosen) and 2p+1 (rejected): one random prompt, then answers of different lengths, labelled alone."""
    rng = np.random.default_rng(seed)
    ids, labels = [], []
    for _ in range(pairs):
        prompt = rng.integers(3, VOCAB, rng.integers(4, 12))
        for _ in range(2):
            answer = rng.integers(3, VOCAB, rng.integers(2, 14))
            row = np.concatenate([prompt, answer]).astype(np.int32)
            ids.append(row)
            labels.append(np.where(np.arange(len(row)) < len(prompt), IGNORE, row).astype(np.int32))
    return ids, labels


def summed(model, objective, batch):
    """The train step's (summed loss, pairs) of one micro-batch, without the update."""
    fn = jax.jit(steps._summed_loss(model, training=False, spec=steps.StepSpec(objective=objective)))
    labels = batch.pop("labels")
    total, count = fn(model.weights, model.buffers, batch, labels, jax.random.PRNGKey(0))
    return float(total), int(count)


OBJECTIVES = [
    preference.Objective("dpo", PreferenceConfig(beta=0.5)),
    preference.Objective("dpo", PreferenceConfig(beta=0.5, loss_type="robust", label_smoothing=0.2)),
    preference.Objective("dpo", PreferenceConfig(beta=0.5, loss_type="ipo")),
    preference.Objective("simpo", PreferenceConfig(beta=2.0, simpo_gamma=0.3, label_smoothing=0.1)),
]


@pytest.mark.parametrize("objective", OBJECTIVES, ids=["sigmoid", "robust", "ipo", "simpo"])
@pytest.mark.parametrize("packed", [True, False], ids=["packed", "padded"])
def test_a_micro_batch_of_pairs_scores_as_each_row_alone(model, objective, packed):
    """The step's loss over a packed or padded micro-batch equals the objective of per-row log-probabilities,
    each row computed alone by the eval step, against arbitrary reference values."""
    ids, labels = pair_rows(6)
    nll, tokens = row_nll(model, ids, labels, batch_size=1, pad_id=PAD, progress=False)  # one row per batch
    reference = np.random.default_rng(1).normal(-30, 5, len(ids)).astype(np.float32)
    expected = pair_summary(objective, -nll, tokens, reference, ["c"] * len(ids))["loss"]

    cfg = TrainConfig(batch_size=6, max_steps=1)
    feed = make_feed([len(r) for r in ids], cfg, 64, batch_shards=1, packed=packed, pairs=True)
    batch = next(feed.micro_batches(ids, labels, PAD, reference))
    if packed:  # every pair in one micro-batch, several to a sequence
        assert batch["input_ids"].shape[0] < 12 and feed.segments >= 4
    total, count = summed(model, objective, batch)
    assert count == 6
    assert total / count == pytest.approx(expected, rel=2e-5, abs=1e-6)


@pytest.mark.parametrize("loss_type", ["sigmoid", "robust"])
def test_with_the_reference_equal_to_the_policy_every_pair_loses_ln_2(model, loss_type):
    ids, labels = pair_rows(5, seed=2)
    nll, tokens = row_nll(model, ids, labels, batch_size=4, pad_id=PAD, progress=False)
    objective = preference.Objective(
        "dpo", PreferenceConfig(beta=0.1, loss_type=loss_type, label_smoothing=0.3 if loss_type == "robust" else 0.0)
    )
    feed = make_feed([len(r) for r in ids], TrainConfig(batch_size=5, max_steps=1), 64, 1, packed=True, pairs=True)
    total, count = summed(model, objective, next(feed.micro_batches(ids, labels, PAD, -nll)))
    assert count == 5 and total / count == pytest.approx(math.log(2), abs=2e-6)
    metrics = pair_summary(objective, -nll, tokens, -nll, ["c"] * len(ids))
    assert (metrics["accuracy"], metrics["margin"]) == (0.5, 0.0)  # every reward 0: ties count half
    assert metrics["loss"] == pytest.approx(math.log(2), abs=1e-7)


def test_accuracy_counts_pairs_whose_chosen_reward_is_higher():
    objective = preference.Objective("dpo", PreferenceConfig(beta=1.0))
    logp = np.array([-1.0, -3.0, -5.0, -2.0, -4.0, -4.0])  # pair 0 chosen wins, pair 1 loses, pair 2 ties
    metrics = pair_summary(objective, logp, np.ones(6), np.zeros(6), ["a", "a", "b", "b", "b", "b"])
    assert metrics["accuracy"] == pytest.approx(0.5) and metrics["pairs"] == 3
    assert metrics["margin"] == pytest.approx((2.0 - 3.0 + 0.0) / 3)
    assert metrics["per_category"]["a"]["accuracy"] == 1.0 and metrics["per_category"]["b"]["accuracy"] == 0.25


def test_the_sft_term_adds_the_chosen_answers_mean_nll_and_is_reported_apart():
    logp = np.array([-2.0, -3.0, -9.0, -1.0])  # chosen answers of 4 and 3 tokens: mean NLL 0.5 and 3.0
    tokens = np.array([4, 5, 3, 2])
    plain = pair_summary(preference.Objective("dpo", PreferenceConfig(beta=0.1)), logp, tokens, logp, ["c"] * 4)
    rpo = pair_summary(
        preference.Objective("dpo", PreferenceConfig(beta=0.1, sft_weight=0.4)), logp, tokens, logp, ["c"] * 4
    )
    # Policy = reference: the DPO term is ln 2, and the SFT term, the chosen NLL less the reference's, 0.
    assert plain["preference_loss"] == plain["loss"] == pytest.approx(math.log(2), abs=1e-7)
    assert rpo["preference_loss"] == rpo["loss"] == pytest.approx(math.log(2), abs=1e-7)
    assert rpo["chosen_nll"] == plain["chosen_nll"] == pytest.approx(1.75)
    # The policy's chosen answers 1 and 2 nats less likely than the reference's: + 0.4 x (1/4 + 2/3) / 2.
    moved = logp - np.array([1.0, 0.0, 2.0, 0.0])
    rpo = pair_summary(
        preference.Objective("dpo", PreferenceConfig(beta=0.1, sft_weight=0.4)), moved, tokens, logp, ["c"] * 4
    )
    assert rpo["loss"] - rpo["preference_loss"] == pytest.approx(0.4 * (1 / 4 + 2 / 3) / 2, abs=1e-6)
