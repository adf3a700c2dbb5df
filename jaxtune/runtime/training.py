"""The training loop: host-side batching and logging around one compiled step."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import jax
import numpy as np
from tqdm import tqdm

from jaxtune.config import TrainConfig
from jaxtune.runtime import steps
from jaxtune.runtime.batches import BUCKET, bucket_length, pad_batch, train_batches
from jaxtune.runtime.model import JaxModel


@dataclass
class TrainResult:
    weights: dict[str, np.ndarray]
    opt_state: dict[str, np.ndarray]
    log: list[dict] = field(default_factory=list)
    summary: dict = field(default_factory=dict)


def train(
    model: JaxModel,
    input_ids: Sequence[Sequence[int]],
    labels: Sequence[Sequence[int]],
    cfg: TrainConfig,
    pad_id: int,
    max_length: int,
    on_log: Callable[[dict], None] = lambda record: None,
) -> TrainResult:
    """Run `cfg.max_steps` steps; every `cfg.log_every` steps fetch the losses and report a record."""
    if cfg.batch_size % model.placement.data_size:
        raise ValueError(f"train.batch_size={cfg.batch_size} must divide over {model.placement.data_size} data-parallel devices")
    optimizer = steps.make_optimizer(cfg)
    step_fn = steps.make_train_step(model, optimizer)
    schedule = steps.learning_rate_schedule(cfg)
    weights, opt_state = model.weights, optimizer.init(model.weights)
    batches = train_batches(len(input_ids), cfg.batch_size, cfg.seed)
    log, pending, window_tokens = [], [], 0
    started = window_start = time.perf_counter()
    compile_seconds = 0.0
    for step in tqdm(range(1, cfg.max_steps + 1), desc="train", unit="step"):
        rows = next(batches)
        length = bucket_length(max(len(input_ids[r]) for r in rows), BUCKET, max_length)
        batch = pad_batch([input_ids[r] for r in rows], [labels[r] for r in rows], pad_id, length, cfg.batch_size)
        window_tokens += int(batch["attention_mask"].sum())
        batch = model.placement.shard_batch(batch)
        batch_labels = batch.pop("labels")
        loss, weights, opt_state = step_fn(weights, model.buffers, opt_state, batch, batch_labels)
        pending.append((loss, steps.grad_norm_of(opt_state)))
        if step == 1 or step % cfg.log_every == 0 or step == cfg.max_steps:
            losses = jax.device_get(pending)  # the only host sync: once per logging window
            elapsed = time.perf_counter() - window_start
            if step == 1:  # the first call compiles: log it alone, with no tokens/s
                compile_seconds, window_tokens = elapsed, 0
            record = _record(step, losses, schedule, window_tokens, elapsed)
            log.append(record), on_log(record)
            pending, window_tokens, window_start = [], 0, time.perf_counter()
    seconds = time.perf_counter() - started
    trained_tokens = sum(r["tokens"] for r in log[1:])
    steady_seconds = sum(r["seconds"] for r in log[1:])
    summary = {
        "steps": cfg.max_steps,
        "seconds": round(seconds, 3),
        "compile_seconds": round(compile_seconds, 3),
        "tokens_per_second": round(trained_tokens / steady_seconds, 1) if steady_seconds else 0.0,
        "final_loss": log[-1]["loss"],
        "trainable_parameters": int(sum(np.prod(v.shape) for v in weights.values())),
    }
    return TrainResult(weights=_to_numpy(weights), opt_state=_flatten(opt_state), log=log, summary=summary)


def _record(step: int, losses, schedule, tokens: int, seconds: float) -> dict:
    loss = float(np.mean([float(l) for l, _ in losses]))
    grad_norm = float(losses[-1][1])
    if not np.isfinite(loss):
        raise FloatingPointError(f"train step {step}: loss is {loss}")
    return {
        "step": step,
        "loss": round(loss, 6),
        "lr": float(schedule(step - 1)),
        "grad_norm": round(grad_norm, 6),
        "tokens": tokens,
        "seconds": round(seconds, 4),
        "tokens_per_second": round(tokens / seconds, 1) if tokens and seconds else 0.0,
    }


def _to_numpy(tree: dict) -> dict[str, np.ndarray]:
    return {name: np.asarray(jax.device_get(value)) for name, value in tree.items()}


def _flatten(tree) -> dict[str, np.ndarray]:
    """Optimizer state as name -> array, names from the pytree path, for safetensors."""
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {jax.tree_util.keystr(path): np.asarray(jax.device_get(leaf)) for path, leaf in leaves}
