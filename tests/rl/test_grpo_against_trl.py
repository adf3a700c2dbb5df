"""jaxtune's GRPO objective against TRL 1.16's `GRPOTrainer`, the implementation it follows.

One tiny Llama with LoRA on every linear layer (B drawn at random, so the policy is not the base)
is converted to JAX for jaxtune, and an identical PyTorch copy goes to TRL's trainer. Both score
the same prompts and answers (left-padded prompts and right-padded answers for TRL, as its
generation leaves them; one right-padded row per answer for jaxtune):

- the reference: TRL's log-probabilities under PEFT's `disable_adapter`, jaxtune's with the
  adapters' B zeroed (`model.adapters_off`);
- the loss and its LoRA gradients: TRL's `_compute_loss` (its own forward, its own masking and
  averaging for each loss_type) and backward, against jaxtune's train-step loss
  (`steps._summed_loss` with the grpo objective, over its count) and `jax.grad` of it;
- the advantages: TRL's grouping and `nanstd`, against `grpo.advantages`.

Both sides compute in float32 and add in different orders, so they agree to a few units in the
last place; each tolerance says why.
"""

from __future__ import annotations

import copy

import jax
import numpy as np
import pytest

from jaxtune.config import RLConfig
from jaxtune.runtime.compiled import grpo, preference, steps
from jaxtune.runtime.modeling import model as rt_model
from tests.conftest import EOS, PAD, VOCAB

# The preference tests' helpers; their fixtures (the tiny LoRA Llama, its JAX copy and their
# word-level tokenizer) come from tests/rl/conftest.py.
from tests.preference.test_against_trl import assert_same_gradients, torch_grads, trl_args

pytestmark = [
    pytest.mark.rl,
    pytest.mark.filterwarnings("ignore:`(is_)?gradient_checkpointing` is deprecated:FutureWarning"),
]

GROUPS, GENERATIONS, ANSWER = 2, 3, 9  # prompts, answers per prompt, TRL's padded answer length
LENGTH = 32  # jaxtune's row length
# A token's log-probability is about -5.5: float32's spacing there is 4.8e-7, and the two sides'
# log-softmax sums add a few units (measured: 9.5e-7).
LOGP_ATOL = 1e-5
# The mean of O(1) token losses: a few units in the last place, relative (measured: equal to the
# last digit). The LoRA gradients are held to the preference tests' bound, 1e-4 of each tensor's
# largest entry (measured: 2.7e-6).
LOSS_RTOL = 1e-5


@pytest.fixture(scope="module")
def rollout():
    """Prompts (each repeated for its group) and answers: of different lengths, some ending in EOS,
    one cut off at ANSWER tokens, one a single token."""
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, VOCAB, rng.integers(3, 9)).tolist() for _ in range(GROUPS)]
    lengths = [4, ANSWER, 1, 6, 2, 7]
    answers = []
    for i, n in enumerate(lengths):
        answer = rng.integers(3, VOCAB, n).tolist()
        if i % 2 == 0:
            answer[-1] = EOS
        answers.append(answer)
    return [p for p in prompts for _ in range(GENERATIONS)], answers


def trl_inputs(rollout):
    """`_compute_loss`'s inputs as TRL's `_generate_and_score_completions` leaves them."""
    import torch

    prompts, answers = rollout
    width = max(map(len, prompts))
    prompt_ids = torch.full((len(prompts), width), PAD)
    prompt_mask = torch.zeros((len(prompts), width), dtype=torch.long)
    completion_ids = torch.full((len(answers), ANSWER), PAD)
    completion_mask = torch.zeros((len(answers), ANSWER), dtype=torch.long)
    for row, (p, a) in enumerate(zip(prompts, answers)):
        prompt_ids[row, width - len(p) :], prompt_mask[row, width - len(p) :] = torch.tensor(p), 1
        completion_ids[row, : len(a)], completion_mask[row, : len(a)] = torch.tensor(a), 1
    return {
        "prompt_ids": prompt_ids,
        "prompt_mask": prompt_mask,
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
    }


def trl_trainer(lora_module, tokenizer, tmp_path, rl: RLConfig):
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    args = trl_args(
        GRPOConfig,
        tmp_path,
        num_generations=GENERATIONS,
        per_device_train_batch_size=GROUPS * GENERATIONS,
        max_completion_length=rl.max_completion_length,
        beta=rl.beta,
        epsilon=rl.epsilon,
        epsilon_high=rl.epsilon_high,
        loss_type=rl.loss_type,
        scale_rewards=rl.scale_rewards,
        num_iterations=rl.num_iterations,
        use_bias_correction_kl=rl.use_bias_correction_kl,
        temperature=rl.temperature,
    )
    trainer = GRPOTrainer(
        model=copy.deepcopy(lora_module),
        reward_funcs=[lambda completions, **_: [0.0] * len(completions)],
        args=args,
        train_dataset=Dataset.from_dict({"prompt": ["t5"] * GROUPS}),
        processing_class=tokenizer,
    )
    trainer.current_gradient_accumulation_steps = 1  # what its training loop sets: one micro-batch a step
    return trainer


def trl_logps(trainer, inputs, adapters: bool = True) -> np.ndarray:
    """TRL's per-token log-probabilities of the answers (B, ANSWER), the adapters on or off."""
    import contextlib

    import torch

    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    off = trainer.model.disable_adapter() if not adapters else contextlib.nullcontext()
    with torch.no_grad(), off:
        logps = trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, ANSWER)[0]
    return logps.numpy()


def jaxtune_rows(rollout):
    prompts, answers = rollout
    batch = grpo.answer_batch(prompts, answers, PAD, LENGTH)
    return batch, np.asarray([len(p) for p in prompts])


def jaxtune_logps(model, rollout, weights=None) -> np.ndarray:
    batch, prompt_lengths = jaxtune_rows(rollout)
    labels = batch.pop("labels")
    logp = steps.make_token_logp_step(model)(
        model.weights if weights is None else weights, model.buffers, batch, labels
    )
    return on_answer_axis(np.asarray(logp), prompt_lengths, ANSWER)


def on_token_axis(values: np.ndarray, prompt_lengths: np.ndarray, length: int) -> np.ndarray:
    """TRL's layout to jaxtune's: (S, C) values of each answer's tokens -> (S, length - 1), where the
    step's per-token NLL has them: answer token j of a row whose prompt has P tokens is token P + j,
    scored at P + j - 1."""
    values = np.asarray(values, np.float32)
    out = np.zeros((values.shape[0], length - 1), np.float32)
    for row, (p, v) in enumerate(zip(prompt_lengths, values)):
        n = min(len(v), length - p)
        out[row, p - 1 : p - 1 + n] = v[:n]
    return out


def on_answer_axis(values: np.ndarray, prompt_lengths: np.ndarray, answer_length: int) -> np.ndarray:
    """The inverse of `on_token_axis`: (S, length - 1) per-token values -> (S, answer_length)."""
    values = np.asarray(values)
    out = np.zeros((values.shape[0], answer_length), values.dtype)
    for row, (p, v) in enumerate(zip(prompt_lengths, values)):
        n = min(answer_length, len(v) - (p - 1))
        out[row, :n] = v[p - 1 : p - 1 + n]
    return out


def test_answer_rows_put_each_answer_token_where_the_step_scores_it(rollout):
    batch, prompt_lengths = jaxtune_rows(rollout)
    values = np.arange(1, len(rollout[1]) * ANSWER + 1, dtype=np.float32).reshape(-1, ANSWER)
    placed = on_token_axis(values, prompt_lengths, LENGTH)
    scored = batch["labels"][:, 1:] != -100
    for row, (p, a) in enumerate(zip(*rollout)):
        # Entry i scores token i + 1: the answer's tokens are scored from the prompt's last position.
        assert np.flatnonzero(scored[row]).tolist() == list(range(len(p) - 1, len(p) - 1 + len(a)))
        assert batch["input_ids"][row, len(p) : len(p) + len(a)].tolist() == a
    np.testing.assert_array_equal(on_answer_axis(placed, prompt_lengths, ANSWER), values)


def test_the_reference_is_the_base_as_peft_disable_adapter_gives_it(
    lora_module, jax_model, tokenizer, rollout, tmp_path
):
    trainer = trl_trainer(lora_module, tokenizer, tmp_path, RLConfig(beta=0.1))
    inputs = trl_inputs(rollout)
    mask = inputs["completion_mask"].numpy().astype(bool)
    ours_on, ours_off = (
        jaxtune_logps(jax_model, rollout),
        jaxtune_logps(jax_model, rollout, rt_model.adapters_off(jax_model.weights)),
    )
    theirs_on, theirs_off = trl_logps(trainer, inputs), trl_logps(trainer, inputs, adapters=False)
    np.testing.assert_allclose(ours_on[mask], theirs_on[mask], rtol=0, atol=LOGP_ATOL)
    np.testing.assert_allclose(ours_off[mask], theirs_off[mask], rtol=0, atol=LOGP_ATOL)
    assert np.abs(theirs_on - theirs_off)[mask].mean() > 0.01  # the adapters matter: this tells them apart


def test_advantages_are_trls_group_relative_ones():
    import torch
    from trl.trainer.utils import nanstd

    rewards = np.asarray([1.0, 0.0, 0.5, 2.0, 2.0, 2.0, 0.0, 1.0, 3.0], np.float32)
    r = torch.tensor(rewards)
    mean = r.view(-1, 3).mean(1).repeat_interleave(3)
    group_std = nanstd(r.view(-1, 3), dim=1).repeat_interleave(3)
    expected = {"group": (r - mean) / (group_std + 1e-4), "batch": (r - mean) / (nanstd(r) + 1e-4), "none": r - mean}
    for scale, theirs in expected.items():
        np.testing.assert_allclose(
            grpo.advantages(rewards, 3, scale), theirs.numpy(), rtol=1e-6, atol=1e-6, err_msg=scale
        )
    assert grpo.advantages(rewards, 3, "group")[3:6].tolist() == [0.0, 0.0, 0.0]  # a group scored alike teaches nothing


CASES = {
    "grpo": RLConfig(loss_type="grpo", max_completion_length=ANSWER),
    "dr_grpo-kl": RLConfig(loss_type="dr_grpo", beta=0.2, max_completion_length=ANSWER),
    # Log-probabilities of softmax(logits / T), as TRL scores the answers it sampled at T.
    "grpo-tempered-kl": RLConfig(loss_type="grpo", temperature=0.7, beta=0.1, max_completion_length=ANSWER),
    "bnpo-plain-kl": RLConfig(loss_type="bnpo", beta=0.05, use_bias_correction_kl=False, max_completion_length=ANSWER),
    "dapo-clipped": RLConfig(
        loss_type="dapo", num_iterations=2, epsilon=0.1, epsilon_high=0.3, max_completion_length=ANSWER
    ),
}


@pytest.mark.parametrize("rl", CASES.values(), ids=CASES.keys())
def test_loss_and_lora_gradients_match_trls(lora_module, jax_model, tokenizer, rollout, tmp_path, rl):
    """Advantages of both signs; with num_iterations 2 the answers' sampling policy is a stand-in a
    few tenths of a nat from the policy per token, so the clip holds some tokens on each side."""
    import torch

    trainer = trl_trainer(lora_module, tokenizer, tmp_path, rl)
    inputs = trl_inputs(rollout)
    mask = inputs["completion_mask"].numpy().astype(bool)
    rng = np.random.default_rng(1)
    advantages = grpo.advantages(rng.normal(size=GROUPS * GENERATIONS), GENERATIONS, rl.scale_rewards)
    inputs["advantages"] = torch.tensor(advantages)
    policy = trl_logps(trainer, inputs)
    extra: dict[str, np.ndarray] = {}
    if rl.beta:
        extra["reference"] = trl_logps(trainer, inputs, adapters=False)
        inputs["ref_per_token_logps"] = torch.tensor(extra["reference"])
    if rl.num_iterations > 1:
        extra["old"] = (policy + rng.normal(0, 0.3, policy.shape) * mask).astype(np.float32)
        inputs["old_per_token_logps"] = torch.tensor(extra["old"])
        ratio = np.exp(policy - extra["old"])
        held = grpo.clip_fraction(rl, ratio, advantages, mask)
        assert 0.1 < held < 0.9
    inputs["num_items_in_batch"] = torch.tensor(float(mask.sum()))
    trainer.model.train()
    trl_loss = trainer._compute_loss(trainer.model, inputs)
    trl_loss.backward()

    batch, prompt_lengths = jaxtune_rows(rollout)
    labels = batch.pop("labels")
    batch["advantages"] = advantages
    for name, values in extra.items():
        batch[name] = on_token_axis(values, prompt_lengths, LENGTH)
    objective = preference.objective_of("grpo", None, rl)
    summed = steps._summed_loss(jax_model, training=True, spec=steps.StepSpec(objective=objective))

    def mean_loss(weights, batch, labels):
        total, count = summed(weights, jax_model.buffers, batch, labels, jax.random.PRNGKey(0))
        return total / count

    loss, grads = jax.jit(jax.value_and_grad(mean_loss))(jax_model.weights, batch, labels)
    # grpo's loss without a KL term is the advantages' mean, 0 in each group: its value says nothing there.
    assert float(loss) == pytest.approx(trl_loss.item(), rel=LOSS_RTOL, abs=1e-7)
    assert_same_gradients({k: np.asarray(v) for k, v in grads.items()}, torch_grads(trainer.model))
