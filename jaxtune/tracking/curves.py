"""The training curves, drawn with matplotlib: the report's loss curve and the live three-panel one."""

from __future__ import annotations

import io
from pathlib import Path


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # no display: files and bytes only
    import matplotlib.pyplot as plt

    return plt


def draw_losses(ax, log: list[dict]) -> None:
    """Train loss per step, and eval loss where it was measured during training."""
    train = [r for r in log if "loss" in r]
    evals = [r for r in log if "eval_loss" in r]
    ax.plot([r["step"] for r in train], [r["loss"] for r in train], label="train loss", linewidth=1)
    if evals:
        ax.plot([r["step"] for r in evals], [r["eval_loss"] for r in evals], "o-", label="eval loss")
    ax.set_xlabel("step"), ax.set_ylabel("loss"), ax.grid(alpha=0.3)


def plot_loss(log: list[dict], baseline: float, final: float, path: Path) -> None:
    """The report's curve: the losses during training against the eval loss before and after."""
    _plot_against_evals(draw_losses, log, baseline, final, path)


def _plot_against_evals(draw, log: list[dict], baseline: float, final: float, path: Path) -> None:
    """`draw`'s curve of the training log, with the eval figure before and after as level lines."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.2), dpi=100)
    draw(ax, log)
    ax.axhline(baseline, color="grey", linestyle="--", label=f"eval before ({baseline:.2f})")
    ax.axhline(final, color="green", linestyle="--", label=f"eval after ({final:.2f})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def draw_rewards(ax, log: list[dict]) -> None:
    """GRPO: the mean reward of each step's sampled answers."""
    train = [r for r in log if "reward" in r]
    ax.plot([r["step"] for r in train], [r["reward"] for r in train], label="sampled answers' reward", linewidth=1)
    ax.set_xlabel("step"), ax.set_ylabel("reward"), ax.grid(alpha=0.3)


def plot_rewards(log: list[dict], baseline: float, final: float, path: Path) -> None:
    """A GRPO report's curve: the sampled answers' reward during training against the greedy answers'
    reward on the eval prompts before and after."""
    _plot_against_evals(draw_rewards, log, baseline, final, path)


def live_curve_png(log: list[dict], total_steps: int) -> bytes:
    """PNG of the run so far: losses (GRPO: rewards), learning rate and gradient norm, each over all `total_steps`."""
    plt = _pyplot()
    train = [r for r in log if "loss" in r]
    steps = [r["step"] for r in train]
    fig, (loss, lr, norm) = plt.subplots(1, 3, figsize=(10, 2.8), dpi=90)
    (draw_rewards if any("reward" in r for r in train) else draw_losses)(loss, log)
    loss.legend(fontsize="small")
    lr.plot(steps, [r["lr"] for r in train], linewidth=1)
    lr.set_ylabel("learning rate"), lr.ticklabel_format(axis="y", style="sci", scilimits=(0, 0))
    norm.plot(steps, [r["grad_norm"] for r in train], linewidth=1)
    norm.set_ylabel("gradient norm")
    for ax in (loss, lr, norm):
        ax.set_xlim(0, max(total_steps, 1)), ax.set_xlabel("step"), ax.grid(alpha=0.3)
    fig.tight_layout()
    out = io.BytesIO()
    fig.savefig(out, format="png")
    plt.close(fig)
    return out.getvalue()
