"""GRPO's training loop: every `rl.num_iterations` optimizer steps it samples answers to the next
prompts with the weights being trained, scores them, and updates on them.

One rollout:
1. the step's prompts (batch_size x grad_accumulation answers over num_generations), in a seeded
   order, each repeated num_generations times and left-padded: one decode program, sampling
   with `rl.temperature`, `top_k` and `top_p` from a key of (seed, rollout);
2. each answer cut after its first end-of-sequence token (kept, as TRL keeps it), scored on the
   host by the caller's `score` (the rewards), and given its group-relative advantage;
3. the prompt-and-answer rows, right-padded to one length for the whole run, with the log-
   probabilities the loss needs beside the policy's own: the reference's (rl.beta > 0: the
   adapters off, or a full fine-tune's starting weights) and the sampling policy's (rl.num_iterations
   > 1), each from one no-gradient pass;
4. num_iterations train steps on them (`grpo.summed_grpo` inside the usual compiled step).

Everything runs on the weights and mesh the update uses: no copy, no conversion. The host syncs
once a step (the rewards need the answers); the steps, checkpoints and stop signals are the one
loop's (`loop`), and a resumed run samples again from the step it resumes at.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path

import jax
import numpy as np

from jaxtune.config import RLConfig, TrainConfig
from jaxtune.runtime.compiled import grpo, steps
from jaxtune.runtime.compiled.batches import bucket_length, epoch_order, row_lengths
from jaxtune.runtime.compiled.preference import objective_of
from jaxtune.runtime.decoding import decode
from jaxtune.runtime.decoding.sampling import Sampling
from jaxtune.runtime.devices.mesh import fetch
from jaxtune.runtime.modeling import attention
from jaxtune.runtime.modeling.model import JaxModel, adapters_off
from jaxtune.runtime.train import loop
from jaxtune.runtime.train.loop import TrainResult

# score(prompt indices (n,), answers (n lists of token ids, each cut after its end token)) -> (n, rewards)
Score = Callable[[np.ndarray, list[list[int]]], np.ndarray]


def prompts_of_rollout(n_prompts: int, per_rollout: int, seed: int, rollout: int) -> np.ndarray:
    """The prompt indices of rollout `rollout` (0-based): consecutive slices of seeded epochs, each
    epoch a fresh permutation of every prompt (a slice may span two epochs)."""
    start = rollout * per_rollout
    epoch, offset = divmod(start, n_prompts)
    order = epoch_order(n_prompts, seed, epoch)
    while len(order) - offset < per_rollout:
        epoch += 1
        order = np.concatenate([order, epoch_order(n_prompts, seed, epoch)])
    return order[offset : offset + per_rollout]


def cut_answers(tokens: np.ndarray, eos_ids: Sequence[int]) -> tuple[list[list[int]], np.ndarray]:
    """Each row's tokens up to and including its first end token, and whether it had none (truncated)."""
    answers, truncated = [], np.zeros(len(tokens), bool)
    stops = set(eos_ids)
    for row, values in enumerate(np.asarray(tokens).tolist()):
        end = next((i for i, token in enumerate(values) if token in stops), None)
        truncated[row] = end is None
        answers.append(values if end is None else values[: end + 1])
    return answers, truncated


def row_length(model: JaxModel, prompt_length: int, rl: RLConfig) -> int:
    """The one length every answer row is padded to: the prompts' bucket and the longest answer."""
    return bucket_length(
        prompt_length + rl.max_completion_length, multiple=attention.length_multiple(model.module, model.placement.mesh)
    )


def train_grpo(
    model: JaxModel,
    prompts: Sequence[Sequence[int]],
    score: Score,
    reward_names: Sequence[str],
    cfg: TrainConfig,
    rl: RLConfig,
    pad_id: int,
    eos_ids: Sequence[int],
    on_log: Callable[[list[dict]], None] = lambda records: None,
    checkpoint_dir: Path | None = None,
    check_memory: bool = True,
    restart: bool = False,
) -> TrainResult:
    """Train for cfg.max_steps optimizer steps of GRPO on `prompts` (token ids, each ending with the
    generation prompt), scored by `score`; `reward_names` name its columns in the log."""
    source = RolloutSource(model, prompts, score, reward_names, cfg, rl, pad_id, eos_ids)
    return loop.run(model, cfg, source, objective_of("grpo", None, rl), on_log, checkpoint_dir, check_memory, restart)


class RolloutSource:
    """Each step's answer rows, sampled every `rl.num_iterations` steps with the weights being trained."""

    every_step = True  # the rewards need the answers on the host: a sync and a record every step

    def __init__(
        self,
        model: JaxModel,
        prompts: Sequence[Sequence[int]],
        score: Score,
        reward_names: Sequence[str],
        cfg: TrainConfig,
        rl: RLConfig,
        pad_id: int,
        eos_ids: Sequence[int],
    ):
        self.model, self.prompts, self.score, self.reward_names = model, prompts, score, reward_names
        self.rl, self.pad_id, self.eos_ids = rl, pad_id, eos_ids
        self.answers_per_step = cfg.batch_size * cfg.grad_accumulation
        self.per_rollout = self.answers_per_step // rl.num_generations
        self.prompt_length = bucket_length(int(row_lengths(prompts).max()))  # a token table's lengths, not its rows
        self.length = row_length(model, self.prompt_length, rl)
        self.weights_of = np.asarray(rl.reward_weights or [1.0] * len(reward_names), np.float32)
        self.generate = decode.make_generate(
            model, rl.max_completion_length, tuple(eos_ids), Sampling(rl.temperature, rl.top_k, rl.top_p)
        )
        self.logp_step = (
            steps.make_token_logp_step(model, temperature=rl.temperature) if rl.beta or rl.num_iterations > 1 else None
        )
        self.frozen_start = None
        if rl.beta and not _is_lora(model):  # a full fine-tune's reference: its starting weights, kept
            self.frozen_start = jax.tree.map(lambda a: a.copy(), model.weights)

    def shape(self, run: TrainConfig) -> tuple[int, int, int]:
        return run.batch_size, self.length, 0

    def total_steps(self, cfg: TrainConfig) -> int:
        return cfg.max_steps

    def start(self, cfg: TrainConfig, step: int) -> None:
        self.cfg, self.rollout = cfg, None  # a resumed run samples again from the step it resumes at

    def flops(self) -> None:
        return None

    def next(self, step: int, weights) -> tuple[dict[str, np.ndarray], dict[str, float]]:
        rl = self.rl
        if self.rollout is None or (step - 1) % rl.num_iterations == 0:
            self.rollout = self.sample(step, weights)
        batch, figures = self.rollout["batch"], dict(self.rollout["figures"])
        if self.logp_step is not None:  # a rollout's first step: the sampling policy's are the policy's own
            fresh = batch.get("old") if (step - 1) % rl.num_iterations == 0 else None
            figures.update(_policy_figures(self.model, self.logp_step, weights, batch, rl, fresh))
        k = self.cfg.grad_accumulation
        return {name: value.reshape(k, -1, *value.shape[1:]) for name, value in batch.items()}, figures

    def sample(self, step: int, weights) -> dict:
        """The rollout of the step: its rows on the host, rewards, advantages and figures."""
        model, rl, cfg = self.model, self.rl, self.cfg
        began = time.perf_counter()
        rollout = (step - 1) // rl.num_iterations
        chosen = prompts_of_rollout(len(self.prompts), self.per_rollout, cfg.seed, rollout)
        rows = np.repeat(chosen, rl.num_generations)
        prompt_ids = [list(self.prompts[i]) for i in rows]
        ids, mask = decode.left_pad(prompt_ids, self.pad_id, self.prompt_length)
        ids, mask = model.placement.shard_prompts((ids, mask))
        tokens = fetch(self.generate(model, weights, model.buffers, ids, mask, steps.step_key(cfg.seed, rollout)))
        answers, truncated = cut_answers(tokens, self.eos_ids)
        sampled = time.perf_counter()
        scores = np.asarray(self.score(rows, answers), np.float32).reshape(len(rows), len(self.reward_names))
        total = scores @ self.weights_of
        batch = grpo.answer_batch(prompt_ids, answers, self.pad_id, self.length)
        if rl.mask_truncated_completions:
            batch["labels"][truncated] = grpo.IGNORE_INDEX
        batch["advantages"] = grpo.advantages(total, rl.num_generations, rl.scale_rewards)
        figures = {
            "reward": float(total.mean()),
            "reward_std": float(total.std(ddof=1)) if len(total) > 1 else 0.0,
            **{f"reward/{name}": float(scores[:, i].mean()) for i, name in enumerate(self.reward_names)},
            "completion_length": float(np.mean([len(a) for a in answers])),
            "truncated": float(truncated.mean()),
            "sample_seconds": sampled - began,
        }
        if self.logp_step is not None:
            rows_on_mesh = _on_mesh(model, batch)
            labels = rows_on_mesh.pop("labels")
            if rl.beta:
                reference = adapters_off(weights) if self.frozen_start is None else self.frozen_start
                batch["reference"] = np.asarray(fetch(self.logp_step(reference, model.buffers, rows_on_mesh, labels)))
            if rl.num_iterations > 1:
                batch["old"] = np.asarray(fetch(self.logp_step(weights, model.buffers, rows_on_mesh, labels)))
        return {"batch": batch, "figures": figures}

    def summary(self, log: list[dict]) -> dict:
        records = [r for r in log if "loss" in r]
        quarter = max(len(records) // 4, 1)
        first, last = records[:quarter], records[-quarter:]
        return {
            "reward_first_quarter": float(np.mean([r["reward"] for r in first])) if records else None,
            "reward_last_quarter": float(np.mean([r["reward"] for r in last])) if records else None,
            "sample_seconds": round(sum(r["sample_seconds"] for r in records), 3),
            "update_seconds": round(sum(r["update_seconds"] for r in records), 3),
            "final_loss": float(np.mean([r["loss"] for r in last])) if records else None,
            "answers_per_step": self.answers_per_step,
            "prompts_per_rollout": self.per_rollout,
            "row_length": self.length,
        }


def _is_lora(model: JaxModel) -> bool:
    return any(".lora_B." in name for name in model.weights)


def _on_mesh(model: JaxModel, batch: dict) -> dict:
    """The rows' model inputs and labels, split over the batch axes (what the log-probability step reads)."""
    keys = ("input_ids", "attention_mask", "labels")
    return {name: model.placement.put(batch[name], model.placement.batch_sharding) for name in keys}


def _policy_figures(model: JaxModel, logp_step, weights, batch: dict, rl: RLConfig, logp: np.ndarray | None) -> dict:
    """The KL to the reference (rl.beta > 0) and the share of answer tokens the clip holds
    (rl.num_iterations > 1), under the weights about to be updated (`logp`, their log-probabilities,
    where the rollout has them already), averaged over answer tokens."""
    if logp is None:
        rows = _on_mesh(model, batch)
        labels = rows.pop("labels")
        logp = np.asarray(fetch(logp_step(weights, model.buffers, rows, labels)))
    terms = grpo.token_terms(rl, logp, batch["advantages"], batch.get("old"), batch.get("reference"))
    mask = batch["labels"][:, 1:] != grpo.IGNORE_INDEX
    figures = {}
    if rl.beta:
        figures["kl"] = float(np.asarray(terms["kl"])[mask].mean()) if mask.any() else 0.0
    if rl.num_iterations > 1:
        figures["clip_fraction"] = grpo.clip_fraction(rl, np.asarray(terms["ratio"]), batch["advantages"], mask)
    return figures
