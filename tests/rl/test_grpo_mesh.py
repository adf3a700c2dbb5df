"""GRPO on a mesh: sampling, scoring and updating on 8 fake CPU devices (data 2, fsdp 2, tensor 2)
give the rewards and losses of one device, step for step.

The runs happen in a child process (`tests/rl/grpo_mesh_run.py`): JAX fixes its device count when
it starts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.rl, pytest.mark.mesh]
ROOT = Path(__file__).parents[2]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("grpo-mesh")
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu"}
    done = subprocess.run(
        [sys.executable, "-m", "tests.rl.grpo_mesh_run", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads((out / "results.json").read_text())


def test_the_mesh_samples_scores_and_trains_as_one_device(runs):
    one, mesh = runs["1x1x1"], runs["2x2x2"]
    assert [r["step"] for r in mesh] == list(range(1, 9))
    # The same key draws the same answers from logits equal up to float32 rounding: the same rewards.
    assert [r["reward"] for r in mesh] == [r["reward"] for r in one]
    assert [r["completion_length"] for r in mesh] == [r["completion_length"] for r in one]
    for a, b in zip(one, mesh):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4, abs=1e-6)
        assert b["kl"] == pytest.approx(a["kl"], rel=1e-3, abs=1e-7)
    assert max(r["reward"] for r in mesh[4:]) > mesh[0]["reward"] + 0.2  # and it learns there
