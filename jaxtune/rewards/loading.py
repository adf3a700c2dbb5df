"""`rl.rewards` specs -> loaded rewards, every one resolved before training starts.

A spec is a built-in (`jaxtune.rewards.builtin`) or a user's `package.module:function`,
imported from `sys.path` or the working directory, never downloaded, and called as
`function(prompts, completions, rows)`. A spec that cannot load raises ConfigError in one line
naming it, so a typo costs a second rather than the stages before training.
"""

from __future__ import annotations

import contextlib
import difflib
import hashlib
import importlib
import inspect
import math
import os
import re
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import ModuleType

from jaxtune.errors import ConfigError, first_line
from jaxtune.rewards.builtin import NAMES, RewardFunction, builtin
from jaxtune.rewards.scoring import BUILTIN, Reward, Rewards

USER_SPEC = re.compile(r"(?P<module>[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*):(?P<function>[A-Za-z_]\w*)")
DIGEST_LENGTH = 20  # hex digits kept, as in jaxtune's own code digests
ACCEPTED = "exact_answer, exact_answer:MARKER, format:REGEX or package.module:function"


def load_rewards(specs: Sequence[str], weights: Sequence[float] | None = None) -> Rewards:
    """The rewards `specs` name, weighted by `weights` (None: all 1); raises ConfigError naming the first that cannot load."""
    specs = tuple(specs)
    if not specs:
        raise ConfigError(f"rl.rewards: no rewards; give at least one: {ACCEPTED}")
    repeated = sorted({spec for spec in specs if specs.count(spec) > 1})
    if repeated:
        raise ConfigError(
            f"rl.rewards: '{repeated[0]}' is given twice; give each reward once, and its weight in rl.reward_weights"
        )
    return Rewards([load_reward(spec) for spec in specs], _weights(specs, weights))


def load_reward(spec: str) -> Reward:
    function = builtin(spec)
    if function is not None:
        return Reward(spec, function, BUILTIN)
    match = USER_SPEC.fullmatch(spec)
    if match is None:
        raise ConfigError(f"rl.rewards: '{spec}' is not a reward{_suggestion(spec)}; give {ACCEPTED}")
    module = _import(spec, match["module"])
    function = getattr(module, match["function"], None)
    if function is None:
        raise ConfigError(f"rl.rewards: '{spec}': module {match['module']} has no {match['function']!r}")
    if not callable(function):
        raise ConfigError(
            f"rl.rewards: '{spec}' is not callable: {match['function']} is of type {type(function).__name__}"
        )
    _check_signature(spec, function)
    return Reward(spec, function, code_digest(spec, function, module))


def code_digest(spec: str, function: RewardFunction, imported: ModuleType) -> str:
    """sha256 of the source file of the module that defines `function` (else of the module its spec
    imports): a user's reward is known to cache keys by its code, so an edit re-runs training.
    Modules that one imports in turn are not hashed."""
    module = inspect.getmodule(function) or imported
    try:
        path = inspect.getsourcefile(module)
    except TypeError:  # a built-in module: no file
        path = None
    if path is None or not Path(path).is_file():
        raise ConfigError(
            f"rl.rewards: '{spec}' is defined in {module.__name__}, which has no source file to key "
            "the cache by; define it in a .py file"
        )
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:DIGEST_LENGTH]


def _import(spec: str, name: str) -> ModuleType:
    try:
        with _working_directory_importable():
            return importlib.import_module(name)
    except Exception as e:  # importing runs the user's module, which may raise anything
        why = first_line(e) if isinstance(e, ImportError) else f"{type(e).__name__}: {first_line(e)}"
        raise ConfigError(f"rl.rewards: '{spec}' cannot be imported: {why}") from e


@contextlib.contextmanager
def _working_directory_importable() -> Iterator[None]:
    """The working directory on sys.path, after what is there, while importing: `jaxtune run`
    started by its console script does not put it there, as `python -m` does."""
    cwd = os.getcwd()
    added = cwd not in sys.path and "" not in sys.path
    if added:
        sys.path.append(cwd)
    try:
        yield
    finally:
        if added:
            sys.path.remove(cwd)


def _check_signature(spec: str, function: RewardFunction) -> None:
    """`function` must take (prompts, completions, rows) positionally; said now, not mid-training."""
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):  # some callables (C functions) have no signature to read
        return
    try:
        signature.bind([], [], [])
    except TypeError as e:
        raise ConfigError(
            f"rl.rewards: '{spec}' cannot be called as function(prompts, completions, rows): {e}"
        ) from None


def _suggestion(spec: str) -> str:
    close = difflib.get_close_matches(spec.partition(":")[0], NAMES, n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _weights(specs: tuple[str, ...], weights: Sequence[float] | None) -> tuple[float, ...]:
    if weights is None:
        return (1.0,) * len(specs)
    weights = tuple(float(w) for w in weights)
    if len(weights) != len(specs):
        raise ConfigError(
            f"rl.reward_weights has {len(weights)} weights for {len(specs)} rewards ({', '.join(specs)}): "
            "give one each, or null for all 1"
        )
    bad = next((w for w in weights if not math.isfinite(w)), None)
    if bad is not None:
        raise ConfigError(f"rl.reward_weights: {bad} is not a finite number")
    return weights
