"""Every shipped recipe fits the chip it is written for: its train step, as the recipe configures
it (method, optimizer, remat, accumulation, batch, length, mesh), compiled by the target's own
compiler for `plan.target`, on a meta model of its checkpoint's exact shape.

The shapes come from nothing downloaded (tests/targets/recipes.py): the hub recipes' models from
their `config.json` as published, the offline recipes' from the headers of the GGUF files their pip
packages install. The train step is each plan's largest and is what is compiled
here (1-2 minutes each on 2 cores); `jaxtune doctor MODEL --config RECIPE --target` adds the eval
and decode steps (docs/planning.md's table of recipes and chips)."""

from __future__ import annotations

from pathlib import Path

import pytest

from jaxtune.config import OFFLINE, load_config
from tests.targets.recipes import HUB, PARAMETERS, checkpoint

pytestmark = pytest.mark.target

ROOT = Path(__file__).parents[2]
# The recipes of a checkpoint: the tiny random offline model is built on the machine it trains on.
RECIPES = sorted(p for p in ROOT.joinpath("configs").glob("*.yaml") if load_config(p).model.name != OFFLINE)


@pytest.fixture(scope="module")
def checkpoint_of(tmp_path_factory):
    """The file or folder standing for a recipe's `model.name`: its config.json, or its GGUF file."""
    models = tmp_path_factory.mktemp("models")
    return lambda name: checkpoint(name, models)


def test_every_recipe_names_a_known_chip_and_a_checkpoint_of_known_shape(checkpoint_of):
    from jaxtune.runtime.devices import targets
    from jaxtune.checks.target_plan import meta_model

    for recipe in RECIPES:
        config = load_config(recipe)
        assert config.plan.target, f"{recipe.name} names no plan.target"
        targets.resolve(config.plan.target)  # raises for a name it does not know
        path = checkpoint_of(config.model.name)
        module = meta_model(str(path), None, False, "bfloat16")
        assert sum(p.numel() for p in module.parameters()) == PARAMETERS[path.name], recipe.name
    assert {load_config(recipe).model.name for recipe in RECIPES} >= set(HUB)


@pytest.mark.slow  # one compile of a real-sized train step each: 1-2 minutes
@pytest.mark.parametrize("recipe", RECIPES, ids=lambda path: path.stem)
def test_the_recipe_fits_its_chip(recipe, checkpoint_of):
    from jaxtune.checks.doctor import MEMORY_CHECK, render
    from jaxtune.runtime.devices import targets
    from jaxtune.checks.target_plan import plan_for_target

    config = load_config(recipe)
    diagnosis = plan_for_target(str(checkpoint_of(config.model.name)), config, config.plan.target, train_only=True)
    print(render(diagnosis))
    rows = {row.check: row for row in diagnosis.rows}
    assert diagnosis.ok and rows[MEMORY_CHECK].ok, render(diagnosis)
    # The figures the verdict rests on, read back: the peak with its code holds at least the
    # weights, and is within what one device of the chip may use.
    peak, weights = _bytes(rows[MEMORY_CHECK].value), _bytes(rows["  parameters"].value)
    assert weights < peak <= targets.resolve(config.plan.target).chip.hbm


def _bytes(text: str) -> float:
    """2.78 GiB ... -> its bytes (as `jaxtune.checks.doctor.size_text` writes them)."""
    number, unit = text.split()[:2]
    return float(number) * {"GiB": 2**30, "MiB": 2**20}[unit]
