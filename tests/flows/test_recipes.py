"""The real recipes in configs/, each run for two steps with a tiny model of the same family.

They name hub models and Dolly 15k, which cannot be downloaded here, or GGUF files that take
minutes to train on (the `real` tests cover those checkpoints); the test swaps in a tiny random
model of the recipe's architecture (and the tokenizer trained on the bundled data that comes
with it) and the bundled Dolly-schema data, and keeps every other setting, the recipe's chat
template included.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from safetensors import safe_open

from jaxtune.config import config_from_dict, load_config
from tests.flows.shapes import TOY_SHAPE

pytestmark = pytest.mark.slow

CONFIGS = Path(__file__).parents[2] / "configs"
RECIPES = {  # recipe -> the family of the model it names
    "gemma3-1b-dolly-lora.yaml": "gemma3",
    "gemma3-1b-dolly-full-adafactor.yaml": "gemma3",
    "llama3.2-1b-dolly-lora.yaml": "llama",
    "gemma3-270m-offline-lora.yaml": "gemma3",
    "smollm2-135m-offline-lora.yaml": "llama",
    "smollm2-135m-offline-dpo.yaml": "llama",
    "smollm2-135m-offline-grpo.yaml": "llama",
    "tiny-offline-dpo.yaml": "gemma3",
}


def test_every_recipe_in_configs_is_covered():
    assert {p.name for p in CONFIGS.glob("*.yaml")} == set(RECIPES)


def tiny_swap(path: Path, family: str, store: Path):
    """The recipe with a tiny model of `family`, the bundled data and 2 training steps."""
    raw = yaml.safe_load(path.read_text())
    raw["model"] = {**raw["model"], "name": "offline", "tiny": {**TOY_SHAPE, "architecture": family}}
    raw["data"] = {**raw["data"], "source": "offline"}
    raw["train"] = {**raw["train"], "max_steps": 2}
    raw["store"] = {"root": str(store)}
    return config_from_dict(raw, where=path.name)


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("recipes")


@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_runs_two_steps_on_a_tiny_model_keeping_its_settings(recipe, store):
    from jaxtune.flows.finetune import finetune

    real = load_config(CONFIGS / recipe)
    config = tiny_swap(CONFIGS / recipe, RECIPES[recipe], store)
    # Only the model, the data source, the step count and the store differ from the recipe.
    assert config.lora == real.lora and config.eval == real.eval and config.generate == real.generate
    assert config.train == real.train.model_copy(update={"max_steps": 2})
    assert config.data == real.data.model_copy(update={"source": "offline"})
    assert config.model.dtype == real.model.dtype and config.model.chat_template == real.model.chat_template

    result = finetune(config=config)
    report = json.loads((Path(result["path"]) / "report.json").read_text())
    if real.train.objective == "grpo":  # rewards of greedy answers, not losses
        assert report["train"]["steps"] == 2 and set(report["rewards"]) == set(real.rl.rewards)
        assert report["prompts"] == real.data.max_eval_rows
    else:
        assert report["train"]["steps"] == 2 and report["final"]["loss"] > 0
    assert (report["data"]["train_rows"], report["data"]["eval_rows"]) == (
        real.data.max_train_rows,
        real.data.max_eval_rows,
    )
    assert report["data"]["length_percentiles"]["max"] <= real.data.max_length
    assert set(report["exact_match"]) == {"before", "after"} and report["parity"]["dtype"] == real.model.dtype
    assert report["parity"]["top1_agreement"] >= 0.9  # bf16 rounding may flip a near tie, rarely

    train_dir = store / "train" / json.loads((Path(result["path"]) / "manifest.json").read_text())["inputs"]["train"]
    method = json.loads((train_dir / "method.json").read_text())
    assert method["method"] == real.train.method
    with safe_open(train_dir / "optimizer.safetensors", "np") as f:
        optimizer_state = list(f.keys())
    if real.train.optimizer == "adafactor":
        assert any("v_row" in key for key in optimizer_state), "factored second moments"
        assert report["export"]["kind"] == "hf_model"
    else:
        assert (
            method["lora"]["r"] == real.lora.r and tuple(method["lora"]["target_modules"]) == real.lora.target_modules
        )
        assert any(".mu" in key for key in optimizer_state) and report["export"]["kind"] == "peft_adapter"
