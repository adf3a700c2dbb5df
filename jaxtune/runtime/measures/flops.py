"""Model FLOPs of a training token, and the device's peak, for model-FLOPs utilisation (MFU).

Counted as the PaLM paper does (appendix B), adapted to frozen weights: a matmul weight of n
entries costs 2n FLOPs per token forward and 2n backward for the activations' gradient; only
trained weights add another 2n for their own gradient. Attention adds 2·2·t·d per token and
layer forward (scores and the weighted sum over t keys, d = heads × head_dim), twice that
backward, with t the keys the layer computes over (`attended_keys`: causally about half the row,
at most the window in a sliding-window layer). Embedding lookups are not FLOPs; a tied output
head is a matmul and counts.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import jax
import numpy as np

from jaxtune.runtime.modeling.model import JaxModel
from jaxtune.runtime.modeling.quantize import QuantizedLinear

# Dense (no sparsity) bf16 peak FLOP/s of one chip, by the device kind JAX reports: the first key
# the kind starts with. The data sheets quote NVIDIA's figures with sparsity, twice the dense ones.
ACCELERATOR_PEAK = {
    "TPU v4": 275e12,  # https://cloud.google.com/tpu/docs/v4: 275 TFLOP/s bf16 per chip
    # https://cloud.google.com/tpu/docs/v5e: 197 TFLOP/s bf16 per chip; JAX calls the chip "TPU v5 lite"
    "TPU v5 lite": 197e12,
    "TPU v5e": 197e12,
    "TPU v5p": 459e12,
    "TPU v5": 459e12,  # https://cloud.google.com/tpu/docs/v5p: 459 TFLOP/s bf16 per chip
    # https://cloud.google.com/tpu/docs/v6e: 918 TFLOP/s bf16 per chip; JAX calls the chip "TPU v6 lite"
    "TPU v6 lite": 918e12,
    "TPU v6e": 918e12,
    # NVIDIA H100 data sheet (https://www.nvidia.com/en-us/data-center/h100/): bf16 Tensor Core 1,979 TFLOP/s
    # with sparsity on the SXM part ("NVIDIA H100 80GB HBM3"), 1,513 on the PCIe card, 1,671 on the NVL card
    "NVIDIA H100 PCIe": 756e12,
    "NVIDIA H100 NVL": 835e12,
    "NVIDIA H100": 989e12,
    # NVIDIA H200 data sheet (https://www.nvidia.com/en-us/data-center/h200/): 1,979 TFLOP/s with sparsity on
    # the SXM part ("NVIDIA H200"), 1,671 on the NVL card
    "NVIDIA H200 NVL": 835e12,
    "NVIDIA H200": 989e12,
    # NVIDIA A100 data sheet (https://www.nvidia.com/en-us/data-center/a100/): 312 TFLOP/s dense, SXM and PCIe
    "NVIDIA A100": 312e12,
}


POSITION_TABLES = ("wpe", "position_embeddings", "embed_positions")


def _matmul_entries(model: JaxModel) -> tuple[int, int]:
    """(entries of frozen matmul weights, entries of trained ones).

    Every 2-d tensor is a matmul weight but lookup tables: position tables, and the (vocab, d)
    tensors, of which exactly one, the output head, is a matmul (trained if any of them is). A weight
    held quantized counts its (out, in) entries, as the matmul its dequantized value takes part in.
    """
    config = model.config
    vocab = (config.vocab_size, config.hidden_size)
    # A base held quantized (`QuantizedLinear`): its codes, scales and levels stand for one (out, in) weight.
    quantized = {
        name: layer.in_features * layer.out_features
        for name, layer in model.module.named_modules()
        if isinstance(layer, QuantizedLinear)
    }
    entries = {"frozen": sum(quantized.values()), "trained": 0}
    head = "frozen"
    for kind, tree in (("frozen", model.buffers), ("trained", model.weights)):
        for held, value in tree.items():
            # a stacked tensor (`stacked.Layout`) counts as its layers' tensors: one per row
            rows = model.layout.rows(held) if model.layout is not None else None
            members = rows[1] if rows else None
            name, shape = (members[0], value.shape[len(rows[0]) :]) if rows else (held, value.shape)
            if name.rsplit(".", 1)[0] in quantized:  # counted once, above, as the weight it stands for
                continue
            if len(shape) != 2 or any(p in name for p in POSITION_TABLES):
                continue
            if tuple(shape) == vocab:
                head = "trained" if kind == "trained" else head
                continue
            entries[kind] += int(np.prod(shape)) * (len(members) if members else 1)
    entries[head] += vocab[0] * vocab[1]
    return entries["frozen"], entries["trained"]


def attended_keys(config, length: int) -> float:
    """The keys a token attends over in a causal row of `length` tokens, averaged over the row's tokens and
    the model's layers: (length + 1) / 2 in a global layer; in a sliding-window layer of window w, where
    token i sees min(i + 1, w) keys, at most w (Gemma 3's 5 of 6 layers, Mistral's all)."""
    window = getattr(config, "sliding_window", None)
    layers = config.num_hidden_layers
    kinds = getattr(config, "layer_types", None) or [("sliding_attention" if window else "full_attention")] * layers

    def mean(w: int | None) -> float:
        if not w or w >= length:
            return (length + 1) / 2
        return (w * (w + 1) / 2 + (length - w) * w) / length

    return sum(mean(window if kind == "sliding_attention" else None) for kind in kinds) / len(kinds)


def train_flops_per_token(model: JaxModel, context: float) -> dict:
    """FLOPs per scored-or-not real token of a train step, with `context` the mean tokens each token attends over."""
    frozen, trained = _matmul_entries(model)
    config = model.config
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    layers = config.num_hidden_layers
    attention = 2 * 2 * context * heads * head_dim * layers
    forward = 2 * (frozen + trained) + attention
    backward = 2 * (frozen + trained) + 2 * trained + 2 * attention
    return {
        "matmul_weights": frozen + trained,
        "trained_weights": trained,
        "attention_forward": attention,
        "forward": forward,
        "backward": backward,
        "total": forward + backward,
    }


def cpu_peak() -> dict:
    """This CPU's float32 peak: cores × clock × FLOPs per cycle, with the assumption spelt out.

    Two FMA pipes per core, each 256 bits wide (8 float32 lanes, 2 FLOPs per FMA): 32 FLOPs per
    cycle. That is Zen 3/4 (Zen 4 runs AVX-512 as two 256-bit halves) and most client Intel
    cores; Intel server cores with two 512-bit FMA units reach 64, so there this is a lower bound.
    """
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    mhz = [float(m) for m in re.findall(r"cpu MHz\s*:\s*([\d.]+)", text)] or [2000.0]
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    flops_per_cycle = 32
    peak = cores * max(mhz) * 1e6 * flops_per_cycle
    return {
        "peak_flops": peak,
        "derivation": f"{cores} cores x {max(mhz):.0f} MHz x {flops_per_cycle} float32 FLOP/cycle "
        f"(2 FMA pipes x 8 lanes x 2) = {peak / 1e9:.1f} GFLOP/s",
    }


def chip_peak(device=None) -> dict:
    """Peak FLOP/s of one device (the first local one unless given), and how it was found."""
    device = device or jax.devices()[0]
    if device.platform == "cpu":
        return cpu_peak()
    kind = device.device_kind
    per_chip = next((v for k, v in ACCELERATOR_PEAK.items() if kind.startswith(k)), None)
    if per_chip is None:
        return {"peak_flops": None, "derivation": f"no peak known for {kind}"}
    return {"peak_flops": per_chip, "derivation": f"{kind} at {per_chip / 1e12:.0f} TFLOP/s dense bf16"}


def device_peak() -> dict:
    """Peak FLOP/s of all local devices together, and how it was found."""
    one = chip_peak()
    if jax.devices()[0].platform == "cpu" or one["peak_flops"] is None:
        return one
    n = jax.local_device_count()
    return {"peak_flops": one["peak_flops"] * n, "derivation": f"{n} x {one['derivation']}"}
