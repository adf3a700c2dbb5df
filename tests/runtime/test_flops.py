"""The per-chip peak MFU is taken against: the data sheets' dense bf16 figures, by the device kind JAX reports."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from jaxtune.runtime.measures.flops import chip_peak


@dataclass
class FakeDevice:
    device_kind: str
    platform: str = "gpu"


@pytest.mark.parametrize(
    "kind, tflops",
    [
        ("NVIDIA H200", 989),
        ("NVIDIA H200 NVL", 835),
        ("NVIDIA H100 80GB HBM3", 989),
        ("NVIDIA H100 PCIe", 756),
        ("NVIDIA A100-SXM4-80GB", 312),
        ("TPU v5 lite", 197),
        ("TPU v5p", 459),
        ("TPU v5", 459),
        ("TPU v6 lite", 918),
    ],
)
def test_chip_peak_by_device_kind(kind, tflops):
    peak = chip_peak(FakeDevice(kind, "tpu" if kind.startswith("TPU") else "gpu"))
    assert peak["peak_flops"] == tflops * 1e12
    assert kind in peak["derivation"] and "dense bf16" in peak["derivation"]


def test_unknown_chip_has_no_peak():
    assert chip_peak(FakeDevice("NVIDIA GeForce RTX 4090"))["peak_flops"] is None


def counted_keys(layer_types: list[str], window: int | None, length: int) -> float:
    """Keys per token and layer counted from the masks themselves: query i sees key j <= i, and in a sliding
    layer only i - window < j, as transformers' sliding-window mask has it."""
    import numpy as np

    i, j = np.arange(length)[:, None], np.arange(length)[None, :]
    causal = j <= i
    seen = {
        "full_attention": causal.sum() / length,
        "sliding_attention": (causal & (i - j < (window or length))).sum() / length,
    }
    return sum(seen[kind] for kind in layer_types) / len(layer_types)


@pytest.mark.parametrize("length", [8, 100, 512, 1000, 2048])
def test_attended_keys_are_those_the_masks_let_through(length):
    """Gemma 3 1B's pattern (five sliding layers of 512 keys to one global), Mistral's (every layer sliding),
    and a model with no window (Llama): the mean keys a token attends over, as `attended_keys` counts them."""
    from transformers import AutoConfig

    from jaxtune.runtime.measures.flops import attended_keys

    gemma = AutoConfig.for_model("gemma3_text", num_hidden_layers=12, sliding_window=512)
    assert gemma.layer_types.count("sliding_attention") == 10
    mistral = AutoConfig.for_model("mistral", num_hidden_layers=3, sliding_window=300)
    llama = AutoConfig.for_model("llama", num_hidden_layers=2)
    for config in (gemma, mistral, llama):
        window = getattr(config, "sliding_window", None)
        kinds = (
            getattr(config, "layer_types", None)
            or ["sliding_attention" if window else "full_attention"] * config.num_hidden_layers
        )
        expected = counted_keys(kinds, window, length)
        assert attended_keys(config, length) == pytest.approx(expected, rel=1e-12), config.model_type
    assert attended_keys(llama, length) == (length + 1) / 2


def test_a_long_row_of_gemma_3_costs_its_windows_not_the_whole_row():
    """At 32,768 tokens, Gemma 3 1B's 22 sliding layers attend over under 512 keys: the layers' mean is
    about a sixth of half the row (a global layer's), not half the row."""
    from transformers import AutoConfig

    from jaxtune.runtime.measures.flops import attended_keys

    config = AutoConfig.for_model("gemma3_text", num_hidden_layers=26, sliding_window=512)
    global_layers = config.layer_types.count("full_attention")
    assert global_layers == 4
    mean = attended_keys(config, 32768)
    assert mean == pytest.approx((22 * (512 - 511 * 512 / 2 / 32768) + 4 * 32769 / 2) / 26, rel=1e-9)
    assert mean < 0.2 * 32769 / 2


@pytest.mark.parametrize("scheme", ["int8", "nf4"])
def test_a_base_held_quantized_counts_the_matmuls_its_weights_take_part_in(scheme):
    """A LoRA model's FLOPs are the same over a quantized base as over its bfloat16 weights: codes and scales
    (2-d tensors both) count as the one (out, in) weight they stand for, not as two weights of their shapes."""
    import torch

    from jaxtune.config import LoraConfig, MeshConfig
    from jaxtune.runtime.devices.mesh import make_placement
    from jaxtune.runtime.measures.flops import train_flops_per_token
    from jaxtune.runtime.modeling import model as rt_model
    from jaxtune.runtime.modeling import quantize
    from tests.conftest import VOCAB, tiny_model

    def flops(quantized: bool) -> dict:
        module = rt_model.attach_lora(
            tiny_model("llama", layers=2, hidden_size=64, intermediate_size=128),
            LoraConfig(r=4, target_modules="all-linear"),
        ).to(torch.bfloat16)
        if quantized:
            assert quantize.quantize_base(module, scheme)
        model = rt_model.to_jax(module, make_placement(MeshConfig()), shapes_only=True)
        return train_flops_per_token(model, 16)

    plain, held = flops(False), flops(True)
    assert held == plain
    # q, o 64 x 64, k, v 32 x 64, the MLP 3 x 64 x 128, in each of 2 layers, and LoRA's r=4 pairs beside them
    frozen = 2 * (2 * 64 * 64 + 2 * 32 * 64 + 3 * 64 * 128)
    assert plain["matmul_weights"] - plain["trained_weights"] - frozen == 64 * VOCAB  # the tied head
