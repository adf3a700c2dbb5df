"""jaxtune's preference losses against TRL 1.16's, the independent implementation they follow.

One tiny Llama with LoRA on every linear layer (B drawn at random, so the policy is not the base)
is converted to JAX for jaxtune, and an identical PyTorch copy of it goes to TRL's own trainers,
which run their own code on it, forward pass included:

- DPO (sigmoid, robust, IPO): `trl.DPOTrainer.compute_loss` (its `_compute_loss`), the reference
  log-probabilities given in the batch as `precompute_ref_log_probs=True` has it do. TRL computes
  the policy's log-probabilities through the model forward it patches with `add_fused_lm_head`,
  whose chunked log-softmax is plain PyTorch (no Liger or Triton kernel is involved on the CPU).
  Its batch loss and LoRA gradients (backward) are compared with jaxtune's train step
  (`steps._summed_loss` over packed pairs, divided by its pair count) and `jax.grad` of it; its
  loss, rewards and log-probabilities per pair (one-pair batches, since TRL logs only batch
  means) with `preference.pair_metrics` on jaxtune's eval-step log-probabilities.
- SimPO: `trl.experimental.cpo.CPOTrainer` with loss_type='simpo' and cpo_alpha=0, through its
  collator, `concatenated_forward` (`get_batch_logps(average_log_prob=True)` on the logits),
  `cpo_loss` (per pair) and `compute_loss` (the batch loss, backpropagated).
- Step 0: TRL precomputes the reference over its own dataset of the same pairs (its tokenisation,
  collator and `compute_ref_log_probs`, through a frozen copy of the policy's adapter); with the
  reference equal to the policy, TRL and jaxtune lose ln 2 on every pair, and TRL's reference
  log-probabilities are those of jaxtune's reference stage (the eval step).

Both sides compute in float32 and add the same terms in different orders (XLA's fused, chunked
log-softmax and einsums; PyTorch's matmuls and its own chunked log-softmax), so they agree to a
few units in float32's last place; each tolerance says why it is what it is, next to the largest
difference measured here.
"""

from __future__ import annotations

import copy
import math

import jax
import numpy as np
import pytest

from jaxtune.config import LoraConfig, MeshConfig, PreferenceConfig, TrainConfig
from jaxtune.runtime.compiled import preference, steps
from jaxtune.runtime.decoding.inference import row_nll
from jaxtune.runtime.devices.mesh import make_placement
from jaxtune.runtime.modeling import model as rt_model
from jaxtune.runtime.train.feed import make_feed
from tests.conftest import EOS, PAD, VOCAB, tiny_model

pytestmark = [
    pytest.mark.preference,
    # transformers 5 renamed gradient checkpointing to activation checkpointing; TRL 1.16's configs (and
    # the models' forward) still use the old names.
    pytest.mark.filterwarnings("ignore:`(is_)?gradient_checkpointing` is deprecated:FutureWarning"),
]
IGNORE = -100
PAIRS = 4

# A summed answer log-probability: up to 14 tokens of about -5.5 each, so |value| < 128, where
# float32's spacing is 7.6e-6: about 4 units in the last place (measured: 7.6e-6).
LOGP_ATOL = 3e-5
# A pair's loss moves by at most about its log-probabilities' error: |d loss / d logp| is at most
# beta / (1 - 2 label_smoothing) = 0.83 for sigmoid and robust here, 2 |delta - 1/(2 beta)| / tokens
# < 2 for IPO, beta / tokens < 1 for SimPO (answers of 3 tokens or more) (measured: 3.5e-6).
PAIR_LOSS_ATOL = 3e-5
# The batch mean of those (measured: 5.4e-7 relative).
LOSS_RTOL = 1e-5
# Each LoRA gradient, elementwise, against its tensor's largest entry: the backward pass sums
# thousands of float32 products in different orders, and a tensor's small entries carry the
# rounding of its large ones (measured: 3.3e-6). A wrong factor or a missing term is off by O(1).
GRAD_ATOL = 1e-4


@pytest.fixture(scope="module")
def lora_module():
    """The PyTorch PEFT model both sides start from; each user takes a deep copy (TRL adds a
    reference adapter to the model it is given and patches its forward)."""
    import torch

    module = rt_model.attach_lora(tiny_model("llama", layers=2), LoraConfig(r=4, target_modules="all-linear"))
    with torch.no_grad():
        for name, param in module.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.05)
    return module


@pytest.fixture(scope="module")
def jax_model(lora_module):
    return rt_model.to_jax(copy.deepcopy(lora_module), make_placement(MeshConfig()))


# Token names: the special ones are not prefixes of the others (a tokenizer finds special tokens
# inside words before it splits them).
NAMES = ["<pad>", "<eos>", "<bos>", "<unk>"] + [f"t{i}" for i in range(4, VOCAB)]
assert (NAMES[PAD], NAMES[EOS]) == ("<pad>", "<eos>")


@pytest.fixture(scope="module")
def tokenizer():
    """Word-level over `NAMES`: a text of space-separated names tokenises to exactly their ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel({name: i for i, name in enumerate(NAMES)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>", unk_token="<unk>"
    )


@pytest.fixture(scope="module")
def pairs() -> list[tuple[list[int], list[int], list[int]]]:
    """(prompt, chosen, rejected) token ids: answers of different lengths, each ending with EOS."""
    rng = np.random.default_rng(0)
    out = []
    for _ in range(PAIRS):
        prompt = rng.integers(3, VOCAB, rng.integers(4, 12)).tolist()
        chosen, rejected = (rng.integers(3, VOCAB, rng.integers(2, 14)).tolist() + [EOS] for _ in range(2))
        out.append((prompt, chosen, rejected))
    return out


def rows(pairs):
    """jaxtune's rows: 2p the prompt and chosen answer, 2p+1 the prompt and rejected one, prompts unscored."""
    ids, labels = [], []
    for prompt, chosen, rejected in pairs:
        for answer in (chosen, rejected):
            row = np.asarray(prompt + answer, np.int32)
            ids.append(row)
            labels.append(np.where(np.arange(len(row)) < len(prompt), IGNORE, row).astype(np.int32))
    return ids, labels


def per_pair(values) -> tuple[np.ndarray, np.ndarray]:
    values = np.asarray(values)
    return values[0::2], values[1::2]


def jaxtune_logps(model, ids, labels) -> tuple[np.ndarray, np.ndarray]:
    """Each row's summed answer log-probability (float32) and answer tokens, from jaxtune's eval step
    (what its reference stage and pair evals compute)."""
    nll, tokens = row_nll(model, ids, labels, batch_size=2 * PAIRS, pad_id=PAD, progress=False)
    return (-nll).astype(np.float32), tokens


def jaxtune_pair_metrics(objective, logp, tokens, reference) -> dict[str, np.ndarray]:
    import jax.numpy as jnp

    def logps(values):
        return preference.PairLogps(*(jnp.asarray(v, jnp.float32) for v in (*per_pair(values), *per_pair(tokens))))

    ref = None if reference is None else logps(reference)
    metrics = preference.pair_metrics(objective.name, objective.preference, logps(logp), ref)
    return {k: np.asarray(v, np.float64) for k, v in metrics.items()}


def jaxtune_step(model, objective, ids, labels, reference) -> tuple[float, dict[str, np.ndarray]]:
    """The train step's mean loss over one packed micro-batch
    of every pair, and its gradient w.r.t. the LoRA weights."""
    pairs = len(ids) // 2
    feed = make_feed(
        [len(r) for r in ids], TrainConfig(batch_size=pairs, max_steps=1), 64, batch_shards=1, packed=True, pairs=True
    )
    batch = next(feed.micro_batches(ids, labels, PAD, reference))
    assert batch["input_ids"].shape[0] < len(ids)  # packed: several rows to a sequence
    batch_labels = batch.pop("labels")
    summed = steps._summed_loss(model, training=True, spec=steps.StepSpec(objective=objective))

    def mean_loss(weights, buffers, batch, batch_labels):
        total, count = summed(weights, buffers, batch, batch_labels, jax.random.PRNGKey(0))
        return total / count, count

    (loss, count), grads = jax.jit(jax.value_and_grad(mean_loss, has_aux=True))(
        model.weights, model.buffers, batch, batch_labels
    )
    assert int(count) == pairs
    return float(loss), {name: np.asarray(g) for name, g in grads.items()}


def torch_grads(module) -> dict[str, np.ndarray]:
    return {name: p.grad.detach().numpy().copy() for name, p in module.named_parameters() if p.requires_grad}


def assert_same_gradients(ours: dict[str, np.ndarray], theirs: dict[str, np.ndarray]) -> None:
    assert set(ours) == set(theirs) and len(ours) == 28  # LoRA A and B of 7 linear layers in each of 2 layers
    for name, expected in theirs.items():
        scale = np.abs(expected).max()
        assert scale > 1e-4, name  # every adapter tensor gets a real gradient
        np.testing.assert_allclose(ours[name], expected, rtol=0, atol=GRAD_ATOL * scale, err_msg=name)


def trl_args(config_class, tmp_path, **settings):
    """TRL's config for a quiet CPU run: no reporting, float32 (TRL defaults to bf16), no checkpointing."""
    return config_class(
        output_dir=str(tmp_path),
        report_to="none",
        use_cpu=True,
        bf16=False,
        gradient_checkpointing=False,
        dataloader_pin_memory=False,
        **settings,
    )


def text_dataset(pairs):
    """TRL's preference format; answers end with the tokenizer's eos token, so TRL adds none."""
    from datasets import Dataset

    def text(ids):
        return " ".join(NAMES[i] for i in ids)

    return Dataset.from_dict(
        {
            "prompt": [text(p) + " " for p, _, _ in pairs],
            "chosen": [text(c) for _, c, _ in pairs],
            "rejected": [text(r) for _, _, r in pairs],
        }
    )


def dpo_trainer(lora_module, tokenizer, pairs, tmp_path, cfg: PreferenceConfig):
    """TRL's DPO trainer on a copy of the policy. Given a PEFT model, TRL's reference is a frozen copy
    of its adapter; with precompute_ref_log_probs it scores the dataset's pairs with it once, one pair
    a batch (as the one-pair batches of `trl_pair_results` are padded), and then reads the reference
    from each batch."""
    from trl import DPOConfig, DPOTrainer

    losses = (
        dict(loss_type=[cfg.loss_type, "sft"], loss_weights=[1.0, cfg.sft_weight])
        if cfg.sft_weight
        else dict(loss_type=cfg.loss_type)
    )
    args = trl_args(
        DPOConfig,
        tmp_path,
        beta=cfg.beta,
        label_smoothing=cfg.label_smoothing,
        precompute_ref_log_probs=True,
        precompute_ref_batch_size=1,
        **losses,
    )
    return DPOTrainer(
        model=copy.deepcopy(lora_module), args=args, train_dataset=text_dataset(pairs), processing_class=tokenizer
    )


def trl_pair_results(trainer, examples) -> dict[str, np.ndarray]:
    """TRL's loss, rewards and log-probabilities of each pair alone (its `_compute_loss` logs batch means)."""
    import torch

    logged_as = {
        "chosen_reward": "rewards/chosen",
        "rejected_reward": "rewards/rejected",
        "chosen_logp": "logps/chosen",
        "rejected_logp": "logps/rejected",
    }
    out = {"loss": [], **{key: [] for key in logged_as}}
    for example in examples:
        with torch.no_grad():
            out["loss"].append(trainer.compute_loss(trainer.model, trainer.data_collator([example])).item())
        logged = trainer._metrics["train" if trainer.model.training else "eval"]
        for key, name in logged_as.items():
            out[key].append(logged[name][-1])
    return {k: np.asarray(v, np.float64) for k, v in out.items()}


def dpo_setup(lora_module, jax_model, tokenizer, pairs, tmp_path, cfg):
    """jaxtune's rows and log-probabilities, a reference a few nats from the policy either way (log-ratios,
    margins and losses far from their step-0 values), and TRL's trainer, examples and per-pair results."""
    ids, labels = rows(pairs)
    logp, tokens = jaxtune_logps(jax_model, ids, labels)
    reference = (logp + np.random.default_rng(1).normal(0, 2, len(logp))).astype(np.float32)
    trainer = dpo_trainer(lora_module, tokenizer, pairs, tmp_path, cfg)
    examples = [
        {
            "prompt_ids": p,
            "chosen_ids": c,
            "rejected_ids": r,
            "ref_chosen_logps": float(reference[2 * i]),
            "ref_rejected_logps": float(reference[2 * i + 1]),
        }
        for i, (p, c, r) in enumerate(pairs)
    ]
    return ids, labels, logp, tokens, reference, trainer, examples, trl_pair_results(trainer, examples)


DPO_CONFIGS = [
    PreferenceConfig(beta=0.5),
    PreferenceConfig(beta=0.5, loss_type="robust", label_smoothing=0.2),
    PreferenceConfig(beta=0.5, loss_type="ipo"),
]


@pytest.mark.parametrize("cfg", DPO_CONFIGS, ids=["sigmoid", "robust", "ipo"])
def test_dpo_loss_rewards_and_lora_gradients_match_trl(lora_module, jax_model, tokenizer, pairs, tmp_path, cfg):
    ids, labels, logp, tokens, reference, trainer, examples, theirs = dpo_setup(
        lora_module, jax_model, tokenizer, pairs, tmp_path, cfg
    )
    trl_loss = trainer.compute_loss(trainer.model, trainer.data_collator(examples))
    trl_loss.backward()

    objective = preference.Objective("dpo", cfg)
    ours = jaxtune_pair_metrics(objective, logp, tokens, reference)
    np.testing.assert_allclose(logp[0::2], theirs["chosen_logp"], rtol=0, atol=LOGP_ATOL)
    np.testing.assert_allclose(logp[1::2], theirs["rejected_logp"], rtol=0, atol=LOGP_ATOL)
    # Rewards: beta times the log-ratio, whose reference part both sides share exactly.
    for side in ("chosen_reward", "rejected_reward"):
        np.testing.assert_allclose(ours[side], theirs[side], rtol=0, atol=cfg.beta * LOGP_ATOL, err_msg=side)
    np.testing.assert_allclose(ours["loss"], theirs["loss"], rtol=0, atol=PAIR_LOSS_ATOL)
    margins = theirs["chosen_reward"] - theirs["rejected_reward"]
    assert np.abs(margins).min() > 0.1 and margins.min() < 0 < margins.max()  # far from step 0's, of both signs

    loss, grads = jaxtune_step(jax_model, objective, ids, labels, reference)
    assert loss == pytest.approx(trl_loss.item(), rel=LOSS_RTOL)
    assert trl_loss.item() == pytest.approx(theirs["loss"].mean(), rel=LOSS_RTOL)  # the batch loss is the pairs' mean
    assert_same_gradients(grads, torch_grads(trainer.model))


def test_the_sft_term_matches_trls_sigmoid_plus_sft_on_each_pair(lora_module, jax_model, tokenizer, pairs, tmp_path):
    """RPO: TRL's loss_type [sigmoid, sft] weighted [1, w]. TRL averages the SFT term over a batch's
    chosen tokens and jaxtune over each pair's, which agree for one pair: so one-pair batches."""
    cfg = PreferenceConfig(beta=0.5, sft_weight=0.7)
    ids, labels, logp, tokens, reference, trainer, examples, theirs = dpo_setup(
        lora_module, jax_model, tokenizer, pairs, tmp_path, cfg
    )

    objective = preference.Objective("dpo", cfg)
    ours = jaxtune_pair_metrics(objective, logp, tokens, reference)
    # jaxtune's term is less the reference's chosen NLL, a constant per pair: TRL's loss is ours plus 0.7 times it.
    reference_nll = -reference[0::2] / tokens[0::2]
    np.testing.assert_allclose(ours["loss"] + 0.7 * reference_nll, theirs["loss"], rtol=0, atol=PAIR_LOSS_ATOL)
    # The term is there: each loss is its DPO loss plus 0.7 times the chosen NLL's rise over the reference's.
    without = jaxtune_pair_metrics(preference.Objective("dpo", PreferenceConfig(beta=0.5)), logp, tokens, reference)
    np.testing.assert_allclose(
        ours["loss"] - without["loss"], 0.7 * (-logp[0::2] / tokens[0::2] - reference_nll), rtol=1e-5
    )
    assert np.abs(ours["loss"] - without["loss"]).min() > 0.03  # 1000 times PAIR_LOSS_ATOL

    trl_loss = trainer.compute_loss(trainer.model, trainer.data_collator(examples[:1]))
    trl_loss.backward()
    loss, grads = jaxtune_step(jax_model, objective, ids[:2], labels[:2], reference[:2])
    assert loss + 0.7 * reference_nll[0] == pytest.approx(trl_loss.item(), rel=LOSS_RTOL)
    assert_same_gradients(grads, torch_grads(trainer.model))  # a constant offset: the same gradients


def test_simpo_matches_trl_cpo_with_loss_type_simpo(lora_module, jax_model, tokenizer, pairs, tmp_path):
    import torch
    from trl.experimental.cpo import CPOConfig, CPOTrainer

    cfg = PreferenceConfig(beta=2.0, simpo_gamma=0.3, label_smoothing=0.1)
    args = trl_args(
        CPOConfig,
        tmp_path,
        loss_type="simpo",
        cpo_alpha=0.0,
        beta=cfg.beta,
        simpo_gamma=cfg.simpo_gamma,
        label_smoothing=cfg.label_smoothing,
        max_length=64,
        remove_unused_columns=False,
    )
    # The dataset only builds the trainer (CPO's own tokenisation of text is not word-level): the
    # batch below is of the very rows jaxtune scores.
    trainer = CPOTrainer(
        model=copy.deepcopy(lora_module), args=args, train_dataset=text_dataset(pairs), processing_class=tokenizer
    )
    assert (trainer.loss_type, trainer.cpo_alpha, trainer.alpha) == ("simpo", 0.0, 0.0)
    ids, labels = rows(pairs)
    features = []
    for i, (prompt, _, _) in enumerate(pairs):
        feature = {"prompt_input_ids": prompt, "prompt_attention_mask": [1] * len(prompt)}
        for side, row in (("chosen", 2 * i), ("rejected", 2 * i + 1)):
            feature |= {
                f"{side}_input_ids": ids[row].tolist(),
                f"{side}_attention_mask": [1] * len(ids[row]),
                f"{side}_labels": labels[row].tolist(),
            }
        features.append(feature)
    inputs = trainer.data_collator(features)
    with torch.no_grad():
        chosen_mean, rejected_mean, *_ = trainer.concatenated_forward(trainer.model, inputs)
        trl_losses, trl_chosen, trl_rejected = (
            t.numpy().astype(np.float64) for t in trainer.cpo_loss(chosen_mean, rejected_mean)
        )
    trl_loss = trainer.compute_loss(trainer.model, inputs)
    trl_loss.backward()

    objective = preference.Objective("simpo", cfg)
    logp, tokens = jaxtune_logps(jax_model, ids, labels)
    ours = jaxtune_pair_metrics(objective, logp, tokens, None)
    # Rewards: beta times the mean token log-probability, whose error is the sum's over its tokens.
    np.testing.assert_allclose(ours["chosen_reward"], trl_chosen, rtol=0, atol=cfg.beta * LOGP_ATOL)
    np.testing.assert_allclose(ours["rejected_reward"], trl_rejected, rtol=0, atol=cfg.beta * LOGP_ATOL)
    np.testing.assert_allclose(ours["loss"], trl_losses, rtol=0, atol=PAIR_LOSS_ATOL)
    # gamma matters here: without it each pair's loss would be 0.12 to 0.15 lower.
    assert np.all(np.abs(trl_losses - preference_loss_without_gamma(cfg, trl_chosen, trl_rejected)) > 0.1)

    loss, grads = jaxtune_step(jax_model, objective, ids, labels, None)
    assert loss == pytest.approx(trl_loss.item(), rel=LOSS_RTOL)
    assert_same_gradients(grads, torch_grads(trainer.model))


def preference_loss_without_gamma(cfg, chosen_reward, rejected_reward):
    z = chosen_reward - rejected_reward
    eps = cfg.label_smoothing
    return (1 - eps) * np.logaddexp(0, -z) + eps * np.logaddexp(0, z)


@pytest.mark.parametrize("cfg", DPO_CONFIGS[:2], ids=["sigmoid", "robust"])
def test_at_step_0_trl_and_jaxtune_lose_ln_2_on_every_pair(lora_module, jax_model, tokenizer, pairs, tmp_path, cfg):
    """TRL's reference precomputed over its own dataset of the pairs, against jaxtune's reference
    stage (the eval step's log-probabilities, before training)."""
    trainer = dpo_trainer(lora_module, tokenizer, pairs, tmp_path, cfg)
    dataset = trainer.train_dataset
    assert [(r["prompt_ids"], r["chosen_ids"], r["rejected_ids"]) for r in dataset] == [tuple(p) for p in pairs]
    examples = [
        {k: r[k] for k in ("prompt_ids", "chosen_ids", "rejected_ids", "ref_chosen_logps", "ref_rejected_logps")}
        for r in dataset
    ]
    theirs = trl_pair_results(trainer, examples)

    ids, labels = rows(pairs)
    logp, tokens = jaxtune_logps(jax_model, ids, labels)
    ours = jaxtune_pair_metrics(preference.Objective("dpo", cfg), logp, tokens, logp)
    # The same reference: TRL's precompute and jaxtune's reference stage score the same rows alike.
    np.testing.assert_allclose(dataset["ref_chosen_logps"], logp[0::2], rtol=0, atol=LOGP_ATOL)
    np.testing.assert_allclose(dataset["ref_rejected_logps"], logp[1::2], rtol=0, atol=LOGP_ATOL)
    # Each side against its own reference: every reward exactly 0, every loss ln 2 (float32's, 2e-9 from math's).
    for results in (theirs, ours):
        assert np.all(results["chosen_reward"] == 0) and np.all(results["rejected_reward"] == 0)
        np.testing.assert_allclose(results["loss"], math.log(2), rtol=0, atol=1e-7)
