"""The training loop: host-side batching, logging, evaluation and checkpoints around one compiled step.

The host syncs only every `log_every` steps, before a checkpoint and before an eval: there it
fetches the losses of the window, stops on the first non-finite one (naming the step and the
last good checkpoint), and reports one record per step.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax
import numpy as np
from tqdm import tqdm

from jaxtune.host import processes, stopping
from jaxtune.config import TrainConfig
from jaxtune.errors import NonFiniteLoss, TrainingGaveUp
from jaxtune.runtime.train import checkpoint
from jaxtune.runtime.measures import fit, memory
from jaxtune.runtime.compiled import steps
from jaxtune.runtime.modeling import attention
from jaxtune.runtime.compiled.batches import row_lengths, stack_micro_batches
from jaxtune.runtime.train.feed import Feed, make_feed
from jaxtune.records import TrainSummary
from jaxtune.runtime.devices.mesh import fetch
from jaxtune.runtime.modeling.model import JaxModel
from jaxtune.runtime.compiled.preference import SFT, Objective


@dataclass
class TrainResult:
    weights: dict[str, np.ndarray]
    opt_state: Any
    log: list[dict] = field(default_factory=list)
    summary: TrainSummary | None = None
    memory: dict = field(default_factory=dict)


def feed_for(model: JaxModel, lengths: Sequence[int], cfg: TrainConfig, max_length: int, packing: bool = True,
             pairs: bool = False) -> Feed:
    """Packed micro-batches when asked for and the model's attention can isolate rows (else padded
    ones); `pairs`: of preference pairs (see `feed`)."""
    return make_feed(lengths, cfg, max_length, model.placement.batch_shards, packing and attention.supported(model.module),
                     pairs, attention.length_multiple(model.module, model.placement.mesh))


def total_steps(cfg: TrainConfig, feed: Feed) -> int:
    """`max_steps`, or the optimizer steps in `epochs` passes over the feed's micro-batches."""
    if cfg.max_steps is not None:
        return cfg.max_steps
    return max(cfg.epochs * feed.micro_batches_per_epoch // cfg.grad_accumulation, 1)


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
    packing: bool = True,
    feed: Feed | None = None,
    restart: bool = False,
    objective: Objective = SFT,
    reference: tuple[np.ndarray, np.ndarray] | None = None,
) -> TrainResult:
    """Train for `total_steps`; resume from the newest checkpoint in `checkpoint_dir` if there is one.
    `feed`: the caller's `feed_for` of these rows, if it has one (planning it is a pass over every row).
    `restart`: this run was started automatically after a crash; it gives up (`TrainingGaveUp`)
    rather than train when the restarts before it are stuck (`GIVE_UP_AFTER`).
    `objective`: a preference objective trains on pairs of rows (2p chosen, 2p+1 rejected), with
    `reference` the reference log-probability of every (train row, eval row) for DPO."""
    # Counted first, before any compile: a stuck restart gives up in seconds.
    interruptions = _interruptions(checkpoint_dir, restart) if checkpoint_dir else []
    feed = feed or feed_for(model, row_lengths(input_ids), cfg, max_length, packing, objective.pairs)
    fused = attention.supported(model.module)
    original = cfg
    optimizer = steps.make_optimizer(cfg)
    plan, chosen, chunk = {}, None, None
    if check_memory:
        # Planned with the step that trains: its first call finds this trace (the model is traced once, not twice).
        feeds = {cfg.batch_size: feed}

        def shape(run: TrainConfig) -> tuple[int, int, int]:
            if run.batch_size not in feeds:
                feeds[run.batch_size] = feed_for(model, row_lengths(input_ids), run, max_length, packing, objective.pairs)
            planned = feeds[run.batch_size]
            return planned.rows, planned.length, planned.segments

        chosen = fit.choose(model, optimizer, cfg, shape, fused=fused, objective=objective)
        plan = {**chosen.plan, "fit": chosen.record()}
        cfg, chunk = chosen.train_config(cfg), chosen.chunk_tokens
        shape(cfg)  # a recalled fit compiled nothing, and asked for no feed of its rows
        feed = feeds[cfg.batch_size]
    elif cfg.remat == "auto":
        cfg = cfg.model_copy(update={"remat": fit.fixed(cfg.remat)})
    total = total_steps(cfg, feed)
    if chosen is not None:  # with train.epochs, a split feed may count a step more or less than the configured one
        on_log([{"memory_plan": plan, "total_steps": total,
                 "message": f"{chosen.describe(original)}; {memory.describe(plan)}"}])
        memory.check_fits(plan, original)
    schedule = steps.learning_rate_schedule(cfg, total)
    step_fn = steps.make_train_step(model, optimizer, remat=cfg.remat, fused=fused, objective=objective,
                                    chunk_tokens=chunk)
    train_reference, eval_reference = reference if reference is not None else (None, None)
    evaluate = _evaluator(model, eval_data, cfg, pad_id, objective, eval_reference) if cfg.eval_every and eval_data else None
    flops = flops_per_token(model, feed)

    # Placed on the mesh as the step's outputs are: a state on one device would compile the step twice.
    weights, opt_state, start, log, last_checkpoint = resume(model, optimizer, checkpoint_dir, on_log)

    k = cfg.grad_accumulation
    micro_batches = feed.micro_batches(input_ids, labels, pad_id, train_reference)
    for _ in range(start * k):  # the data position: every micro-batch before the resumed step
        next(micro_batches)
    pending, window_tokens, slots = [], 0, [0, 0]
    started = window_start = time.perf_counter()
    compile_seconds = 0.0
    with stopping.stop_on_signals(cfg.checkpoint_minutes) as stops:
        for step in tqdm(range(start + 1, total + 1), desc="train", unit="step", initial=start, total=total):
            parts = [next(micro_batches) for _ in range(k)]
            batch = stack_micro_batches(parts, pad_id)
            tokens = int(batch["attention_mask"].sum())
            window_tokens += tokens
            slots[0], slots[1] = slots[0] + tokens, slots[1] + batch["attention_mask"].size
            batch = model.placement.shard_micro_batches(batch)
            batch_labels = batch.pop("labels")
            loss, weights, opt_state = step_fn(weights, model.buffers, opt_state, batch, batch_labels,
                                               steps.step_key(cfg.seed, step), schedule(step - 1))
            pending.append((step, tokens, loss, steps.grad_norm_of(opt_state)))

            # On a stop signal this step is the last: saved whatever its number, and not evaluated
            # (the notice's seconds go to the checkpoint; a resumed run starts after this step).
            stop, due = stops.after_step()
            saving = checkpoint_dir is not None and (stop or (step < total and (step % cfg.checkpoint_every == 0 or due)))
            evaluating = not stop and evaluate is not None and (step % cfg.eval_every == 0 or step == total)
            if step == start + 1 or step % cfg.log_every == 0 or step == total or saving or evaluating or stop:
                fetched = fetch(pending)  # the host sync
                elapsed = time.perf_counter() - window_start
                if step == start + 1:  # the first call compiles: no tokens/s for it
                    compile_seconds, window_tokens = elapsed, 0
                records = [_record(s, float(l), float(g), t, schedule, window_tokens / elapsed if window_tokens else 0.0,
                                   last_checkpoint, flops) for s, t, l, g in fetched]
                if checkpoint_dir is not None and processes.writes():  # at the syncs only, a file write; before
                    checkpoint.note_progress(checkpoint_dir, step)  # the log, so it never says less than the log
                log += records
                on_log(records)
                pending, window_tokens, window_start = [], 0, time.perf_counter()
                if evaluating:
                    record = {"step": step, "eval_loss": evaluate(weights)}
                    log.append(record)
                    on_log([record])
                    window_start = time.perf_counter()
                if saving:
                    last_checkpoint = save_checkpoint(checkpoint_dir, step, weights, opt_state, log, cfg)
                    stops.saved()
                    window_start = time.perf_counter()
                if stop:
                    if saving and processes.writes():
                        checkpoint.note_progress(checkpoint_dir, step, stopped_by=stops.signal)
                    raise stops.stopped(step, last_checkpoint if saving else None)

    train_records = [r for r in log if "loss" in r]
    window = [r for r in train_records if r["step"] > total - cfg.log_every] or train_records[-1:]
    steady = [r for r in train_records if r["step"] > start + 1 and r["tokens_per_second"]]
    tokens_per_second = float(np.mean([r["tokens_per_second"] for r in steady])) if steady else 0.0
    summary = TrainSummary(
        steps=total,
        objective=objective.name,
        resumed_from=start,
        interruptions=interruptions,
        seconds=round(time.perf_counter() - started, 3),
        compile_seconds=round(compile_seconds, 3),
        tokens_per_second=round(tokens_per_second, 1),
        mfu=round(tokens_per_second * flops["per_token"] / flops["peak"], 4) if flops["peak"] else None,
        mfu_derivation=flops["derivation"],
        packed=feed.packed,
        fused_attention=fused,
        batch_shape=[k, feed.rows, feed.length],
        nonpad_fraction=round(slots[0] / slots[1], 4) if slots[1] else None,
        final_loss=float(np.mean([r["loss"] for r in window])),
        trainable_parameters=int(sum(np.prod(v.shape) for v in weights.values())),
        rows_per_step=cfg.batch_size * k,
        mesh=model.placement.describe(),
        remat=cfg.remat,
        loss_chunk_tokens=chunk,
        fit=chosen.record() if chosen else None,
    )
    weights, opt_state = fetch((weights, opt_state))
    return TrainResult(weights=weights, opt_state=opt_state, log=log, summary=summary, memory=plan)


def resume(model: JaxModel, optimizer, checkpoint_dir: Path | None, on_log: Callable[[list[dict]], None]):
    """(weights, optimizer state, step, log, checkpoint path): the newest checkpoint's in `checkpoint_dir`,
    placed on the mesh as the step's outputs are (a state on one device would compile the step twice),
    else the model's own at step 0. A resumed log is passed to `on_log` first, so the run's log is whole."""
    weights, opt_state = model.weights, steps.init_optimizer(model, optimizer)
    resumed = checkpoint.latest(checkpoint_dir, opt_state) if checkpoint_dir else None
    if resumed is None:
        return weights, opt_state, 0, [], None
    put = model.placement.put
    weights = {name: put(resumed.weights[name], value.sharding) for name, value in weights.items()}
    opt_state = jax.tree.map(lambda saved, now: put(saved, now.sharding), resumed.opt_state, opt_state)
    on_log(resumed.state["log"])
    return weights, opt_state, resumed.step, resumed.state["log"], str(resumed.path)


GIVE_UP_AFTER = 3  # automatic restarts in a row that came back to one checkpoint before the next gives up


def _interruptions(folder: Path, restart: bool) -> list[dict]:
    """The interruptions of this training so far, the one that ended the attempt before this one
    (if one ran) added: the last step it logged, how it stopped, the logged steps this run trains
    again (a killed run may have trained a few more, unlogged), and whether this run is an
    automatic restart. Recorded at once, so an attempt killed before its first checkpoint counts."""
    start = checkpoint.newest_step(folder)
    found = checkpoint.read_interruptions(folder)
    progress = checkpoint.read_progress(folder)
    if progress is not None:  # an attempt before this one began, and did not finish
        found.append({"reached": progress["step"], "resumed_from": start, "lost_steps": max(progress["step"] - start, 0),
                      "stopped_by": progress.get("stopped_by") or "killed", "restart": restart})
    processes.barrier("interruptions read")  # by every process, before process 0 writes them
    if processes.writes():
        checkpoint.note_interruptions(folder, found)
        checkpoint.note_progress(folder, start)  # this attempt began: dying before its first log counts too
    stuck = list(itertools.takewhile(lambda i: i["restart"] and i["resumed_from"] == start, reversed(found)))
    if restart and len(stuck) > GIVE_UP_AFTER:
        if processes.writes():
            checkpoint.note_progress(folder, start, stopped_by="gave up")
        last = stuck[0]  # how the newest of those restarts ended
        raise TrainingGaveUp(
            f"gave up: {len(stuck) - 1} automatic restarts in a row resumed from step {start} and none saved a later "
            f"checkpoint (the last reached step {last['reached']}, {last['stopped_by']}); not restarting again. Find "
            f"the cause in those runs' logs, then run it again by hand: it resumes from step {start}")
    return found


def save_checkpoint(folder: Path, step: int, weights, opt_state, log: list[dict], cfg: TrainConfig) -> str:
    """Checkpoint `step` (every process gathers the state, process 0 writes it); its path."""
    state = {"micro_batches": step * cfg.grad_accumulation, "rng": {"seed": cfg.seed, "step": step}, "log": log}
    host_weights, host_state = fetch((weights, opt_state))
    path = folder / f"{checkpoint.PREFIX}{step:08d}"
    if processes.writes():
        path = checkpoint.save(folder, step, host_weights, host_state, state)
    processes.barrier(f"checkpoint {step}")
    return str(path)


def flops_per_token(model: JaxModel, feed: Feed) -> dict:
    """Model FLOPs per real token (attention over about half the mean row, causally) and the devices' peak."""
    from jaxtune.runtime.measures.flops import device_peak, train_flops_per_token

    context = float(np.mean(feed.lengths)) / 2
    per_token = train_flops_per_token(model, context)["total"]
    peak = device_peak()
    return {"per_token": per_token, "peak": peak["peak_flops"],
            "derivation": f"{per_token / 1e6:.1f} MFLOP per token (forward + backward, attention over {context:.0f} "
                          f"tokens); peak {peak['derivation']}"}


def _record(step: int, loss: float, grad_norm: float, tokens: int, schedule, tokens_per_second: float,
            last_checkpoint: str | None, flops: dict) -> dict:
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
        "mfu": round(tokens_per_second * flops["per_token"] / flops["peak"], 4) if flops["peak"] else None,
    }


def _evaluator(model: JaxModel, eval_data, cfg: TrainConfig, pad_id: int, objective: Objective = SFT,
               reference: np.ndarray | None = None) -> Callable:
    """weights -> eval-split loss (the objective's), with one compiled eval step reused across calls."""
    from jaxtune.runtime.decoding.inference import evaluate, evaluate_pairs

    eval_step = steps.make_eval_step(model)
    ids, labels = eval_data
    categories = [""] * len(ids)

    def run(weights) -> float:
        trained = JaxModel(model.module, weights, model.buffers, model.placement, model.dtype, model.casts, model.scan_layers)
        if objective.pairs:
            return evaluate_pairs(trained, objective, ids, labels, reference, categories, cfg.batch_size, pad_id,
                                  eval_step=eval_step, progress=False)["loss"]
        return evaluate(trained, ids, labels, categories, cfg.batch_size, pad_id, eval_step=eval_step, progress=False)["loss"]

    return run
