"""Stages `baseline_eval` and `final_eval`: eval-split loss and perplexity, overall and per category.

For preference pairs (train.objective dpo or simpo), also the objective's loss, preference
accuracy, reward margin and the chosen and rejected answers' log-probabilities
(`inference.pair_summary`), against the `reference` stage's log-probabilities for DPO; loss and
perplexity are then those of the chosen answers. An SFT eval also writes each row's loss
(rows.json), a preference eval each pair's margin and log-probabilities (pairs.json), from which
the report finds the rows or pairs training helped least.

For GRPO (prompt and answer rows, nothing to score by likelihood) an eval is the rewards of the
greedy answers to the eval split's prompts: the mean total reward, each reward's mean and the
total per category, and each prompt's answer and scores (answers.json)."""

from __future__ import annotations

import json
from pathlib import Path

from prefect import get_run_logger, task

from jaxtune.artifacts import ArtifactRef
from jaxtune.config import EvalConfig, MeshConfig, ModelConfig, PreferenceConfig, Section
from jaxtune.records import EvalMetrics
from jaxtune.tasks.stage import build_artifact
from jaxtune.tasks.trained import open_trained_model

PARITY_ROWS = 4  # eval rows whose logits are also computed in PyTorch, to certify the numerics
ROWS = "rows.json"  # each eval row's loss, in eval.arrow's order (SFT evals)
PAIRS = "pairs.json"  # each eval pair's reward margin and log-probabilities, in eval.arrow's order (preference evals)
PAIR_FIGURES = ("margin", "chosen_logp", "rejected_logp")
ANSWERS = "answers.json"  # each eval prompt's greedy answer, its scores and total reward (GRPO evals)


class EvalSection(Section):
    model: ModelConfig
    eval: EvalConfig


class PairEvalSection(EvalSection):
    """The eval of preference pairs: the objective and its settings decide the loss and the rewards."""

    objective: str
    preference: PreferenceConfig


class RewardEvalSection(EvalSection):
    """The eval of a GRPO run: its rewards (and their code, so an edit re-scores) on greedy answers
    of at most `max_new_tokens`."""

    rewards: tuple[str, ...]
    reward_weights: tuple[float, ...] | None
    reward_code: dict[str, str]
    max_new_tokens: int


def _loss_parts(p: dict, section: PairEvalSection) -> str:
    """With the SFT term on, what the loss is made of: the preference term, and the weighted chosen NLL."""
    weight = section.preference.sft_weight
    if not weight:
        return ""
    return f" (of which {section.objective} {p['preference_loss']:.4f}; chosen answers' mean NLL {p['chosen_nll']:.4f})"


def row_losses(nll, count) -> dict:
    """Each row's mean token loss (None for a row with no scored token) and its scored tokens."""
    return {
        "loss": [round(float(n / c), 6) if c else None for n, c in zip(nll, count)],
        "tokens": [int(c) for c in count],
    }


def _evaluate(stage: str, section: EvalSection, inputs: dict, store_root: str, mesh: MeshConfig) -> ArtifactRef:
    def build(folder: Path) -> None:
        from jaxtune.data.token_table import TokenTable
        from jaxtune.runtime.decoding.inference import loss_summary, row_nll
        from jaxtune.runtime.measures.parity import logits_parity

        pad_id = inputs["data"].read_json("stats.json")["pad_id"]
        model = open_trained_model(inputs, section.model, mesh)
        table = TokenTable(inputs["data"].file("eval.arrow"))  # memory-mapped: rows are read as batches take them
        logger = get_run_logger()
        if isinstance(section, RewardEvalSection):
            metrics, answers = _reward_metrics(model, table, section, inputs)
            (folder / ANSWERS).write_text(json.dumps(answers, ensure_ascii=False))
            metrics["parity"] = logits_parity(model, table.input_ids[:PARITY_ROWS], pad_id)
            EvalMetrics(**metrics).write(folder / "metrics.json")
            logger.info(
                "%s: mean reward %.4f (%s) over %d prompts",
                stage,
                metrics["reward"],
                ", ".join(f"{k} {v:.3f}" for k, v in metrics["rewards"].items()),
                metrics["prompts"],
            )
            return
        if isinstance(section, PairEvalSection):
            metrics, figures = _pair_metrics(model, table, section, inputs, pad_id)
            (folder / PAIRS).write_text(json.dumps({k: [round(float(v), 6) for v in figures[k]] for k in PAIR_FIGURES}))
            p = metrics["preference"]
            logger.info(
                "%s: %s loss %.4f%s, preference accuracy %.3f, reward margin %.4f, log-probability chosen %.3f "
                "rejected %.3f over %d pairs",
                stage,
                section.objective,
                p["loss"],
                _loss_parts(p, section),
                p["accuracy"],
                p["margin"],
                p["chosen_logp"],
                p["rejected_logp"],
                p["pairs"],
            )
        else:
            nll, count = row_nll(model, table.input_ids, table.labels, section.eval.batch_size, pad_id)
            metrics = loss_summary(nll, count, table.column("category"))
            (folder / ROWS).write_text(json.dumps(row_losses(nll, count)))
        metrics["parity"] = logits_parity(model, table.input_ids[:PARITY_ROWS], pad_id)
        EvalMetrics(**metrics).write(folder / "metrics.json")
        logger.info(
            "%s: loss %.4f perplexity %.2f over %d tokens",
            stage,
            metrics["loss"],
            metrics["perplexity"],
            metrics["tokens"],
        )
        logger.info(
            "%s: JAX vs PyTorch logits max |diff| %.2e (%s)",
            stage,
            metrics["parity"]["max_abs_diff"],
            metrics["parity"]["dtype"],
        )

    return build_artifact(store_root, stage, __name__, section, inputs, build)


def _reward_metrics(model, table, section: RewardEvalSection, inputs: dict) -> tuple[dict, list[dict]]:
    """`scoring.summary` of the greedy answers to every eval prompt, and each prompt's answer and scores."""
    from jaxtune.rewards import load_rewards
    from jaxtune.tasks import scoring
    from jaxtune.tasks.sources import open_tokenizer

    rewards = load_rewards(section.rewards, section.reward_weights)
    tokenizer = open_tokenizer(inputs["model"], section.model)
    rows = scoring.reward_rows(table, "eval")
    answers, scores = scoring.greedy_scores(
        model, tokenizer, table.input_ids, rows, rewards, section.eval.batch_size, section.max_new_tokens
    )
    total = rewards.total(scores)
    per_prompt = [
        {"answer": a, "scores": [round(float(v), 6) for v in s], "reward": round(float(t), 6)}
        for a, s, t in zip(answers, scores, total)
    ]
    return scoring.summary(rewards, scores, [r["category"] for r in rows]), per_prompt


def _pair_metrics(model, table, section: PairEvalSection, inputs: dict, pad_id: int) -> tuple[dict, dict]:
    """Loss and perplexity of the chosen answers, and the pairs' `pair_summary` under `preference`;
    and each pair's figures (`inference.per_pair`)."""
    import numpy as np

    from jaxtune.runtime.compiled.preference import objective_of
    from jaxtune.runtime.decoding.inference import _loss_summary, _per_category, per_pair, row_nll, summarize_pairs
    from jaxtune.tasks.reference import read_reference

    nll, count = row_nll(model, table.input_ids, table.labels, section.eval.batch_size, pad_id)
    categories = table.column("category")
    chosen = np.arange(0, len(nll), 2)
    objective = objective_of(section.objective, section.preference)
    reference = read_reference(inputs.get("reference"), "eval")
    figures = per_pair(objective, -nll, count, reference)
    pair_categories = [categories[i] for i in chosen]
    return {
        **_loss_summary(nll[chosen], count[chosen]),
        "per_category": _per_category(nll[chosen], count[chosen], pair_categories),
        "preference": summarize_pairs(objective, figures, pair_categories),
    }, figures


@task(name="baseline_eval", result_serializer="json")
def baseline_eval(
    section: EvalSection, inputs: dict[str, ArtifactRef], store_root: str, mesh: MeshConfig
) -> ArtifactRef:
    """inputs: `model`, `data` (and `reference` for DPO)."""
    return _evaluate("baseline_eval", section, inputs, store_root, mesh)


@task(name="final_eval", result_serializer="json")
def final_eval(section: EvalSection, inputs: dict[str, ArtifactRef], store_root: str, mesh: MeshConfig) -> ArtifactRef:
    """inputs: `model`, `data`, `train` (and `reference` for DPO)."""
    return _evaluate("final_eval", section, inputs, store_root, mesh)
