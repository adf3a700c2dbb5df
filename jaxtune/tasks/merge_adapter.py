"""Stage `merge_adapter`: a PEFT LoRA adapter and its base model -> one HF model folder in the store.

A run whose `model.name` is an adapter folder (an earlier run's export/<key>/adapter, or one
made by any PEFT tool) starts from that adapter merged into its base, the model the adapter
was trained to be. It is merged once, in float32 (W + scale * B @ A rounded once), keyed by the
adapter's files and the base model's key, so every later stage's key holds the adapter's
weights: a retrained adapter re-runs what follows. The tokenizer is the adapter folder's when
it ships one (PEFT saves it beside a trained adapter), else the base model's.
"""

from __future__ import annotations

from pathlib import Path

from prefect import task

from jaxtune.artifacts import ArtifactRef
from jaxtune.tasks.sources import adapter_base, model_ref, pretrained_location
from jaxtune.tasks.stage import build_artifact, built_outside_flow

STAGE = "merge_adapter"
SECTION = {"dtype": "float32"}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def write_merged(adapter: Path, base: ArtifactRef, folder: Path, trust_remote_code: bool) -> None:
    from peft import PeftModel
    from transformers import AutoTokenizer

    from jaxtune.runtime.modeling.model import load_torch_model

    name, revision = pretrained_location(base)
    module = PeftModel.from_pretrained(load_torch_model(name, revision, trust_remote_code, "float32"), str(adapter))
    module.merge_and_unload().save_pretrained(folder, safe_serialization=True)
    has_tokenizer = any((adapter / f).is_file() for f in TOKENIZER_FILES)
    source, source_revision = (str(adapter), None) if has_tokenizer else (name, revision)
    AutoTokenizer.from_pretrained(
        source, revision=source_revision, trust_remote_code=trust_remote_code
    ).save_pretrained(folder)


@task(name=STAGE, result_serializer="json")
def merge_adapter(
    section: dict, inputs: dict[str, ArtifactRef], store_root: str, trust_remote_code: bool = False
) -> ArtifactRef:
    """inputs: `adapter`, the adapter folder (keyed by its files), and `base`, its base model."""
    return build_artifact(
        store_root,
        STAGE,
        __name__,
        section,
        inputs,
        lambda folder: write_merged(inputs["adapter"].folder, inputs["base"], folder, trust_remote_code),
    )


def merged(store_root: str | Path, adapter: ArtifactRef, trust_remote_code: bool = False) -> ArtifactRef:
    """The merged model for an adapter folder's ref (`sources.model_ref`) outside any flow
    (`jaxtune doctor`): the folder a run from that adapter starts from, built once, then reused."""
    inputs = {"adapter": adapter, "base": model_ref(adapter_base(adapter.folder))}
    return built_outside_flow(
        store_root,
        STAGE,
        __name__,
        SECTION,
        inputs,
        lambda: merge_adapter.fn(SECTION, inputs, str(store_root), trust_remote_code),
    )
