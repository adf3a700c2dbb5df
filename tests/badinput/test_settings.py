"""Bad settings and usage: exit status 2 before any flow starts, one last line naming the key,
file or stage, with a did-you-mean or the accepted values."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.badinput.conftest import refused_before_the_flow

pytestmark = pytest.mark.badinput

ROOT = Path(__file__).parents[2]


def refused(done, last_line: str) -> None:
    refused_before_the_flow(done, 2, last_line)


def test_an_unknown_key_gets_a_did_you_mean(jaxtune):
    refused(
        jaxtune.run("--set=train.learning_rat=0.1"),
        "jaxtune: --set: train.learning_rat: unknown key; did you mean train.learning_rate?",
    )
    assert jaxtune.folders() == set()


def test_an_unknown_key_in_a_config_file_names_the_file(jaxtune, tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("train:\n  max_step: 3\n")
    refused(
        jaxtune.run(str(recipe), toy=False),
        f"jaxtune: {recipe}: train.max_step: unknown key; did you mean train.max_steps?",
    )


def test_a_value_of_the_wrong_type_is_named_with_the_value(jaxtune):
    refused(
        jaxtune.run("--set=train.batch_size=eight"),
        "jaxtune: --set: train.batch_size: Input should be a valid integer, unable to parse string as an integer (got 'eight')",
    )


def test_a_negative_learning_rate_is_refused(jaxtune):
    refused(
        jaxtune.run("--set=train.learning_rate=-0.0003"),
        "jaxtune: --set: train.learning_rate: Input should be greater than 0 (got -0.0003)",
    )
    refused(
        jaxtune.run("--set=train.learning_rate=-3e-4"),  # YAML reads -3e-4 as text; pydantic still parses it
        "jaxtune: --set: train.learning_rate: Input should be greater than 0 (got '-3e-4')",
    )


def test_a_choice_outside_the_accepted_ones_lists_them(jaxtune):
    refused(
        jaxtune.run("--set=data.too_long=cut"),
        "jaxtune: --set: data.too_long: Input should be 'drop' or 'truncate' (got 'cut')",
    )


def test_a_set_without_a_value_is_refused(jaxtune):
    refused(jaxtune.run("--set=train.max_steps"), "jaxtune: --set 'train.max_steps': expected section.key=value")


def test_a_missing_or_malformed_config_file_is_refused(jaxtune, tmp_path):
    done = jaxtune.run(str(tmp_path / "nothere.yaml"), toy=False)
    assert (done.status, done.flow_started) == (2, False)
    assert done.last_line.startswith(f"jaxtune: {tmp_path / 'nothere.yaml'}: [Errno 2] No such file")
    broken = tmp_path / "broken.yaml"
    broken.write_text("train: [max_steps: 3\n")
    done = jaxtune.run(str(broken), toy=False)
    assert (done.status, done.flow_started) == (2, False)
    # One line, not the parser's eight: the 1-based line and column where it stopped (the end of the
    # file, as the bracket opened on line 1 is never closed) and what it expected there.
    assert done.stderr == f"jaxtune: {broken}: line 2, column 1: expected ',' or ']', but got '<stream end>'\n", (
        done.stderr
    )


@pytest.mark.parametrize(
    ("flag", "stages"),
    [
        ("--refresh", "build_tokenizer, build_model, import_gguf, merge_adapter, quantize_base, tokenize"),
        ("--until", "stages: tokenize, reference, baseline_eval"),
    ],
)
def test_an_unknown_stage_gets_a_did_you_mean(jaxtune, flag, stages):
    done = jaxtune.run(flag, "trian")
    assert (done.status, done.flow_started) == (2, False)
    assert done.last_line.startswith(
        f"jaxtune run: error: argument {flag}: unknown stage 'trian'; did you mean train? stages: "
    )
    assert stages in done.last_line


def test_a_mesh_larger_than_the_devices_is_refused(jaxtune):
    refused(
        jaxtune.run("--set=mesh.data=4"),
        "jaxtune: mesh.data=4, mesh.fsdp=1, mesh.tensor=1 needs 4 devices but only 1 device is visible; "
        "make the axes' product at most 1, or set one axis to -1 for the devices the others leave",
    )


@pytest.mark.parametrize(
    ("settings", "devices", "message"),
    [
        (
            {"fsdp": 4, "tensor": 4},
            8,
            "mesh.data=-1, mesh.fsdp=4, mesh.tensor=4 needs a multiple of 16 devices but 8 devices "
            "are visible: the fixed axes' product, 16, must divide 8",
        ),
        (
            {"data": 3, "fsdp": -1},
            8,
            "mesh.data=3, mesh.fsdp=-1, mesh.tensor=1 needs a multiple of 3 devices but 8 "
            "devices are visible: the fixed axes' product, 3, must divide 8",
        ),
        (
            {"data": 2, "fsdp": 2, "tensor": 4},
            8,
            "mesh.data=2, mesh.fsdp=2, mesh.tensor=4 needs 16 devices but only 8 "
            "devices are visible; make the axes' product at most 8, or set one axis to -1 for the devices the others leave",
        ),
        (
            {"data": 2, "fsdp": 2},
            8,
            "eval.batch_size=6 cannot split evenly over the mesh's batch axes, data=2 x fsdp=2 = 4 "
            "devices; use a multiple of 4, e.g. eval.batch_size=8",
        ),
        (
            {"data": 1, "fsdp": 4, "tensor": 2},
            8,
            "eval.batch_size=6 cannot split evenly over the mesh's batch axes, data=1 "
            "x fsdp=4 = 4 devices; use a multiple of 4, e.g. eval.batch_size=8",
        ),
    ],
)
def test_the_mesh_is_checked_against_the_devices_and_every_batch_over_data_x_fsdp(settings, devices, message):
    """Unit-level: preflight.check_mesh on a config, with a device count instead of devices."""
    from jaxtune.checks.preflight import check_mesh
    from jaxtune.config import load_config
    from jaxtune.errors import ConfigError

    batches = lambda rows: [f"{stage}.batch_size={n}" for stage, n in zip(("train", "eval", "generate"), rows)]  # noqa: E731
    mesh = [f"mesh.{axis}={size}" for axis, size in settings.items()]
    with pytest.raises(ConfigError) as caught:
        check_mesh(load_config(None, mesh + batches((8, 6, 8))), devices)
    assert str(caught.value) == message
    if "batch_size" in message:  # the same mesh passes with batches of 16 rows
        check_mesh(load_config(None, mesh + batches((16, 16, 16))), devices)
    # 4 rows over data x fsdp = 4 of 8 devices (tensor takes the other factor of 2).
    check_mesh(load_config(None, ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2", *batches((4, 4, 4))]), 8)


def test_a_store_root_that_is_a_file_is_refused(jaxtune, tmp_path):
    a_file = tmp_path / "store.txt"
    a_file.write_text("")
    done = jaxtune.run(f"--set=store.root={a_file}")
    refused(done, f"jaxtune: store.root {str(a_file)!r} is a file, not a folder")


@pytest.mark.slow
def test_a_batch_that_cannot_split_over_the_mesh_is_refused_with_a_size_that_can(tmp_path):
    """Two fake CPU devices in a fresh process: 3 rows cannot split over 2, 4 can."""
    flags = f"{os.environ['XLA_FLAGS']} --xla_force_host_platform_device_count=2"  # beside the suite's own
    env = {**os.environ, "PYTHONPATH": str(ROOT), "XLA_FLAGS": flags}
    env.pop("PREFECT_API_URL", None)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "jaxtune.cli",
            "run",
            "--set",
            "train.batch_size=3",
            "--set",
            f"store.root={tmp_path / 'store'}",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1] == (
        "jaxtune: train.batch_size=3 cannot split evenly over the mesh's batch axes, data=2 x fsdp=1 = 2 devices; "
        "use a multiple of 2, e.g. train.batch_size=4"
    )
    assert "server" not in done.stderr.lower(), "refused before any Prefect server started"
    assert not (tmp_path / "store").exists()
