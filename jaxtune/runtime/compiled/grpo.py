"""GRPO's objective: group-relative advantages, and the clipped policy-ratio loss with a KL term.

Each prompt's `num_generations` answers form a group. An answer's advantage is its reward less
its group's mean, divided by the group's (or the step's) standard deviation; every token of the
answer carries it. Per answer token, with log-probabilities under the policy being trained (p),
the policy that sampled the answer (old) and the reference (ref):

    ratio = exp(p - old), loss = -min(ratio * A, clip(ratio, 1 - eps, 1 + eps_high) * A)
                                 + beta * ratio * (exp(ref - p) - (ref - p) - 1)

(the KL term weighted by the ratio unless `rl.use_bias_correction_kl` is off).

With one optimizer step per sampled batch (`rl.num_iterations` 1) the sampling policy is the one
being trained: old is p itself with its gradient stopped, so the ratio is 1 and its gradient is
p's. The token losses are then averaged as `rl.loss_type` says. Every formula is TRL's
`GRPOTrainer` (`_generate_and_score_completions` for the advantages, `_compute_loss` for the
loss), term for term; tests/rl compares the two.

A batch reaches `summed_grpo` as padded rows, one answer each (the prompt, then the sampled
answer), with `advantages` (S,) and, where they are needed, per-token `reference` and `old`
log-probabilities (S, t-1), aligned with the step's per-token NLL: entry i scores token i+1.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxtune.config import RLConfig
from jaxtune.runtime.compiled.batches import IGNORE_INDEX, pad_batch

F32 = jnp.float32
STD_FLOOR = 1e-4  # TRL's: a group whose answers all scored alike gets advantage 0, not 0/0


def advantages(rewards: np.ndarray, num_generations: int, scale: str) -> np.ndarray:
    """(n,) advantages of (n,) rewards, groups of `num_generations` consecutive answers; float32.

    `scale`: divide by the group's standard deviation (group), the whole batch's (batch), or not
    at all (none). Standard deviations are the unbiased ones, as torch.std's."""
    rewards = np.asarray(rewards, np.float64)
    grouped = rewards.reshape(-1, num_generations)
    centred = (grouped - grouped.mean(axis=1, keepdims=True)).reshape(-1)
    if scale == "none":
        return centred.astype(np.float32)
    if scale == "group":
        std = np.repeat(grouped.std(axis=1, ddof=1), num_generations)
    elif scale == "batch":
        std = np.full_like(rewards, rewards.std(ddof=1) if rewards.size > 1 else 0.0)
    else:
        raise ValueError(f"rl.scale_rewards must be group, batch or none, got {scale!r}")
    return (centred / (std + STD_FLOOR)).astype(np.float32)


def token_terms(
    rl: RLConfig,
    logp: jax.Array,
    advantages: jax.Array,
    old: jax.Array | None = None,
    reference: jax.Array | None = None,
) -> dict[str, jax.Array]:
    """Per-token (S, T) loss, and the KL and policy ratio it was made of, float32.

    `logp`, `old` and `reference` are (S, T) log-probabilities of the answer tokens; `old` None is
    the policy itself (one step per sampled batch); `reference` is needed when rl.beta > 0."""
    logp = logp.astype(F32)
    old = jax.lax.stop_gradient(logp) if old is None else old.astype(F32)
    ratio = jnp.exp(logp - old)
    a = advantages.astype(F32)[:, None]
    clipped = jnp.clip(ratio, 1.0 - rl.epsilon, 1.0 + rl.clip_high)
    loss = -jnp.minimum(ratio * a, clipped * a)
    kl = jnp.zeros_like(loss)
    if rl.beta:
        delta = reference.astype(F32) - logp
        kl = jnp.exp(delta) - delta - 1.0
        # Weighted by the ratio (1 in value on-policy, not in gradient): the unbiased reverse-KL gradient.
        loss = loss + rl.beta * (kl * ratio if rl.use_bias_correction_kl else kl)
    return {"loss": loss, "kl": kl, "ratio": ratio}


def summed_loss(rl: RLConfig, token_loss: jax.Array, mask: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(summed loss, count) of one micro-batch's (S, T) token losses over its answer tokens `mask`,
    whose ratio, summed over micro-batches, is TRL's loss of the step for `rl.loss_type`:

    - grpo: each answer's mean token loss, averaged over answers (count: answers);
    - bnpo: the micro-batch's mean token loss, averaged over micro-batches (count: 1 each);
    - dr_grpo: the summed token loss over answers x max_completion_length;
    - dapo: the summed token loss over the step's answer tokens."""
    mask = mask.astype(F32)
    per_token = token_loss * mask
    rows = mask.shape[0]
    if rl.loss_type == "grpo":
        return (per_token.sum(-1) / jnp.maximum(mask.sum(-1), 1.0)).sum(), jnp.int32(rows)
    if rl.loss_type == "bnpo":
        return per_token.sum() / jnp.maximum(mask.sum(), 1.0), jnp.int32(1)
    if rl.loss_type == "dr_grpo":
        return per_token.sum(), jnp.int32(rows * rl.max_completion_length)
    if rl.loss_type == "dapo":
        return per_token.sum(), mask.sum().astype(jnp.int32)
    raise ValueError(f"rl.loss_type must be one of grpo, bnpo, dr_grpo, dapo, got {rl.loss_type!r}")


def summed_grpo(rl: RLConfig, nll: jax.Array, scored: jax.Array, batch: dict) -> tuple[jax.Array, jax.Array]:
    """(summed loss, count) of a micro-batch of answers (see `summed_loss`), from the step's per-token
    NLL and scored mask (S, t-1) and the batch's `advantages`, `old` and `reference`."""
    terms = token_terms(rl, -nll, batch["advantages"], batch.get("old"), batch.get("reference"))
    return summed_loss(rl, terms["loss"], scored)


def clip_fraction(rl: RLConfig, ratio: np.ndarray, advantages: np.ndarray, mask: np.ndarray) -> float:
    """The share of answer tokens whose ratio the clip held (TRL's clip_ratio/region_mean): below
    1 - epsilon with a negative advantage, or above 1 + epsilon_high with a positive one."""
    a = np.asarray(advantages)[:, None]
    clipped = ((ratio < 1 - rl.epsilon) & (a < 0)) | ((ratio > 1 + rl.clip_high) & (a > 0))
    mask = np.asarray(mask, bool)
    return float(clipped[mask].mean()) if mask.any() else 0.0


def answer_batch(prompts: list[list[int]], answers: list[list[int]], pad_id: int, length: int) -> dict[str, np.ndarray]:
    """Rows of each prompt followed by its answer, right-padded to `length`: input_ids, attention_mask,
    segment_ids, position_ids and labels (S, length), the labels the answer's tokens alone (the
    prompt and padding -100). Every key the train step is planned with (`steps.BATCH_KEYS`), so the
    step that trains is the one `fit.choose` compiled."""
    ids = [list(p) + list(a) for p, a in zip(prompts, answers)]
    labels = [[IGNORE_INDEX] * len(p) + list(a) for p, a in zip(prompts, answers)]
    longest = max(len(row) for row in ids)
    if longest > length:
        raise ValueError(f"an answer row of {longest} tokens does not fit the batch's {length}")
    batch = pad_batch(ids, labels, pad_id, length, len(ids))
    batch["segment_ids"] = batch["attention_mask"].copy()  # one row, one segment; padding none
    batch["position_ids"] = np.broadcast_to(np.arange(length, dtype=np.int32), (len(ids), length)).copy()
    return batch
