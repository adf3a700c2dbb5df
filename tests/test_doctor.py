"""`jaxtune doctor` passes on every family, and fails loudly when one op computes wrongly."""

from __future__ import annotations

import re

import numpy as np
import pytest

from jaxtune.cli.main import main
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


@pytest.fixture
def programs_traced_afresh():
    """No step kept from an earlier test (see `jaxtune.runtime.compiled.programs`), and none of this test's
    kept after it: a step traced with a broken op computes with it for as long as it is kept."""
    from jaxtune.runtime.compiled import programs

    programs.clear()
    yield
    programs.clear()


@pytest.mark.usefixtures("programs_traced_afresh")
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


def test_doctor_on_a_gguf_file_checks_the_folder_the_import_gguf_stage_builds(tmp_path, monkeypatch, capsys):
    """`jaxtune doctor FILE.gguf` imports the file as the import_gguf stage does (into the store,
    keyed by its content: the folder a run of the same file reads), says so, and checks that folder.
    The checks are the other tests' (a doctor run costs about 15 s here): `diagnose` only loads the folder."""
    import os
    import shutil

    import torch

    from jaxtune.checks import doctor
    from jaxtune.cli.main import _model_folder
    from jaxtune.config import load_config
    from jaxtune.flows.finetune import pipeline
    from jaxtune.runtime.modeling.model import load_torch_model
    from jaxtune.tasks.stage import stage_key
    from tests.models.test_model_errors import write_tiny_gguf

    checked = []

    def diagnose(name, config, revision=None, tokens=48):
        module = load_torch_model(name, revision, config.model.trust_remote_code, "float32")
        checked.append((name, module.config.model_type, {p.dtype for p in module.parameters()}, tokens))
        return doctor.Diagnosis(model=name, summary=f"{module.config.model_type}, checks left out")

    monkeypatch.setattr(doctor, "diagnose", diagnose)
    gguf, store = tmp_path / "tiny.gguf", tmp_path / "store"
    write_tiny_gguf(gguf)
    assert main(["doctor", str(gguf), *SMALL, "--set", f"store.root={store}"]) == 0
    out, err = capsys.readouterr()
    [step] = [s for s in pipeline(load_config(None, [f"model.name={gguf}"])) if s.stage == "import_gguf"]
    folder = store / "import_gguf" / stage_key(step.stage, step.module, step.section, {"gguf": step.inputs["gguf"].key})
    assert f"jaxtune: {gguf} imported as {folder}" in err.splitlines(), err
    assert checked == [(str(folder), "llama", {torch.float32}, 24)]
    assert out.splitlines()[0] == f"jaxtune doctor: {folder} (llama, checks left out)"
    # Once: a copy of the file elsewhere, under another name, opens the same folder without importing it again.
    built = os.stat(folder / "model.safetensors").st_mtime_ns
    copy = tmp_path / "elsewhere" / "renamed.gguf"
    copy.parent.mkdir()
    shutil.copy(gguf, copy)
    assert _model_folder(str(copy), load_config(None, [f"store.root={store}"])) == str(folder)
    assert os.stat(folder / "model.safetensors").st_mtime_ns == built


@pytest.fixture(scope="module")
def adapter_dir(model_dirs, tmp_path_factory) -> str:
    """A PEFT LoRA adapter (B random, so merging changes the weights) over the tiny Llama, whose
    folder is given a tokenizer, as a real base has."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from jaxtune.config import DataConfig
    from jaxtune.data.rows import read_rows
    from jaxtune.offline.tokenizer import texts_for_tokenizer, train_tokenizer

    train_tokenizer(texts_for_tokenizer(read_rows(DataConfig())[:50]), 300, model_dirs["llama"])
    peft_model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(model_dirs["llama"]),
        LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    )
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.05)
    folder = tmp_path_factory.mktemp("adapter")
    peft_model.save_pretrained(folder)
    return str(folder)


def test_doctor_on_a_lora_adapter_checks_the_model_merged_as_a_run_from_it_starts(
    adapter_dir, model_dirs, tmp_path, capsys
):
    """`jaxtune doctor ADAPTER` merges it into its base as the merge_adapter stage does (the folder
    a run from the adapter reads; PEFT's merge_and_unload to 1e-6) and checks that: a fresh LoRA
    on the merged weights, not the adapter left attached beside a second one."""
    from peft import PeftModel
    from safetensors.numpy import load_file

    from jaxtune.checks.doctor import as_trained
    from jaxtune.config import config_from_dict, load_config
    from jaxtune.flows.finetune import pipeline
    from jaxtune.runtime.modeling.model import load_torch_model
    from jaxtune.tasks.stage import input_keys, stage_key

    store = tmp_path / "store"
    assert main(["doctor", adapter_dir, *SMALL, "--set", f"store.root={store}"]) == 0
    out, err = capsys.readouterr()
    [step] = [s for s in pipeline(load_config(None, [f"model.name={adapter_dir}"])) if s.stage == "merge_adapter"]
    folder = store / "merge_adapter" / stage_key(step.stage, step.module, step.section, input_keys(step.inputs))
    assert f"jaxtune: the LoRA adapter {adapter_dir} merged into its base as {folder}" in err.splitlines(), err
    assert out.splitlines()[0].startswith(f"jaxtune doctor: {folder} (llama, LoRA r=8")
    assert all(status(out, check) == "ok" for check in CHECKS), out

    base = load_torch_model(model_dirs["llama"], None, False, "float32")
    theirs = PeftModel.from_pretrained(base, adapter_dir).merge_and_unload().state_dict()
    ours = load_file(str(folder / "model.safetensors"))
    assert {k for k in ours} <= set(theirs) and any("q_proj" in k for k in ours)
    for name, value in ours.items():
        np.testing.assert_allclose(value, theirs[name].numpy(), rtol=0, atol=1e-6, err_msg=name)
    fresh = as_trained(load_torch_model(model_dirs["llama"], None, False, "float32"), config_from_dict({}), False)
    trainable = sum(p.numel() for p in fresh.parameters() if p.requires_grad)
    assert re.search(rf"^trainable parameters\s+{trainable:,} ", out, re.M), out


@pytest.mark.target
def test_doctor_plans_a_lora_adapter_for_a_target_from_its_base(adapter_dir, model_dirs, capsys):
    """A target's plan reads shapes alone, which merging keeps: the adapter's base is planned."""
    assert (
        main(["doctor", adapter_dir, "--target", "h100", "--set", "data.max_length=64", "--set", "train.batch_size=2"])
        == 0
    )
    out = capsys.readouterr().out
    assert out.splitlines()[0].startswith(f"jaxtune doctor: {model_dirs['llama']} (llama, LoRA r=8; XLA:GPU plan"), out
