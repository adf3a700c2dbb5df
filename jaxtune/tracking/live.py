"""The training curve and the latest figures as Prefect artifacts, made again under the same keys
as training goes, so the run's page in the UI shows the newest of each."""

from __future__ import annotations

import base64

from jaxtune.tracking import ui
from jaxtune.tracking.curves import live_curve_png

CURVE = "train-curve"
LATEST = "train-latest"
FIGURES = ("step", "loss", "eval_loss", "tokens_per_second", "mfu")
RL_FIGURES = ("reward", "kl")  # GRPO's, shown only by runs that log them


class LiveCurve:
    """Publishes the curve (losses, learning rate, gradient norm) and a table of the latest figures."""

    def __init__(self, total_steps: int):
        self.total = total_steps
        self.records: list[dict] = []

    def add(self, records: list[dict]) -> None:
        self.records += [r for r in records if "loss" in r or "eval_loss" in r]

    def publish(self) -> None:
        from prefect.artifacts import create_markdown_artifact, create_table_artifact

        step = self.records[-1]["step"] if self.records else 0
        png = base64.b64encode(live_curve_png(self.records, self.total)).decode()
        where = f"step {step} of {self.total}"
        create_markdown_artifact(
            key=ui.artifact_key(CURVE),
            description=f"training curve, {where}",
            markdown=f"### Training, {where}\n\n![training curve](data:image/png;base64,{png})\n",
        )
        create_table_artifact(
            key=ui.artifact_key(LATEST),
            table=[latest_figures(self.records)],
            description=f"latest training figures, {where}",
        )


def latest_figures(records: list[dict]) -> dict:
    """The newest step, train loss, eval loss (if measured yet), tokens/s and MFU; a GRPO run's reward and KL."""
    figures = dict.fromkeys(FIGURES)
    for record in records:  # in step order: later values win
        figures.update({name: record[name] for name in FIGURES + RL_FIGURES if record.get(name) is not None})
    return figures
