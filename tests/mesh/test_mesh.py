"""A tiny Llama trained, evaluated, decoded and exported on 8 fake CPU devices, on meshes
(data, fsdp, tensor) = (8,1,1), (2,2,2), (1,4,2), (1,1,8), LoRA and full: every mesh computes
what one device computes, every tensor is split as the rules say, and the step compiles once.

All runs happen in one child process (`tests/mesh/mesh_runs.py`): JAX fixes its device count
when it starts, so 8 fake devices need a process of their own.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from tests.mesh.mesh_runs import MESHES, METHODS, STEPS

pytestmark = pytest.mark.mesh

ROOT = Path(__file__).resolve().parents[2]
TOLERANCE = 1e-4  # relative, float32


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("mesh")
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, "-m", "tests.mesh.mesh_runs", str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    return {(r["method"], tuple(r["mesh"])): r for r in json.loads((out / "results.json").read_text())}


MESHED = [(method, sizes) for method in METHODS for sizes in MESHES[1:]]
ids = [f"{method}-{'x'.join(map(str, sizes))}" for method, sizes in MESHED]


@pytest.mark.parametrize(("method", "sizes"), MESHED, ids=ids)
def test_five_steps_on_the_mesh_give_the_losses_of_one_device(runs, method, sizes):
    one, mesh = runs[(method, (1, 1, 1))], runs[(method, sizes)]
    assert len(mesh["losses"]) == STEPS
    np.testing.assert_allclose(mesh["losses"], one["losses"], rtol=TOLERANCE)
    assert mesh["losses"][0] != mesh["losses"][-1]  # it trained
    np.testing.assert_allclose(mesh["eval_loss"], one["eval_loss"], rtol=TOLERANCE)
    assert mesh["generated"] == one["generated"]
    data, fsdp, tensor = sizes
    assert mesh["summary_mesh"] == f"data={data}, fsdp={fsdp}, tensor={tensor} on 8 cpu devices"


@pytest.mark.parametrize(("method", "sizes"), [(m, s) for m in METHODS for s in MESHES], ids=lambda v: str(v))
def test_the_train_step_compiles_once(runs, method, sizes):
    """Inputs and outputs have pinned shardings: step 2 reuses step 1's program."""
    assert runs[(method, sizes)]["train_step_compiles"] == 1


def expected_spec(name: str, sizes: tuple[int, int, int]) -> list:
    """The rule table written out by hand, trailing unsplit dimensions dropped."""
    data, fsdp, tensor = sizes
    f, t = ("fsdp" if fsdp > 1 else None), ("tensor" if tensor > 1 else None)
    column = any(f"{layer}." in name for layer in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"))
    row = any(f"{layer}." in name for layer in ("o_proj", "down_proj"))
    if ".lora_A." in name:
        spec = [None, f if column else t]
    elif ".lora_B." in name:
        spec = [t if column else f]
    elif column:
        spec = [t, f]
    elif row:
        spec = [f, t]
    elif "embed_tokens" in name:  # hidden over fsdp x tensor
        split = [axis for axis in (f, t) if axis]
        spec = [None, split[0] if len(split) == 1 else split or None]
    elif "lm_head" in name:
        spec = [t, f]
    else:
        assert "norm" in name or "rotary_emb" in name, name
        spec = []
    while spec and spec[-1] is None:
        spec.pop()
    return spec


@pytest.mark.parametrize(("method", "sizes"), MESHED, ids=ids)
def test_every_tensor_and_its_optimizer_state_is_split_as_the_rules_say(runs, method, sizes):
    run = runs[(method, sizes)]
    assert len(run["specs"]) == (51 if method == "lora" else 23)
    for name, spec in run["specs"].items():
        assert spec == expected_spec(name, sizes), name
    trainable = [n for n in run["specs"] if ".lora_" in n] if method == "lora" else \
        [n for n in run["specs"] if "rotary_emb" not in n]
    assert sorted(run["optimizer_specs"]) == sorted(trainable)
    for name, specs in run["optimizer_specs"].items():  # Adam's two moments live where their parameter does
        assert specs == [run["specs"][name]] * 2, name


@pytest.mark.parametrize("sizes", MESHES[1:], ids=lambda s: "x".join(map(str, s)))
def test_the_exported_adapter_equals_the_one_device_adapter(runs, sizes):
    one, mesh = Path(runs[("lora", (1, 1, 1))]["adapter"]), Path(runs[("lora", sizes)]["adapter"])
    assert json.loads((mesh / "adapter_config.json").read_text()) == json.loads((one / "adapter_config.json").read_text())
    expected, got = load_file(str(one / "adapter_model.safetensors")), load_file(str(mesh / "adapter_model.safetensors"))
    assert sorted(got) == sorted(expected) and len(got) == 28
    for name in expected:
        np.testing.assert_allclose(got[name], expected[name], rtol=TOLERANCE, atol=1e-6, err_msg=name)


@pytest.mark.parametrize("sizes", MESHES[1:], ids=lambda s: "x".join(map(str, s)))
def test_fully_fine_tuned_weights_equal_the_one_device_weights(runs, sizes):
    expected = load_file(runs[("full", (1, 1, 1))]["weights"])
    got = load_file(runs[("full", sizes)]["weights"])
    assert sorted(got) == sorted(expected)
    for name in expected:
        np.testing.assert_allclose(got[name], expected[name], rtol=TOLERANCE, atol=1e-6, err_msg=name)


@pytest.mark.parametrize("sizes", MESHES[1:], ids=lambda s: "x".join(map(str, s)))
def test_the_memory_plan_is_one_devices_share(runs, sizes):
    """Weights, gradients and Adam's moments per device are each tensor's shard, summed; XLA's
    peak for the step shrinks with them."""
    one, run = runs[("full", (1, 1, 1))], runs[("full", sizes)]
    axes = dict(zip(("data", "fsdp", "tensor"), sizes))

    def shard_bytes(name):
        parts = [np.prod([axes[a] for a in ([axis] if isinstance(axis, str) else axis)]) for axis in run["specs"][name] if axis]
        return 4 * np.prod(run["shapes"][name]) // int(np.prod(parts))

    weights = sum(shard_bytes(name) for name in run["optimizer_specs"])
    plan = run["memory"]
    assert plan["mesh"] == axes and plan["devices"] == 8
    assert plan["gradients"] == weights and 2 * weights <= plan["optimizer_state"] < 2 * weights + 64
    if axes["fsdp"] * axes["tensor"] > 1:
        assert plan["peak"] < one["memory"]["peak"]
