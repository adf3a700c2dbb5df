"""The training loop: host-side batching, logging, evaluation and checkpoints around one compiled step.

The host syncs only every `log_every` steps, before a checkpoint and before an eval: there it
fetches the losses of the window, stops on the first non-finite one (naming the step and the
last good checkpoint), and reports one record per step.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax
import numpy as np
from tqdm import tqdm

from jaxtune.config import TrainConfig
from jaxtune.runtime import checkpoint, memory, steps
from jaxtune.runtime.batches import bucket_length, pad_batch, train_batches
from jaxtune.runtime.model import JaxModel


class NonFiniteLoss(FloatingPointError):
    """A step produced a NaN or infinite loss or gradient norm."""


@dataclass
class TrainResult:
    weights: dict[str, np.ndarray]
    opt_state: Any
    log: list[dict] = field(default_factory=list)
    summary: dict = field(default_factory=dict)
    memory: dict = field(default_factory=dict)


def total_steps(cfg: TrainConfig, n_rows: int) -> int:
    """`max_steps`, or the optimizer steps in `epochs` passes (each pass drops its last partial micro-batch)."""
    if cfg.max_steps is not None:
        return cfg.max_steps
    return max(cfg.epochs * (n_rows // cfg.batch_size) // cfg.grad_accumulation, 1)


def train(
    model: JaxModel,
    input_ids: Sequence[Sequence[int]],
    labels: Sequence[Sequence[int]],
    cfg: TrainConfig,
    pad_id: int,
    max_length: int,
    on_log: Callable[[list[dict]], None] = lambda records: None,
    eval_data: tuple[Sequence[Sequence[int]], Sequence[Sequence[int]]] | None = None,
    checkpoint_dir: Path | None = None,
    check_memory: bool = True,
) -> TrainResult:
    """Train for `total_steps`; resume from the newest checkpoint in `checkpoint_dir` if there is one."""
    if cfg.batch_size % model.placement.data_size:
        raise ValueError(f"train.batch_size={cfg.batch_size} must divide over {model.placement.data_size} data-parallel devices")
    total = total_steps(cfg, len(input_ids))
    optimizer = steps.make_optimizer(cfg, total)
    schedule = steps.learning_rate_schedule(cfg, total)
    plan = {}
    if check_memory:
        plan = memory.memory_plan(model, optimizer, cfg, max_length)
        on_log([{"memory_plan": plan, "message": memory.describe(plan)}])
        memory.check_fits(plan, cfg)
    step_fn = steps.make_train_step(model, optimizer, remat=cfg.remat == "layer")
    evaluate = _evaluator(model, eval_data, cfg, pad_id) if cfg.eval_every and eval_data else None

    weights, opt_state, start, log = model.weights, optimizer.init(model.weights), 0, []
    resumed = checkpoint.latest(checkpoint_dir, opt_state) if checkpoint_dir else None
    if resumed is not None:
        weights = {name: model.placement.replicate(jax.numpy.asarray(resumed.weights[name])) for name in weights}
        opt_state = model.placement.replicate(resumed.opt_state)
        start, log = resumed.step, resumed.state["log"]
        on_log(log)  # the records before the checkpoint, so the resumed run's log is whole
    last_checkpoint = str(resumed.path) if resumed else None

    k = cfg.grad_accumulation
    micro_batches = train_batches(len(input_ids), cfg.batch_size, cfg.seed)
    for _ in range(start * k):  # the data position: every micro-batch before the resumed step
        next(micro_batches)
    pending, window_tokens = [], 0
    started = window_start = time.perf_counter()
    compile_seconds = 0.0
    for step in tqdm(range(start + 1, total + 1), desc="train", unit="step", initial=start, total=total):
        rows = [next(micro_batches) for _ in range(k)]
        length = bucket_length(max(len(input_ids[r]) for chunk in rows for r in chunk), max_length)
        parts = [pad_batch([input_ids[r] for r in chunk], [labels[r] for r in chunk], pad_id, length, cfg.batch_size)
                 for chunk in rows]
        batch = {name: np.stack([part[name] for part in parts]) for name in parts[0]}
        tokens = int(batch["attention_mask"].sum())
        window_tokens += tokens
        batch = model.placement.shard_micro_batches(batch)
        batch_labels = batch.pop("labels")
        loss, weights, opt_state = step_fn(weights, model.buffers, opt_state, batch, batch_labels, steps.step_key(cfg.seed, step))
        pending.append((step, tokens, loss, steps.grad_norm_of(opt_state)))

        saving = step % cfg.checkpoint_every == 0 and step < total and checkpoint_dir is not None
        evaluating = evaluate is not None and (step % cfg.eval_every == 0 or step == total)
        if step == start + 1 or step % cfg.log_every == 0 or step == total or saving or evaluating:
            fetched = jax.device_get(pending)  # the host sync
            elapsed = time.perf_counter() - window_start
            if step == start + 1:  # the first call compiles: no tokens/s for it
                compile_seconds, window_tokens = elapsed, 0
            records = [_record(s, float(l), float(g), t, schedule, window_tokens / elapsed if window_tokens else 0.0,
                               last_checkpoint) for s, t, l, g in fetched]
            log += records
            on_log(records)
            pending, window_tokens, window_start = [], 0, time.perf_counter()
            if evaluating:
                record = {"step": step, "eval_loss": evaluate(weights)}
                log.append(record)
                on_log([record])
                window_start = time.perf_counter()
            if saving:
                state = {"micro_batches": step * k, "rng": {"seed": cfg.seed, "step": step}, "log": log}
                last_checkpoint = str(checkpoint.save(checkpoint_dir, step, weights, opt_state, state))
                window_start = time.perf_counter()

    train_records = [r for r in log if "loss" in r]
    window = [r for r in train_records if r["step"] > total - cfg.log_every] or train_records[-1:]
    steady = [r for r in train_records if r["step"] > start + 1 and r["tokens_per_second"]]
    summary = {
        "steps": total,
        "resumed_from": start,
        "seconds": round(time.perf_counter() - started, 3),
        "compile_seconds": round(compile_seconds, 3),
        "tokens_per_second": round(float(np.mean([r["tokens_per_second"] for r in steady])), 1) if steady else 0.0,
        "final_loss": float(np.mean([r["loss"] for r in window])),
        "trainable_parameters": int(sum(np.prod(v.shape) for v in weights.values())),
        "rows_per_step": cfg.batch_size * k,
    }
    weights = {name: np.asarray(jax.device_get(value)) for name, value in weights.items()}
    return TrainResult(weights=weights, opt_state=jax.device_get(opt_state), log=log, summary=summary, memory=plan)


def _record(step: int, loss: float, grad_norm: float, tokens: int, schedule, tokens_per_second: float,
            last_checkpoint: str | None) -> dict:
    if not (np.isfinite(loss) and np.isfinite(grad_norm)):
        where = f"last good checkpoint: {last_checkpoint} (kept)" if last_checkpoint else "no checkpoint was written yet"
        raise NonFiniteLoss(f"train step {step}: loss {loss}, gradient norm {grad_norm}; {where}")
    return {
        "step": step,
        "loss": round(loss, 6),
        "lr": float(schedule(step - 1)),
        "grad_norm": round(grad_norm, 6),
        "tokens": tokens,
        "tokens_per_second": round(tokens_per_second, 1),
    }


def _evaluator(model: JaxModel, eval_data, cfg: TrainConfig, pad_id: int) -> Callable:
    """weights -> eval-split loss, with one compiled eval step reused across calls."""
    from jaxtune.runtime.inference import evaluate

    eval_step = steps.make_eval_step(model)
    ids, labels = eval_data
    categories = [""] * len(ids)

    def run(weights) -> float:
        trained = JaxModel(model.module, weights, model.buffers, model.placement, model.dtype, model.casts)
        return evaluate(trained, ids, labels, categories, cfg.batch_size, pad_id, eval_step=eval_step, progress=False)["loss"]

    return run
