"""The pulse test: the whole flow on a 2-layer toy model, then caching and exact invalidation."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from jaxtune.config import load_config
from tests.flows.plain_torch import plain_torch_losses
from tests.flows.shapes import TOY_MODEL

pytestmark = pytest.mark.slow

TOY = [
    *TOY_MODEL, "data.max_train_rows=64", "data.max_eval_rows=24",
    "train.max_steps=4", "train.batch_size=4", "train.log_every=2", "train.warmup_steps=1",
    "generate.num_prompts=4", "generate.max_new_tokens=6", "generate.batch_size=4",
]
ALL = {"build_tokenizer", "build_model", "tokenize", "baseline_eval", "train", "final_eval", "export", "generate", "report"}


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("store")


def run(store: Path, *overrides: str, refresh=(), until="report"):
    from jaxtune.flows.finetune import finetune

    config = load_config(None, [*TOY, f"store.root={store}", *overrides])
    return finetune(config=config, refresh=list(refresh), until=until)


def ran(result) -> set[str]:
    return {stage for stage, state in result["stages"].items() if state != "Cached"}


@pytest.fixture(scope="module")
def first(store):
    return run(store)


def test_first_run_computes_every_stage_and_reports(first):
    assert ran(first) == ALL
    report = json.loads((Path(first["path"]) / "report.json").read_text())
    assert report["baseline"]["loss"] > 0 and report["final"]["loss"] > 0
    assert report["train"]["steps"] == 4
    assert set(report["exact_match"]) == {"before", "after"}
    assert Path(report["export"]["path"], "adapter_config.json").is_file()
    assert (Path(first["path"]) / "report.md").read_text().startswith("# jaxtune report")
    parity = report["parity"]  # the trained model certifies its own numerics, here in float32
    assert parity["dtype"] == "float32" and parity["tokens"] > 100
    assert parity["max_abs_diff"] <= 1e-4 and parity["top1_agreement"] == 1.0
    assert "## Parity" in (Path(first["path"]) / "report.md").read_text()
    # The demo's eval_every (250) is past the toy's 4 steps: the eval at the last step is still logged.
    assert [r["step"] for r in report["eval_during_training"]] == [4]


def test_training_shows_progress_in_the_prefect_ui(first):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    with get_client(sync_client=True) as client:
        found = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["jaxtune-train-progress"])))
    assert found and found[0].type == "progress" and float(found[0].data) == 100.0


def test_second_run_is_all_cached(store, first):
    again = run(store)
    assert ran(again) == set()
    assert again["path"] == first["path"]


def test_changing_train_config_reruns_exactly_train_and_downstream(store, first):
    changed = run(store, "train.learning_rate=0.002")
    assert ran(changed) == {"train", "final_eval", "export", "generate", "report"}


def test_deleted_artifact_reruns_only_that_stage(store, first):
    key = json.loads((Path(first["path"]) / "manifest.json").read_text())["inputs"]["final_eval"]
    shutil.rmtree(store / "final_eval" / key)
    assert ran(run(store)) == {"final_eval"}


def test_refresh_recomputes_named_stage(store, first):
    assert ran(run(store, refresh=["tokenize"])) == {"tokenize"}


def test_exported_adapter_loads_in_plain_pytorch_with_the_same_loss(store, first):
    report = json.loads((Path(first["path"]) / "report.json").read_text())
    adapter = report["export"]["path"]
    base = json.loads((Path(adapter).parent / "export.json").read_text())["base_model"]
    eval_arrow = next((store / "tokenize").glob("*/eval.arrow"))
    [loss] = plain_torch_losses([{"base": base, "adapter": adapter, "eval_arrow": eval_arrow}])
    assert abs(loss - report["final"]["loss"]) <= 0.01 * report["final"]["loss"], (loss, report["final"]["loss"])


def test_full_fine_tune_exports_a_plain_hf_model_with_the_same_loss(store, first):
    result = run(store, "train.method=full", until="export")
    assert ran(result) == {"train", "final_eval", "export"}
    export_folder = Path(result["path"])
    assert json.loads((export_folder / "export.json").read_text())["kind"] == "hf_model"
    train_key = json.loads((export_folder / "manifest.json").read_text())["inputs"]["train"]
    metrics = next(p for p in (store / "final_eval").glob("*/manifest.json")
                   if json.loads(p.read_text())["inputs"].get("train") == train_key).parent / "metrics.json"
    final_loss = json.loads(metrics.read_text())["loss"]
    eval_arrow = next((store / "tokenize").glob("*/eval.arrow"))
    [loss] = plain_torch_losses([{"base": export_folder / "model", "adapter": None, "eval_arrow": eval_arrow}])
    assert abs(loss - final_loss) <= 0.01 * final_loss, (loss, final_loss)
