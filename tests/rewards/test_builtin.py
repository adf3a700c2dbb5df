"""The built-in rewards on hand-checked completions, and the config errors of their specs."""

from __future__ import annotations

import pytest

from jaxtune.errors import ConfigError, RewardError
from jaxtune.rewards import load_rewards

pytestmark = pytest.mark.rewards


def scores(spec: str, completions: list[str], answers: list[str]) -> list[float]:
    rewards = load_rewards([spec])
    return rewards.score(["q"] * len(completions), completions, [{"answer": a} for a in answers])[:, 0].tolist()


@pytest.mark.parametrize(
    "completion, answer, expected",
    [
        ("The answer is 42.", "42", 1.0),
        ("42.0", "42", 1.0),  # compared as numbers
        ("It costs $1,234 in all", "1234", 1.0),
        ("1234", "1,234", 1.0),
        ("-5 degrees", "-5", 1.0),
        ("17 - 22 = -5", "-5", 1.0),
        ("17-5 = 12", "12", 1.0),  # the minus of 17-5 is no sign: its numbers are 17 and 5
        ("3.50", "3.5", 1.0),
        (".5", "0.5", 1.0),
        ("about 3.5, or 4", "3.5", 0.0),  # the last number counts
        ("1, 2, 3", "3", 1.0),
        ("no number here", "3", 0.0),
        ("41", "42", 0.0),
        ("12345678901234567", "12345678901234568", 0.0),  # exact, not float's nearest
        ("  Paris ", "paris", 1.0),  # text: stripped and compared case-insensitively
        ("The   Eiffel\nTower", "the eiffel tower", 1.0),  # whitespace collapsed
        ("The Eiffel Tower.", "the eiffel tower", 0.0),
        ("Paris, France", "Paris", 0.0),  # the whole completion, not a part of it
    ],
)
def test_exact_answer(completion, answer, expected):
    assert scores("exact_answer", [completion], [answer]) == [expected]


@pytest.mark.parametrize(
    "completion, answer, expected",
    [
        ("7 + 35 makes 42, so #### 42", "42", 1.0),
        ("#### 42 (not 43)", "42", 1.0),  # the first number after the marker
        ("#### 1\n#### 2", "2", 1.0),  # after the last marker
        ("#### 1\n#### 2", "1", 0.0),
        ("#### -1,250.0", "-1250", 1.0),
        ("The answer is 42", "42", 0.0),  # no marker: 0 whatever follows
        ("the sum ####", "5", 0.0),  # a marker and no number after it
        ("#### 5 apples", "5 apples", 1.0),  # a text answer: the text after the marker
        (
            "Natalia sold 48 + 24 clips.\n#### 72",
            "She sold 48/2 = 24 in May.\n#### 72",
            1.0,
        ),  # GSM8K: both after the marker
        ("Natalia sold clips.\n#### 71", "She sold 48/2 = 24 in May.\n#### 72", 0.0),
    ],
)
def test_exact_answer_after_a_marker(completion, answer, expected):
    assert scores("exact_answer:####", [completion], [answer]) == [expected]


def test_exact_answer_reads_a_token_table_rows_response_and_says_when_a_row_has_none():
    rewards = load_rewards(["exact_answer"])
    assert rewards.score(["q"], ["#### 9"], [{"response": "9", "prompt_text": "q"}]).tolist() == [[1.0]]
    with pytest.raises(RewardError) as error:
        rewards.score(["q", "q"], ["9", "9"], [{"answer": "9"}, {"prompt_text": "q", "row": 4, "source": "a.jsonl"}])
    assert str(error.value) == (
        "reward exact_answer raised ValueError on row 1 of the batch (a.jsonl row 4): the row has "
        "no 'answer' (its keys: prompt_text, row, source)"
    )


@pytest.mark.parametrize(
    "completion, expected",
    [
        ("Adding them: 42\n#### 42", 1.0),  # re.DOTALL: '.' crosses lines
        ("  #### 42\n", 1.0),  # the completion is stripped
        ("#### 42 and more", 0.0),  # the whole completion must match
        ("#### forty-two", 0.0),
    ],
)
def test_format(completion, expected):
    assert scores(r"format:.*#### -?\d+", [completion], ["42"]) == [expected]


@pytest.mark.parametrize(
    "spec, message",
    [
        (
            "exact_answer:",
            "rl.rewards: 'exact_answer:' names no marker; give exact_answer:MARKER, e.g. exact_answer:####",
        ),
        ("format", "rl.rewards: 'format' names no regular expression; give format:REGEX, e.g. 'format:.*#### -?\\d+'"),
        (
            "format:(#### \\d+",
            "rl.rewards: 'format:(#### \\d+' is not a valid regular expression: missing ), unterminated "
            "subpattern at position 0",
        ),
        (
            "exact_answr",
            "rl.rewards: 'exact_answr' is not a reward (did you mean 'exact_answer'?); give exact_answer, "
            "exact_answer:MARKER, format:REGEX or package.module:function",
        ),
        (
            "my reward",
            "rl.rewards: 'my reward' is not a reward; give exact_answer, exact_answer:MARKER, format:REGEX or "
            "package.module:function",
        ),
    ],
)
def test_a_bad_builtin_spec_is_a_config_error_naming_it(spec, message):
    with pytest.raises(ConfigError) as error:
        load_rewards(["exact_answer:####", spec])
    assert str(error.value) == message


def test_builtins_are_known_by_their_spec():
    rewards = load_rewards(["exact_answer", "exact_answer:####", "format:.*"])
    assert rewards.names == ("exact_answer", "exact_answer:####", "format:.*")
    assert rewards.identity() == {"exact_answer": "jaxtune", "exact_answer:####": "jaxtune", "format:.*": "jaxtune"}
