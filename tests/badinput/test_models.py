"""Bad models: a path that is not there, a folder that is not a causal LM, a truncated GGUF file,
a tokenizer without a chat template, LoRA targets that match nothing. Exit status 1, one line
naming the path or key and what is accepted, and no artifact folder added."""

from __future__ import annotations

import json
import shutil

import pytest

from tests.badinput.conftest import refused_before_the_flow

pytestmark = pytest.mark.badinput

HINT = " (--debug shows the traceback)"


def test_a_model_path_that_does_not_exist_is_refused_before_the_flow_starts(jaxtune, tmp_path):
    missing = tmp_path / "models" / "mine"
    refused_before_the_flow(
        jaxtune.run(f"--set=model.name={missing}"), 1, f"jaxtune: model.name {str(missing)!r}: no such file or folder"
    )
    assert jaxtune.folders() == set()


def test_a_folder_that_is_not_a_causal_lm_is_refused_before_the_flow_starts(jaxtune, tmp_path):
    bert = tmp_path / "bert"
    bert.mkdir()
    (bert / "config.json").write_text(json.dumps({"model_type": "bert", "architectures": ["BertForMaskedLM"]}))
    refused_before_the_flow(
        jaxtune.run(f"--set=model.name={bert}"),
        1,
        f"jaxtune: {bert}: model_type 'bert' (BertForMaskedLM) is not a causal LM",
        prefix=True,
    )
    empty = tmp_path / "empty"
    empty.mkdir()
    refused_before_the_flow(
        jaxtune.run(f"--set=model.name={empty}"), 1, f"jaxtune: {empty}: not an HF model folder (no config.json)"
    )
    assert jaxtune.folders() == set()


def test_a_file_that_is_not_gguf_is_refused_before_the_flow_starts(jaxtune, tmp_path):
    fake = tmp_path / "model.gguf"
    fake.write_bytes(b"<html>rate limited</html>" * 4)
    refused_before_the_flow(
        jaxtune.run(f"--set=model.name={fake}"), 1, f"jaxtune: {fake}: not a GGUF file", prefix=True
    )
    assert jaxtune.folders() == set()


def test_a_truncated_gguf_file_fails_its_import_by_name_and_leaves_nothing(jaxtune, tmp_path):
    from tests.models.test_model_errors import write_tiny_gguf

    whole = tmp_path / "tiny.gguf"
    write_tiny_gguf(whole)
    half = tmp_path / "half.gguf"
    half.write_bytes(whole.read_bytes()[: whole.stat().st_size // 2])  # a download cut off midway
    done = jaxtune.run(f"--set=model.name={half}", "--until=tokenize")
    assert done.status == 1 and done.flow_started, "the header is intact: only reading the file finds the cut"
    assert done.last_line.startswith(
        f"jaxtune: import_gguf: {half}: cannot read this GGUF file, it may be truncated or corrupt ("
    )
    assert jaxtune.folders() == set()


def test_a_tokenizer_without_a_chat_template_names_the_setting_that_gives_one(jaxtune_after_eval, tmp_path):
    [built] = jaxtune_after_eval.store.glob("build_model/*")
    plain = tmp_path / "plain-model"
    shutil.copytree(built, plain, ignore=shutil.ignore_patterns("manifest.json", "result.json", "chat_template.jinja"))
    config = json.loads((plain / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (plain / "tokenizer_config.json").write_text(json.dumps(config))
    before = jaxtune_after_eval.folders()
    done = jaxtune_after_eval.run(f"--set=model.name={plain}", "--until=tokenize")
    assert done.status == 1 and done.flow_started
    assert done.last_line.startswith(
        f"jaxtune: tokenize: {plain}: its tokenizer has no chat template; "
        "set model.chat_template to 'gemma' or a Jinja template string"
    )
    assert jaxtune_after_eval.folders() == before


def test_lora_targets_that_match_no_layer_list_the_models_linear_layers(jaxtune_after_eval):
    before = jaxtune_after_eval.folders()
    done = jaxtune_after_eval.run("--set=lora.target_modules=[q_projj]", "--until=train")
    assert done.status == 1
    assert done.last_line == (
        "jaxtune: train: lora.target_modules [q_projj] matches no layer of this model; its linear layers are: "
        f"q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj (or all-linear){HINT}"
    )
    assert jaxtune_after_eval.folders() == before
