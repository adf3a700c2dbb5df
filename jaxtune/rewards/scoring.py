"""Loaded rewards, called on a batch of completions, and what they return checked.

A reward returns one value per completion. Numbers are accepted (ints, floats, numpy scalars,
and bools as 1 and 0, so `[answer in c for c in completions]` works); None, text, NaN and
infinities are not: any of them in an advantage would spread to the whole group's, so the
first one stops training with a RewardError naming the reward and the row.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from jaxtune.errors import RewardError, first_line
from jaxtune.rewards.builtin import RewardFunction

BUILTIN = "jaxtune"  # a built-in's code: jaxtune's own, which its stage's code digest already covers
FLOAT32_MAX = float(np.finfo(np.float32).max)  # scores are float32: a larger value would become inf there


@dataclass(frozen=True)
class Reward:
    """One loaded reward: what names it, what it calls, and what cache keys know its code by."""

    spec: str  # as rl.rewards gives it
    function: RewardFunction
    code: str  # BUILTIN, or the digest of the source of a user's module


class Rewards:
    """The rewards of `rl.rewards`, each a column of `score`, summed by `total` with `weights`."""

    def __init__(self, rewards: Sequence[Reward], weights: Sequence[float]):
        self.rewards, self.weights = tuple(rewards), tuple(float(w) for w in weights)

    @property
    def names(self) -> tuple[str, ...]:
        """Each reward's name in logs: its spec ('exact_answer:####', 'mypkg.rw:score')."""
        return tuple(reward.spec for reward in self.rewards)

    def identity(self) -> dict[str, str]:
        """{spec: code} for a cache key: a user's reward is keyed by its module's source, so an edit re-runs training."""
        return {reward.spec: reward.code for reward in self.rewards}

    def score(self, prompts: Sequence[str], completions: Sequence[str], rows: Sequence[Mapping]) -> np.ndarray:
        """(n, R) float32: every reward's value for each of the n completions, rows[i] the row completion i answers."""
        n = len(completions)
        if len(prompts) != n or len(rows) != n:
            raise ValueError(
                f"score needs a prompt and a row per completion: got {len(prompts)} prompts, {n} "
                f"completions, {len(rows)} rows"
            )
        batch = list(prompts), list(completions), list(rows)
        columns = [_column(reward, *batch) for reward in self.rewards]
        return np.stack(columns, axis=1)  # (n, R)

    def total(self, scores: np.ndarray) -> np.ndarray:
        """(n,) float32: each completion's rewards weighted and summed."""
        scores = np.asarray(scores, np.float32)
        if scores.ndim != 2 or scores.shape[1] != len(self.rewards):
            raise ValueError(f"total needs scores of shape (n, {len(self.rewards)}), got {scores.shape}")
        return scores @ np.asarray(self.weights, np.float32)  # (n, R) @ (R,)


def _column(reward: Reward, prompts: list[str], completions: list[str], rows: list[Mapping]) -> np.ndarray:
    """(n,) float32: one reward's values, checked."""
    try:
        values = reward.function(prompts, completions, rows)
    except Exception as e:  # a user's code may raise anything; the message names it and the row
        raise RewardError(_raised(reward, e, prompts, completions, rows)) from e
    values = _listed(reward, values, len(completions))
    return np.array([_number(reward, value, i, rows[i]) for i, value in enumerate(values)], np.float32)


def _raised(reward: Reward, error: Exception, prompts: list[str], completions: list[str], rows: list[Mapping]) -> str:
    """What a reward that raised on a batch says, naming the first row that makes it raise alone
    (each row is tried again, by itself, only after a failure)."""
    for i in range(len(completions)):
        try:
            reward.function(prompts[i : i + 1], completions[i : i + 1], rows[i : i + 1])
        except Exception as alone:
            return f"reward {reward.spec} raised {type(alone).__name__} on {_row(i, rows[i])}: {first_line(alone)}"
    return (
        f"reward {reward.spec} raised {type(error).__name__} on a batch of {len(completions)} completions (on none "
        f"of them alone): {first_line(error)}"
    )


def _listed(reward: Reward, values: object, n: int) -> list:
    if isinstance(values, np.ndarray) and values.ndim == 1:
        values = values.tolist()
    if isinstance(values, (str, bytes, Mapping, np.ndarray)) or not isinstance(values, Iterable):
        raise RewardError(f"reward {reward.spec} returned {_what(values)}, not a sequence of one number per completion")
    values = list(values)
    if len(values) != n:
        raise RewardError(f"reward {reward.spec} returned {len(values)} values for {n} completions")
    return values


def _number(reward: Reward, value: object, i: int, row: Mapping) -> float:
    """`value` as a float: a finite number in float32's range (a bool counts as 1 or 0)."""
    if isinstance(value, (numbers.Real, np.bool_)):
        try:
            number = float(value)
        except OverflowError:  # an int beyond float's range
            number = math.inf
        if abs(number) <= FLOAT32_MAX:  # False for NaN too
            return number
    got = "an int beyond float32's range" if isinstance(value, numbers.Integral) else _what(value)
    raise RewardError(f"reward {reward.spec} returned {got} for {_row(i, row)}: rewards must be finite float32 numbers")


def _what(value: object) -> str:
    """A returned value as a message shows it: its type, a float itself."""
    if value is None:
        return "None"
    if isinstance(value, (float, np.floating)):
        return repr(float(value))
    if isinstance(value, np.ndarray):
        return f"an array of shape {value.shape}"
    name = type(value).__name__
    return f"{'an' if name[0] in 'aeiou' else 'a'} {name}"


def _row(i: int, row: Mapping) -> str:
    """'row 2 of the batch', and where the row came from when it says: its `where`, or its `source` and `row`."""
    where = ""
    if isinstance(row, Mapping):
        if row.get("where"):
            where = f" ({row['where']})"
        elif row.get("row") is not None:
            where = f" ({row['source']} row {row['row']})" if row.get("source") else f" (row {row['row']})"
    return f"row {i} of the batch{where}"
