"""GRPO's rewards fed a user's mistakes through `jaxtune run`: one that cannot be imported is refused
before the flow starts; one that raises while training stops the run with one line naming it and the
row, and leaves no train artifact in the store."""

from __future__ import annotations

import pytest

from tests.badinput.conftest import refused_before_the_flow

pytestmark = [pytest.mark.badinput, pytest.mark.rl]

GRPO = [
    "data.format=prompt_answer",
    "train.objective=grpo",
    "train.max_steps=2",
    "train.batch_size=8",
    "rl.num_generations=4",
    "rl.max_completion_length=4",
    "data.max_train_rows=16",
    "data.max_eval_rows=8",
    "eval.batch_size=8",
    "generate.num_prompts=8",
    "generate.batch_size=8",
    "lora.modules_to_save=[]",
]


def test_a_reward_that_cannot_be_imported_is_refused_before_the_flow(jaxtune):
    done = jaxtune.run(*(f"--set={s}" for s in GRPO), "--set=rl.rewards=[no_such_rewards_module:score]")
    refused_before_the_flow(
        done,
        2,
        "jaxtune: rl.rewards: 'no_such_rewards_module:score' cannot be imported: "
        "No module named 'no_such_rewards_module'",
    )
    assert jaxtune.folders() == set()


def test_a_reward_that_raises_stops_training_naming_it_and_the_row(jaxtune, tmp_path, monkeypatch):
    (tmp_path / "picky_rewards.py").write_text(
        "def score(prompts, completions, rows):\n"
        "    if any(r['where'].startswith('train') for r in rows):\n"
        "        raise ValueError('not while training')\n"
        "    return [0.5] * len(completions)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    done = jaxtune.run(*(f"--set={s}" for s in GRPO), "--set=rl.rewards=[picky_rewards:score]")
    assert done.status == 1 and done.flow_started, done.stderr[-3000:]
    assert "reward picky_rewards:score raised ValueError on row" in done.last_line, done.last_line
    assert "on row 0 of the batch (train row " in done.last_line and done.last_line.endswith(
        "): not while training (--debug shows the traceback)"
    ), done.last_line
    assert not any(folder.startswith("train/") for folder in jaxtune.folders())  # nothing half-written
