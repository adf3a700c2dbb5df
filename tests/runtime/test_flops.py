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
