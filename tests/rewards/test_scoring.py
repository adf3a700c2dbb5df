"""What a reward returns, checked: one finite number per completion, else one error naming the
reward and the first bad row."""

from __future__ import annotations

import numpy as np
import pytest

from jaxtune.errors import RewardError
from jaxtune.rewards import load_rewards

pytestmark = pytest.mark.rewards

ROWS = [{"answer": str(i), "where": f"data.jsonl line {10 + i}"} for i in range(4)]
COMPLETIONS = ["0", "1", "bad", "3"]


def reward_error(user_module, body: str, rows: list[dict] = ROWS, completions: list[str] = COMPLETIONS) -> str:
    """The message of the RewardError that scoring with `def score(prompts, completions, rows): <body>` raises."""
    name = f"jt_scored_{abs(hash(body))}"
    user_module(name, f"import math\nimport numpy as np\n\ndef score(prompts, completions, rows):\n    {body}\n")
    rewards = load_rewards(["exact_answer", f"{name}:score"])
    with pytest.raises(RewardError) as error:
        rewards.score(["q"] * len(completions), completions, rows)
    return str(error.value).replace(name, "rw")


@pytest.mark.parametrize(
    "body, message",
    [
        ("return [1.0] * 3", "reward rw:score returned 3 values for 4 completions"),
        ("return 1.0", "reward rw:score returned 1.0, not a sequence of one number per completion"),
        ("return 'yes'", "reward rw:score returned a str, not a sequence of one number per completion"),
        (
            "return np.ones((4, 1))",
            "reward rw:score returned an array of shape (4, 1), not a sequence of one number per completion",
        ),
        (
            "return [None if c == 'bad' else 1.0 for c in completions]",
            "reward rw:score returned None for row 2 of the batch (data.jsonl line 12): rewards must be finite float32 numbers",
        ),
        (
            "return [math.nan if c == 'bad' else 1.0 for c in completions]",
            "reward rw:score returned nan for row 2 of the batch (data.jsonl line 12): rewards must be finite float32 numbers",
        ),
        (
            "return np.where(np.array(completions) == 'bad', -np.inf, 0.0)",
            "reward rw:score returned -inf for row 2 of the batch (data.jsonl line 12): rewards must be finite float32 numbers",
        ),
        (
            "return [1e39] * len(completions)",
            "reward rw:score returned 1e+39 for row 0 of the batch (data.jsonl line 10): rewards must be finite float32 numbers",
        ),
        (
            "return [10 ** 400] * len(completions)",
            "reward rw:score returned an int beyond float32's range for row 0 of the batch (data.jsonl line 10): rewards must "
            "be finite float32 numbers",
        ),
        (
            "return ['1.0'] * len(completions)",
            "reward rw:score returned a str for row 0 of the batch (data.jsonl line 10): rewards must be finite float32 numbers",
        ),
        (
            "return [float(c) for c in completions]",
            "reward rw:score raised ValueError on row 2 of the batch (data.jsonl line 12): could not convert string to float: 'bad'",
        ),
        (
            "assert len(completions) < 3, 'too many'\n    return [0.0] * len(completions)",
            "reward rw:score raised AssertionError on a batch of 4 completions (on none of them alone): too many",
        ),
    ],
)
def test_a_bad_return_or_a_raise_names_the_reward_and_the_first_bad_row(body, message, user_module):
    assert reward_error(user_module, body) == message


def test_a_row_is_located_by_its_source_and_row_when_it_has_no_where(user_module):
    rows = [{"answer": "0", "source": "math.parquet", "row": 7}, {"answer": "1", "row": 8}]
    assert reward_error(user_module, "return [None] * len(completions)", rows, ["0", "1"]) == (
        "reward rw:score returned None for row 0 of the batch (math.parquet row 7): rewards must be finite float32 numbers"
    )
    assert reward_error(user_module, "return [1.0, None]", rows, ["0", "1"]) == (
        "reward rw:score returned None for row 1 of the batch (row 8): rewards must be finite float32 numbers"
    )


@pytest.mark.parametrize(
    "body",
    [
        "return [c == rows[i]['answer'] for i, c in enumerate(completions)]",
        "return np.array([c == r['answer'] for c, r in zip(completions, rows)], np.float64)",
        "return (int(c == r['answer']) for c, r in zip(completions, rows))",
        "return tuple(np.float32(c == r['answer']) for c, r in zip(completions, rows))",
    ],
)
def test_bools_ints_numpy_values_and_any_iterable_are_accepted(body, user_module):
    user_module("jt_accepting_rw", f"import numpy as np\n\ndef score(prompts, completions, rows):\n    {body}\n")
    scores = load_rewards(["jt_accepting_rw:score"]).score(["q"] * 2, ["0", "x"], ROWS[:2])
    assert scores.dtype == np.float32 and scores.tolist() == [[1.0], [0.0]]


def test_score_is_one_column_per_reward_and_total_their_weighted_sum():
    rewards = load_rewards(["exact_answer", "format:#### \\d+"], [2.0, -0.5])
    scores = rewards.score(["q"] * 3, ["#### 0", "1", "#### 7"], ROWS[:3])
    assert scores.tolist() == [[1.0, 1.0], [1.0, 0.0], [0.0, 1.0]]
    assert rewards.total(scores).dtype == np.float32
    assert rewards.total(scores).tolist() == [1.5, 2.0, -0.5]
    assert rewards.score([], [], []).shape == (0, 2)
    with pytest.raises(ValueError, match=r"total needs scores of shape \(n, 2\), got \(3,\)"):
        rewards.total(scores[:, 0])
    with pytest.raises(
        ValueError, match="score needs a prompt and a row per completion: got 1 prompts, 2 completions, 2 rows"
    ):
        rewards.score(["q"], ["a", "b"], ROWS[:2])
