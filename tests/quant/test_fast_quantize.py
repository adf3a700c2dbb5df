"""`quantize_fast`, the quantizing a streamed load uses (one XLA program on the host), against `quantize`, the
reference: the same codes and scales, bit for bit, on random weights and on the values where rounding decides
(a value at a midpoint between two codes, one float either side of it, halves for int8 and int4), blocks of
zeros, of negative zeros and of values too small for their scale, and each dtype a checkpoint holds."""

from __future__ import annotations

import jax.numpy as jnp
import pytest
import torch

from jaxtune.runtime.modeling.quantize import BLOCK, NF4_LEVELS, SCHEMES, _host_program, quantize, quantize_fast

pytestmark = pytest.mark.quant


def assert_same(weight: torch.Tensor, scheme: str, block: int = BLOCK, rare: bool = False) -> None:
    """`quantize_fast` gives `quantize`'s fields, its XLA program's own (or, `rare`, `quantize`'s)."""
    host = weight.view(torch.int16).numpy().view(jnp.bfloat16) if weight.dtype == torch.bfloat16 else weight.numpy()
    assert bool(_host_program(scheme, block)(host)[2]) == rare
    reference, fast = quantize(weight, scheme, block), quantize_fast(weight, scheme, block)
    assert list(fast) == list(reference)
    for field, tensor in reference.items():
        assert fast[field].dtype == tensor.dtype and fast[field].shape == tensor.shape, field
        # the bits, not the values: a scale of -0.0 for +0.0 or another NaN would differ
        same = fast[field].view(torch.uint8) if tensor.dtype != torch.float32 else fast[field]
        assert torch.equal(same, tensor.view(torch.uint8) if tensor.dtype != torch.float32 else tensor), field


def decisive(scheme: str, rows: int, generator: torch.Generator) -> torch.Tensor:
    """(rows, BLOCK * 8) float32 blocks whose largest magnitude makes a bfloat16 scale that is exact
    (a power of two times a few bits) and whose other values are, once divided by it, exactly a
    rounding boundary (nf4's midpoints; int8's and int4's halves) or the float next to it either
    side: where a division that is not correctly rounded, or a comparison the wrong way, changes a code."""
    top = SCHEMES[scheme]
    if scheme == "nf4":
        levels = torch.tensor(NF4_LEVELS)
        boundaries = (levels[1:] + levels[:-1]) / 2
    else:
        boundaries = torch.arange(-top, top, dtype=torch.float32) + 0.5
    blocks = rows * 8
    scale = (torch.randint(1, 256, (blocks, 1), generator=generator).float() / 128).to(torch.bfloat16).float()
    scale = scale * 2.0 ** torch.randint(-12, 2, (blocks, 1), generator=generator).float()
    picked = boundaries[torch.randint(len(boundaries), (blocks, BLOCK - 1), generator=generator)]
    nudge = torch.randint(-1, 2, picked.shape, generator=generator)
    picked = torch.where(nudge > 0, torch.nextafter(picked, torch.tensor(2.0)), picked)
    picked = torch.where(nudge < 0, torch.nextafter(picked, torch.tensor(-2.0)), picked)
    values = torch.cat([torch.full((blocks, 1), float(top)), picked], dim=1) * scale
    # the largest in a random place of its block, some blocks negated
    values = values[:, torch.randperm(BLOCK, generator=generator)]
    sign = torch.where(torch.rand(blocks, 1, generator=generator) < 0.5, -1.0, 1.0)
    return (values * sign).reshape(rows, BLOCK * 8)


@pytest.mark.parametrize("scheme", sorted(SCHEMES))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_random_weights_quantize_as_the_reference(scheme, dtype):
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(96, 1024, generator=generator) * 0.02
    weight[3, :BLOCK] *= 1e4  # a block far larger than the rest
    assert_same(weight.to(dtype), scheme)
    assert_same(torch.randn(64, 256, generator=generator).to(dtype), scheme, block=32)


@pytest.mark.parametrize("scheme", sorted(SCHEMES))
def test_values_on_and_beside_each_rounding_boundary_quantize_as_the_reference(scheme):
    generator = torch.Generator().manual_seed(1)
    weight = decisive(scheme, 128, generator)
    # found in the weight: rounding decides many codes (not only values well inside a code's interval)
    normalized = quantize(weight, scheme)["scales"].float().repeat_interleave(BLOCK, dim=1)
    assert (weight / normalized).abs().max() <= SCHEMES[scheme]
    assert_same(weight, scheme)
    assert_same(weight.to(torch.bfloat16), scheme)


@pytest.mark.parametrize("scheme", sorted(SCHEMES))
def test_zeros_negative_zeros_and_values_below_their_scale_quantize_as_the_reference(scheme):
    weight = torch.randn(8, 4 * BLOCK) * 0.02
    weight[0] = 0.0
    weight[1] = -0.0
    weight[2, :BLOCK] = 1e-45  # the smallest float32: its block's scale rounds to zero
    weight[3, BLOCK : 2 * BLOCK] = -1e-40  # subnormal
    weight[4, :BLOCK] = torch.linspace(-1, 1, BLOCK) * 3e38  # near float32's largest
    weight[5, :BLOCK] = 2.0**-126 * 3  # normal, its block's scale subnormal
    weight[6, 1] = -1e-41  # subnormal, in a block of ordinary values
    assert_same(weight, scheme, rare=True)
    assert_same(weight[[0, 1, 6, 7]], scheme)  # without the rare blocks: the fast program's own codes
    half = torch.randn(8, 4 * BLOCK).to(torch.float16)
    half[0, :BLOCK] = 6e-8  # float16's subnormals, ordinary float32 values
    half[1, 3] = -1e-7
    assert_same(half, scheme)


@pytest.mark.parametrize("scheme", sorted(SCHEMES))
def test_a_weight_holding_an_infinity_or_a_nan_quantizes_as_the_reference(scheme):
    weight = torch.randn(4, 2 * BLOCK)
    weight[1, 5] = float("inf")
    weight[2, BLOCK + 1] = float("-inf")
    weight[3, 7] = float("nan")
    assert_same(weight, scheme, rare=True)


def test_a_weight_whose_inputs_do_not_split_into_blocks_is_refused():
    with pytest.raises(ValueError, match="does not split into blocks"):
        quantize_fast(torch.zeros(4, BLOCK + 2), "int8")


def test_without_a_cpu_backend_the_reference_quantizes(monkeypatch):
    """JAX_PLATFORMS naming only an accelerator leaves JAX no CPU device to run the fast program on."""
    import jax

    def no_cpu(backend=None):
        raise RuntimeError(f"Unknown backend {backend}")

    _host_program.cache_clear()
    monkeypatch.setattr(jax, "devices", no_cpu)
    try:
        assert _host_program("nf4", BLOCK) is None
        weight = torch.randn(8, 2 * BLOCK)
        reference, fast = quantize(weight, "nf4"), quantize_fast(weight, "nf4")
        assert all(torch.equal(fast[k], reference[k]) for k in reference)
    finally:
        _host_program.cache_clear()
