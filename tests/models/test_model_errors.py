"""A user's model mistakes end in one error whose first line names the path or key, what is
wrong, and what is accepted: LoRA targets that match nothing, a missing path, a folder that
is not a causal LM, a cut-short GGUF file, a tokenizer without a chat template."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from jaxtune.config import ARCHITECTURES, LoraConfig, ModelConfig
from jaxtune.errors import ModelError, ModelNotFoundError
from jaxtune.tasks.sources import model_ref
from tests.conftest import tiny_model

pytestmark = pytest.mark.badinput


def first_line(error: pytest.ExceptionInfo) -> str:
    return str(error.value).splitlines()[0]


@pytest.mark.parametrize(
    ("family", "saved", "layers"),
    [
        ("llama", (), "q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj"),
        # With modules_to_save (the offline recipe's), PEFT says so in other words.
        ("gemma3", ("embed_tokens", "lm_head"), "q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj"),
        ("gpt2", (), "c_attn, c_proj, c_fc"),  # Conv1D layers, which all-linear adapts too
    ],
)
def test_lora_targets_that_match_no_layer_name_the_linear_layers(family, saved, layers):
    from jaxtune.runtime.modeling.model import attach_lora

    with pytest.raises(ModelError) as caught:
        attach_lora(tiny_model(family, layers=1), LoraConfig(target_modules=("q_projj",), modules_to_save=saved))
    assert first_line(caught) == (
        f"lora.target_modules [q_projj] matches no layer of this model; its linear layers are: {layers} (or all-linear)"
    )


def test_lora_targets_that_match_some_layer_attach():
    from jaxtune.runtime.modeling.model import attach_lora

    module = attach_lora(tiny_model("llama", layers=1), LoraConfig(target_modules=("q_projj", "v_proj")))
    assert any("v_proj.lora_A" in name for name, _ in module.named_parameters())


@pytest.mark.parametrize(
    "name",
    [
        "./no-model",
        "/no/such/model",
        "~/no-such-jaxtune-model",
        "models/smol/v2",
        "smol.safetensors",
        "weights.bin",
        "models\\smol",
    ],
)
def test_a_path_that_does_not_exist_is_named(name):
    with pytest.raises(ModelNotFoundError) as caught:
        model_ref(ModelConfig(name=name))
    assert first_line(caught) == f"model.name {name!r}: no such file or folder"


def test_a_missing_gguf_file_is_named_and_still_a_file_not_found_error(tmp_path):
    name = str(tmp_path / "nothere.gguf")
    with pytest.raises(FileNotFoundError) as caught:
        model_ref(ModelConfig(name=name))
    assert isinstance(caught.value, ModelError)
    assert first_line(caught) == f"model.name {name!r}: no such GGUF file"


def test_a_missing_offline_checkpoint_names_the_command_that_places_it(tmp_path, monkeypatch):
    """The offline real-model recipes expect files pip packages ship but a fresh clone lacks."""
    monkeypatch.chdir(tmp_path)
    name = ".jaxtune/models/gemma-3-270m-q4_k_m.gguf"  # what configs/gemma3-270m-offline-lora.yaml sets
    with pytest.raises(ModelNotFoundError) as caught:
        model_ref(ModelConfig(name=name))
    assert first_line(caught) == (
        f"model.name {name!r}: no such GGUF file; place it with "
        "`python -m jaxtune.offline.checkpoints` (or `make demo-real`)"
    )
    elsewhere = str(tmp_path / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf")
    with pytest.raises(ModelNotFoundError) as caught:
        model_ref(ModelConfig(name=elsewhere))
    assert first_line(caught) == (
        f"model.name {elsewhere!r}: no such GGUF file; place it with "
        f"`python -m jaxtune.offline.checkpoints {tmp_path / 'models'}`"
    )


def test_owner_slash_name_stays_a_hub_id_and_a_bare_word_is_refused():
    assert model_ref(ModelConfig(name="HuggingFaceTB/SmolLM2-135M")).stage == "hub"
    with pytest.raises(ModelError) as caught:
        model_ref(ModelConfig(name="smollm2"))
    assert (
        first_line(caught)
        == "model.name 'smollm2': no such file or folder, and not a hub id like 'google/gemma-3-1b-it'"
    )


def test_a_file_that_is_not_gguf_is_refused(tmp_path):
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"\0" * 64)
    with pytest.raises(ModelError) as caught:
        model_ref(ModelConfig(name=str(weights)))
    assert first_line(caught) == f"model.name {str(weights)!r}: a file, not an HF model folder or a .gguf file"


@pytest.mark.parametrize("family", ARCHITECTURES)
def test_every_supported_family_passes_the_folder_check(family, tmp_path):
    tiny_model(family, layers=1).save_pretrained(tmp_path)
    assert model_ref(ModelConfig(name=str(tmp_path))).stage == "source"


def test_a_folder_without_config_json_is_not_a_model_folder(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ModelError) as caught:
        model_ref(ModelConfig(name=str(tmp_path)))
    assert first_line(caught) == f"{tmp_path}: not an HF model folder (no config.json)"


def test_an_unreadable_config_json_is_named(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "llama",')
    with pytest.raises(ModelError) as caught:
        model_ref(ModelConfig(name=str(tmp_path)))
    assert first_line(caught).startswith(f"{tmp_path / 'config.json'}: not readable JSON (")


@pytest.mark.parametrize(
    ("config", "named"),
    [
        ({"model_type": "bert", "architectures": ["BertForMaskedLM"]}, "'bert' (BertForMaskedLM)"),
        ({"model_type": "t5", "architectures": ["T5ForConditionalGeneration"]}, "'t5' (T5ForConditionalGeneration)"),
        (
            {"model_type": "qwen3", "architectures": ["Qwen3ForSequenceClassification"]},
            "'qwen3' (Qwen3ForSequenceClassification)",
        ),
        ({"model_type": "no_such_family"}, "'no_such_family'"),
    ],
)
def test_a_folder_of_another_kind_of_model_is_not_a_causal_lm(config, named, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelError) as caught:
        model_ref(ModelConfig(name=str(tmp_path)))
    assert first_line(caught) == (
        f"{tmp_path}: model_type {named} is not a causal LM; "
        "jaxtune fine-tunes AutoModelForCausalLM models such as llama, gemma3, qwen3"
    )


def test_a_checkpoint_with_its_own_causal_lm_code_passes(tmp_path):
    config = {"model_type": "my_lm", "auto_map": {"AutoModelForCausalLM": "modeling_my_lm.MyLM"}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert model_ref(ModelConfig(name=str(tmp_path), trust_remote_code=True)).stage == "source"


@pytest.mark.parametrize(
    ("content", "why"),
    [
        (b"version https://git-lfs.github.com/spec/v1\n", "it starts with b'vers', not b'GGUF'"),
        (b"GGUF\x03\0\0\0", "8 bytes, too short to hold a model"),
    ],
)
def test_a_file_that_does_not_start_like_gguf_is_refused(content, why, tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(content)
    with pytest.raises(ModelError) as caught:
        model_ref(ModelConfig(name=str(path)))
    assert first_line(caught) == f"{path}: not a GGUF file ({why})"


def write_tiny_gguf(path: Path, hidden: int = 32, ff: int = 64, heads: int = 2) -> None:
    """A one-layer random Llama with a byte-level tokenizer, float32 tensors."""
    import gguf
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    tokens = list(bytes_to_unicode().values())
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny")
    writer.add_context_length(64)
    writer.add_embedding_length(hidden)
    writer.add_block_count(1)
    writer.add_feed_forward_length(ff)
    writer.add_head_count(heads)
    writer.add_head_count_kv(heads)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(10000.0)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * len(tokens))
    writer.add_token_scores([0.0] * len(tokens))
    writer.add_token_merges([])
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(1)
    rng = np.random.default_rng(0)
    shapes = {
        "token_embd": (len(tokens), hidden),
        "output": (len(tokens), hidden),
        "output_norm": (hidden,),
        "blk.0.attn_norm": (hidden,),
        "blk.0.ffn_norm": (hidden,),
        "blk.0.attn_q": (hidden, hidden),
        "blk.0.attn_k": (hidden, hidden),
        "blk.0.attn_v": (hidden, hidden),
        "blk.0.attn_output": (hidden, hidden),
        "blk.0.ffn_gate": (ff, hidden),
        "blk.0.ffn_up": (ff, hidden),
        "blk.0.ffn_down": (hidden, ff),
    }
    for name, shape in shapes.items():
        writer.add_tensor(f"{name}.weight", (rng.standard_normal(shape) * 0.02).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_a_truncated_gguf_file_is_named_as_truncated_or_corrupt(tmp_path):
    from jaxtune.tasks.import_gguf import write_hf_folder

    whole = tmp_path / "tiny.gguf"
    write_tiny_gguf(whole)
    write_hf_folder(whole, tmp_path / "imported")  # the whole file imports
    assert (tmp_path / "imported" / "config.json").is_file()
    half = tmp_path / "half.gguf"
    half.write_bytes(whole.read_bytes()[: whole.stat().st_size // 2])
    assert model_ref(ModelConfig(name=str(half))).stage == "gguf"  # its header is intact
    with pytest.raises(ModelError) as caught:
        write_hf_folder(half, tmp_path / "half")
    assert first_line(caught).startswith(f"{half}: cannot read this GGUF file, it may be truncated or corrupt (")


def test_a_tokenizer_without_a_chat_template_names_the_model_and_the_setting():
    from jaxtune.data.templates import apply_chat_template_setting, require_chat_template
    from jaxtune.errors import ChatTemplateError

    tokenizer = SimpleNamespace(chat_template=None)
    with pytest.raises(ChatTemplateError) as caught:
        require_chat_template(tokenizer, "/models/gemma-3-270m")
    assert first_line(caught) == (
        "/models/gemma-3-270m: its tokenizer has no chat template; set model.chat_template to 'gemma' or a Jinja template string"
    )
    require_chat_template(apply_chat_template_setting(tokenizer, "gemma"), "/models/gemma-3-270m")


def _summary(trust_remote_code: bool | None) -> dict:
    loss = {"loss": 2.0, "perplexity": 7.4}
    summary = {
        "baseline": loss,
        "final": loss,
        "exact_match": {"before": 0.0, "after": 0.5},
        "per_category": {},
        "train": {
            "steps": 3,
            "seconds": 1.0,
            "compile_seconds": 0.5,
            "tokens_per_second": 100.0,
            "trainable_parameters": 10,
        },
        "export": {"kind": "peft_adapter", "path": "/store/export/k"},
        "parity": {
            "rows": 2,
            "tokens": 20,
            "dtype": "float32",
            "max_abs_diff": 1e-6,
            "max_abs_logit": 3.0,
            "top1_agreement": 1.0,
        },
    }
    return summary if trust_remote_code is None else {**summary, "trust_remote_code": trust_remote_code}


@pytest.mark.parametrize("on", [True, False])
def test_the_report_says_when_checkpoint_code_ran(on, tmp_path):
    from jaxtune.artifacts import ArtifactStore
    from jaxtune.config import load_config
    from jaxtune.flows.finetune import _train_section
    from jaxtune.tasks.report import ran_remote_code, render_markdown

    store = ArtifactStore(tmp_path)
    section = _train_section(load_config(None, [f"model.trust_remote_code={str(on).lower()}"]))
    with store.writing("train", "k", inputs={}, config=section, code={}):
        pass
    assert ran_remote_code(store.ref("train", "k")) is on
    line = "**trust_remote_code was on**: model code shipped with the checkpoint ran."
    assert (line in render_markdown(_summary(on), [], "loss.png").splitlines()) is on
    assert line not in render_markdown(_summary(None), [], "loss.png")  # a report.json from before the field
