"""Stage `export`: trained weights -> a PEFT adapter folder (LoRA) or a full HF model folder,
both loadable by plain PyTorch without jaxtune."""

from __future__ import annotations

import json
from pathlib import Path

from prefect import get_run_logger, task

from jaxtune.artifacts import ArtifactRef
from jaxtune.config import ExportConfig, ModelConfig, Section
from jaxtune.tasks.sources import pretrained_location
from jaxtune.tasks.stage import build_artifact
from jaxtune.tasks.trained import method_of

STAGE = "export"


class ExportSection(Section):
    model: ModelConfig
    export: ExportConfig


def trained_torch_model(inputs: dict[str, ArtifactRef], model_cfg: ModelConfig):
    """The PyTorch module (PEFT-wrapped for LoRA) holding the trained weights."""
    import torch

    from jaxtune.runtime.model import attach_lora, load_torch_model, load_weights

    method, lora = method_of(inputs["train"])
    name, revision = pretrained_location(inputs["model"])
    module = load_torch_model(name, revision, model_cfg.trust_remote_code)
    if lora is not None:
        module = attach_lora(module, lora)
    trained = {k: torch.from_numpy(v) for k, v in load_weights(inputs["train"].file("params.safetensors")).items()}
    missing = set(trained) - {n for n, _ in module.named_parameters()}
    if missing:
        raise KeyError(f"trained weights name parameters the model lacks: {sorted(missing)[:5]}")
    module.load_state_dict(trained, strict=False)
    return module, method


@task(name=STAGE, result_serializer="json")
def export(section: ExportSection, inputs: dict[str, ArtifactRef], store_root: str) -> ArtifactRef:
    """inputs: `model`, `train`."""

    def build(folder: Path) -> None:
        import torch
        from transformers import AutoTokenizer

        module, method = trained_torch_model(inputs, section.model)
        module = module.to(getattr(torch, section.export.dtype))
        sub = "adapter" if method == "lora" else "model"
        module.save_pretrained(folder / sub, safe_serialization=True)
        name, revision = pretrained_location(inputs["model"])
        AutoTokenizer.from_pretrained(name, revision=revision).save_pretrained(folder / sub)
        info = {"kind": "peft_adapter" if method == "lora" else "hf_model", "subfolder": sub, "base_model": name}
        (folder / "export.json").write_text(json.dumps(info, indent=2))
        get_run_logger().info("exported a %s (%s/)", info["kind"], sub)

    return build_artifact(store_root, STAGE, __name__, section, inputs, build)
