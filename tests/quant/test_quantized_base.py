"""A LoRA base held as int8 or int4 blocks (`runtime.modeling.quantize`): the codes and their error bound,
and the quantized model's logits and LoRA gradients in JAX against PyTorch running the same
model with each quantized layer's weight dequantized by numpy (an independent reading of the
codes), for three families."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from jaxtune.config import LoraConfig, MeshConfig
from jaxtune.runtime.devices.mesh import make_placement
from jaxtune.runtime.measures import parity
from jaxtune.runtime.modeling import model as rt_model
from jaxtune.runtime.modeling import quantize
from tests.conftest import VOCAB, tiny_model

pytestmark = pytest.mark.quant
SCHEMES = ("int8", "int4", "nf4")
FAMILIES = ("llama", "gemma3", "qwen3")
# float32 logits of the same weights through XLA and PyTorch: different summation orders, a
# few ulps of values of order 1 (measured below 2e-6); a wrongly read block or nibble moves
# them by the quantization error, 1e-3 and more.
LOGIT_ATOL = 2e-5
GRAD_ATOL = 1e-4  # of each tensor's largest entry, as tests/preference's


# QLoRA's NF4 levels as the QLoRA paper's appendix and bitsandbytes list them, written out here
# rather than read from jaxtune.
NF4 = np.array(
    [
        -1.0,
        -0.6961928009986877,
        -0.5250730514526367,
        -0.39491748809814453,
        -0.28444138169288635,
        -0.18477343022823334,
        -0.09105003625154495,
        0.0,
        0.07958029955625534,
        0.16093020141124725,
        0.24611230194568634,
        0.33791524171829224,
        0.44070982933044434,
        0.5626170039176941,
        0.7229568362236023,
        1.0,
    ]
)


def numpy_dequantized(codes: np.ndarray, scales: np.ndarray, scheme: str) -> np.ndarray:
    """The weight the codes stand for, read as the module docstring describes them."""
    if scheme in ("int4", "nf4"):
        codes = np.stack([codes & 0x0F, codes >> 4], axis=-1).reshape(codes.shape[0], -1).astype(np.int64)
        codes = codes - 8 if scheme == "int4" else NF4.astype(np.float32).astype(np.float64)[codes]
    blocks = codes.astype(np.float64).reshape(codes.shape[0], scales.shape[1], -1)
    return (blocks * scales.astype(np.float64)[..., None]).reshape(codes.shape[0], -1)


def scales_of(layer) -> np.ndarray:
    return layer.scales.float().numpy()


@pytest.mark.parametrize("scheme", SCHEMES)
def test_each_value_is_within_half_a_step_of_its_block_and_codes_are_packed_as_stated(scheme):
    torch.manual_seed(0)
    weight = torch.randn(48, 256) * torch.logspace(-3, 1, 48)[:, None]  # rows of very different magnitudes
    weight[3, 64:128] = 0.0  # an all-zero block: scale 0, codes 0, values exactly 0
    fields = quantize.quantize(weight, scheme)
    codes, scales = fields["codes"], fields["scales"]
    top = quantize.SCHEMES[scheme]
    assert scales.dtype == torch.bfloat16 and tuple(scales.shape) == (48, 256 // quantize.BLOCK)
    if scheme == "int8":
        assert codes.dtype == torch.int8 and tuple(codes.shape) == (48, 256)
        assert codes.abs().max() == top
    elif scheme == "int4":
        assert codes.dtype == torch.uint8 and tuple(codes.shape) == (48, 128)
        low, high = (codes & 0x0F).int() - 8, (codes >> 4).int() - 8
        assert low.abs().max() <= top and high.abs().max() <= top
    else:
        assert codes.dtype == torch.uint8 and tuple(codes.shape) == (48, 128) and len(fields["levels"]) == 16
    ours = numpy_dequantized(codes.numpy(), scales.float().numpy(), scheme)
    np.testing.assert_array_equal(quantize.dequantize(fields, scheme, torch.float32).numpy(), ours.astype(np.float32))
    # A step: int8 and int4's one code apart; nf4's levels lie unevenly, at most its widest gap apart.
    widest = 1.0 if scheme != "nf4" else np.diff(NF4).max()
    step = widest * np.repeat(scales.float().numpy(), quantize.BLOCK, axis=1)
    error = np.abs(ours - weight.double().numpy())
    assert np.all(error <= 0.5 * step + 1e-7 * np.abs(weight.numpy()))
    assert np.all(ours[3, 64:128] == 0.0)
    if scheme != "nf4":  # The bound is tight: some value of most blocks lands near half a step away.
        assert np.mean(error.max(axis=1) > 0.4 * step.max(axis=1)) > 0.5


def test_nf4_holds_normally_distributed_weights_closer_than_int4():
    """What NF4 is for: weights are about normal, and its levels, dense near zero, lose less of them."""
    weight = torch.randn(256, 1024, generator=torch.Generator().manual_seed(0)) * 0.02
    errors = {
        scheme: (quantize.dequantize(quantize.quantize(weight, scheme), scheme, torch.float32) - weight)
        .pow(2)
        .mean()
        .sqrt()
        .item()
        for scheme in ("int4", "nf4")
    }
    assert errors["nf4"] < 0.9 * errors["int4"], (
        errors
    )  # measured 0.86: 16 levels against int4's 15, placed where weights lie


def test_int4_puts_each_pairs_first_code_in_the_low_nibble():
    weight = torch.zeros(1, 64)
    weight[0, :4] = torch.tensor([7.0, -7.0, 1.0, 0.0])  # scale 1: codes 7, -7, 1, 0 stored as 15, 1, 9, 8
    fields = quantize.quantize(weight, "int4")
    codes, scales = fields["codes"], fields["scales"]
    assert scales[0, 0].item() == 1.0
    assert codes[0, :2].tolist() == [15 | 1 << 4, 9 | 8 << 4]


def lora_model(family: str) -> torch.nn.Module:
    module = rt_model.attach_lora(
        tiny_model(family, layers=2, hidden_size=64, intermediate_size=128),
        LoraConfig(r=4, target_modules="all-linear"),
    )
    with torch.no_grad():
        for name, param in module.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.05)
    return module


def reference_of(quantized: torch.nn.Module) -> torch.nn.Module:
    """A copy of the quantized model with each QuantizedLinear a plain Linear of its numpy-dequantized weight."""
    reference = copy.deepcopy(quantized)
    for name, layer in list(reference.named_modules()):
        if isinstance(layer, quantize.QuantizedLinear):
            linear = torch.nn.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None)
            weight = numpy_dequantized(layer.codes.numpy(), scales_of(layer), layer.scheme)
            linear.weight = torch.nn.Parameter(torch.from_numpy(weight.astype(np.float32)), requires_grad=False)
            if layer.bias is not None:
                linear.bias = torch.nn.Parameter(layer.bias.detach().clone(), requires_grad=False)
            parent, _, child = name.rpartition(".")
            setattr(reference.get_submodule(parent), child, linear)
    return reference


def batch(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    ids = rng.integers(3, VOCAB, (2, 24)).astype(np.int32)
    return ids, ids.copy()


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("scheme", SCHEMES)
def test_logits_and_lora_gradients_equal_pytorch_on_the_dequantized_weights(family, scheme):
    module = lora_model(family)
    plain = copy.deepcopy(module)
    names = quantize.quantize_base(module, scheme)
    assert len(names) == 2 * 7  # q, k, v, o, gate, up, down of each layer; never the head
    reference = reference_of(module)
    model = rt_model.to_jax(module, make_placement(MeshConfig()))
    assert all(model.buffers[f"{name}.codes"].dtype == (np.int8 if scheme == "int8" else np.uint8) for name in names)
    assert not any(".base_layer.weight" in name for name in model.buffers)  # no float copy of a quantized layer

    ids, labels = batch()
    inputs = {"input_ids": ids, "attention_mask": np.ones_like(ids)}
    loss, grads = parity.jax_loss_and_grads(model, inputs, labels)
    reference.train()
    theirs = reference(input_ids=torch.from_numpy(ids).long(), labels=torch.from_numpy(labels).long())
    theirs.loss.backward()
    assert loss == pytest.approx(theirs.loss.item(), rel=1e-5)
    trained = {name: p.grad.numpy() for name, p in reference.named_parameters() if p.requires_grad}
    assert set(trained) == set(grads) and len(trained) == 28
    for name, expected in trained.items():
        np.testing.assert_allclose(grads[name], expected, rtol=0, atol=GRAD_ATOL * np.abs(expected).max(), err_msg=name)

    reference.eval()
    with torch.no_grad():
        expected = reference(input_ids=torch.from_numpy(ids).long()).logits.numpy()
        unquantized = plain(input_ids=torch.from_numpy(ids).long()).logits.numpy()
    np.testing.assert_allclose(parity.jax_logits(model, inputs), expected, rtol=0, atol=LOGIT_ATOL)
    # Quantizing did change the model, int4 (15 levels a block) more than int8 (255).
    moved = np.abs(expected - unquantized).max()
    assert (1e-4 < moved < 0.05) if scheme == "int8" else (1e-3 < moved < 0.5), moved


def test_a_full_fine_tune_over_a_quantized_base_is_refused():
    from jaxtune.config import load_config
    from jaxtune.errors import ConfigError

    with pytest.raises(
        ConfigError,
        match="model.base_quantization=int4 needs train.method=lora: a full fine-tune "
        "trains the base weights, which a quantized base holds frozen",
    ):
        load_config(None, ["model.base_quantization=int4", "train.method=full"])


@pytest.mark.parametrize("layer", ["q_proj", "down_proj"])
def test_codes_and_scales_are_split_over_the_mesh_as_the_weight_they_stand_for(layer):
    from jax.sharding import PartitionSpec

    from jaxtune.runtime.devices.sharding import rule_spec

    sizes = {"data": 1, "fsdp": 2, "tensor": 2}
    prefix = f"base_model.model.model.layers.0.{'self_attn' if layer == 'q_proj' else 'mlp'}.{layer}.base_layer"
    weight = rule_spec(f"{prefix}.weight", (256, 512), sizes)
    assert weight == (PartitionSpec("tensor", "fsdp") if layer == "q_proj" else PartitionSpec("fsdp", "tensor"))
    assert rule_spec(f"{prefix}.codes", (256, 256), sizes) == weight  # int4: two codes a byte
    assert rule_spec(f"{prefix}.scales", (256, 512 // quantize.BLOCK), sizes) == weight


@pytest.mark.parametrize("scheme, ratio", [("none", 1.0), ("int8", (1 + 2 / 64) / 2), ("int4", (0.5 + 2 / 64) / 2)])
def test_the_memory_plan_counts_the_base_layers_as_held(scheme, ratio):
    """A bfloat16 base: 2 bytes a weight, against 1 (int8) or 1/2 (int4) plus a 2-byte scale per 64."""
    from jaxtune.checks.doctor import base_text
    from jaxtune.runtime.measures.memory import base_bytes

    module = lora_model("llama").to(torch.bfloat16)
    if scheme != "none":
        quantize.quantize_base(module, scheme)
    base = base_bytes(rt_model.to_jax(module, make_placement(MeshConfig()), shapes_only=True))
    # 2 layers of q, k, v, o (64 x 64 each: 4 heads of 16 over 64 inputs, 2 kv heads: k, v 32 x 64) and
    # the MLP (3 x 64 x 128)
    weights = 2 * (64 * 64 * 2 + 32 * 64 * 2 + 3 * 64 * 128)
    assert base["unquantized"] == 2 * weights and base["scheme"] == scheme and base["compute_dtype"] == "bfloat16"
    assert base["held"] == pytest.approx(ratio * base["unquantized"], abs=0)
    mib = lambda n: f"{n / 2**20:.1f} MiB"  # noqa: E731
    int8, int4 = (1 + 2 / 64) * weights, (0.5 + 2 / 64) * weights
    assert base["by_scheme"] == {"int8": int8, "int4": int4}
    assert (
        base_text(base)
        == {
            "none": f"{mib(2 * weights)} in bfloat16; int8 would hold {mib(int8)}, int4 {mib(int4)}",
            "int8": f"{mib(int8)} as int8 (0.52x of {mib(2 * weights)} in bfloat16); int4 would hold {mib(int4)}",
            "int4": f"{mib(int4)} as int4 (0.27x of {mib(2 * weights)} in bfloat16); int8 would hold {mib(int8)}",
        }[scheme]
    )


@pytest.mark.slow
def test_on_a_mesh_the_codes_are_split_and_loss_and_gradients_are_one_devices():
    """In a child process with 4 fake CPU devices (JAX reads the device count once): (1, 2, 2) against one device."""
    from tests.fake_devices import run_with_devices

    runs = run_with_devices("tests.quant.quant_mesh_runs", 4)
    # q_proj is column-parallel: its (64, 32) int4 codes and (64, 1) scales split out over tensor, in over fsdp
    # where the dimension divides (one scale a row: its in dimension stays whole).
    assert runs["mesh"]["specs"] == {"codes": ["tensor", "fsdp"], "scales": ["tensor"]}
    assert runs["one"]["specs"] == {"codes": [], "scales": []}
    assert runs["mesh"]["loss"] == pytest.approx(runs["one"]["loss"], rel=1e-6)
    for name, expected in runs["one"]["grads"].items():
        expected = np.asarray(expected)
        np.testing.assert_allclose(
            runs["mesh"]["grads"][name], expected, rtol=0, atol=GRAD_ATOL * np.abs(expected).max(), err_msg=name
        )


@pytest.mark.target
@pytest.mark.slow
def test_on_a_tpu_the_int4_step_peaks_below_the_bfloat16_one():
    """XLA:TPU's plan (compiled here for a v5e chip) of a LoRA step with remat=layer, 8 layers of width
    1024 in bfloat16. Measured: bfloat16 base 210.7 MiB of arguments, 111.2 MiB of temporaries;
    int4 67.6 and 173.0 MiB. Without the barrier that ties each layer's dequantizing to its input,
    XLA dequantized every layer's weights ahead of time: 348.1 MiB of temporaries, a higher peak
    than the bfloat16 base's."""
    from jaxtune.config import TrainConfig
    from jaxtune.runtime.compiled import steps
    from jaxtune.runtime.devices import targets

    devices = targets.devices(targets.resolve("v5e-1"))
    plans = {}
    for scheme in ("none", "int4"):
        module = rt_model.attach_lora(
            tiny_model("gemma3", layers=8, hidden_size=1024, intermediate_size=4096),
            LoraConfig(r=8, target_modules="all-linear"),
        ).to(torch.bfloat16)
        if scheme != "none":
            quantize.quantize_base(module, scheme)
        model = rt_model.to_jax(module, make_placement(MeshConfig(), devices), shapes_only=True)
        plans[scheme] = steps.train_step_memory(
            model, steps.make_optimizer(TrainConfig()), 1, 8, 256, steps.StepSpec("layer")
        )
    none, int4 = plans["none"], plans["int4"]
    assert int4["argument_bytes"] < 0.4 * none["argument_bytes"]
    assert int4["temp_bytes"] < 2 * none["temp_bytes"]  # the layers' dequantized weights one at a time, not all at once
    assert int4["peak_bytes"] < 0.85 * none["peak_bytes"]
