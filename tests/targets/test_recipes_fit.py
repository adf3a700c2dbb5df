"""Every shipped recipe fits the chip it is written for: its train step, as the recipe configures
it (method, optimizer, remat, accumulation, batch, length, mesh), compiled by the target's own
compiler for `plan.target`, on a meta model of its checkpoint's exact shape.

The shapes come from nothing downloaded (tests/targets/recipes.py): the hub recipes' models from
their `config.json` as published, the offline recipes' from the headers of the GGUF files their pip
packages install. The train step is each plan's largest and is what is compiled here (2-7 minutes
each on 2 cores; where it traces to the very program whose plan tests/targets/plans.json holds, that
plan is read instead: tests/conftest.py); `jaxtune doctor MODEL --config RECIPE --target` adds the
eval and decode steps (docs/planning.md's table of recipes and chips). A recipe whose step is another's
on fewer rows (`COVERED_BY`) fits where that one does and is not compiled again."""

from __future__ import annotations

from pathlib import Path

import pytest

from jaxtune.config import OFFLINE, load_config
from tests.targets.recipes import HUB, PARAMETERS, checkpoint

pytestmark = pytest.mark.target

ROOT = Path(__file__).parents[2]
# The recipes of a checkpoint: the tiny random offline model is built on the machine it trains on.
RECIPES = sorted(p for p in ROOT.joinpath("configs").glob("*.yaml") if load_config(p).model.name != OFFLINE)
# The SFT recipe the DPO one starts from: the DPO step runs the same model, LoRA, optimizer and
# rows of the same length, two to a pair, so it holds at least the SFT step's rows; where it fits,
# the SFT step fits. Compiling both (about 100 s each on 2 cores) would learn nothing more.
COVERED_BY = {"smollm2-135m-offline-lora": "smollm2-135m-offline-dpo"}


@pytest.fixture(scope="module")
def checkpoint_of(tmp_path_factory):
    """The file or folder standing for a recipe's `model.name`: its config.json, or its GGUF file."""
    models = tmp_path_factory.mktemp("models")
    return lambda name: checkpoint(name, models)


def test_every_recipe_names_a_known_chip_and_a_checkpoint_of_known_shape(checkpoint_of):
    from jaxtune.checks.target_plan import meta_model
    from jaxtune.runtime.devices import targets

    for recipe in RECIPES:
        config = load_config(recipe)
        assert config.plan.target, f"{recipe.name} names no plan.target"
        targets.resolve(config.plan.target)  # raises for a name it does not know
        path = checkpoint_of(config.model.name)
        module = meta_model(str(path), None, False, "bfloat16")
        assert sum(p.numel() for p in module.parameters()) == PARAMETERS[path.name], recipe.name
    assert {load_config(recipe).model.name for recipe in RECIPES} >= set(HUB)


@pytest.mark.slow  # one compile of a real-sized train step each: 1-2 minutes
@pytest.mark.parametrize("recipe", [p for p in RECIPES if p.stem not in COVERED_BY], ids=lambda path: path.stem)
def test_the_recipe_fits_its_chip(recipe, checkpoint_of):
    from jaxtune.checks.doctor import MEMORY_CHECK, render
    from jaxtune.checks.target_plan import plan_for_target
    from jaxtune.runtime.devices import targets

    config = load_config(recipe)
    diagnosis = plan_for_target(str(checkpoint_of(config.model.name)), config, config.plan.target, train_only=True)
    print(render(diagnosis))
    rows = {row.check: row for row in diagnosis.rows}
    assert diagnosis.ok and rows[MEMORY_CHECK].ok, render(diagnosis)
    # The figures the verdict rests on, read back: the peak with its code holds at least the
    # weights, and is within what one device of the chip may use.
    peak, weights = _bytes(rows[MEMORY_CHECK].value), _bytes(rows["  parameters"].value)
    assert weights < peak <= targets.resolve(config.plan.target).chip.hbm


def test_a_recipe_left_uncompiled_is_the_step_of_one_compiled_on_no_more_rows(checkpoint_of):
    """What `COVERED_BY` rests on, read from the recipes: change either so that it no longer holds,
    and this fails, naming the setting, until the recipe is compiled on its own again."""
    for covered, by in COVERED_BY.items():
        small, large = (load_config(ROOT / "configs" / f"{name}.yaml") for name in (covered, by))
        assert (small.train.objective, large.train.objective) == ("sft", "dpo"), (covered, by)
        assert checkpoint_of(small.model.name) == checkpoint_of(large.model.name), (covered, by)
        for section in ("lora", "mesh", "plan"):
            assert getattr(small, section) == getattr(large, section), f"{covered}, {by}: {section}"
        assert small.model.model_copy(update={"name": ""}) == large.model.model_copy(update={"name": ""}), (covered, by)
        for setting in ("method", "optimizer", "remat", "grad_accumulation", "max_grad_norm"):
            assert getattr(small.train, setting) == getattr(large.train, setting), f"{covered}, {by}: train.{setting}"
        assert small.data.max_length <= large.data.max_length, (covered, by)
        assert small.train.batch_size <= 2 * large.train.batch_size, (covered, by)  # a DPO pair is two rows
        assert RECIPES.count(ROOT / "configs" / f"{by}.yaml") == 1 and by not in COVERED_BY


def _bytes(text: str) -> float:
    """2.78 GiB ... -> its bytes (as `jaxtune.checks.doctor.size_text` writes them)."""
    number, unit = text.split()[:2]
    return float(number) * {"GiB": 2**30, "MiB": 2**20}[unit]
