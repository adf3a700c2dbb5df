"""Reading a `train` artifact back: which method made it, and the model with its weights applied.

Kept apart from the train stage so that the stages reading its output (evaluate, generate,
export) do not run, and so are not keyed by, the training loop's code.
"""

from __future__ import annotations

from jaxtune.artifacts import ArtifactRef
from jaxtune.config import LoraConfig, MeshConfig, ModelConfig
from jaxtune.tasks.sources import pretrained_location


def method_of(train_ref: ArtifactRef | None) -> tuple[str, LoraConfig | None]:
    """How to rebuild the trained model: ('base'|'lora'|'full', LoRA settings)."""
    if train_ref is None:
        return "base", None
    meta = train_ref.read_json("method.json")
    return meta["method"], LoraConfig(**meta["lora"]) if meta["lora"] else None


def open_trained_model(inputs: dict[str, ArtifactRef | None], model_cfg: ModelConfig, mesh: MeshConfig):
    """The base model with the `train` input's weights applied (or the base model alone when it is None)."""
    from jaxtune.runtime.devices.mesh import make_placement
    from jaxtune.runtime.modeling.model import open_model

    train_ref = inputs.get("train")
    _, lora = method_of(train_ref)
    name, revision = pretrained_location(inputs["model"])
    trained = train_ref.file("params.safetensors") if train_ref is not None else None
    return open_model(
        name, revision, model_cfg, make_placement(mesh), lora=lora, trained=trained, base=held_base(inputs)
    )


def held_base(inputs: dict[str, ArtifactRef | None]) -> tuple[dict, dict[str, str]] | None:
    """The quantized base's tensors and schemes, from the `base` input (a quantize_base artifact), if any."""
    from jaxtune.tasks.quantize_base import stored_base

    return stored_base(inputs["base"]) if inputs.get("base") is not None else None
