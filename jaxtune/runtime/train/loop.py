"""The one training loop: SFT, preference and GRPO training all run here, around one compiled step.

What differs between them is where a step's rows come from, a `Source`: the feed of packed or
padded micro-batches (`training.FeedSource`), or the rollouts GRPO samples with the weights being
trained (`rollouts.RolloutSource`). Everything else exists once, in this order:

1. the interruptions of earlier attempts, counted before any compile (a stuck restart gives up in
   seconds, `TrainingGaveUp`);
2. the plan: `train.remat: auto` chooses how the step runs (`fit.choose`) from the shapes the
   source gives for a batch size, and the plan is logged and checked against the device;
3. resume from the newest checkpoint, the source positioned at the resumed step;
4. the steps: the host syncs at a log point (every `log_every` steps, before a checkpoint, an eval
   or a stop; every step for a source that needs one, as GRPO's rewards need the answers), where it
   stops on the first non-finite loss, naming the step and the last good checkpoint, and logs one
   record per step; checkpoints every `checkpoint_every` steps and on a stop signal;
5. the summary (`records.TrainSummary`): the loop's own figures and the source's.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import jax
import numpy as np
from tqdm import tqdm

from jaxtune.config import TrainConfig
from jaxtune.errors import NonFiniteLoss, TrainingGaveUp
from jaxtune.host import processes, stopping
from jaxtune.records import TrainSummary
from jaxtune.runtime.compiled import steps
from jaxtune.runtime.compiled.preference import Objective
from jaxtune.runtime.devices.mesh import fetch
from jaxtune.runtime.measures import fit, memory
from jaxtune.runtime.modeling import attention
from jaxtune.runtime.modeling.model import JaxModel
from jaxtune.runtime.modeling.stacked import Layout
from jaxtune.runtime.train import checkpoint

Shape = tuple[int, int, int]  # rows, length and segments of one micro-batch


class Source(Protocol):
    """Where a loop's batches come from."""

    every_step: bool  # a host sync and a record every step, with the step's own timings

    def shape(self, run: TrainConfig) -> Shape:
        """One micro-batch's shape under `run` (the plan asks for other batch sizes)."""

    def total_steps(self, cfg: TrainConfig) -> int: ...

    def start(self, cfg: TrainConfig, step: int) -> None:
        """Be ready for step `step` + 1 under the chosen `cfg`."""

    def next(self, step: int, weights) -> tuple[dict[str, np.ndarray], dict[str, float]]:
        """Step `step`'s k micro-batches stacked on the host, (k, rows, ...) with labels, and figures for its record."""

    def flops(self) -> dict | None:
        """{'per_token', 'peak', 'derivation'} for the MFU (once started), or None where it is not counted."""

    def summary(self, log: list[dict]) -> dict[str, Any]:
        """The source's own fields of the summary, `final_loss` among them."""


@dataclass
class TrainResult:
    weights: dict[str, np.ndarray]
    opt_state: Any
    log: list[dict] = field(default_factory=list)
    summary: TrainSummary | None = None
    memory: dict = field(default_factory=dict)


def run(
    model: JaxModel,
    cfg: TrainConfig,
    source: Source,
    objective: Objective,
    on_log: Callable[[list[dict]], None] = lambda records: None,
    checkpoint_dir: Path | None = None,
    check_memory: bool = True,
    restart: bool = False,
    evaluator: Callable[[TrainConfig], Callable[[dict], float]] | None = None,
) -> TrainResult:
    """Train for the source's total steps; resume from the newest checkpoint in `checkpoint_dir` if
    there is one. `restart`: this run was started automatically after a crash; it gives up
    (`TrainingGaveUp`) rather than train when the restarts before it are stuck (`GIVE_UP_AFTER`).
    `evaluator(cfg as chosen)`: weights -> the eval split's loss, run every `eval_every` steps and at the end."""
    interruptions = _interruptions(checkpoint_dir, restart) if checkpoint_dir else []
    fused = attention.supported(model.module)
    optimizer = steps.make_optimizer(cfg)
    # `asked` is train as configured; from here on `cfg` is train as it runs (auto's policy and split)
    asked, plan, chosen, chunk = cfg, {}, None, None
    if check_memory:
        chosen = fit.choose(model, optimizer, cfg, source.shape, fused=fused, objective=objective)
        plan = {**chosen.plan.record(), "fit": chosen.record()}  # as memory.json and the log keep it
        cfg, chunk = chosen.train_config(asked), chosen.chunk_tokens
    elif cfg.remat == "auto":
        cfg = cfg.model_copy(update={"remat": fit.fixed(cfg.remat)})
    spec = steps.StepSpec(cfg.remat, fused=fused, objective=objective, chunk_tokens=chunk)
    total = source.total_steps(cfg)
    if chosen is not None:  # with train.epochs, a split feed may count a step more or less than the configured one
        on_log(
            [
                {
                    "memory_plan": plan,
                    "total_steps": total,
                    "message": f"{chosen.describe(asked)}; {memory.describe(chosen.plan)}",
                }
            ]
        )
        memory.check_fits(chosen.plan, asked)
    schedule = steps.learning_rate_schedule(cfg, total)
    step_fn = steps.make_train_step(model, optimizer, spec)
    evaluate = evaluator(cfg) if evaluator is not None and cfg.eval_every else None

    weights, opt_state, start, log, last_checkpoint = resume(model, optimizer, checkpoint_dir, on_log)
    source.start(cfg, start)
    flops = source.flops()
    pending, window_tokens = [], 0
    started = window_start = time.perf_counter()
    compile_seconds = 0.0
    with stopping.stop_on_signals(cfg.checkpoint_minutes) as stops:
        for step in tqdm(range(start + 1, total + 1), desc="train", unit="step", initial=start, total=total):
            step_began = time.perf_counter()
            batch, figures = source.next(step, weights)
            tokens = int(batch["attention_mask"].sum())
            window_tokens += tokens
            stacked = model.placement.shard_micro_batches(batch)
            labels = stacked.pop("labels")
            update_began = time.perf_counter()
            loss, weights, opt_state = step_fn(
                weights, model.buffers, opt_state, stacked, labels, steps.step_key(cfg.seed, step), schedule(step - 1)
            )
            pending.append((step, tokens, figures, loss, steps.grad_norm_of(opt_state)))

            # On a stop signal this step is the last: saved whatever its number, and not evaluated
            # (the notice's seconds go to the checkpoint; a resumed run starts after this step).
            stop, due = stops.after_step()
            saving = checkpoint_dir is not None and (
                stop or (step < total and (step % cfg.checkpoint_every == 0 or due))
            )
            evaluating = not stop and evaluate is not None and (step % cfg.eval_every == 0 or step == total)
            if (
                source.every_step
                or step == start + 1
                or step % cfg.log_every == 0
                or step == total
                or saving
                or evaluating
                or stop
            ):
                values = fetch([(loss_, norm) for *_, loss_, norm in pending])  # the host sync
                now = time.perf_counter()
                elapsed = now - window_start
                if step == start + 1:  # the first call compiles: no tokens/s for it
                    compile_seconds, window_tokens = now - update_began, 0
                timing = {"update_seconds": round(now - update_began, 4), "step_seconds": round(now - step_began, 4)}
                rate = (
                    tokens / (now - update_began)
                    if source.every_step
                    else window_tokens / elapsed
                    if window_tokens
                    else 0.0
                )
                records = [
                    _record(
                        s,
                        float(loss_),
                        float(norm),
                        t,
                        schedule,
                        rate,
                        last_checkpoint,
                        flops,
                        f,
                        timing if source.every_step else {},
                    )
                    for (s, t, f, *_), (loss_, norm) in zip(pending, values)
                ]
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
                last_checkpoint = save_checkpoint(checkpoint_dir, step, weights, opt_state, log, cfg, model.layout)
                stops.saved()
                window_start = time.perf_counter()
            if stop:
                if saving and processes.writes():
                    checkpoint.note_progress(checkpoint_dir, step, stopped_by=stops.signal)
                raise stops.stopped(step, last_checkpoint if saving else None)

    summary = TrainSummary(
        steps=total,
        objective=objective.name,
        resumed_from=start,
        interruptions=interruptions,
        seconds=round(time.perf_counter() - started, 3),
        compile_seconds=round(compile_seconds, 3),
        trainable_parameters=int(sum(np.prod(v.shape) for v in weights.values())),
        mesh=model.placement.describe(),
        remat=cfg.remat,
        loss_chunk_tokens=chunk,
        fit=chosen.record() if chosen else None,
        **source.summary(log),
    )
    weights, opt_state = fetch((weights, opt_state))
    return TrainResult(weights=model.flat(weights), opt_state=opt_state, log=log, summary=summary, memory=plan)


def _record(
    step: int,
    loss: float,
    grad_norm: float,
    tokens: int,
    schedule,
    tokens_per_second: float,
    last_checkpoint: str | None,
    flops: dict | None,
    figures: dict,
    timing: dict,
) -> dict:
    if not (np.isfinite(loss) and np.isfinite(grad_norm)):
        where = (
            f"last good checkpoint: {last_checkpoint} (kept)" if last_checkpoint else "no checkpoint was written yet"
        )
        raise NonFiniteLoss(f"train step {step}: loss {loss}, gradient norm {grad_norm}; {where}")
    record = {
        "step": step,
        "loss": round(loss, 6),
        "lr": float(schedule(step - 1)),
        "grad_norm": round(grad_norm, 6),
        "tokens": tokens,
        "tokens_per_second": round(tokens_per_second, 1),
    }
    if flops is not None:
        record["mfu"] = round(tokens_per_second * flops["per_token"] / flops["peak"], 4) if flops["peak"] else None
    return {**record, **timing, **{key: round(value, 6) for key, value in figures.items()}}


def resume(model: JaxModel, optimizer, checkpoint_dir: Path | None, on_log: Callable[[list[dict]], None]):
    """(weights, optimizer state, step, log, checkpoint path): the newest checkpoint's in `checkpoint_dir`,
    placed on the mesh as the step's outputs are (a state on one device would compile the step twice),
    else the model's own at step 0. A resumed log is passed to `on_log` first, so the run's log is whole."""
    weights, opt_state = model.weights, steps.init_optimizer(model, optimizer)
    resumed = checkpoint.latest(checkpoint_dir, opt_state, model.layout) if checkpoint_dir else None
    if resumed is None:
        return weights, opt_state, 0, [], None
    put = model.placement.put
    weights = {name: put(resumed.weights[name], value.sharding) for name, value in weights.items()}
    opt_state = jax.tree.map(lambda saved, now: put(saved, now.sharding), resumed.opt_state, opt_state)
    on_log(resumed.state["log"])
    return weights, opt_state, resumed.step, resumed.state["log"], str(resumed.path)


def save_checkpoint(
    folder: Path, step: int, weights, opt_state, log: list[dict], cfg: TrainConfig, layout: Layout | None = None
) -> str:
    """Checkpoint `step` (every process gathers the state, process 0 writes it, in per-layer names); its path."""
    state = {"micro_batches": step * cfg.grad_accumulation, "rng": {"seed": cfg.seed, "step": step}, "log": log}
    host_weights, host_state = fetch((weights, opt_state))
    path = folder / f"{checkpoint.PREFIX}{step:08d}"
    if processes.writes():
        path = checkpoint.save(folder, step, host_weights, host_state, state, layout)
    processes.barrier(f"checkpoint {step}")
    return str(path)


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
        found.append(
            {
                "reached": progress["step"],
                "resumed_from": start,
                "lost_steps": max(progress["step"] - start, 0),
                "stopped_by": progress.get("stopped_by") or "killed",
                "restart": restart,
            }
        )
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
            f"the cause in those runs' logs, then run it again by hand: it resumes from step {start}"
        )
    return found
