"""The finetune flow over a quantized base: the quantize_base stage runs once and every stage that
opens the model reads it; the merged export is the dequantized base plus the adapter; the report says so."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from tests.flows.toy import artifact, run_in_new_store, run_toy, states

pytestmark = [pytest.mark.quant, pytest.mark.slow]
# Width 64, so q, k, v, gate and up (64 inputs) and down (128) split into blocks of 64; o_proj's
# 32 inputs (2 heads of 16) do not, and it stays a float weight.
INT4 = (
    "model.tiny.hidden_size=64",
    "model.tiny.intermediate_size=128",
    "model.base_quantization=int4",
    "export.merge=true",
)


@pytest.fixture(scope="module")
def int4_run(tmp_path_factory):
    return run_in_new_store(tmp_path_factory, *INT4)


def test_the_base_is_quantized_once_and_the_report_says_the_adapter_learned_against_it(int4_run):
    store, result = int4_run
    assert list(states(result)) == [
        "build_tokenizer",
        "build_model",
        "quantize_base",
        "tokenize",
        "baseline_eval",
        "train",
        "final_eval",
        "export",
        "generate",
        "report",
    ]
    info = json.loads((artifact(store, "quantize_base") / "quantize.json").read_text())
    assert info["kinds"] == {"int4": 2 * 6} and not any("o_proj" in layer for layer in info["layers"])
    # int4: half a byte a weight and a bfloat16 scale per 64, against float32's 4 bytes (the offline model's dtype)
    assert info["held_bytes"] / info["unquantized_bytes"] == pytest.approx((0.5 + 2 / 64) / 4)
    report = (artifact(store, "report") / "report.md").read_text()
    assert (
        "**Trained against a quantized base** (`model.base_quantization: int4`): 12 frozen linear layers held as 12 int4"
        in report
    )
    assert json.loads((artifact(store, "export") / "export.json").read_text())["trained_on_quantized_base"] == "int4"


def test_the_merged_export_is_the_dequantized_base_plus_the_adapter(int4_run):
    from safetensors.torch import load_file

    from jaxtune.runtime.modeling.quantize import dequantize

    store, _ = int4_run
    export = artifact(store, "export")
    merged = load_file(str(export / "merged" / "model.safetensors"))
    adapter = load_file(str(export / "adapter" / "adapter_model.safetensors"))
    config = json.loads((export / "adapter" / "adapter_config.json").read_text())
    stored = load_file(str(artifact(store, "quantize_base") / "base.safetensors"))
    base = load_file(str(artifact(store, "build_model") / "model.safetensors"))
    layer = "model.layers.1.mlp.down_proj"
    a = adapter[f"base_model.model.{layer}.lora_A.weight"]
    b = adapter[f"base_model.model.{layer}.lora_B.weight"]
    dequantized = dequantize(
        {"codes": stored[f"{layer}.codes"], "scales": stored[f"{layer}.scales"]}, "int4", torch.float32
    )
    expected = dequantized + (config["lora_alpha"] / config["r"]) * (b @ a)
    np.testing.assert_allclose(merged[f"{layer}.weight"].numpy(), expected.numpy(), rtol=0, atol=1e-6)
    assert not torch.equal(dequantized, base[f"{layer}.weight"])  # the base as held, not as it was
    # o_proj stayed a float weight: merged into the base as it was
    o_proj = "model.layers.1.self_attn.o_proj"
    expected = base[f"{o_proj}.weight"] + (config["lora_alpha"] / config["r"]) * (
        adapter[f"base_model.model.{o_proj}.lora_B.weight"] @ adapter[f"base_model.model.{o_proj}.lora_A.weight"]
    )
    np.testing.assert_allclose(merged[f"{o_proj}.weight"].numpy(), expected.numpy(), rtol=0, atol=1e-6)


def test_a_second_run_reads_the_quantized_base_from_the_store(int4_run):  # last: it adds a second train artifact
    store, _ = int4_run
    again = run_toy(store, *INT4, "train.learning_rate=1e-3")
    assert states(again)["quantize_base"] == "Cached" and states(again)["train"] == "Completed"
