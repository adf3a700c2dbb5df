"""Host loops around the compiled eval step and greedy decoder."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence

import numpy as np
from tqdm import tqdm

from jaxtune.runtime.compiled import preference, steps
from jaxtune.runtime.compiled.batches import bucket_length, pad_batch, row_lengths
from jaxtune.runtime.compiled.preference import Objective
from jaxtune.runtime.decoding import decode
from jaxtune.runtime.devices.mesh import fetch
from jaxtune.runtime.modeling import attention
from jaxtune.runtime.modeling.model import JaxModel


def evaluate(
    model: JaxModel,
    input_ids: Sequence[Sequence[int]],
    labels: Sequence[Sequence[int]],
    categories: Sequence[str],
    batch_size: int,
    pad_id: int,
    eval_step=None,
    progress: bool = True,
) -> dict:
    """Token-weighted loss and perplexity over all rows, and the same per category (see `row_nll`)."""
    nll, count = row_nll(model, input_ids, labels, batch_size, pad_id, eval_step, progress)
    return loss_summary(nll, count, categories)


def loss_summary(nll: np.ndarray, count: np.ndarray, categories: Sequence[str]) -> dict:
    """`evaluate`'s figures from each row's summed NLL and scored tokens (`row_nll`)."""
    return {**_loss_summary(nll, count), "per_category": _per_category(nll, count, categories)}


def row_nll(
    model: JaxModel,
    input_ids: Sequence[Sequence[int]],
    labels: Sequence[Sequence[int]],
    batch_size: int,
    pad_id: int,
    eval_step=None,
    progress: bool = True,
) -> tuple[np.ndarray, np.ndarray]:
    """Each row's summed token NLL (float64 of the step's float32) and its scored tokens.

    Every batch pads to the longest row's bucket: one program for the whole eval, however the
    lengths spread (each length of its own is another trace and compile: seconds on the CPU, a
    minute for a 1B model on an accelerator, against a forward pass over a little more padding),
    rounded up to a tile the mesh's attention kernel takes (splash's 128 tokens on a TPU).
    `eval_step` reuses a compiled step across calls (periodic eval during training).
    """
    eval_step = eval_step or steps.make_eval_step(model)
    rows_per_batch = -(-batch_size // model.placement.batch_shards) * model.placement.batch_shards
    nll = np.zeros(len(input_ids))
    count = np.zeros(len(input_ids))
    length = bucket_length(
        int(row_lengths(input_ids).max()), multiple=attention.length_multiple(model.module, model.placement.mesh)
    )
    batches = [
        np.arange(start, min(start + rows_per_batch, len(input_ids)))
        for start in range(0, len(input_ids), rows_per_batch)
    ]
    pending = []
    for rows in tqdm(batches, desc="eval", unit="batch", disable=not progress):
        batch = model.placement.shard_batch(
            pad_batch([input_ids[r] for r in rows], [labels[r] for r in rows], pad_id, length, rows_per_batch)
        )
        batch_labels = batch.pop("labels")
        pending.append((rows, eval_step(model.weights, model.buffers, batch, batch_labels)))
    for rows, (batch_nll, batch_count) in fetch(pending):
        nll[rows] = batch_nll[: len(rows)]
        count[rows] = batch_count[: len(rows)]
    return nll, count


def evaluate_pairs(
    model: JaxModel,
    objective: Objective,
    input_ids: Sequence[Sequence[int]],
    labels: Sequence[Sequence[int]],
    reference: np.ndarray | None,
    categories: Sequence[str],
    batch_size: int,
    pad_id: int,
    eval_step=None,
    progress: bool = True,
) -> dict:
    """`pair_summary` of preference pairs (rows 2p chosen, 2p+1 rejected) under `model`, against
    `reference` (each row's reference log-probability; DPO only)."""
    nll, count = row_nll(model, input_ids, labels, batch_size, pad_id, eval_step, progress)
    return pair_summary(objective, -nll, count, reference, categories)


def pair_summary(
    objective: Objective, logp: np.ndarray, tokens: np.ndarray, reference: np.ndarray | None, categories: Sequence[str]
) -> dict:
    """The objective's loss, preference accuracy (ties count half), mean reward margin, mean chosen
    and rejected log-probabilities and rewards over every pair, and per category (each pair's
    category is its chosen row's)."""
    return summarize_pairs(objective, per_pair(objective, logp, tokens, reference), list(categories)[0::2])


def per_pair(
    objective: Objective, logp: np.ndarray, tokens: np.ndarray, reference: np.ndarray | None
) -> dict[str, np.ndarray]:
    """Each pair's figures (`preference.pair_metrics`: loss, win, margin, rewards...) and its chosen
    and rejected log-probabilities, from each row's log-probability (rows 2p chosen, 2p+1 rejected)."""
    import jax.numpy as jnp

    def arrays(values):
        values = np.asarray(values, np.float64)
        return values[0::2], values[1::2]

    chosen_tokens, rejected_tokens = arrays(tokens)
    policy = preference.PairLogps(*arrays(logp), chosen_tokens, rejected_tokens)
    ref = None if reference is None else preference.PairLogps(*arrays(reference), chosen_tokens, rejected_tokens)
    as_f32 = lambda t: None if t is None else preference.PairLogps(*(jnp.asarray(v, jnp.float32) for v in t))
    figures = {
        k: np.asarray(v, np.float64)
        for k, v in preference.pair_metrics(objective.name, objective.preference, as_f32(policy), as_f32(ref)).items()
    }
    figures["chosen_logp"], figures["rejected_logp"] = policy.chosen, policy.rejected
    return figures


def summarize_pairs(objective: Objective, figures: dict[str, np.ndarray], pair_categories: Sequence[str]) -> dict:
    """`pair_summary` from `per_pair`'s figures and each pair's category."""

    def summary(which: np.ndarray) -> dict:
        return {
            "loss": float(figures["loss"][which].mean()),
            "accuracy": float(figures["win"][which].mean()),
            "preference_loss": float(figures["preference_loss"][which].mean()),
            "chosen_nll": float(figures["chosen_nll"][which].mean()),
            "margin": float(figures["margin"][which].mean()),
            "chosen_reward": float(figures["chosen_reward"][which].mean()),
            "rejected_reward": float(figures["rejected_reward"][which].mean()),
            "chosen_logp": float(figures["chosen_logp"][which].mean()),
            "rejected_logp": float(figures["rejected_logp"][which].mean()),
            "pairs": int(len(which)),
        }

    groups = defaultdict(list)
    for pair, category in enumerate(pair_categories):
        groups[category].append(pair)
    return {
        **summary(np.arange(len(pair_categories))),
        "objective": objective.name,
        "per_category": {c: summary(np.asarray(p)) for c, p in sorted(groups.items())},
    }


def _loss_summary(nll: np.ndarray, count: np.ndarray) -> dict:
    loss = float(nll.sum() / max(count.sum(), 1))
    return {"loss": loss, "perplexity": math.exp(min(loss, 50.0)), "tokens": int(count.sum()), "rows": len(nll)}


def _per_category(nll: np.ndarray, count: np.ndarray, categories: Sequence[str]) -> dict:
    groups = defaultdict(list)
    for row, category in enumerate(categories):
        groups[category].append(row)
    return {c: _loss_summary(nll[rows], count[rows]) for c, rows in sorted(groups.items())}


def greedy_generate(
    model: JaxModel,
    prompts: Sequence[Sequence[int]],
    batch_size: int,
    max_new_tokens: int,
    eos_ids: Sequence[int],
    pad_id: int,
) -> list[list[int]]:
    """New tokens per prompt, cut after the first end-of-sequence token (which is dropped).

    Every batch has the same shape, its prompts left-padded to the longest prompt's bucket: one
    program for all of them (as `evaluate`)."""
    generate = decode.make_generate(model, max_new_tokens, tuple(eos_ids))
    length = bucket_length(max(len(p) for p in prompts))
    outputs: list[list[int]] = []
    for start in tqdm(range(0, len(prompts), batch_size), desc="generate", unit="batch"):
        chunk = list(prompts[start : start + batch_size])
        chunk += [chunk[-1]] * (batch_size - len(chunk))  # fixed batch shape: one compile
        ids, mask = decode.left_pad(chunk, pad_id, length)
        ids, mask = model.placement.shard_prompts((ids, mask))
        tokens = fetch(generate(model, model.weights, model.buffers, ids, mask))
        outputs += [_until_eos(row.tolist(), eos_ids) for row in tokens[: min(batch_size, len(prompts) - start)]]
    return outputs


def _until_eos(tokens: list[int], eos_ids: Sequence[int]) -> list[int]:
    for i, token in enumerate(tokens):
        if token in eos_ids:
            return tokens[:i]
    return tokens
