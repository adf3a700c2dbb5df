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
