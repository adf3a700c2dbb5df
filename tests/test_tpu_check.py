"""benchmarks/tpu/tpu_check.py's own logic, on this CPU: which way the pipeline runs (the socket probe), that
the stages run without Prefect are the flow's own list in its order, that a failing family fails the
report and the exit status, and that the family comparison flags a loss outside its bound, with one
family's real numbers. The whole check runs on a TPU alone (marker `tpu`; skipped elsewhere)."""

from __future__ import annotations

import errno
import json
import math
import os
import socket
import subprocess
import sys
import types
from pathlib import Path

import pytest
from prefect import get_run_logger
from prefect.exceptions import MissingContextError

from benchmarks.tpu import tpu_check
from benchmarks.tpu import tpu_check_families as families
from jaxtune.artifacts import ArtifactStore
from jaxtune.config import OFFLINE
from jaxtune.flows import finetune
from jaxtune.host import accelerators

ROOT = Path(__file__).resolve().parents[1]

MACHINE = {
    "platform": "cpu",
    "device_kind": "cpu",
    "devices": 1,
    "jax": "0.10.2",
    "jaxlib": "0.10.2",
    "libtpu": None,
    "torch": "2.13.0",
    "python": "3.11",
}


def refused_socket_module() -> types.SimpleNamespace:
    """`socket` as a machine without TCP has it: an internet socket cannot even be made."""

    def refuse(*args, **kwargs):
        raise OSError(errno.EAFNOSUPPORT, os.strerror(errno.EAFNOSUPPORT))

    return types.SimpleNamespace(
        AF_INET=socket.AF_INET,
        SOCK_STREAM=socket.SOCK_STREAM,
        socket=refuse,
        create_connection=socket.create_connection,
    )


def test_without_a_tcp_socket_the_stages_are_called_directly(monkeypatch):
    monkeypatch.setattr(tpu_check, "socket", refused_socket_module())
    assert tpu_check.tcp_problem() == "[Errno 97] Address family not supported by protocol"
    use_prefect, note = tpu_check.prefect_route(no_prefect=False)
    assert use_prefect is False
    assert note == (
        "Prefect server unavailable here (no TCP socket): stages called directly over the store, without "
        "Prefect [[Errno 97] Address family not supported by protocol]"
    )


def test_where_tcp_works_jaxtune_run_runs_the_pipeline_unless_told_not_to():
    assert tpu_check.tcp_problem() is None  # this machine's loopback (the suite's own Prefect servers use it)
    assert tpu_check.prefect_route(no_prefect=False)[0] is True
    assert tpu_check.prefect_route(no_prefect=True) == (False, tpu_check.FORCED)


def test_the_stages_are_the_flows_own_list_in_its_order():
    config = finetune.load_recipe(OFFLINE)
    assert (
        tpu_check.stage_names(config)
        == [step.stage for step in finetune.pipeline(config)]
        == [
            "build_tokenizer",
            "build_model",
            "tokenize",
            "baseline_eval",
            "train",
            "final_eval",
            "export",
            "generate",
            "report",
        ]
    )


def test_a_recipes_check_runs_its_own_stages_and_export_and_asks_for_no_gguf_of_its_own(tmp_path, monkeypatch):
    """--recipe: the real Gemma 3 270M recipe's stages (its GGUF file imported, no tiny model built), with the
    check's merged export and no GGUF added; the offline default keeps its GGUF where its family takes one.
    A fresh clone has no .jaxtune/models, so a tiny GGUF file stands where the recipe names its checkpoint."""
    from tests.models.test_model_errors import write_tiny_gguf

    recipe = str(ROOT / "configs" / "gemma3-270m-offline-lora.yaml")
    monkeypatch.chdir(tmp_path)
    (tmp_path / ".jaxtune" / "models").mkdir(parents=True)
    write_tiny_gguf(tmp_path / ".jaxtune" / "models" / "gemma-3-270m-q4_k_m.gguf")
    overrides, refused = tpu_check.check_overrides(tmp_path, 5, recipe)
    assert overrides == [f"store.root={tmp_path}", "export.merge=true", "train.max_steps=5"] and refused is None
    config = finetune.load_recipe(recipe, overrides)
    assert not config.export.gguf and config.model.name != OFFLINE and config.train.max_steps == 5
    stages = tpu_check.stage_names(config)
    assert stages[0] == "import_gguf" and "build_model" not in stages and stages[-1] == "report"
    offline, _ = tpu_check.check_overrides(tmp_path, None)
    assert offline[:2] == overrides[:2] and len(offline) in (2, 3)


def test_the_direct_run_calls_the_flows_steps_in_order_over_the_store_without_prefect(tmp_path, monkeypatch, caplog):
    """The flow's first three steps (shortened by patching the flow's own list, which the check must follow):
    the offline tokenizer, the tiny model and the tokenized data, built by the stages' own functions; tokenize
    logs to its Prefect run's logger, which here is a plain one."""
    full = finetune.pipeline
    monkeypatch.setattr(finetune, "pipeline", lambda config, restart=False: full(config, restart)[:3])
    config = finetune.load_recipe(OFFLINE, [f"store.root={tmp_path}", "store.compile_cache=false"])
    with caplog.at_level("INFO", logger="jaxtune.tpu_check"):
        seconds = tpu_check.run_directly(config)
    assert list(seconds) == tpu_check.stage_names(config) == ["build_tokenizer", "build_model", "tokenize"]
    assert any(r.name == "jaxtune.tpu_check" and " rows in: " in r.getMessage() for r in caplog.records)
    keys, store = finetune.planned_keys(config), ArtifactStore(tmp_path)
    assert list(keys) == list(seconds) and all(store.problem(stage, key) is None for stage, key in keys.items())
    assert store.manifest("tokenize", keys["tokenize"])["inputs"]["model"] == keys["build_model"]
    with pytest.raises(MissingContextError):  # the stand-ins are gone after the block
        get_run_logger()


def test_the_comparison_flags_a_loss_outside_the_bound():
    torch_loss, losses = 6.9444, [6.9444, 6.877, 6.830]
    inside = families.compare("llama", torch_loss + 0.9 * families.LOSS_BOUND, torch_loss, losses, "splash")
    outside = families.compare("llama", torch_loss + 1.1 * families.LOSS_BOUND, torch_loss, losses, "splash")
    assert inside["pass"] is True and inside["diff"] == pytest.approx(0.9 * families.LOSS_BOUND)
    assert outside["pass"] is False and outside["diff"] == pytest.approx(1.1 * families.LOSS_BOUND)
    diverged = families.compare("llama", torch_loss, torch_loss, [6.9444, math.nan, math.inf], "splash")
    assert (diverged["pass"], diverged["finite"], diverged["fell"]) == (False, False, False)
    assert families.compare("llama", torch_loss, torch_loss, losses[:2], "splash")["pass"] is False  # a step missing


def test_a_failing_family_fails_the_report_and_the_exit_status(tmp_path, monkeypatch):
    rows = {
        "llama": families.compare("llama", 6.94440, 6.94442, [6.9444, 6.877, 6.830], "splash"),
        "gpt2": families.compare("gpt2", 6.95700, 6.96000, [6.9527, 6.851, 6.893], "splash"),
    }

    def check(family):
        if family == "qwen3":
            raise RuntimeError("Mosaic failed to compile\nits long log")
        return rows[family]

    monkeypatch.setattr(families, "check_family", check)
    monkeypatch.setattr(tpu_check, "machine", lambda: MACHINE)
    arguments = ["--parts", "families", "--families", "llama", "gpt2", "--families", "qwen3", "--out", str(tmp_path)]
    status = tpu_check.main(arguments)
    assert status == 1
    saved = json.loads((tmp_path / "tpu-check.json").read_text())
    part = saved["parts"]["families"]
    assert (saved["pass"], part["pass"]) == (False, False)
    assert [(row["family"], row["pass"]) for row in part["rows"]] == [
        ("llama", True),
        ("gpt2", False),
        ("qwen3", False),
    ]
    assert part["rows"][2]["error"] == "RuntimeError: Mosaic failed to compile"
    markdown = (tmp_path / "tpu-check.md").read_text()
    assert "## Families: **FAIL**" in markdown
    assert "| gpt2 | 6.957000 | 6.960000 | 3.0e-03 | 5e-04 | 6.9527, 6.8510, 6.8930 | splash | **FAIL** |" in markdown
    assert "| llama | 6.944400 | 6.944420 | 2.0e-05 | 5e-04 | 6.9444, 6.8770, 6.8300 | splash | pass |" in markdown
    rows["gpt2"] = families.compare("gpt2", 6.95745, 6.95748, [6.9527, 6.851, 6.893], "splash")
    assert tpu_check.main(["--parts", "families", "--families", "llama", "gpt2", "--out", str(tmp_path)]) == 0
    assert json.loads((tmp_path / "tpu-check.json").read_text())["pass"] is True


@pytest.fixture(scope="module")
def llama():
    """The prepared llama and its step-0 loss in JAX, taken before any test's steps donate its weights."""
    model, reference, rows, batch = families.prepared("llama")
    return model, reference, rows, batch, families.jax_loss(model, batch)


def test_a_family_on_this_cpu_matches_pytorch_within_the_bound_and_learns(llama):
    model, reference, rows, batch, loss_jax = llama
    loss_torch = families.torch_loss(reference, batch)
    assert loss_torch == pytest.approx(6.944421, abs=1e-4)  # ln(1024) = 6.93 at initialisation, and LoRA's random B
    row = families.compare("llama", loss_jax, loss_torch, families.few_steps(model, rows), "xla")
    assert row["pass"] and row["diff"] <= families.LOSS_BOUND, row
    assert row["losses"][0] == pytest.approx(loss_jax, abs=families.LOSS_BOUND)  # step 1 starts from the same weights
    assert row["fell"] and row["losses"][-1] < row["losses"][0] - 0.05, row["losses"]


def test_the_bound_catches_five_tokens_a_row_left_out_of_the_loss(llama):
    """The same batch with five more tokens a row unscored on the PyTorch side only: an error of the kind
    (a mask off by a few tokens) that the bound is there to catch."""
    _, reference, _, batch, loss_jax = llama
    shifted = {**batch, "labels": batch["labels"].copy()}
    for row, n in enumerate(families.LENGTHS):
        shifted["labels"][row, n - 5 : n] = -100
    row = families.compare("llama", loss_jax, families.torch_loss(reference, shifted), [6.9] * 3, "xla")
    assert row["pass"] is False and row["diff"] > 2 * families.LOSS_BOUND, row


def _default_platform() -> str:
    """The platform JAX picks with no JAX_PLATFORMS (which this suite sets to cpu), asked in a process of its
    own: only one process at a time can hold a TPU chip, and the check's must."""
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    found = subprocess.run(
        [sys.executable, "-c", "import jax; print(jax.devices()[0].platform)"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    return found.stdout.strip().splitlines()[-1] if found.returncode == 0 and found.stdout.strip() else "none"


@pytest.mark.tpu
def test_the_whole_check_passes_on_a_tpu(tmp_path):
    if not accelerators.present() or _default_platform() != "tpu":
        pytest.skip("no TPU here: jax.devices()[0].platform is not tpu")
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    run = subprocess.run(
        [sys.executable, "-m", "benchmarks.tpu.tpu_check", "--out", str(tmp_path)],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=3600,
    )
    assert run.returncode == 0, (run.stdout + run.stderr)[-6000:]
    results = json.loads((tmp_path / "tpu-check.json").read_text())
    assert results["pass"] is True and results["machine"]["platform"] == "tpu"
    pipeline = results["parts"]["pipeline"]
    assert [s["stage"] for s in pipeline["stages"]] == tpu_check.stage_names(finetune.load_recipe(OFFLINE))
    assert all(s["problem"] is None for s in pipeline["stages"])
    assert pipeline["final_loss"] < pipeline["baseline_loss"] and pipeline["train"]["tokens_per_second"] > 0
    rows = results["parts"]["families"]["rows"]
    assert [row["family"] for row in rows] == list(families.ARCHITECTURES)
    assert all(row["pass"] and row["attention"] == "splash" for row in rows), rows
