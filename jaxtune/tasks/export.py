"""Stage `export`: trained weights -> a PEFT adapter folder (LoRA) or a full HF model folder, and with
`export.merge` also the LoRA merged into a full HF model; all load in plain PyTorch without jaxtune.
With `export.gguf`, also GGUF files of the merged model for llama.cpp and Ollama (`gguf/`)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from prefect import get_run_logger, task

from jaxtune.artifacts import ArtifactRef
from jaxtune.config import ExportConfig, ModelConfig, Section
from jaxtune.tasks.sources import open_tokenizer, pretrained_location
from jaxtune.tasks.stage import build_artifact
from jaxtune.tasks.trained import method_of

STAGE = "export"


class ExportSection(Section):
    model: ModelConfig
    export: ExportConfig


def trained_torch_model(inputs: dict[str, ArtifactRef], model_cfg: ModelConfig):
    """The PyTorch module (PEFT-wrapped for LoRA) holding the trained weights. Over a quantized base
    (a `base` input), the frozen layers are the dequantized base the adapter was trained against,
    so a merge is that base plus the adapter."""
    import torch

    from jaxtune.runtime.modeling.model import attach_lora, load_torch_model, load_weights
    from jaxtune.runtime.modeling.quantize import dequantize_base
    from jaxtune.tasks.trained import held_base

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
    if (base := held_base(inputs)) is not None:
        dequantize_base(module, *base)
    return module, method


def save_model(module, folder: Path, section: ExportSection, model_ref: ArtifactRef) -> None:
    """`module` cast to export.dtype (in place) plus the base model's tokenizer: a folder `from_pretrained` loads."""
    import torch

    module.to(getattr(torch, section.export.dtype)).save_pretrained(folder, safe_serialization=True)
    open_tokenizer(model_ref, section.model).save_pretrained(folder)


def save_merged(folder: Path, section: ExportSection, inputs: dict[str, ArtifactRef]) -> None:
    """LoRA folded into the base weights, modules_to_save swapped in: a plain HF model for serving.

    The trained model is loaded afresh in float32 (saving the adapter cast the first copy in place) and
    merged before the cast, so W + scale * B @ A is rounded once. Where modules_to_save untie a tied
    embedding, PEFT's merge sets tie_word_embeddings=False, so both trained matrices are saved and kept.
    """
    module, _ = trained_torch_model(inputs, section.model)
    save_model(module.merge_and_unload(), folder, section, inputs["model"])


def check_gguf_export(model_ref: ArtifactRef, model_cfg: ModelConfig) -> None:
    """Raise ModelError if `export.gguf` could not write this model: the flow asks before training."""
    from transformers import AutoConfig

    from jaxtune.gguf.writer import check_exportable

    name, revision = pretrained_location(model_ref)
    config = AutoConfig.from_pretrained(name, revision=revision, trust_remote_code=model_cfg.trust_remote_code)
    check_exportable(config, open_tokenizer(model_ref, model_cfg))


def save_gguf(folder: Path, section: ExportSection, inputs: dict[str, ArtifactRef]) -> list[dict]:
    """Each `export.gguf` type as `folder/<architecture>-<type>.gguf`, with its Ollama Modelfile.

    Written from the trained model merged in float32 (a folder removed afterwards), so every type
    rounds the weights once, whatever export.dtype is. Returns each file's name, type and bytes."""
    from jaxtune.gguf.writer import gguf_architecture, ollama_modelfile, write_ggufs

    source = folder.with_name(f".{folder.name}-source")
    module, _ = trained_torch_model(inputs, section.model)
    if hasattr(module, "merge_and_unload"):
        module = module.merge_and_unload()
    module.float().save_pretrained(source, safe_serialization=True)
    architecture = gguf_architecture(module.config)
    del module
    tokenizer = open_tokenizer(inputs["model"], section.model)
    tokenizer.save_pretrained(source)
    folder.mkdir()
    files = []
    try:
        types = list(dict.fromkeys(section.export.gguf))  # a type listed twice is written once
        paths = write_ggufs(source, {qtype: folder / f"{architecture}-{qtype}.gguf" for qtype in types}, tokenizer)
        for qtype, path in zip(types, paths):
            path.with_suffix(".Modelfile").write_text(ollama_modelfile(path.name, tokenizer))
            files.append({"file": path.name, "type": qtype, "bytes": path.stat().st_size})
    finally:
        shutil.rmtree(source)
    return files


@task(name=STAGE, result_serializer="json")
def export(section: ExportSection, inputs: dict[str, ArtifactRef], store_root: str) -> ArtifactRef:
    """inputs: `model`, `train`; `base`, the quantize_base stage's, for LoRA over a quantized base."""

    def build(folder: Path) -> None:
        module, method = trained_torch_model(inputs, section.model)
        sub = "adapter" if method == "lora" else "model"
        save_model(module, folder / sub, section, inputs["model"])
        del module  # before a merge loads a second copy
        name, _ = pretrained_location(inputs["model"])
        info = {"kind": "peft_adapter" if method == "lora" else "hf_model", "subfolder": sub, "base_model": name}
        if inputs.get("base") is not None:  # the adapter learned against the base as the quantize_base stage held it
            info["trained_on_quantized_base"] = inputs["base"].read_json("quantize.json")["scheme"]
        if method == "lora" and section.export.merge:
            save_merged(folder / "merged", section, inputs)
            info["merged"] = "merged"
        if section.export.gguf:
            info["gguf"] = save_gguf(folder / "gguf", section, inputs)
        (folder / "export.json").write_text(json.dumps(info, indent=2))
        get_run_logger().info(
            "exported a %s (%s/)%s%s",
            info["kind"],
            sub,
            " and merged/" if "merged" in info else "",
            "".join(f", gguf/{f['file']}" for f in info.get("gguf", [])),
        )

    return build_artifact(store_root, STAGE, __name__, section, inputs, build)
