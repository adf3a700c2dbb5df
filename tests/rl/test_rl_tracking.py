"""Where a GRPO run's figures go beside the report: TensorBoard, the live table and MLflow."""

from __future__ import annotations

import json

import pytest

from jaxtune.tracking import live, mlflow_run
from jaxtune.tracking.tensorboard import TensorBoardWriter

pytestmark = pytest.mark.rl

RECORDS = [
    {
        "step": s,
        "loss": 0.1 * s,
        "lr": 1e-4,
        "grad_norm": 0.5,
        "tokens": 100,
        "tokens_per_second": 10.0,
        "reward": 0.2 * s,
        "reward_std": 0.3,
        "reward/exact_answer": 0.1 * s,
        "reward/format:.*####.*": 0.5,
        "kl": 0.01 * s,
        "clip_fraction": 0.0,
        "completion_length": 12.0,
        "truncated": 0.25,
    }
    for s in (1, 2, 3)
]


def test_tensorboard_shows_the_reward_kl_and_each_reward_per_step(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    writer = TensorBoardWriter(tmp_path, "train: {objective: grpo}")
    writer.write(RECORDS)
    writer.close()
    events = EventAccumulator(str(tmp_path), size_guidance={"scalars": 0})
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {
        "rl/reward",
        "rl/kl",
        "rl/clip_fraction",
        "rl/completion_length",
        "rl/truncated",
        "rl/reward_std",
        "rl/reward/exact_answer",
    } <= tags
    assert any(tag.startswith("rl/reward/format") for tag in tags)  # TensorBoard's own spelling of the regex
    assert [(e.step, round(e.value, 6)) for e in events.Scalars("rl/reward")] == [(1, 0.2), (2, 0.4), (3, 0.6)]
    assert [round(e.value, 6) for e in events.Scalars("rl/kl")] == [0.01, 0.02, 0.03]


def test_the_live_table_adds_reward_and_kl_only_for_runs_that_log_them():
    assert live.latest_figures(RECORDS) == {
        "step": 3,
        "loss": pytest.approx(0.3),
        "eval_loss": None,
        "tokens_per_second": 10.0,
        "mfu": None,
        "reward": pytest.approx(0.6),
        "kl": pytest.approx(0.03),
    }
    sft = [{"step": 1, "loss": 2.0, "tokens_per_second": 5.0}]
    assert set(live.latest_figures(sft)) == set(live.FIGURES)


class _Ref:
    """An artifact as run_metrics reads it: files in a folder."""

    def __init__(self, folder, files: dict[str, str]):
        self.folder = folder
        for name, text in files.items():
            (folder / name).write_text(text)

    def file(self, name):
        return self.folder / name

    def read_json(self, name):
        return json.loads((self.folder / name).read_text())


def test_mlflow_gets_every_step_figure_and_the_evals_rewards(tmp_path):
    pytest.importorskip("mlflow")
    folders = {name: tmp_path / name for name in ("train", "baseline_eval", "final_eval")}
    for folder in folders.values():
        folder.mkdir()
    parity = {
        "dtype": "float32",
        "rows": 2,
        "tokens": 9,
        "max_abs_diff": 0.0,
        "max_abs_logit": 1.0,
        "top1_agreement": 1.0,
    }
    evals = {  # a GRPO eval's metrics.json, as records.EvalMetrics holds it
        "reward": 0.25,
        "rewards": {"exact_answer": 0.25, "format:.*####.*": 0.5},
        "prompts": 8,
        "per_category": {"sum": {"reward": 0.25, "prompts": 8}},
        "parity": parity,
    }
    done = {
        "train": _Ref(
            folders["train"],
            {
                "log.jsonl": "\n".join(json.dumps(r) for r in RECORDS),
                "summary.json": json.dumps(
                    {"steps": 3, "objective": "grpo", "seconds": 4.5, "trainable_parameters": 96}
                ),
            },
        ),
        "baseline_eval": _Ref(folders["baseline_eval"], {"metrics.json": json.dumps(evals)}),
        "final_eval": _Ref(folders["final_eval"], {"metrics.json": json.dumps({**evals, "reward": 0.75})}),
    }
    metrics = {(m.key, m.step): m.value for m in mlflow_run.run_metrics(done)}
    assert metrics[("reward", 2)] == pytest.approx(0.4) and metrics[("kl", 3)] == pytest.approx(0.03)
    assert metrics[("reward/exact_answer", 1)] == pytest.approx(0.1)
    assert metrics[("reward/format_._____._", 1)] == 0.5  # a spec's characters MLflow refuses become '_'
    assert metrics[("baseline_eval_reward", 0)] == 0.25 and metrics[("final_eval_reward", 0)] == 0.75
    assert metrics[("train_seconds", 3)] == 4.5
    assert metrics[("final_eval_reward/format_._____._", 0)] == 0.5
    assert not any(key.endswith("_loss") for key, _ in metrics if key.startswith(("baseline", "final")))
