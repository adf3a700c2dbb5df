"""Answers scored by GRPO's rewards: the rows a reward sees, the train stage's scorer, and the
greedy answers the reward evals score.

A reward is called with the prompts' text, the completions' text (special tokens dropped, as a
user reads them) and one dict per row: its `answer`, `prompt`, `category` and `where` (the
split and row, for messages)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from jaxtune.rewards import Rewards


def reward_rows(table, split: str) -> list[dict]:
    """Every row of a prompt_answer token table as a reward sees it."""
    answers, prompts, categories = (table.column(name) for name in ("response", "prompt_text", "category"))
    return [
        {"answer": a, "prompt": p, "category": c, "where": f"{split} row {i}"}
        for i, (a, p, c) in enumerate(zip(answers, prompts, categories))
    ]


def scorer(rewards: Rewards, tokenizer, rows: list[dict]):
    """score(row indices, answer token ids) -> (n, rewards) scores: what `rollouts.train_grpo` calls."""

    def score(indices: np.ndarray, answers: list[list[int]]) -> np.ndarray:
        chosen = [rows[i] for i in indices]
        completions = [tokenizer.decode(a, skip_special_tokens=True) for a in answers]
        return rewards.score([r["prompt"] for r in chosen], completions, chosen)

    return score


def greedy_scores(
    model,
    tokenizer,
    prompts: Sequence[Sequence[int]],
    rows: list[dict],
    rewards: Rewards,
    batch_size: int,
    max_new_tokens: int,
) -> tuple[list[str], np.ndarray]:
    """Each prompt's greedy answer (text) and its scores (n, rewards)."""
    from jaxtune.data.templates import stop_ids
    from jaxtune.data.tokenize import pad_id_of
    from jaxtune.runtime.decoding.inference import greedy_generate

    eos = stop_ids(tokenizer, getattr(model.module, "generation_config", None))
    tokens = greedy_generate(model, prompts, batch_size, max_new_tokens, eos, pad_id_of(tokenizer))
    answers = [tokenizer.decode(t, skip_special_tokens=True) for t in tokens]
    return answers, rewards.score([r["prompt"] for r in rows], answers, rows)


def summary(rewards: Rewards, scores: np.ndarray, categories: Sequence[str]) -> dict:
    """Mean total reward, each reward's mean, and the total per category."""
    total = rewards.total(scores)
    per_category = {}
    for category in sorted(set(categories)):
        chosen = np.asarray([c == category for c in categories])
        per_category[category] = {"reward": round(float(total[chosen].mean()), 6), "prompts": int(chosen.sum())}
    return {
        "reward": round(float(total.mean()), 6) if len(total) else 0.0,
        "rewards": {name: round(float(scores[:, i].mean()), 6) for i, name in enumerate(rewards.names)},
        "prompts": len(total),
        "per_category": per_category,
    }
