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
once a step (the rewards need the answers); checkpoints and stop signals are handled as in
`training`, and a resumed run samples again from the step it resumes at.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path

import jax
import numpy as np
from tqdm import tqdm

from jaxtune.config import RLConfig, TrainConfig
from jaxtune.errors import NonFiniteLoss
from jaxtune.host import processes, stopping
from jaxtune.runtime.compiled import grpo, steps
from jaxtune.runtime.compiled.batches import bucket_length, epoch_order, row_lengths
from jaxtune.runtime.compiled.preference import objective_of
from jaxtune.runtime.decoding import decode
from jaxtune.runtime.decoding.sampling import Sampling
from jaxtune.runtime.devices.mesh import fetch
from jaxtune.runtime.measures import fit, memory
from jaxtune.runtime.modeling import attention
from jaxtune.runtime.modeling.model import JaxModel, adapters_off
from jaxtune.runtime.train import checkpoint
from jaxtune.records import TrainSummary
from jaxtune.runtime.train.training import TrainResult, resume, save_checkpoint

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
    return order[offset:offset + per_rollout]


def cut_answers(tokens: np.ndarray, eos_ids: Sequence[int]) -> tuple[list[list[int]], np.ndarray]:
    """Each row's tokens up to and including its first end token, and whether it had none (truncated)."""
    answers, truncated = [], np.zeros(len(tokens), bool)
    stops = set(eos_ids)
    for row, values in enumerate(np.asarray(tokens).tolist()):
        end = next((i for i, token in enumerate(values) if token in stops), None)
        truncated[row] = end is None
        answers.append(values if end is None else values[:end + 1])
    return answers, truncated


def row_length(model: JaxModel, prompt_length: int, rl: RLConfig) -> int:
    """The one length every answer row is padded to: the prompts' bucket and the longest answer."""
    return bucket_length(prompt_length + rl.max_completion_length,
                         multiple=attention.length_multiple(model.module, model.placement.mesh))


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
) -> TrainResult:
    """Train for cfg.max_steps optimizer steps of GRPO on `prompts` (token ids, each ending with the
    generation prompt), scored by `score`; `reward_names` name its columns in the log."""
    objective = objective_of("grpo", None, rl)
    fused = attention.supported(model.module)
    answers_per_step = cfg.batch_size * cfg.grad_accumulation
    per_rollout = answers_per_step // rl.num_generations
    prompt_length = bucket_length(int(row_lengths(prompts).max()))  # a token table's lengths, not its rows
    length = row_length(model, prompt_length, rl)
    weights_of = np.asarray(rl.reward_weights or [1.0] * len(reward_names), np.float32)

    optimizer = steps.make_optimizer(cfg)
    plan, chunk = {}, None
    if check_memory:
        chosen = fit.choose(model, optimizer, cfg, lambda run: (run.batch_size, length, 0), fused=fused,
                            objective=objective)
        plan = {**chosen.plan, "fit": chosen.record()}
        on_log([{"memory_plan": plan, "total_steps": cfg.max_steps,
                 "message": f"{chosen.describe(cfg)}; {memory.describe(plan)}"}])
        memory.check_fits(plan, cfg)
        cfg, chunk = chosen.train_config(cfg), chosen.chunk_tokens
    elif cfg.remat == "auto":
        cfg = cfg.model_copy(update={"remat": fit.fixed(cfg.remat)})
    k = cfg.grad_accumulation
    step_fn = steps.make_train_step(model, optimizer, remat=cfg.remat, fused=fused, objective=objective,
                                    chunk_tokens=chunk)
    schedule = steps.learning_rate_schedule(cfg, cfg.max_steps)
    generate = decode.make_generate(model, rl.max_completion_length, tuple(eos_ids),
                                    Sampling(rl.temperature, rl.top_k, rl.top_p))
    logp_step = (steps.make_token_logp_step(model, temperature=rl.temperature)
                 if rl.beta or rl.num_iterations > 1 else None)
    frozen_start = None
    if rl.beta and not _is_lora(model):  # a full fine-tune's reference: its starting weights, kept
        frozen_start = jax.tree.map(lambda a: a.copy(), model.weights)

    weights, opt_state, start, log, last_checkpoint = resume(model, optimizer, checkpoint_dir, on_log)

    def sample(step: int, weights) -> dict:
        """The rollout of the step: its rows on the host, rewards, advantages and figures."""
        began = time.perf_counter()
        rollout = (step - 1) // rl.num_iterations
        chosen = prompts_of_rollout(len(prompts), per_rollout, cfg.seed, rollout)
        rows = np.repeat(chosen, rl.num_generations)
        prompt_ids = [list(prompts[i]) for i in rows]
        ids, mask = decode.left_pad(prompt_ids, pad_id, prompt_length)
        ids, mask = model.placement.shard_prompts((ids, mask))
        tokens = fetch(generate(model, weights, model.buffers, ids, mask, steps.step_key(cfg.seed, rollout)))
        answers, truncated = cut_answers(tokens, eos_ids)
        sampled = time.perf_counter()
        scores = np.asarray(score(rows, answers), np.float32).reshape(len(rows), len(reward_names))
        total = scores @ weights_of
        batch = grpo.answer_batch(prompt_ids, answers, pad_id, length)
        if rl.mask_truncated_completions:
            batch["labels"][truncated] = grpo.IGNORE_INDEX
        batch["advantages"] = grpo.advantages(total, rl.num_generations, rl.scale_rewards)
        figures = {"reward": float(total.mean()), "reward_std": float(total.std(ddof=1)) if len(total) > 1 else 0.0,
                   **{f"reward/{name}": float(scores[:, i].mean()) for i, name in enumerate(reward_names)},
                   "completion_length": float(np.mean([len(a) for a in answers])),
                   "truncated": float(truncated.mean()), "sample_seconds": sampled - began}
        if logp_step is not None:
            rows_on_mesh = _on_mesh(model, batch)
            labels = rows_on_mesh.pop("labels")
            if rl.beta:
                reference = adapters_off(weights) if frozen_start is None else frozen_start
                batch["reference"] = np.asarray(fetch(logp_step(reference, model.buffers, rows_on_mesh, labels)))
            if rl.num_iterations > 1:
                batch["old"] = np.asarray(fetch(logp_step(weights, model.buffers, rows_on_mesh, labels)))
        return {"batch": batch, "figures": figures}

    rollout_data = None
    started = time.perf_counter()
    with stopping.stop_on_signals(cfg.checkpoint_minutes) as stops:
        for step in tqdm(range(start + 1, cfg.max_steps + 1), desc="train", unit="step", initial=start,
                         total=cfg.max_steps):
            step_began = time.perf_counter()
            if rollout_data is None or (step - 1) % rl.num_iterations == 0:
                rollout_data = sample(step, weights)
            batch = rollout_data["batch"]
            figures = dict(rollout_data["figures"])
            if logp_step is not None:  # a rollout's first step: the sampling policy's are the policy's own
                fresh = batch.get("old") if (step - 1) % rl.num_iterations == 0 else None
                figures.update(_policy_figures(model, logp_step, weights, batch, rl, fresh))
            stacked = {name: value.reshape(k, -1, *value.shape[1:]) for name, value in batch.items()}
            stacked = model.placement.shard_micro_batches(stacked)
            labels = stacked.pop("labels")
            update_began = time.perf_counter()
            loss, weights, opt_state = step_fn(weights, model.buffers, opt_state, stacked, labels,
                                               steps.step_key(cfg.seed, step), schedule(step - 1))
            loss, grad_norm = (float(v) for v in fetch((loss, steps.grad_norm_of(opt_state))))
            now = time.perf_counter()
            if not (np.isfinite(loss) and np.isfinite(grad_norm)):
                where = f"last good checkpoint: {last_checkpoint} (kept)" if last_checkpoint else "no checkpoint was written yet"
                raise NonFiniteLoss(f"train step {step}: loss {loss}, gradient norm {grad_norm}; {where}")
            tokens = int(batch["attention_mask"].sum())
            record = {"step": step, "loss": round(loss, 6), "lr": float(schedule(step - 1)),
                      "grad_norm": round(grad_norm, 6), "tokens": tokens,
                      "tokens_per_second": round(tokens / (now - update_began), 1),
                      "update_seconds": round(now - update_began, 4), "step_seconds": round(now - step_began, 4),
                      **{key: round(value, 6) for key, value in figures.items()}}
            log.append(record)
            on_log([record])
            if checkpoint_dir is not None and processes.writes():
                checkpoint.note_progress(checkpoint_dir, step)
            stop, due = stops.after_step()
            saving = checkpoint_dir is not None and (stop or (step < cfg.max_steps and (
                step % cfg.checkpoint_every == 0 or due)))
            if saving:
                last_checkpoint = save_checkpoint(checkpoint_dir, step, weights, opt_state, log, cfg)
                stops.saved()
            if stop:
                if saving and processes.writes():
                    checkpoint.note_progress(checkpoint_dir, step, stopped_by=stops.signal)
                raise stops.stopped(step, last_checkpoint if saving else None)

    records = [r for r in log if "loss" in r]
    first, last = records[:max(len(records) // 4, 1)], records[-max(len(records) // 4, 1):]
    summary = TrainSummary(
        steps=cfg.max_steps, objective="grpo", resumed_from=start,
        seconds=round(time.perf_counter() - started, 3),
        reward_first_quarter=float(np.mean([r["reward"] for r in first])) if records else None,
        reward_last_quarter=float(np.mean([r["reward"] for r in last])) if records else None,
        sample_seconds=round(sum(r["sample_seconds"] for r in records), 3),
        update_seconds=round(sum(r["update_seconds"] for r in records), 3),
        final_loss=float(np.mean([r["loss"] for r in last])) if records else None,
        trainable_parameters=int(sum(np.prod(v.shape) for v in weights.values())),
        answers_per_step=answers_per_step, prompts_per_rollout=per_rollout, row_length=length,
        mesh=model.placement.describe(), remat=cfg.remat, loss_chunk_tokens=chunk,
    )
    weights, opt_state = fetch((weights, opt_state))
    return TrainResult(weights=weights, opt_state=opt_state, log=log, summary=summary, memory=plan)


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
