"""SFT and preference training: the rows' micro-batches (`FeedSource`) through the one loop (`loop.run`),
with the eval split's loss as the loop's eval.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from jaxtune.config import TrainConfig
from jaxtune.runtime.compiled import steps
from jaxtune.runtime.compiled.batches import row_lengths, stack_micro_batches
from jaxtune.runtime.compiled.preference import SFT, Objective
from jaxtune.runtime.modeling import attention
from jaxtune.runtime.modeling.model import JaxModel
from jaxtune.runtime.train import loop
from jaxtune.runtime.train.feed import Feed, make_feed
from jaxtune.runtime.train.loop import GIVE_UP_AFTER, TrainResult  # noqa: F401 - callers name them here too


def feed_for(
    model: JaxModel,
    lengths: Sequence[int],
    cfg: TrainConfig,
    longest: int,
    packing: bool = True,
    pairs: bool = False,
) -> Feed:
    """Packed micro-batches when asked for and the model's attention can isolate rows (else padded
    ones); `pairs`: of preference pairs (see `feed`). `longest`: the longest of the rows (the tokenized
    rows' `longest`, at most data.max_length), the most tokens a packed sequence holds."""
    return make_feed(
        lengths,
        cfg,
        longest,
        model.placement.batch_shards,
        packing and attention.supported(model.module),
        pairs,
        attention.length_multiple(model.module, model.placement.mesh),
    )


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
    longest: int,
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
    """SFT or preference training on these rows (the longest of them `longest` tokens) through `loop.run`,
    resuming from the newest checkpoint in `checkpoint_dir` if there is one. `feed`: the caller's `feed_for`
    of these rows, if it has one (planning it is a pass over every row). `restart`: see `loop.run`.
    `objective`: a preference objective trains on pairs of rows (2p chosen, 2p+1 rejected), with
    `reference` the reference log-probability of every (train row, eval row) for DPO."""
    train_reference, eval_reference = reference if reference is not None else (None, None)
    source = FeedSource(
        model,
        input_ids,
        labels,
        pad_id,
        longest,
        packing,
        objective.pairs,
        train_reference,
        {cfg.batch_size: feed} if feed is not None else {},
    )
    evaluator = (
        (lambda chosen: _evaluator(model, eval_data, chosen, pad_id, objective, eval_reference)) if eval_data else None
    )
    return loop.run(model, cfg, source, objective, on_log, checkpoint_dir, check_memory, restart, evaluator)


class FeedSource:
    """The rows' packed or padded micro-batches (`feed`), in the seeded order, from the resumed step on."""

    every_step = False

    def __init__(
        self,
        model: JaxModel,
        input_ids,
        labels,
        pad_id: int,
        longest: int,
        packing: bool,
        pairs: bool,
        reference: np.ndarray | None,
        feeds: dict[int, Feed],
    ):
        self.model, self.input_ids, self.labels, self.pad_id = model, input_ids, labels, pad_id
        self.longest, self.packing, self.pairs, self.reference = longest, packing, pairs, reference
        self.feeds = feeds  # by batch size: the plan asks for others, each a pass over the rows

    def _feed(self, cfg: TrainConfig) -> Feed:
        if cfg.batch_size not in self.feeds:
            self.feeds[cfg.batch_size] = feed_for(
                self.model, row_lengths(self.input_ids), cfg, self.longest, self.packing, self.pairs
            )
        return self.feeds[cfg.batch_size]

    def shape(self, run: TrainConfig) -> tuple[int, int, int]:
        feed = self._feed(run)
        return feed.rows, feed.length, feed.segments

    def total_steps(self, cfg: TrainConfig) -> int:
        return total_steps(cfg, self._feed(cfg))

    def start(self, cfg: TrainConfig, step: int) -> None:
        self.cfg, self.feed, self.first = cfg, self._feed(cfg), step
        self.figures = flops_per_token(self.model, self.feed)  # the MFU's: once, for the records and the summary
        self.micro_batches = self.feed.micro_batches(self.input_ids, self.labels, self.pad_id, self.reference)
        for _ in range(step * cfg.grad_accumulation):  # the data position: every micro-batch before the resumed step
            next(self.micro_batches)
        self.slots = [0, 0]  # real tokens, token slots

    def next(self, step: int, weights) -> tuple[dict[str, np.ndarray], dict[str, float]]:
        batch = stack_micro_batches([next(self.micro_batches) for _ in range(self.cfg.grad_accumulation)], self.pad_id)
        self.slots[0] += int(batch["attention_mask"].sum())
        self.slots[1] += batch["attention_mask"].size
        return batch, {}

    def flops(self) -> dict:
        return self.figures

    def summary(self, log: list[dict]) -> dict:
        cfg, feed, slots = self.cfg, self.feed, self.slots
        records = [r for r in log if "loss" in r]
        total = records[-1]["step"] if records else self.first
        window = [r for r in records if r["step"] > total - cfg.log_every] or records[-1:]
        steady = [r for r in records if r["step"] > self.first + 1 and r["tokens_per_second"]]
        tokens_per_second = float(np.mean([r["tokens_per_second"] for r in steady])) if steady else 0.0
        flops = self.flops()
        return {
            "tokens_per_second": round(tokens_per_second, 1),
            "mfu": round(tokens_per_second * flops["per_token"] / flops["peak"], 4) if flops["peak"] else None,
            "mfu_derivation": flops["derivation"],
            "packed": feed.packed,
            "fused_attention": attention.supported(self.model.module),
            "batch_shape": [cfg.grad_accumulation, feed.rows, feed.length],
            "nonpad_fraction": round(slots[0] / slots[1], 4) if slots[1] else None,
            "final_loss": float(np.mean([r["loss"] for r in window])),
            "rows_per_step": cfg.batch_size * cfg.grad_accumulation,
        }


def flops_per_token(model: JaxModel, feed: Feed) -> dict:
    """Model FLOPs per real token (attention over about half the mean row causally, at most the window in a
    sliding-window layer) and the devices' peak."""
    from jaxtune.runtime.measures.flops import attended_keys, device_peak, train_flops_per_token

    context = attended_keys(model.config, round(float(np.mean(feed.lengths))))
    per_token = train_flops_per_token(model, context)["total"]
    peak = device_peak()
    return {
        "per_token": per_token,
        "peak": peak["peak_flops"],
        "derivation": f"{per_token / 1e6:.1f} MFLOP per token (forward + backward, attention over {context:.0f} "
        f"tokens); peak {peak['derivation']}",
    }


def _evaluator(
    model: JaxModel,
    eval_data,
    cfg: TrainConfig,
    pad_id: int,
    objective: Objective = SFT,
    reference: np.ndarray | None = None,
) -> Callable:
    """weights -> eval-split loss (the objective's), with one compiled eval step reused across calls."""
    from jaxtune.runtime.decoding.inference import evaluate, evaluate_pairs

    eval_step = steps.make_eval_step(model)
    ids, labels = eval_data
    categories = [""] * len(ids)

    def run(weights) -> float:
        trained = dataclasses.replace(model, weights=weights)
        if objective.pairs:
            return evaluate_pairs(
                trained,
                objective,
                ids,
                labels,
                reference,
                categories,
                cfg.batch_size,
                pad_id,
                eval_step=eval_step,
                progress=False,
            )["loss"]
        return evaluate(trained, ids, labels, categories, cfg.batch_size, pad_id, eval_step=eval_step, progress=False)[
            "loss"
        ]

    return run
