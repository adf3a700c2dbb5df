"""A toy run with `tracking.tensorboard` and a periodic eval: TensorBoard's own reader finds every
logged scalar at every step in the train artifact, and the Prefect run holds its curve and
latest-figures artifacts in several versions, each made at an eval, the earlier with fewer steps."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.flows.toy import artifact, run_in_new_store
from tests.prefect_runs import flow_runs_of_store

pytestmark = [pytest.mark.tracking, pytest.mark.slow]

STEPS = 4


@pytest.fixture(scope="module")
def toy(tmp_path_factory) -> tuple[Path, dict]:
    return run_in_new_store(tmp_path_factory, "tracking.tensorboard=true", "train.eval_every=2")


def _log(store: Path) -> list[dict]:
    return [json.loads(line) for line in (artifact(store, "train") / "log.jsonl").read_text().splitlines()]


def _events(store: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(
        str(artifact(store, "train") / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0}
    )
    return accumulator.Reload()


def test_tensorboard_reads_back_every_scalar_at_every_step(toy):
    from jaxtune.tracking.tensorboard import SCALARS

    store, _ = toy
    events, log = _events(store), _log(store)
    for field, tag in SCALARS.items():
        expected = [(r["step"], r[field]) for r in log if r.get(field) is not None]
        read = [(e.step, e.value) for e in events.Scalars(tag)] if tag in events.Tags()["scalars"] else []
        assert [s for s, _ in read] == [s for s, _ in expected], tag
        assert [v for _, v in read] == pytest.approx([v for _, v in expected], rel=1e-6), tag
    assert len(events.Scalars("train/loss")) == STEPS and len(events.Scalars("eval/loss")) == 2


def test_tensorboard_has_the_config_and_the_final_figures(toy):
    store, _ = toy
    events = _events(store)
    summary = json.loads((artifact(store, "train") / "summary.json").read_text())
    [final_loss] = events.Scalars("final/final_loss")
    assert (final_loss.step, final_loss.value) == (STEPS, pytest.approx(summary["final_loss"]))
    [config] = events.Tensors("config/text_summary")
    text = config.tensor_proto.string_val[0].decode()
    assert "learning_rate" in text and "max_steps: 4" in text


def test_tensorboard_files_are_listed_in_the_train_manifest(toy):
    store, _ = toy
    manifest = json.loads((artifact(store, "train") / "manifest.json").read_text())
    assert any(name.startswith("tensorboard/events.out.tfevents.") for name in manifest["files"])


def test_the_live_curve_and_figures_have_a_version_per_eval(toy):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    store, _ = toy
    with get_client(sync_client=True) as client:
        [run] = flow_runs_of_store(client, store)
        artifacts = client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[run.id]))
        )
    curves = sorted((a for a in artifacts if (a.key or "").endswith("-train-curve")), key=lambda a: a.created)
    latest = sorted((a for a in artifacts if (a.key or "").endswith("-train-latest")), key=lambda a: a.created)
    assert len(curves) == len(latest) == 2, "one of each per eval (steps 2 and 4)"
    assert len({a.key for a in curves}) == 1, "updated under one key"
    steps = [int(re.search(r"step (\d+) of 4", a.description).group(1)) for a in curves]
    assert steps == [2, STEPS], "the earlier version has fewer steps"
    assert all("data:image/png;base64," in a.data for a in curves)
    tables = [json.loads(a.data) if isinstance(a.data, str) else a.data for a in latest]
    assert [t[0]["step"] for t in tables] == [2, STEPS]
    log = _log(store)
    last_eval = [r["eval_loss"] for r in log if "eval_loss" in r][-1]
    assert tables[-1][0]["eval_loss"] == pytest.approx(last_eval)
    assert tables[-1][0]["loss"] == pytest.approx([r["loss"] for r in log if "loss" in r][-1])
