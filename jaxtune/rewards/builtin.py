"""The built-in rewards, each 1.0 or 0.0 per completion and called as a user's reward is.

- `exact_answer`: the completion's final answer equals the row's. When the row's answer is a
  number, the final answer is the completion's last number ("1,234", "-5" and "3.50" are
  numbers; "42.0" equals "42"); otherwise it is the whole completion, compared as text.
- `exact_answer:MARKER`: the same, on the text after the completion's last MARKER (its first
  number, for a number); a completion without MARKER scores 0. A row's answer holding MARKER
  is read the same way (GSM8K's answers end in "#### 72").
- `format:REGEX`: the whole stripped completion matches REGEX (`re.fullmatch`, `re.DOTALL`).

Text is compared case-insensitively, with its whitespace collapsed to single spaces.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from decimal import Decimal

from jaxtune.errors import ConfigError

RewardFunction = Callable[[list[str], list[str], list[Mapping]], Sequence[float]]
NAMES = ("exact_answer", "format")
# A number, with thousands separated by commas or not, a sign and decimals; never begun inside
# another number, so "17-5" holds 17 and 5, and "3.50" one number, not 3 and 50.
NUMBER = re.compile(r"(?<![\d.])-?(?:(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|\.\d+)")


def builtin(spec: str) -> RewardFunction | None:
    """The built-in reward `spec` names; None when it names none (it may then be a user's).
    A built-in's name with a bad argument raises ConfigError naming the spec."""
    name, colon, argument = spec.partition(":")
    if name == "exact_answer":
        if colon and not argument:
            raise ConfigError(f"rl.rewards: '{spec}' names no marker; give exact_answer:MARKER, e.g. exact_answer:####")
        return exact_answer(argument or None)
    if name == "format":
        if not argument:
            raise ConfigError(
                f"rl.rewards: '{spec}' names no regular expression; give format:REGEX, e.g. 'format:.*#### -?\\d+'"
            )
        try:
            pattern = re.compile(argument, re.DOTALL)
        except re.error as e:
            raise ConfigError(f"rl.rewards: '{spec}' is not a valid regular expression: {e}") from None
        return format_match(pattern)
    return None


def exact_answer(marker: str | None = None) -> RewardFunction:
    """The reward `exact_answer` (or `exact_answer:MARKER`): 1.0 where `answer_matches`."""

    def reward(prompts: list[str], completions: list[str], rows: list[Mapping]) -> list[float]:
        return [float(answer_matches(completion, answer_of(row), marker)) for completion, row in zip(completions, rows)]

    return reward


def format_match(pattern: re.Pattern) -> RewardFunction:
    """The reward `format:REGEX`: 1.0 where the whole stripped completion matches."""

    def reward(prompts: list[str], completions: list[str], rows: list[Mapping]) -> list[float]:
        return [float(pattern.fullmatch(completion.strip()) is not None) for completion in completions]

    return reward


def answer_matches(completion: str, answer: str, marker: str | None = None) -> bool:
    """Whether the completion's final answer (see the module docstring) equals `answer`."""
    if marker is not None:
        if marker not in completion:
            return False
        completion = completion.rpartition(marker)[2]
        answer = answer.rpartition(marker)[2]  # all of it when it holds no marker
    reference = as_number(answer)
    if reference is None:
        return normalized(completion) == normalized(answer)
    numbers = NUMBER.findall(completion)
    if not numbers:
        return False
    return _decimal(numbers[0] if marker is not None else numbers[-1]) == reference


def as_number(text: str) -> Decimal | None:
    """`text` as an exact number when it is one number alone ('1,234', '-5', '3.50'); else None."""
    match = NUMBER.fullmatch(text.strip())
    return _decimal(match.group()) if match else None


def _decimal(number: str) -> Decimal:
    """Decimal, not float: '12345678901234567' and '12345678901234568' differ, and '42.0' equals '42'."""
    return Decimal(number.replace(",", ""))


def normalized(text: str) -> str:
    return " ".join(text.split()).casefold()


def answer_of(row: Mapping) -> str:
    """The answer a row holds: its `answer`, or a token table row's `response` (the same text)."""
    for key in ("answer", "response"):
        if key in row:
            return str(row[key])
    raise ValueError(f"the row has no 'answer' (its keys: {', '.join(map(str, row)) or 'none'})")
