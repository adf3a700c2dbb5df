"""The pulse test: the whole flow on a 2-layer toy model, its report, and its exports in plain
PyTorch. Which stages a change recomputes is the invalidation matrix's (test_invalidation.py)."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from tests.flows.plain_torch import EXPORT_RTOL, TRAINED_MARGIN, plain_torch_losses
from tests.flows.toy import ALL_STAGES, TOY, run_toy, states
from tests.prefect_runs import flow_runs_of_store

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("store")


@pytest.fixture(scope="module")
def first(store):
    return run_toy(store)


@pytest.fixture(scope="module")
def report(first) -> dict:
    return json.loads((Path(first["path"]) / "report.json").read_text())


def test_first_run_computes_every_stage_and_reports(first, report):
    assert states(first) == {stage: "Completed" for stage in ALL_STAGES}
    # A random model over a 300-token vocabulary starts near the uniform loss ln(300) = 5.70.
    assert abs(report["baseline"]["loss"] - math.log(300)) < 0.1
    assert report["baseline"]["perplexity"] == pytest.approx(math.exp(report["baseline"]["loss"]), rel=1e-9)
    # 5.704 -> 5.507 when written: far more than the export check's tolerance (see plain_torch).
    assert report["baseline"]["loss"] - report["final"]["loss"] >= TRAINED_MARGIN * report["baseline"]["loss"]
    assert report["train"]["steps"] == 4 and report["train"]["rows_per_step"] == 4
    assert Path(report["export"]["path"], "adapter_config.json").is_file()
    assert (Path(first["path"]) / "report.md").read_text().startswith("# jaxtune report")
    parity = report["parity"]  # the trained model certifies its own numerics, here in float32
    assert parity["dtype"] == "float32" and parity["tokens"] > 100
    assert parity["max_abs_diff"] <= 1e-4 and parity["top1_agreement"] == 1.0
    assert "## Parity" in (Path(first["path"]) / "report.md").read_text()
    # The demo's eval_every (250) is past the toy's 4 steps: the eval at the last step is still logged.
    assert [r["step"] for r in report["eval_during_training"]] == [4]


def test_exact_match_is_what_the_generations_say(store, first, report):
    rows = [
        json.loads(line) for line in next((store / "generate").glob("*/generations.jsonl")).read_text().splitlines()
    ]
    assert len(rows) == 4
    for when in ("before", "after"):
        assert report["exact_match"][when] == sum(r[f"{when}_exact"] for r in rows) / 4
        assert all(r[f"{when}_exact"] == (r[when].strip() == r["reference"].strip()) for r in rows)
    # A random model's greedy output is noise: it matches none of the 4 references, one-word ones included.
    assert report["exact_match"]["before"] == 0.0


def test_the_report_names_the_eval_rows_training_helped_least(store, report, first):
    """Both evals record each row's loss; the report's hardest rows are those whose loss fell
    least or rose, and its per-category shares of rows that got worse agree with the same numbers."""

    def rows(stage: str) -> list[float]:
        return json.loads(next((store / stage).glob("*/rows.json")).read_text())["loss"]

    before, after = rows("baseline_eval"), rows("final_eval")
    hardest = report["hardest"]
    assert len(before) == len(after) == hardest["compared"] == 24
    changes = sorted((a - b for b, a in zip(before, after)), reverse=True)
    assert [r["change"] for r in hardest["rows"]] == pytest.approx(changes[:5], abs=2e-6)
    for r in hardest["rows"]:
        assert (r["baseline_loss"], r["final_loss"]) == (before[r["row"]], after[r["row"]])
    generations = [
        json.loads(line) for line in next((store / "generate").glob("*/generations.jsonl")).read_text().splitlines()
    ]
    assert [r["generation"] for r in hardest["rows"]] == [
        generations[r["row"]]["after"] if r["row"] < 4 else None for r in hardest["rows"]
    ]
    assert [r["prompt"] for r in hardest["rows"] if r["row"] < 4] == [
        generations[r["row"]]["prompt"] for r in hardest["rows"] if r["row"] < 4
    ]
    worse = hardest["worse_by_category"]
    assert sum(m["rows"] for m in worse.values()) == 24
    assert sum(m["worse"] for m in worse.values()) == sum(a > b for b, a in zip(before, after))
    assert all(m["share"] == m["worse"] / m["rows"] for m in worse.values())
    # Weighted by their scored tokens, the rows' losses give back the eval loss.
    tokens = json.loads(next((store / "final_eval").glob("*/rows.json")).read_text())["tokens"]
    assert sum(a * t for a, t in zip(after, tokens)) / sum(tokens) == pytest.approx(report["final"]["loss"], rel=1e-5)
    text = (Path(first["path"]) / "report.md").read_text()
    assert "## Hardest examples" in text and f"| {hardest['rows'][0]['row']} |" in text


def test_training_shows_progress_in_the_prefect_ui(store, first):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterKey

    with get_client(sync_client=True) as client:
        [run] = [
            r for r in flow_runs_of_store(client, store) if r.parameters["overrides"] == [*TOY, f"store.root={store}"]
        ]
        found = client.read_artifacts(
            artifact_filter=ArtifactFilter(
                key=ArtifactFilterKey(any_=["offline-train-progress"]),
                flow_run_id=ArtifactFilterFlowRunId(any_=[run.id]),
            )
        )
    assert found and found[0].type == "progress" and float(found[0].data) == 100.0


def test_exported_adapter_loads_in_plain_pytorch_with_the_same_loss(store, report):
    adapter = report["export"]["path"]
    base = json.loads((Path(adapter).parent / "export.json").read_text())["base_model"]
    eval_arrow = next((store / "tokenize").glob("*/eval.arrow"))
    [loss, base_loss] = plain_torch_losses(
        [
            {"base": base, "adapter": adapter, "eval_arrow": eval_arrow},
            {"base": base, "adapter": None, "eval_arrow": eval_arrow},
        ]
    )
    print(
        f"plain PyTorch: adapter {loss:.6f} vs final {report['final']['loss']:.6f}; "
        f"base {base_loss:.6f} vs baseline {report['baseline']['loss']:.6f}"
    )
    assert loss == pytest.approx(report["final"]["loss"], rel=EXPORT_RTOL)
    assert base_loss == pytest.approx(report["baseline"]["loss"], rel=EXPORT_RTOL)


def test_a_plan_larger_than_the_device_stops_training_before_step_1(store, first, monkeypatch):
    """The train stage reads XLA's memory plans (9.2 MiB peak here) of the step it will call, before
    calling it; on a device of 1 MiB (faked: the CPU reports no limit) train.remat auto tries every
    policy, then every split of the batch, and stops, naming what would fit."""
    from jaxtune.runtime.compiled import steps
    from jaxtune.runtime.measures import memory

    def no_step(*args, **kwargs):  # the plan compiles the step from shapes alone (`steps.shared_train_step`)
        def step(*inputs):
            raise AssertionError("a train step ran")

        return step

    trained = sorted((store / "train").glob("*/manifest.json"))
    monkeypatch.setattr(memory, "device_limit", lambda: 2**20)
    monkeypatch.setattr(steps, "make_train_step", no_step)
    with pytest.raises(
        MemoryError,
        match=r"do not fit the device: even remat layer with 1 row per micro-batch needs "
        r"\d+\.\d MiB, and 1\.0 MiB is free",
    ) as refused:
        run_toy(store, "train.seed=7", until="train")
    message = str(refused.value)  # what would fit by estimate: here 7 fsdp devices (rows of 135 tokens need 128+)
    assert re.search(r"Try (data\.max_length=\d+|mesh\.fsdp=\d+ on \d+ devices)", message), message
    assert "train.optimizer=adafactor" in message
    assert sorted((store / "train").glob("*/manifest.json")) == trained, "no train artifact written"
    assert not list((store / "train").glob(".tmp-*")) and not list(store.glob(".scratch/train/*/step-*"))


def test_full_fine_tune_exports_a_plain_hf_model_with_the_same_loss(store, first, report):
    result = run_toy(store, "train.method=full", until="export")
    assert {s for s, state in states(result).items() if state != "Cached"} == {"train", "final_eval", "export"}
    export_folder = Path(result["path"])
    assert json.loads((export_folder / "export.json").read_text())["kind"] == "hf_model"
    train_key = json.loads((export_folder / "manifest.json").read_text())["inputs"]["train"]
    metrics = (
        next(
            p
            for p in (store / "final_eval").glob("*/manifest.json")
            if json.loads(p.read_text())["inputs"].get("train") == train_key
        ).parent
        / "metrics.json"
    )
    final_loss = json.loads(metrics.read_text())["loss"]
    assert report["baseline"]["loss"] - final_loss >= TRAINED_MARGIN * report["baseline"]["loss"]
    eval_arrow = next((store / "tokenize").glob("*/eval.arrow"))
    [loss] = plain_torch_losses([{"base": export_folder / "model", "adapter": None, "eval_arrow": eval_arrow}])
    assert loss == pytest.approx(final_loss, rel=EXPORT_RTOL)
