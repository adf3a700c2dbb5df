"""A user's `package.module:function` reward: imported, called, keyed by its module's source, and
each way it can fail to load reported in one line naming it."""

from __future__ import annotations

import hashlib
import shutil
import sys

import pytest

from jaxtune.errors import ConfigError
from jaxtune.rewards import load_rewards

pytestmark = pytest.mark.rewards

LENGTH = """
    def shortness(prompts, completions, rows):
        return [1.0 / (1 + len(c)) for c in completions]
"""


def config_error(specs: list[str], weights: list[float] | None = None) -> str:
    with pytest.raises(ConfigError) as error:
        load_rewards(specs, weights)
    assert "\n" not in str(error.value)
    return str(error.value)


def test_a_users_reward_is_imported_called_and_keyed_by_its_source(user_module):
    path = user_module("jt_user_pkg.rw", LENGTH)
    rewards = load_rewards(["exact_answer", "jt_user_pkg.rw:shortness"], [1.0, 0.5])
    assert rewards.names == ("exact_answer", "jt_user_pkg.rw:shortness")
    assert rewards.weights == (1.0, 0.5)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()[:20]
    assert rewards.identity() == {"exact_answer": "jaxtune", "jt_user_pkg.rw:shortness": digest}
    scores = rewards.score(["q", "q"], ["3", "three"], [{"answer": "3"}, {"answer": "3"}])
    assert scores.dtype == "float32" and scores.shape == (2, 2)
    assert scores.ravel().tolist() == pytest.approx([1.0, 0.5, 0.0, 1 / 6])
    assert rewards.total(scores).tolist() == pytest.approx([1.25, 1 / 12])


def test_its_key_changes_when_its_source_does(user_module):
    user_module("jt_edited_rw", LENGTH)
    before = load_rewards(["jt_edited_rw:shortness"]).identity()
    del sys.modules["jt_edited_rw"]  # a new process, as the next run is
    path = user_module("jt_edited_rw", LENGTH.replace("1.0 /", "2.0 /"))
    # Python trusts a cached .pyc whose source has the same size and modification second: an edit
    # that fast is a test's, not a person's, so the cache goes as a new second would make it stale.
    shutil.rmtree(path.parent / "__pycache__", ignore_errors=True)
    after = load_rewards(["jt_edited_rw:shortness"])
    assert after.identity() != before
    assert after.score(["q"], ["x"], [{}]).tolist() == [[1.0]]  # the edited code is what runs


def test_the_key_is_of_the_module_that_defines_the_function(user_module):
    defining = user_module("jt_defines", LENGTH)
    user_module("jt_reexports", "from jt_defines import shortness\n")
    identity = load_rewards(["jt_reexports:shortness"]).identity()
    assert identity == {"jt_reexports:shortness": hashlib.sha256(defining.read_bytes()).hexdigest()[:20]}


def test_a_module_in_the_working_directory_is_found(tmp_path, monkeypatch):
    (tmp_path / "jt_cwd_rw.py").write_text(LENGTH.strip().replace("    ", "", 1))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    path_before = list(sys.path)
    try:
        assert load_rewards(["jt_cwd_rw:shortness"]).score(["q"], [""], [{}]).tolist() == [[1.0]]
    finally:
        sys.modules.pop("jt_cwd_rw", None)
    assert sys.path == path_before  # only while importing


def test_a_callable_object_is_a_reward(user_module):
    user_module(
        "jt_callable_rw",
        """
        class Always:
            def __call__(self, prompts, completions, rows):
                return [True] * len(completions)

        always = Always()
    """,
    )
    assert load_rewards(["jt_callable_rw:always"]).score(["q"] * 2, ["a", "b"], [{}, {}]).tolist() == [[1.0], [1.0]]


@pytest.mark.parametrize(
    "source, spec, message",
    [
        (
            None,
            "jt_absent_pkg.rw:score",
            "rl.rewards: 'jt_absent_pkg.rw:score' cannot be imported: No module named 'jt_absent_pkg'",
        ),
        (
            "raise RuntimeError('no model here')\n",
            "jt_raising_rw:score",
            "rl.rewards: 'jt_raising_rw:score' cannot be imported: RuntimeError: no model here",
        ),
        (LENGTH, "jt_named_rw:score", "rl.rewards: 'jt_named_rw:score': module jt_named_rw has no 'score'"),
        ("score = 3\n", "jt_value_rw:score", "rl.rewards: 'jt_value_rw:score' is not callable: score is of type int"),
        (
            "def score(completions):\n    return [0.0]\n",
            "jt_narrow_rw:score",
            "rl.rewards: 'jt_narrow_rw:score' cannot be called as function(prompts, completions, rows): too many positional arguments",
        ),
        (
            None,
            "jt_rw.score",
            "rl.rewards: 'jt_rw.score' is not a reward; give exact_answer, exact_answer:MARKER, "
            "format:REGEX or package.module:function",
        ),
        (
            None,
            "jt_rw:score:x",
            "rl.rewards: 'jt_rw:score:x' is not a reward; give exact_answer, exact_answer:MARKER, "
            "format:REGEX or package.module:function",
        ),
    ],
)
def test_a_reward_that_cannot_load_is_a_config_error_naming_it(source, spec, message, user_module):
    if source is not None:
        user_module(spec.partition(":")[0], source)
    assert config_error(["exact_answer", spec]) == message


def test_a_module_that_does_not_parse_is_named_with_its_line(user_module):
    user_module("jt_syntax_rw", "def score(:\n")
    message = config_error(["jt_syntax_rw:score"])
    assert message.startswith(
        "rl.rewards: 'jt_syntax_rw:score' cannot be imported: SyntaxError: "
    )  # Python's own words follow
    assert message.endswith("(jt_syntax_rw.py, line 1)")


def test_the_list_and_its_weights_are_checked():
    assert config_error([]) == (
        "rl.rewards: no rewards; give at least one: exact_answer, exact_answer:MARKER, "
        "format:REGEX or package.module:function"
    )
    assert config_error(["exact_answer", "format:.*", "exact_answer"]) == (
        "rl.rewards: 'exact_answer' is given twice; give each reward once, and its weight in rl.reward_weights"
    )
    assert config_error(["exact_answer", "format:.*"], [1.0]) == (
        "rl.reward_weights has 1 weights for 2 rewards (exact_answer, format:.*): give one each, or null for all 1"
    )
    assert config_error(["exact_answer"], [float("nan")]) == "rl.reward_weights: nan is not a finite number"
    assert load_rewards(["exact_answer", "format:.*"]).weights == (1.0, 1.0)
