"""A user's reward is part of the cache keys of the stages that call it, by its code."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.rl


def test_editing_a_reward_changes_the_keys_of_the_stages_that_use_it(tmp_path, monkeypatch):
    from jaxtune.config import config_from_dict
    from jaxtune.flows.finetune import planned_keys

    module = tmp_path / "my_rewards.py"
    module.write_text("def score(prompts, completions, rows):\n    return [1.0] * len(completions)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    config = config_from_dict(
        {
            "data": {"format": "prompt_answer"},
            "train": {"objective": "grpo"},
            "lora": {"modules_to_save": []},
            "rl": {"rewards": ["my_rewards:score", "exact_answer"]},
            "store": {"root": str(tmp_path / "store")},
        }
    )
    before = planned_keys(config)
    module.write_text("def score(prompts, completions, rows):\n    return [0.0] * len(completions)\n")
    after = planned_keys(config)
    changed = {stage for stage in before if before[stage] != after[stage]}
    assert {"baseline_eval", "train", "final_eval", "report"} <= changed
    assert {"tokenize", "build_model"}.isdisjoint(changed)
