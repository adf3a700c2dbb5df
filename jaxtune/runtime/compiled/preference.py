"""Preference objectives on answers' summed log-probabilities: DPO (sigmoid, robust, IPO) and SimPO.

Each pair is a prompt with a chosen and a rejected answer. A batch reaches these functions as
per-pair arrays: the policy's summed log-probability of each answer's tokens, how many tokens
each answer has, and for DPO the reference model's summed log-probabilities (the `reference`
stage computed them once, before training). The formulas are TRL's, term for term:
`DPOTrainer._compute_loss` for DPO, and `CPOTrainer.cpo_loss` with loss_type='simpo' and
cpo_alpha=0 for SimPO (tests/preference compares them). The optional SFT term (RPO) is TRL's
loss_type 'sft' per pair: TRL averages over the batch's chosen tokens, so the two agree for one
pair, or pairs of equal length, and otherwise jaxtune weighs every pair alike; for DPO it is
offset by the reference's value, a constant (see `pair_losses`).

The implicit reward of an answer is what the objective ranks answers by: beta * (policy − reference)
summed log-probability for DPO, beta * the mean token log-probability for SimPO. Preference
accuracy is the share of pairs whose chosen answer's reward is the higher, a tie counting half:
before DPO training policy and reference agree, every reward is 0 and the accuracy 0.5.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxtune.config import PreferenceConfig, RLConfig
from jaxtune.runtime.compiled import grpo

F32 = jnp.float32


class PairLogps(NamedTuple):
    """Per-pair arrays (P,): summed answer log-probabilities and answer token counts, float32."""

    chosen: jax.Array
    rejected: jax.Array
    chosen_tokens: jax.Array
    rejected_tokens: jax.Array


def rewards(
    objective: str, cfg: PreferenceConfig, policy: PairLogps, reference: PairLogps | None
) -> tuple[jax.Array, jax.Array]:
    """The implicit rewards (chosen, rejected), each (P,)."""
    if objective == "dpo":
        return cfg.beta * (policy.chosen - reference.chosen), cfg.beta * (policy.rejected - reference.rejected)
    if objective == "simpo":
        return cfg.beta * _mean(policy.chosen, policy.chosen_tokens), cfg.beta * _mean(
            policy.rejected, policy.rejected_tokens
        )
    raise ValueError(f"not a preference objective: {objective!r}")


def pair_losses(
    objective: str, cfg: PreferenceConfig, policy: PairLogps, reference: PairLogps | None = None
) -> jax.Array:
    """The loss of each pair (P,), float32; `reference` is needed by DPO alone.

    With `cfg.sft_weight` it adds that times the chosen answer's mean token NLL (RPO), for each
    pair alike; for DPO less the reference's, a constant that leaves every gradient as RPO's and
    the loss ln 2 while the policy is the reference (the term is then how far the chosen answers'
    likelihood fell below the reference's, negative where it rose)."""
    return _with_sft_term(_preference_losses(objective, cfg, policy, reference), objective, cfg, policy, reference)


def _with_sft_term(
    losses: jax.Array, objective: str, cfg: PreferenceConfig, policy: PairLogps, reference: PairLogps | None
) -> jax.Array:
    if not cfg.sft_weight:
        return losses
    sft = chosen_nll(policy) - (chosen_nll(reference) if objective == "dpo" else 0.0)
    return losses + cfg.sft_weight * sft


def chosen_nll(policy: PairLogps) -> jax.Array:
    """Each chosen answer's mean token NLL (P,): what the SFT term weighs."""
    return -_mean(policy.chosen, policy.chosen_tokens)


def _preference_losses(
    objective: str, cfg: PreferenceConfig, policy: PairLogps, reference: PairLogps | None
) -> jax.Array:
    if objective == "simpo":
        # TRL's CPO with loss_type=simpo: logits = mean_c - mean_r - gamma / beta.
        logits = _mean(policy.chosen, policy.chosen_tokens) - _mean(policy.rejected, policy.rejected_tokens)
        logits = logits - cfg.simpo_gamma / cfg.beta
        return _smoothed(cfg.beta * logits, cfg.label_smoothing)
    if objective != "dpo":
        raise ValueError(f"not a preference objective: {objective!r}")
    chosen_ratio, rejected_ratio = policy.chosen - reference.chosen, policy.rejected - reference.rejected
    if cfg.loss_type == "ipo":
        # Length-normalised, as TRL and the IPO authors' reported results: (Eq. 17) on mean token log-ratios.
        delta = _mean(chosen_ratio, policy.chosen_tokens) - _mean(rejected_ratio, policy.rejected_tokens)
        return jnp.square(delta - 1.0 / (2.0 * cfg.beta))
    z = cfg.beta * (chosen_ratio - rejected_ratio)
    if cfg.loss_type == "robust":
        eps = cfg.label_smoothing
        return (-(1.0 - eps) * jax.nn.log_sigmoid(z) + eps * jax.nn.log_sigmoid(-z)) / (1.0 - 2.0 * eps)
    return -jax.nn.log_sigmoid(z)


def _smoothed(z: jax.Array, eps: float) -> jax.Array:
    """−(1−ε)·log σ(z) − ε·log σ(−z): the conservative loss for labels flipped with probability ε."""
    loss = -jax.nn.log_sigmoid(z)
    return loss if not eps else (1.0 - eps) * loss - eps * jax.nn.log_sigmoid(-z)


def _mean(summed: jax.Array, tokens: jax.Array) -> jax.Array:
    return summed / jnp.maximum(tokens, 1).astype(F32)


def pair_metrics(objective: str, cfg: PreferenceConfig, policy: PairLogps, reference: PairLogps | None = None) -> dict:
    """Per-pair (P,) loss, its preference term alone (without the SFT term; DPO's is ln 2 while the
    policy is the reference), the chosen answer's mean token NLL, rewards, margin and win (1 chosen
    ranked higher, 0.5 a tie, 0 lower)."""
    chosen, rejected = rewards(objective, cfg, policy, reference)
    margin = chosen - rejected
    preference_losses = _preference_losses(objective, cfg, policy, reference)
    return {
        "loss": _with_sft_term(preference_losses, objective, cfg, policy, reference),
        "preference_loss": preference_losses,
        "chosen_nll": chosen_nll(policy),
        "chosen_reward": chosen,
        "rejected_reward": rejected,
        "margin": margin,
        "win": jnp.where(margin > 0, 1.0, jnp.where(margin == 0, 0.5, 0.0)),
    }


def segment_sums(token_values: jax.Array, segment_ids: jax.Array, segments: int) -> jax.Array:
    """(S, segments) sums of per-token values (S, t-1) by the segment of the token each scores.

    Entry [s, i] of a per-token array scores the token at i+1 (the loss's shift), so it belongs to
    segment_ids[s, i+1]; segment k (1-based) lands in column k-1, padding (segment 0) nowhere.
    """
    owner = segment_ids[:, 1:]  # (S, t-1)
    onehot = (owner[..., None] == jnp.arange(1, segments + 1, dtype=owner.dtype)).astype(F32)  # (S, t-1, segments)
    return jnp.einsum("st,stk->sk", token_values.astype(F32), onehot)


def pairs_of(values: jax.Array, packed: bool) -> tuple[jax.Array, jax.Array]:
    """(chosen, rejected), each (P,), from per-segment values (S, segments).

    Packed: a sequence holds whole pairs, the chosen answer's row just before its rejected one, so
    its segments 1, 2 are pair 0, segments 3, 4 pair 1, and so on (P = S * segments / 2). Padded:
    each row is one segment, chosen rows even and rejected rows odd (P = S / 2)."""
    flat = values.reshape(-1, 2) if packed else values[:, 0].reshape(-1, 2)
    return flat[:, 0], flat[:, 1]


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class Objective:
    """What a train step minimises (static: part of the compiled program's identity)."""

    name: str = "sft"  # train.objective
    preference: PreferenceConfig | None = None  # its settings, for dpo and simpo
    rl: RLConfig | None = None  # its settings, for grpo

    @property
    def pairs(self) -> bool:
        """Trains on pairs of a chosen and a rejected answer."""
        return self.name in ("dpo", "simpo")

    @property
    def sampled(self) -> bool:
        """Trains on answers it samples and scores (grpo)."""
        return self.name == "grpo"


SFT = Objective()
# Batch entries an objective reads beside the model's inputs; the model never sees them.
OBJECTIVE_INPUTS = ("reference", "advantages", "old")


def objective_of(name: str, preference: PreferenceConfig | None, rl: RLConfig | None = None) -> Objective:
    if name == "sft":
        return SFT
    if name == "grpo":
        return Objective(name, rl=rl or RLConfig())
    return Objective(name, preference or PreferenceConfig())


def summed_objective(
    objective: Objective, nll: jax.Array, scored: jax.Array, batch: dict
) -> tuple[jax.Array, jax.Array]:
    """(summed loss, count) of one micro-batch, whose ratio is its mean: summed token NLL over scored
    tokens for sft; summed pair losses over pairs for dpo and simpo; for grpo see `grpo.summed_loss`. Summed over micro-batches, the
    ratio is the whole step's mean, as one big batch would give.

    A preference batch carries `reference` (S, M): each segment's reference log-probability (zeros
    for simpo), whose shape says the layout (`pairs_of`): M segments per packed sequence, or M = 1
    for padded rows."""
    if objective.sampled:
        return grpo.summed_grpo(objective.rl, nll, scored, batch)
    if not objective.pairs:
        return nll.sum(), scored.sum()
    reference = batch["reference"].astype(F32)
    segments = reference.shape[1]
    packed = segments > 1
    logp = segment_sums(-nll, batch["segment_ids"], segments)
    tokens = segment_sums(scored, batch["segment_ids"], segments)
    chosen_tokens, rejected_tokens = pairs_of(tokens, packed)
    policy = PairLogps(*pairs_of(logp, packed), chosen_tokens, rejected_tokens)
    ref = PairLogps(*pairs_of(reference, packed), chosen_tokens, rejected_tokens)
    real = chosen_tokens > 0  # a slot a pair fills: every kept answer scores at least one token
    losses = pair_losses(objective.name, objective.preference, policy, ref)
    return jnp.where(real, losses, 0.0).sum(), real.sum()
