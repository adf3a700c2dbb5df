"""The toy pipeline flow tests run: a 2-layer model of width 32 on a few dozen rows, so a whole run takes seconds."""

from __future__ import annotations

from pathlib import Path

from tests.flows.shapes import TOY_MODEL

TOY = [
    *TOY_MODEL,
    "data.max_train_rows=64",
    "data.max_eval_rows=24",
    "train.max_steps=4",
    "train.batch_size=4",
    "train.log_every=2",
    "train.warmup_steps=1",
    "generate.num_prompts=4",
    "generate.max_new_tokens=6",
    "generate.batch_size=4",
]
ALL_STAGES = (
    "build_tokenizer",
    "build_model",
    "tokenize",
    "baseline_eval",
    "train",
    "final_eval",
    "export",
    "generate",
    "report",
)


def toy_config(store: Path, *overrides: str):
    """The toy settings (then `overrides`) with `store` as the artifact store."""
    from jaxtune.config import load_config

    return load_config(None, [*TOY, f"store.root={store}", *overrides])


def run_toy(store: Path, *overrides: str, refresh=(), until: str = "report") -> dict:
    """The finetune flow on the toy settings (then `overrides`) in `store`."""
    from jaxtune.flows.finetune import finetune

    return finetune(overrides=[*TOY, f"store.root={store}", *overrides], refresh=list(refresh), until=until)


def run_in_new_store(tmp_path_factory, *overrides: str) -> tuple[Path, dict]:
    """(a new store, the toy run in it with `overrides`): what a module's shared run fixture returns."""
    store = tmp_path_factory.mktemp("store")
    return store, run_toy(store, *overrides)


def states(result: dict) -> dict[str, str]:
    """{stage: Completed | Cached} of a flow result."""
    return dict(result["stages"])


def artifact(store: Path, stage: str) -> Path:
    """The one artifact folder of `stage` in `store`."""
    (folder,) = [p for p in (store / stage).iterdir() if p.is_dir() and not p.name.startswith(".")]
    return folder
