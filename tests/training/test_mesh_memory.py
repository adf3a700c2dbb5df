"""The memory plan on a mesh: which mesh of the same devices a plan that does not fit is refused
with (estimated from the plan's parts), the mesh named in the plan, the doctor's rows and the
report. Every plan here is synthetic: nothing is compiled."""

from __future__ import annotations

import dataclasses
import json

import pytest

from jaxtune.config import TrainConfig
from jaxtune.runtime.measures import memory

pytestmark = pytest.mark.training

GiB = 2**30


def plan(
    mesh: dict[str, int],
    *,
    parameters: float,
    gradients: float,
    optimizer_state: float,
    activations: float,
    limit: float | None,
    rows: int = 1,
    peak: float | None = None,
) -> memory.MemoryPlan:
    """A plan as `memory_plan` returns it, in GiB; its peak as XLA counts one with donated state:
    parameters, optimizer state, two gradients' worth (accumulator and micro-batch) and activations."""
    peak = parameters + optimizer_state + 2 * gradients + activations if peak is None else peak
    return memory.MemoryPlan(
        parameters=int(parameters * GiB),
        gradients=int(gradients * GiB),
        optimizer_state=int(optimizer_state * GiB),
        activations_per_micro_batch=int(activations * GiB),
        peak=int(peak * GiB),
        device_limit=None if limit is None else int(limit * GiB),
        mesh=mesh,
        devices=mesh["data"] * mesh["fsdp"] * mesh["tensor"],
        shape={"micro_batches": 1, "rows_per_device": rows, "length": 512},
    )


# Data parallel over 8 devices: 14 GiB of state (6 + 4 + 2 x 2) and 3 GiB of activations, 17 GiB in all.
DATA8 = plan({"data": 8, "fsdp": 1, "tensor": 1}, parameters=6, gradients=2, optimizer_state=4, activations=3, limit=16)
FULL = TrainConfig(
    method="full", optimizer="adamw", batch_size=8, remat="matmuls"
)  # a fixed policy: auto tries layer itself


def test_the_estimate_splits_state_over_fsdp_x_tensor_and_activations_over_the_batch_shards():
    assert memory.estimate_peak(DATA8, DATA8.mesh) == DATA8.peak  # the plan's own mesh: its own peak
    assert memory.estimate_peak(DATA8, {"data": 4, "fsdp": 2, "tensor": 1}) == 10 * GiB  # 14 / 2 + 3 x 8 / 8
    assert memory.estimate_peak(DATA8, {"data": 4, "fsdp": 1, "tensor": 2}) == 13 * GiB  # 14 / 2 + 3 x 8 / 4
    assert memory.estimate_peak(DATA8, {"data": 1, "fsdp": 8, "tensor": 1}) == int(4.75 * GiB)  # 14 / 8 + 3
    assert memory.estimate_peak(DATA8, {"data": 1, "fsdp": 1, "tensor": 8}) == int(25.75 * GiB)  # 14 / 8 + 3 x 8
    # From a sharded plan back to fewer shards: the state grows again.
    fsdp8 = plan(
        {"data": 1, "fsdp": 8, "tensor": 1}, parameters=1, gradients=0.5, optimizer_state=1, activations=2, limit=8
    )
    assert memory.estimate_peak(fsdp8, {"data": 8, "fsdp": 1, "tensor": 1}) == 26 * GiB  # 3 x 8 + 2


def test_the_suggestion_is_the_fitting_mesh_with_the_largest_data_axis_then_the_smallest_tensor_axis():
    # (4, 2, 1) at 10 GiB and (4, 1, 2) at 13 GiB both fit 16 GiB; data=8 is the plan's own mesh.
    assert memory.suggest_mesh(DATA8, FULL) == {"mesh": {"data": 4, "fsdp": 2, "tensor": 1}, "peak": 10 * GiB}
    # At 9 GiB no data=4 mesh fits; of data=2: (2, 4, 1) 6.5 GiB fits, (2, 2, 2) 9.5 GiB does not.
    tight = dataclasses.replace(DATA8, device_limit=9 * GiB)
    assert memory.suggest_mesh(tight, FULL) == {"mesh": {"data": 2, "fsdp": 4, "tensor": 1}, "peak": int(6.5 * GiB)}
    assert (
        memory.suggest_mesh(dataclasses.replace(DATA8, device_limit=None), FULL) is None
    )  # no limit known: nothing to fit


def test_only_meshes_whose_batch_shards_divide_the_batch_are_suggested():
    # Two rows a step on 8 devices: data x fsdp must divide 2, so tensor takes the rest.
    tensor4 = plan(
        {"data": 2, "fsdp": 1, "tensor": 4}, parameters=8, gradients=2, optimizer_state=4, activations=4, limit=18
    )  # 20 GiB: 16 of state, 4 of activations
    cfg = FULL.model_copy(update={"batch_size": 2})
    candidates = memory.mesh_candidates(tensor4, cfg)
    # Preferred first (data desc, tensor asc): (1, 2, 4) at 16 / 2 + 4 = 12 GiB, then (1, 1, 8) at 8 + 4 x 2 = 16 GiB.
    assert candidates == [
        {"mesh": {"data": 1, "fsdp": 2, "tensor": 4}, "peak": 12 * GiB},
        {"mesh": {"data": 1, "fsdp": 1, "tensor": 8}, "peak": 16 * GiB},
    ]
    assert memory.suggest_mesh(tensor4, cfg) == {"mesh": {"data": 1, "fsdp": 2, "tensor": 4}, "peak": 12 * GiB}
    # With 8 rows the (8, 1, 1) .. (1, 8, 1) meshes count too.
    assert len(memory.mesh_candidates(tensor4, FULL)) == 9  # the 10 ordered factorizations of 8, less the plan's own


def test_a_plan_that_does_not_fit_is_refused_naming_its_mesh_and_one_that_would_fit():
    with pytest.raises(MemoryError) as refused:
        memory.check_fits(DATA8, FULL)
    message = str(refused.value)
    assert message.startswith(
        "training needs 17.00 GiB per device on mesh data=8, fsdp=1, tensor=1 on 8 devices "
        "but the device has 16.00 GiB. "
    )
    assert (
        "Try mesh.data=4, mesh.fsdp=2, mesh.tensor=1: about 10.00 GiB per device by estimate (parameters, "
        "gradients and optimizer state split 2 ways instead of 1, each batch split 8 ways instead of 8). Or try: "
        "train.method=lora"
    ) in message
    for knob in ("train.optimizer=adafactor", "train.remat=layer", "batch_size=4, grad_accumulation=2"):
        assert knob in message
    memory.check_fits(dataclasses.replace(DATA8, device_limit=17 * GiB), FULL)  # exactly the peak: fits


def test_when_no_mesh_of_the_devices_fits_the_refusal_says_so_and_keeps_the_settings_to_change():
    # 192 GiB of state: even split 8 ways (24 GiB) it is over 16 GiB.
    huge = plan(
        {"data": 8, "fsdp": 1, "tensor": 1}, parameters=64, gradients=32, optimizer_state=64, activations=8, limit=16
    )
    assert memory.suggest_mesh(huge, FULL) is None
    with pytest.raises(MemoryError) as refused:
        memory.check_fits(huge, FULL)
    message = str(refused.value)
    assert (
        "No mesh of 8 devices fits by estimate (the smallest estimate, mesh.data=1, mesh.fsdp=8, mesh.tensor=1, "
        "needs about 32.00 GiB). Try: train.method=lora"
    ) in message  # 192 / 8 + 8
    assert "train.optimizer=adafactor" in message and "Try mesh." not in message
    one = plan(
        {"data": 1, "fsdp": 1, "tensor": 1}, parameters=4, gradients=1, optimizer_state=2, activations=2, limit=4
    )
    with pytest.raises(MemoryError) as refused:
        memory.check_fits(one, TrainConfig(method="lora", optimizer="adafactor", remat="layer", batch_size=1))
    assert str(refused.value).endswith(
        "No mesh of 1 device fits by estimate. Try: a shorter data.max_length or a device with more memory"
    )


def test_describe_names_the_mesh():
    text = memory.describe(DATA8)
    assert text.startswith(
        "memory plan per device on mesh data=8, fsdp=1, tensor=1 on 8 devices: parameters 6,144.0 MiB"
    )
    assert "per micro-batch of 1 x 512; XLA peak 17,408.0 MiB; device memory 16,384.0 MiB" in text


def test_the_doctor_shows_the_mesh_and_when_the_plan_does_not_fit_a_mesh_that_would():
    from jaxtune.checks.doctor import Diagnosis, _memory_rows, render
    from jaxtune.config import load_config

    config = load_config(None, ["train.method=full", "train.batch_size=8"])
    rows = _memory_rows(dataclasses.replace(DATA8, device_limit=None), config, "bfloat16")
    assert (rows[0].check, rows[0].value, rows[0].ok) == ("mesh", "data=8, fsdp=1, tensor=1 on 8 devices", None)
    assert rows[1].ok is None and rows[1].limit == "not reported" and len(rows) == 6  # the CPU: nothing to check
    labelled = _memory_rows(dataclasses.replace(DATA8, device_limit=None, platform="cpu"), config, "bfloat16")
    assert (labelled[-1].check, labelled[-1].value) == (
        "  planned by",
        (
            "XLA:CPU, which computes bf16 matmuls in float32 and keeps float32 copies of the weights for them: "
            "an accelerator needs less. For an accelerator's own plan: --target v5e-1 (or v6e-1, v5p-8, h100, ...)"
        ),
    )
    rows = _memory_rows(DATA8, config, "bfloat16")
    assert (rows[1].check, rows[1].value.split(" (")[0], rows[1].limit, rows[1].ok) == (
        "train step memory, peak",
        "17.00 GiB",
        "16.00 GiB",
        False,
    )
    assert rows[-1].check == "  to fit"
    assert rows[-1].value.startswith("Try mesh.data=4, mesh.fsdp=2, mesh.tensor=1: about 10.00 GiB")
    out = render(Diagnosis("m", "s", rows))
    assert "FAIL" in next(line for line in out.splitlines() if line.startswith("train step memory, peak"))
    assert out.endswith("parity ok, but MEMORY: the train step does not fit the device as configured (see 'to fit')")


def _artifacts(root, train_summary: dict) -> dict:
    """The report's upstream artifacts, each a folder with the files `summarize` reads."""
    from jaxtune.artifacts import MANIFEST, ArtifactRef

    loss = {
        "loss": 2.0,
        "perplexity": 7.4,
        "tokens": 20,
        "rows": 2,
        "per_category": {"qa": {"loss": 2.0, "perplexity": 7.4, "tokens": 20, "rows": 2}},
        "parity": {
            "rows": 2,
            "tokens": 20,
            "dtype": "float32",
            "max_abs_diff": 1e-6,
            "max_abs_logit": 3.0,
            "top1_agreement": 1.0,
        },
    }
    files = {
        "tokenize": {"stats.json": {"rows_in": 10, "train_rows": 9, "eval_rows": 1, "dropped": {}, "truncated": 0}},
        "baseline_eval": {"metrics.json": loss},
        "final_eval": {"metrics.json": loss},
        "train": {"summary.json": train_summary, MANIFEST: {}},
        "export": {"export.json": {"kind": "peft_adapter", "subfolder": "adapter"}},
        "generate": {"metrics.json": {"prompts": 2, "exact_match": {"before": 0.0, "after": 0.5}}},
    }
    refs = {}
    for stage, contents in files.items():
        folder = root / stage
        folder.mkdir()
        for name, value in contents.items():
            (folder / name).write_text(json.dumps(value))
        refs[stage] = ArtifactRef(stage=stage, key="k", path=str(folder))
    (root / "train" / "log.jsonl").write_text(json.dumps({"step": 1, "loss": 2.5}) + "\n")
    return refs


def test_the_report_states_the_mesh_training_ran_on(tmp_path):
    from jaxtune.tasks.report import render_markdown, summarize

    train = {"steps": 3, "seconds": 1.0, "compile_seconds": 0.5, "tokens_per_second": 100.0, "trainable_parameters": 10}
    (tmp_path / "now").mkdir(), (tmp_path / "old").mkdir()
    summary = summarize(_artifacts(tmp_path / "now", {**train, "mesh": "data=2, fsdp=2, tensor=2 on 8 cpu devices"}))
    assert summary["train"]["mesh"] == "data=2, fsdp=2, tensor=2 on 8 cpu devices"
    lines = render_markdown(summary, [], "loss.png").splitlines()
    training = next(i for i, line in enumerate(lines) if line.startswith("Training: 3 steps"))
    assert lines[training + 2] == "Mesh: data=2, fsdp=2, tensor=2 on 8 cpu devices."  # just below the training figures
    old = summarize(_artifacts(tmp_path / "old", train))  # a train artifact from before the mesh was recorded
    assert old["train"]["mesh"] is None
    assert "Mesh: not recorded." in render_markdown(old, [], "loss.png").splitlines()


def test_the_report_counts_the_interruptions_and_the_steps_each_trained_again(tmp_path):
    from jaxtune.tasks.report import render_markdown, summarize

    train = {
        "steps": 60,
        "seconds": 1.0,
        "compile_seconds": 0.5,
        "tokens_per_second": 100.0,
        "trainable_parameters": 10,
        "interruptions": [
            {"reached": 13, "resumed_from": 10, "lost_steps": 3, "stopped_by": "killed"},
            {"reached": 49, "resumed_from": 49, "lost_steps": 0, "stopped_by": "SIGTERM", "restart": True},
        ],
    }
    (tmp_path / "run").mkdir(), (tmp_path / "whole").mkdir()
    lines = render_markdown(summarize(_artifacts(tmp_path / "run", train)), [], "loss.png").splitlines()
    assert (
        "Interrupted 2 times, 3 steps trained again in all: at step 13 (killed), resumed from 10, 3 steps trained "
        "again; at step 49 (SIGTERM), resumed from 49 by an automatic restart, 0 steps trained again."
    ) in lines
    whole = {k: v for k, v in train.items() if k != "interruptions"}
    assert not any(
        line.startswith("Interrupted")
        for line in render_markdown(summarize(_artifacts(tmp_path / "whole", whole)), [], "loss.png").splitlines()
    )
