"""The JSON records one stage writes and another reads, one pydantic model each, shared by writer
and reader: a field renamed on one side fails on the other instead of reading as missing.

`TrainSummary` is the train stage's `summary.json`: the fields all objectives share first, then
those of supervised training (SFT, DPO, SimPO) and of GRPO, each left out for the other.
`EvalMetrics` is an eval stage's `metrics.json` (the token loss, a preference run's pair figures or a
GRPO run's rewards, and JAX's logits against PyTorch's), `GenerateMetrics` the generate stage's.
Nothing else may be written (`extra="forbid"`).

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


class _Record(BaseModel):
    """A record written once, read as written: every field named, no other."""

    # NaN and infinities written as json.dumps writes them (a diverged run's loss), not as null
    model_config = ConfigDict(extra="forbid", frozen=True, ser_json_inf_nan="constants")

    def write(self, path: Path) -> None:
        path.write_text(self.model_dump_json(indent=2, exclude_none=True))

    @classmethod
    def read(cls, path: Path):
        """The record at `path`; a file with other fields fails here, naming them."""
        return cls.model_validate_json(path.read_text())


class Parity(_Record):
    """JAX's logits against PyTorch eager's on a few eval rows, over their real tokens."""

    dtype: str
    rows: int
    tokens: int
    max_abs_diff: float
    max_abs_logit: float
    top1_agreement: float  # how often both pick the same top token


class LossFigures(_Record):
    """The mean token loss over some rows: all of them, or one category's."""

    loss: float
    perplexity: float
    tokens: int
    rows: int


class PairFigures(_Record):
    """A preference objective's figures, the mean over some pairs."""

    loss: float
    accuracy: float  # how often the chosen answer's reward beats the rejected one's
    preference_loss: float
    chosen_nll: float
    margin: float
    chosen_reward: float
    rejected_reward: float
    chosen_logp: float
    rejected_logp: float
    pairs: int


class Preference(PairFigures):
    objective: str  # dpo or simpo
    per_category: dict[str, PairFigures]


class CategoryReward(_Record):
    reward: float
    prompts: int


class EvalMetrics(_Record):
    """An eval stage's `metrics.json`. SFT: the token loss over every eval row and per category. DPO and
    SimPO: the same over the chosen answers, and the pairs' figures under `preference`. GRPO: the mean
    reward of greedy answers, each reward's mean and the reward per category, no loss. Every kind: `parity`."""

    parity: Parity
    loss: float | None = None
    perplexity: float | None = None
    tokens: int | None = None
    rows: int | None = None
    per_category: dict[str, LossFigures] | dict[str, CategoryReward] = {}
    preference: Preference | None = None
    reward: float | None = None
    rewards: dict[str, float] | None = None  # GRPO: each reward's mean
    prompts: int | None = None

    @property
    def rewarded(self) -> bool:
        """Whether it scores rewards (a GRPO run's eval) rather than a loss."""
        return self.rewards is not None


class ExactMatch(_Record):
    before: float
    after: float


class GenerateMetrics(_Record):
    """The generate stage's `metrics.json`: the share of prompts whose greedy answer equals the reference,
    with the base model and with the trained one."""

    prompts: int
    exact_match: ExactMatch
