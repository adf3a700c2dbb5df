"""jaxtune.records: the JSON one stage writes and another reads has one model, which refuses what
it does not know, naming it, and writes back only what the writer set."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from jaxtune.records import TrainSummary

SFT = {
    "steps": 4,
    "objective": "sft",
    "resumed_from": 0,
    "seconds": 1.5,
    "final_loss": 2.25,
    "trainable_parameters": 96,
    "mesh": "data=1 on 1 cpu device",
    "remat": "matmuls",
    "loss_chunk_tokens": 1024,
    "mfu": None,
    "interruptions": [{"reached": 3, "resumed_from": 2, "lost_steps": 1, "stopped_by": "killed", "restart": False}],
    "batch_shape": [1, 4, 64],
    "fit": None,
}


def test_a_summary_writes_back_the_fields_its_writer_set_none_included_and_no_other(tmp_path):
    TrainSummary(**SFT).write(tmp_path / "summary.json")
    written = json.loads((tmp_path / "summary.json").read_text())
    assert written == SFT  # mfu and fit stay null; GRPO's fields and the unset ones are not written
    again = TrainSummary.read(tmp_path / "summary.json")
    assert again.interruptions[0].lost_steps == 1 and again.reward_last_quarter is None


def test_an_unknown_or_misspelt_field_fails_naming_it(tmp_path):
    with pytest.raises(ValidationError, match="tokens_per_secnd"):
        TrainSummary(**SFT, tokens_per_secnd=3.0)
    (tmp_path / "summary.json").write_text(json.dumps({**SFT, "rewards_last_quarter": 0.5}))
    with pytest.raises(ValidationError, match="rewards_last_quarter"):
        TrainSummary.read(tmp_path / "summary.json")
    with pytest.raises(ValidationError, match="steps"):
        TrainSummary(**{k: v for k, v in SFT.items() if k != "steps"})


PARITY = {
    "dtype": "float32",
    "rows": 4,
    "tokens": 90,
    "max_abs_diff": 7.6e-6,
    "max_abs_logit": 14.0,
    "top1_agreement": 1.0,
}
FIGURES = {"loss": 0.5, "perplexity": 1.6487, "tokens": 90, "rows": 4}
PAIR = dict.fromkeys(
    ("loss", "accuracy", "preference_loss", "chosen_nll", "margin", "chosen_reward", "rejected_reward"), 0.25
) | {"chosen_logp": -3.0, "rejected_logp": -4.0, "pairs": 2}
EVALS = {  # what each kind of eval stage writes: SFT, a preference run's, a GRPO run's
    "sft": {**FIGURES, "per_category": {"qa": FIGURES}, "parity": PARITY},
    "dpo": {
        **FIGURES,
        "per_category": {"qa": FIGURES},
        "preference": {**PAIR, "objective": "dpo", "per_category": {"qa": PAIR}},
        "parity": PARITY,
    },
    "grpo": {
        "reward": 0.5,
        "rewards": {"number": 0.5},
        "prompts": 2,
        "per_category": {"math": {"reward": 0.5, "prompts": 2}},
        "parity": PARITY,
    },
}


@pytest.mark.parametrize("kind", EVALS)
def test_each_kind_of_eval_metrics_round_trips_as_written(kind, tmp_path):
    from jaxtune.records import CategoryReward, EvalMetrics, LossFigures

    EvalMetrics(**EVALS[kind]).write(tmp_path / "metrics.json")
    assert json.loads((tmp_path / "metrics.json").read_text()) == EVALS[kind]
    read = EvalMetrics.read(tmp_path / "metrics.json")
    assert read.rewarded == (kind == "grpo") and (read.preference is not None) == (kind == "dpo")
    assert isinstance(next(iter(read.per_category.values())), CategoryReward if kind == "grpo" else LossFigures)


def test_eval_metrics_refuse_a_field_no_writer_sets_and_keep_a_diverged_loss(tmp_path):
    import math

    from jaxtune.records import EvalMetrics, GenerateMetrics

    (tmp_path / "metrics.json").write_text(json.dumps({**EVALS["sft"], "los": 0.5}))
    with pytest.raises(ValidationError, match="los\n  Extra inputs are not permitted"):
        EvalMetrics.read(tmp_path / "metrics.json")
    EvalMetrics(**{**EVALS["sft"], "loss": math.nan}).write(tmp_path / "metrics.json")
    assert "NaN" in (tmp_path / "metrics.json").read_text()
    assert math.isnan(EvalMetrics.read(tmp_path / "metrics.json").loss)
    (tmp_path / "generate.json").write_text(json.dumps({"prompts": 8, "exact_match": {"before": 0.0}}))
    with pytest.raises(ValidationError, match="exact_match.after\n  Field required"):
        GenerateMetrics.read(tmp_path / "generate.json")
