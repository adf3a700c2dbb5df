"""The JSON records one stage writes and another reads, one pydantic model each, shared by writer
and reader: a field renamed on one side fails on the other instead of reading as missing.

`TrainSummary` is the train stage's `summary.json`: the fields all objectives share first, then
those of supervised training (SFT, DPO, SimPO) and of GRPO, each left out for the other. Nothing
else may be written (`extra="forbid"`).

May import: nothing from jaxtune
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict


class Interruption(BaseModel):
    """One earlier attempt of this training that did not finish."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    reached: int  # the last step it logged
    resumed_from: int  # the checkpoint the next attempt started from
    lost_steps: int  # logged steps trained again
    stopped_by: str  # SIGINT, SIGTERM, killed, gave up
    restart: bool = False  # whether the attempt after it was an automatic restart


class TrainSummary(BaseModel):
    model_config = ConfigDict(extra="forbid")

    # Every objective. (None: not recorded by the version that wrote an older artifact.)
    steps: int
    seconds: float
    trainable_parameters: int
    objective: str | None = None  # sft, dpo, simpo or grpo
    resumed_from: int | None = None  # the checkpoint's step this attempt started from (0: the start)
    final_loss: float | None = None  # the mean train loss of the last log window (GRPO: the last quarter's)
    mesh: str | None = None
    remat: str | None = None  # train.remat as it ran: the policy, once auto chose one
    loss_chunk_tokens: int | None = None
    # Supervised training.
    interruptions: list[Interruption] = []
    compile_seconds: float | None = None
    tokens_per_second: float | None = None
    mfu: float | None = None  # None where the device's peak is not known
    mfu_derivation: str | None = None
    packed: bool | None = None
    fused_attention: bool | None = None
    batch_shape: list[int] | None = None  # micro-batches, rows, length of a step
    nonpad_fraction: float | None = None
    rows_per_step: int | None = None
    fit: dict | None = None  # train.remat auto's choice and the candidates it compiled (`fit.Fit.record`)
    # GRPO.
    reward_first_quarter: float | None = None
    reward_last_quarter: float | None = None
    sample_seconds: float | None = None
    update_seconds: float | None = None
    answers_per_step: int | None = None
    prompts_per_rollout: int | None = None
    row_length: int | None = None

    def write(self, path: Path) -> None:
        """As JSON, the fields the loop set (an objective's own, None included), not the other objectives'."""
        path.write_text(self.model_dump_json(indent=2, exclude_unset=True))

    @classmethod
    def read(cls, path: Path) -> TrainSummary:
        """The summary at `path`; a file another version wrote with other fields fails here, naming them."""
        return cls.model_validate_json(path.read_text())
