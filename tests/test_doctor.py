"""`jaxtune doctor` passes on every family, and fails loudly when one op computes wrongly."""

from __future__ import annotations

import re

import pytest

from jaxtune.cli import main
from jaxtune.config import ARCHITECTURES
from tests.conftest import tiny_model

pytestmark = pytest.mark.parity

SMALL = ["--tokens", "24", "--set", "data.max_length=64", "--set", "train.batch_size=2"]
CHECKS = ("logits max |diff|", "loss relative diff", "gradient relative diff", "greedy decode == generate")


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, str]:
    dirs = {}
    for family in ARCHITECTURES:
        path = tmp_path_factory.mktemp(f"tiny-{family}")
        tiny_model(family, sliding_window=8).save_pretrained(path)
        dirs[family] = str(path)
    return dirs


def status(output: str, check: str) -> str:
    line = next(line for line in output.splitlines() if line.startswith(check))
    return line.split()[-1]


@pytest.mark.parametrize("family", ARCHITECTURES)
def test_doctor_passes_and_prints_the_table(family, model_dirs, capsys):
    # GPT-2 has no q/k/v/o projections (its attention is one fused Conv1D): adapt every linear layer.
    targets = ["--set", "lora.target_modules=all-linear"] if family == "gpt2" else []
    assert main(["doctor", model_dirs[family], *SMALL, *targets]) == 0
    out = capsys.readouterr().out
    assert all(status(out, check) == "ok" for check in CHECKS), out
    total = int(re.search(r"^parameters\s+([\d,]+)", out, re.M).group(1).replace(",", ""))
    trainable = int(re.search(r"^trainable parameters\s+([\d,]+)", out, re.M).group(1).replace(",", ""))
    assert 0 < trainable < total
    peak = float(re.search(r"^train step memory, peak\s+([\d.]+) MiB", out, re.M).group(1))
    assert peak > 0 and "(bfloat16, adamw, remat matmuls, 1 x 2 x 64)" in out
    assert re.search(r"^mesh\s+data=1, fsdp=1, tensor=1 on 1 device$", out, re.M), out  # mesh.data=-1 on the one CPU
    assert "  to fit" not in out  # the CPU reports no limit: nothing to suggest
    assert out.rstrip().endswith("parity ok")


def test_doctor_exits_nonzero_when_an_op_is_broken(model_dirs, monkeypatch, capsys):
    """Corrupt torchax's rsqrt (used by every RMSNorm) by 1%: every check must notice."""
    import torch

    from jaxtune.runtime.compat import torchax_env

    env = torchax_env()
    rsqrt = torch.ops.aten.rsqrt  # torchax registers the overload packet
    monkeypatch.setitem(env._ops, rsqrt, env._ops[rsqrt])  # restored when the test ends
    env.override_op_definition(rsqrt, lambda x: torch.sqrt(x).reciprocal() * 1.01)
    assert main(["doctor", model_dirs["llama"], *SMALL]) == 1
    out = capsys.readouterr().out
    assert status(out, "logits max |diff|") == "FAIL" and status(out, "gradient relative diff") == "FAIL"
    assert "PARITY FAILED" in out


def test_doctor_names_the_linear_layers_when_lora_targets_match_none(model_dirs, capsys):
    assert main(["doctor", model_dirs["gpt2"], *SMALL]) == 2
    err = capsys.readouterr().err
    assert "c_attn" in err and "all-linear" in err
