"""GRPO's loop on a tiny LoRA Llama: it samples, scores and updates, and the reward rises.

The reward is the share of an answer's tokens that are even ids: a random model scores about
0.5, every answer scores differently (so every group teaches), and LoRA can raise it quickly.
"""

from __future__ import annotations

import numpy as np
import pytest

from jaxtune.config import LoraConfig, MeshConfig, RLConfig, TrainConfig
from jaxtune.runtime.devices.mesh import make_placement
from jaxtune.runtime.modeling import model as rt_model
from jaxtune.runtime.train import rollouts
from tests.conftest import EOS, PAD, VOCAB, tiny_model

pytestmark = pytest.mark.rl


def lora_model(placement=None):
    """A tiny Llama with LoRA on every linear layer (on `placement`, default one device). A random
    model's logits are within a few hundredths of each other whatever its hidden state, which LoRA
    cannot change; its output head is scaled up so they are nats apart, as a trained model's are."""
    import torch

    base = tiny_model("llama", layers=2)
    with torch.no_grad():
        base.lm_head.weight.mul_(20.0)
    module = rt_model.attach_lora(base, LoraConfig(r=8, alpha=16, target_modules="all-linear"))
    return rt_model.to_jax(module, placement or make_placement(MeshConfig()))


def even_share(rows: np.ndarray, answers: list[list[int]]) -> np.ndarray:
    return np.asarray([[np.mean([t % 2 == 0 for t in a]) if a else 0.0] for a in answers], np.float32)


PROMPTS = [np.random.default_rng(i).integers(3, VOCAB, 5 + i % 3).tolist() for i in range(12)]


def test_prompts_of_a_rollout_walk_seeded_epochs():
    seen = np.concatenate([rollouts.prompts_of_rollout(10, 4, seed=3, rollout=r) for r in range(5)])
    assert sorted(seen[:10].tolist()) == list(range(10))  # the first epoch: every prompt once
    assert sorted(seen[10:20].tolist()) == list(range(10))  # the second, another order
    assert seen[:10].tolist() != seen[10:20].tolist()
    np.testing.assert_array_equal(rollouts.prompts_of_rollout(10, 4, 3, 2), seen[8:12])  # spans epochs 0 and 1


def test_answers_keep_their_first_end_token_and_report_truncation():
    tokens = np.asarray([[5, EOS, 7, EOS], [5, 6, 7, 8], [EOS, EOS, EOS, EOS]])
    answers, truncated = rollouts.cut_answers(tokens, [EOS])
    assert answers == [[5, EOS], [5, 6, 7, 8], [EOS]]
    assert truncated.tolist() == [False, True, False]


def test_the_reward_rises_and_every_figure_is_logged():
    model = lora_model()
    cfg = TrainConfig(
        max_steps=16,
        batch_size=16,
        learning_rate=1e-2,
        warmup_steps=0,
        lr_schedule="constant",
        weight_decay=0.0,
        log_every=1,
    )
    rl = RLConfig(num_generations=4, max_completion_length=8, beta=0.02, num_iterations=2, loss_type="dapo")
    log: list[dict] = []
    result = rollouts.train_grpo(
        model, PROMPTS, even_share, ["even"], cfg, rl, PAD, [EOS], on_log=log.extend, check_memory=True
    )
    (plan,) = [r for r in log if "memory_plan" in r]  # the step was planned with its advantages, reference and old
    assert plan["memory_plan"]["shape"] == {"micro_batches": 1, "rows_per_device": 16, "length": 32}
    assert plan["memory_plan"]["activations_per_micro_batch"] > 0
    records = [r for r in log if "loss" in r]
    assert [r["step"] for r in records] == list(range(1, 17))
    assert 0.3 < records[0]["reward"] < 0.7  # a random model: about half its tokens are even
    assert result.summary.reward_last_quarter > 0.8, [r["reward"] for r in records]
    for r in records:
        assert r["reward"] == r["reward/even"]
        assert 0 < r["completion_length"] <= 8 and 0 <= r["truncated"] <= 1
        assert r["kl"] >= 0 and 0 <= r["clip_fraction"] <= 1
    assert records[0]["kl"] == pytest.approx(0.0, abs=1e-6)  # the adapters start at B = 0: the policy is the reference
    assert records[-1]["kl"] > 1e-4  # and moves away from it
    assert all(r["clip_fraction"] == 0.0 for r in records[0::2])  # a rollout's first step is on-policy
    assert result.summary.answers_per_step == 16 and result.summary.prompts_per_rollout == 4


def test_a_full_fine_tunes_reference_is_its_starting_weights():
    """Every weight trains, so the reference is a copy of the starting ones: the KL starts at 0 and
    grows as the weights leave them, and the starting weights are still what the model holds."""
    import torch

    base = tiny_model("llama", layers=2)
    with torch.no_grad():
        base.lm_head.weight.mul_(20.0)
    model = rt_model.to_jax(base, make_placement(MeshConfig()))
    start = {name: np.asarray(value) for name, value in model.weights.items()}
    cfg = TrainConfig(
        method="full",
        max_steps=4,
        batch_size=8,
        learning_rate=1e-3,
        warmup_steps=0,
        lr_schedule="constant",
        weight_decay=0.0,
    )
    rl = RLConfig(num_generations=4, max_completion_length=6, beta=0.1)
    log: list[dict] = []
    result = rollouts.train_grpo(
        model, PROMPTS, even_share, ["even"], cfg, rl, PAD, [EOS], on_log=log.extend, check_memory=False
    )
    kl = [r["kl"] for r in log if "loss" in r]
    assert kl[0] == pytest.approx(0.0, abs=1e-7) and kl[-1] > 1e-4, kl
    changed = [name for name in start if not np.array_equal(start[name], result.weights[name])]
    assert len(changed) == len(start)  # every weight trained


def test_a_resumed_run_samples_and_trains_as_an_uninterrupted_one(tmp_path):
    """Killed after its step-2 checkpoint, a run started again resumes there: it samples step 3's
    answers from the same key with the same weights, so it ends with the same weights and log."""
    cfg = TrainConfig(
        max_steps=4, batch_size=8, learning_rate=1e-2, warmup_steps=0, lr_schedule="constant", checkpoint_every=2
    )
    rl = RLConfig(num_generations=4, max_completion_length=6)
    whole: list[dict] = []
    uninterrupted = rollouts.train_grpo(
        lora_model(),
        PROMPTS,
        even_share,
        ["even"],
        cfg,
        rl,
        PAD,
        [EOS],
        on_log=whole.extend,
        checkpoint_dir=tmp_path,
        check_memory=False,
    )
    assert [p.name for p in tmp_path.glob("step-*")] == ["step-00000002"]  # what a kill after step 2 leaves
    again: list[dict] = []
    resumed = rollouts.train_grpo(
        lora_model(),
        PROMPTS,
        even_share,
        ["even"],
        cfg,
        rl,
        PAD,
        [EOS],
        on_log=again.extend,
        checkpoint_dir=tmp_path,
        check_memory=False,
    )
    assert resumed.summary.resumed_from == 2
    steps_of = lambda log: [(r["step"], r["reward"], r["loss"]) for r in log if "loss" in r]  # noqa: E731
    assert steps_of(again) == steps_of(whole)
    for name, value in uninterrupted.weights.items():
        np.testing.assert_allclose(resumed.weights[name], value, rtol=0, atol=1e-6, err_msg=name)
