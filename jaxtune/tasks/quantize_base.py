"""Stage `quantize_base`: the base model's frozen linear layers as codes and scales, for LoRA
over a quantized base (`model.base_quantization`).

Made once, keyed by the model's weights and the scheme, and read by every stage that opens the
model (the reference, the evals, train, generate, export): `int8`, `int4` quantize the weights
in the compute dtype (`runtime.modeling.quantize`); `gguf` keeps the blocks of the GGUF file the model
was imported from (Q8_0, Q4_0, Q4_1, Q5_0) byte for byte (`jaxtune.gguf.blocks`), and its
layers of other types stay as the imported float weights. Writes `base.safetensors` (tensors
'<layer>.codes', '<layer>.scales', ... named as the plain HF model names its layers) and
`quantize.json`: the scheme of each layer, those left unquantized and why, and the bytes held
against the same layers in the compute dtype.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from prefect import get_run_logger, task

from jaxtune.artifacts import ArtifactRef
from jaxtune.config import Section
from jaxtune.tasks.sources import pretrained_location
from jaxtune.tasks.stage import build_artifact

STAGE = "quantize_base"
STORED = "base.safetensors"


class QuantizeSection(Section):
    scheme: str  # int8, int4 or gguf
    dtype: str  # the compute dtype: what int8 and int4 quantize from, what the held bytes are compared with
    trust_remote_code: bool = False


@task(name=STAGE, result_serializer="json")
def quantize_base(section: QuantizeSection, inputs: dict[str, ArtifactRef], store_root: str) -> ArtifactRef:
    """inputs: `model`, the base model folder; for `gguf` also `gguf`, the file it was imported from."""

    def build(folder: Path) -> None:
        import numpy as np
        import torch
        from safetensors.torch import save_file

        from jaxtune.runtime.modeling.model import load_quantized, load_torch_model

        name, revision = pretrained_location(inputs["model"])
        left: dict[str, str] = {}
        if section.scheme == "gguf":
            from jaxtune.gguf.blocks import read_blocks

            module = load_torch_model(name, revision, section.trust_remote_code, section.dtype)
            arrays, schemes, left = read_blocks(inputs["gguf"].path, module.config)
            tensors = {key: torch.from_numpy(np.ascontiguousarray(value)) for key, value in arrays.items()}
        else:  # quantized as each layer is read: the float model is never all in memory
            module, (stored, schemes) = load_quantized(
                name, revision, section.trust_remote_code, section.dtype, section.scheme
            )
            tensors = {key: tensor.contiguous() for key, tensor in stored.items()}
        save_file(tensors, str(folder / STORED))
        itemsize = torch.empty((), dtype=getattr(torch, section.dtype)).element_size()
        weights = sum(_weight_elements(module, layer) for layer in schemes)
        info = {
            "scheme": section.scheme,
            "layers": schemes,
            "kinds": dict(Counter(schemes.values())),
            "left_unquantized": left,  # layer -> the GGUF type it has, which is held as the imported float weight
            "held_bytes": sum(t.numel() * t.element_size() for t in tensors.values()),
            "unquantized_bytes": weights * itemsize,
            "compute_dtype": section.dtype,
        }
        (folder / "quantize.json").write_text(json.dumps(info, indent=2))
        get_run_logger().info(
            "%d linear layers held as %s: %.1f MiB, %.2fx of %.1f MiB in %s%s",
            len(schemes),
            ", ".join(f"{n} {kind}" for kind, n in info["kinds"].items()),
            info["held_bytes"] / 2**20,
            info["held_bytes"] / max(info["unquantized_bytes"], 1),
            info["unquantized_bytes"] / 2**20,
            section.dtype,
            f"; {len(left)} left as float weights ({', '.join(sorted(set(left.values())))} blocks are not held)"
            if left
            else "",
        )

    return build_artifact(store_root, STAGE, __name__, section, inputs, build)


def _weight_elements(module, layer: str) -> int:
    sub = module.get_submodule(layer)
    return sub.in_features * sub.out_features


def stored_base(ref: ArtifactRef) -> tuple[dict, dict[str, str]]:
    """(the tensors, the scheme of each layer) a `quantize_base` artifact holds."""
    from safetensors.torch import load_file

    return load_file(str(ref.file(STORED))), ref.read_json("quantize.json")["layers"]
