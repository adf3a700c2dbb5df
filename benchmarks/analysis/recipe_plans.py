"""Every shipped recipe's train step planned for the chips people rent, compiled here without them:
docs/planning.md's table of recipes and chips.

    JAX_PLATFORMS=cpu python -m benchmarks.analysis.recipe_plans [--targets v5e-1,h100] [--recipes gemma3-1b-dolly-lora]
    JAX_PLATFORMS=cpu python -m benchmarks.analysis.recipe_plans --out benchmarks/results/recipe-plans.json

Each row is `jaxtune doctor CHECKPOINT --config RECIPE --target TARGET`'s train step (the plan's
largest), on a meta model of the recipe's checkpoint (tests/targets/recipes.py: nothing is
downloaded), with the recipe's mesh as configured. A step that does not fit is followed, as the
doctor does, by the smallest larger slice of that chip that does. Prints one markdown row per
plan as it is compiled (each takes 20 s to 4 minutes on 2 cores); `--out` keeps every row's cells and
compile time as a result, rewritten after each row, so a run cut short keeps what it planned, and
adds to the rows already there. Not part of `make bench`;
needs the tpu-plan and gpu-plan extras (`make test` installs both).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
ROOT = Path(__file__).resolve().parents[2]
TARGETS = ("v5e-1", "v5e-8", "v6e-1", "v5p-8", "h100", "h200")


CELLS = ("recipe", "target", "mesh", "peak", "fits", "roofline")


def row(recipe: Path, target: str, models: Path) -> tuple[tuple[str, ...], float]:
    """The markdown cells of `recipe`'s plan on `target`, and the seconds it took."""
    from jaxtune.checks.doctor import MEMORY_CHECK
    from jaxtune.checks.target_plan import plan_for_target
    from jaxtune.config import load_config
    from tests.targets.recipes import checkpoint

    config = load_config(recipe)
    started = time.perf_counter()
    diagnosis = plan_for_target(str(checkpoint(config.model.name, models)), config, target, train_only=True)
    rows = {r.check.strip(): r for r in diagnosis.rows}
    train = rows[MEMORY_CHECK]
    peak = train.value.split(" with its code")[0] if train.value[0].isdigit() else "does not compile"
    fits = (
        "yes"
        if train.ok
        else "no" + (f": {rows['to fit'].value.split('. Or try')[0]}" if "fits:" in rows["to fit"].value else "")
    )
    roofline = (
        rows["roofline (estimate)"].value.split(", <= ")[1] if "roofline (estimate)" in rows else "(no flop count)"
    )
    declared = " (`plan.target`)" if config.plan.target == target else ""
    cells = (
        f"`{recipe.stem}`",
        f"{target}{declared}",
        rows["mesh"].value,
        f"{peak} / {train.limit.removesuffix(' HBM')}",
        fits,
        roofline,
    )
    seconds = time.perf_counter() - started
    print(f"  {recipe.stem} on {target}: {seconds:.0f} s", file=sys.stderr, flush=True)
    return cells, seconds


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--targets", default=",".join(TARGETS))
    parser.add_argument("--recipes", default="", help="recipe names (configs/NAME.yaml), comma-separated; default all")
    parser.add_argument("--out", type=Path, help="also keep the rows as a result (JSON), for the docs to cite")
    args = parser.parse_args()
    result = {"date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), "rows": {}}
    if args.out and args.out.is_file():  # rows of an earlier run (other recipes or targets) are kept
        result["rows"] = json.loads(args.out.read_text())["rows"]
    if args.out:
        from benchmarks.common.harness import provenance

        result["provenance"] = provenance()
    recipes = (
        [ROOT / "configs" / f"{name}.yaml" for name in args.recipes.split(",")]
        if args.recipes
        else sorted(ROOT.joinpath("configs").glob("*.yaml"))
    )
    print(
        "| recipe | target | mesh | train step peak with its code "
        "/ per device | fits | roofline (compiler's estimate) |"
    )
    print("|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as models:
        for recipe in recipes:
            for target in args.targets.split(","):
                cells, seconds = row(recipe, target, Path(models))
                print("| " + " | ".join(cells) + " |", flush=True)
                if args.out:
                    result["rows"].setdefault(recipe.stem, {})[target] = {**dict(zip(CELLS, cells)), "seconds": seconds}
                    args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
