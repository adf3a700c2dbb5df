"""The invalidation matrix: flip one setting of each config section, damage one file, move the
store, refresh one stage, and exactly the stages that depend on the change run again while
every other stage is Cached."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.flows.toy import ALL_STAGES, run_toy, states, toy_config

pytestmark = [pytest.mark.cache, pytest.mark.slow]

AFTER_TRAIN = {"train", "final_eval", "export", "generate", "report"}
AFTER_TOKENIZE = {"tokenize", "baseline_eval", *AFTER_TRAIN}

FLIPS = {
    "data": ("data.max_eval_rows=20", AFTER_TOKENIZE),
    "model": ("model.dtype=bfloat16", AFTER_TOKENIZE - {"tokenize"}),
    # The tiny model's weights change; its tokenizer (trained on the data alone) does not.
    "tiny": ("model.tiny.seed=1", {"build_model", *AFTER_TOKENIZE}),
    "lora": ("lora.r=4", AFTER_TRAIN),
    "train": ("train.learning_rate=0.002", AFTER_TRAIN),
    "eval": ("eval.batch_size=8", {"baseline_eval", "final_eval", "report"}),
    "generate": ("generate.max_new_tokens=4", {"generate", "report"}),
    "export": ("export.dtype=bfloat16", {"export", "report"}),
    # How the batch is laid over devices does not change what is computed.
    "mesh": ("mesh.data=1", set()),
    # Where the curves also go (TensorBoard files, an MLflow server) is no stage's business.
    "tracking": ("tracking.tensorboard=true", set()),
    "mlflow": ("tracking.mlflow_experiment=other", set()),
}


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    store = tmp_path_factory.mktemp("matrix")
    assert set(states(run_toy(store)).values()) == {"Completed"}
    return store


def expect(ran: set[str]) -> dict[str, str]:
    return {stage: "Completed" if stage in ran else "Cached" for stage in ALL_STAGES}


def test_an_unchanged_config_is_all_cached(store):
    assert states(run_toy(store)) == expect(set())


@pytest.mark.parametrize("section", FLIPS)
def test_flipping_one_setting_reruns_exactly_its_dependents(store, section):
    override, ran = FLIPS[section]
    assert states(run_toy(store, override)) == expect(ran)
    assert states(run_toy(store, override)) == expect(set()), "the changed run is cached in its turn"


@pytest.mark.parametrize("stage", ALL_STAGES)
def test_refresh_recomputes_exactly_the_named_stage(store, stage):
    assert states(run_toy(store, refresh=[stage])) == expect({stage})


def _folder(store: Path, stage: str) -> Path:
    from jaxtune.flows.finetune import planned_keys

    return store / stage / planned_keys(toy_config(store))[stage]


@pytest.mark.parametrize(
    "stage, name", [("train", "params.safetensors"), ("final_eval", "metrics.json"), ("tokenize", "eval.arrow")]
)
def test_a_damaged_file_recomputes_its_stage_to_the_same_bytes(store, stage, name):
    file = _folder(store, stage) / name
    original = file.read_bytes()
    damaged = bytearray(original)
    damaged[len(damaged) // 2] ^= 0xFF  # one flipped byte, same size: only the sha256 tells
    file.write_bytes(bytes(damaged))
    assert states(run_toy(store)) == expect({stage})
    assert file.read_bytes() == original, "recomputed deterministically"


def test_a_moved_store_is_all_cached_and_answers_from_its_new_place(store, tmp_path):
    moved = tmp_path / "elsewhere"
    shutil.copytree(store, moved)
    result = run_toy(moved)
    assert states(result) == expect(set())
    assert Path(result["path"]).is_relative_to(moved) and (Path(result["path"]) / "report.md").is_file()
