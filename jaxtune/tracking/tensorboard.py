"""TensorBoard event files of a training run, written as it goes by tensorboardX (no TensorFlow)."""

from __future__ import annotations

from pathlib import Path

# Each train-log field and the tag TensorBoard shows it under.
SCALARS = {
    "loss": "train/loss",
    "eval_loss": "eval/loss",
    "lr": "train/learning_rate",
    "grad_norm": "train/grad_norm",
    "tokens_per_second": "train/tokens_per_second",
    "mfu": "train/mfu",
    # GRPO: the step's sampled answers
    "reward": "rl/reward",
    "reward_std": "rl/reward_std",
    "kl": "rl/kl",
    "clip_fraction": "rl/clip_fraction",
    "completion_length": "rl/completion_length",
    "truncated": "rl/truncated",
}
EACH_REWARD = "reward/"  # GRPO: a record's `reward/NAME`, each reward's mean, shown as rl/reward/NAME


class TensorBoardWriter:
    """Scalars of every log record, the config as text, and the final figures, into `folder`."""

    def __init__(self, folder: Path, config_text: str):
        from tensorboardX import SummaryWriter

        self.writer = SummaryWriter(logdir=str(folder))
        self.writer.add_text("config", _code_block(config_text), 0)

    def write(self, records: list[dict]) -> None:
        for record in records:
            for field, tag in SCALARS.items():
                if record.get(field) is not None:
                    self.writer.add_scalar(tag, record[field], record["step"])
            for field in (f for f in record if f.startswith(EACH_REWARD)):
                self.writer.add_scalar(f"rl/{field}", record[field], record["step"])
        self.writer.flush()  # at every host sync, so `tensorboard --logdir` shows the run as it goes

    def finish(self, summary: dict, step: int) -> None:
        """The run's final figures (every number of the train summary) at its last step."""
        for name, value in summary.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                self.writer.add_scalar(f"final/{name}", value, step)

    def close(self) -> None:
        self.writer.close()


def _code_block(text: str) -> str:
    """Markdown that TensorBoard's text tab shows verbatim: each line indented as code."""
    return "\n".join(f"    {line}" for line in text.splitlines())
